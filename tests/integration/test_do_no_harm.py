"""The guard is never the reason a run dies or gets worse, the same in every front door (the Lightning callback, the
plain-loop guard, the Fabric guard): a rung that breaks the model is reverted and the batch runs again, a rung that
raises memory is reverted, a rung that changes nothing is not called helpful, and a failed attempt's buffer updates
are undone."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

from lightning_memguard import FabricMemGuard, MemGuard, MemGuardCallback
from lightning_memguard.mitigations.checkpointing import checkpoint_module, is_checkpointed
from tests.models import pl, trainer_kwargs

FRONTS = ["lightning", "loop", "fabric"]


class Wrapped(pl.LightningModule):
    """A plain module trained by Lightning on fixed batches with SGD, the loss being ``loss(model, batch)``."""

    def __init__(self, model: nn.Module, data: list, momentum: float) -> None:
        super().__init__()
        self.model, self.data, self.momentum = model, data, momentum

    def training_step(self, batch, batch_idx):
        self.model.batch_index = batch_idx
        return mse(self.model, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=self.momentum)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=None)


def mse(model: nn.Module, batch) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def fit(front: str, model: nn.Module, data: list, root, momentum: float = 0.9, **settings):
    """Trains ``model`` on ``data`` (one optimizer step a batch) through ``front``, under MemGuard with ``settings``;
    returns the guard and the MemGuard warnings."""
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if front == "lightning":
            guard = MemGuardCallback(**settings)
            trainer = pl.Trainer(**trainer_kwargs(max_steps=len(data), callbacks=[guard], logger=False,
                                                  default_root_dir=str(root)))
            trainer.fit(Wrapped(model, data, momentum))
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)
            fabric = None
            if front == "fabric":
                fabric = Fabric(accelerator="cpu", devices=1)
                wrapped, optimizer = fabric.setup(model, optimizer)
                guard = FabricMemGuard(fabric, wrapped, optimizer, log_dir=str(root), **settings)
            else:
                guard = MemGuard(model, optimizer, log_dir=str(root), **settings)
            for index, batch in enumerate(data):
                model.batch_index = index
                guard.step(batch, lambda m, b: mse(m, b))
            guard.close()
    said = [str(w.message) for w in caught if "lightning-memguard" in str(w.message)]
    return guard, said


def unguarded(model: nn.Module, data: list, momentum: float = 0.9) -> nn.Module:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)
    for index, batch in enumerate(data):
        model.batch_index = index
        optimizer.zero_grad(set_to_none=True)
        mse(model, batch).backward()
        optimizer.step()
    return model


def step0_peak(front: str, make_model, data: list, root, momentum: float = 0.9) -> int:
    """The first step's highest phase peak through ``front``, measured by a monitoring-only guard."""
    guard, _ = fit(front, make_model(), data[:1], root / "probe", momentum, budget="64GiB", mitigations=(),
                   cpu_sample_every=1)
    return int(guard.history.query("step == 0")["peak_bytes"].max())


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


# --- a rung that breaks the model ---------------------------------------------------------------------------------
class FragileBlock(nn.Module):
    """A residual MLP block that raises when it runs inside backward (a checkpointed recomputation) once the model
    reached ``fail_from`` batches: the model trains fine unless MemGuard checkpoints it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        root = self.root_ref()
        if torch._C._current_graph_task_id() != -1 and root.batch_index >= root.fail_from:
            raise RuntimeError("this block cannot be recomputed")
        return x + self.down(torch.relu(self.up(x)))


class FragileStack(nn.Module):
    def __init__(self, fail_from: int, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fail_from, self.batch_index = fail_from, 0
        self.inp = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[FragileBlock(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)
        for block in self.blocks:
            block.root_ref = lambda: self

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def regression_batches(n: int, size: int = 256, features: int = 16) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randn(size, features, generator=g)
        out.append((x, x.sum(dim=1, keepdim=True).sin()))
    return out


@pytest.mark.parametrize("front", FRONTS)
def test_a_rung_that_breaks_the_step_is_reverted_and_the_batch_runs_again(tmp_path, front):
    data = regression_batches(4)
    peak = step0_peak(front, lambda: FragileStack(fail_from=99), data, tmp_path)
    model = FragileStack(fail_from=1)  # the first batch's estimate and step 0 run; step 1's recomputation raises
    guard, said = fit(front, model, data, tmp_path / "run", budget=int(peak / 0.95), mitigations=("checkpointing",),
                      cpu_sample_every=1)
    events = guard.events
    applied = events.query("action == 'apply' and rung == 'checkpointing'")
    reverted = events.query("action == 'revert' and rung == 'checkpointing'")
    assert list(applied["step"]) == [0] and list(reverted["step"]) == [1]
    assert "broke the step (RuntimeError: this block cannot be recomputed)" in reverted["reason"].iloc[0]
    assert [s for s in said if "broke the step" in s] and len([s for s in said if "broke the step" in s]) == 1
    assert not any(is_checkpointed(b) for b in model.blocks) and guard.levels["checkpointing"] == 0
    assert sorted(guard.history["step"].unique()) == [0, 1, 2, 3]  # no batch skipped
    assert_same_parameters(model, unguarded(FragileStack(fail_from=99), data))


@pytest.mark.parametrize("front", ["lightning", "loop"])
def test_a_rung_whose_prediction_fails_is_never_applied(tmp_path, front):
    data = regression_batches(3)
    peak = step0_peak(front, lambda: FragileStack(fail_from=99), data, tmp_path)
    model = FragileStack(fail_from=0)  # checkpointed, it fails already in the first batch's estimate
    guard, said = fit(front, model, data, tmp_path / "run", budget=int(peak / 0.95), mitigations=("checkpointing",),
                      cpu_sample_every=1)
    assert [s for s in said if "the checkpointing rung is off for this run" in s and "cannot be recomputed" in s]
    assert guard.events.query("rung == 'checkpointing' and action in ('apply', 'rescue')").empty
    assert_same_parameters(model, unguarded(FragileStack(fail_from=99), data))


# --- the judge compares like with like ----------------------------------------------------------------------------
class WideStack(nn.Module):
    """Six 1024-wide linear blocks: parameters and gradients dwarf the activations of small batches."""

    def __init__(self, width: int = 1024, depth: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


@pytest.mark.parametrize("rung, batch_size", [
    # checkpointing six blocks of a batch of 4 saves a few KiB of activations next to 24 MiB of gradients
    ("checkpointing", 4),
    # bf16 weight copies of a parameter-heavy model outweigh the activations they halve: memory rises
    ("amp", 8),
], ids=["changes-nothing", "raises-memory"])
@pytest.mark.parametrize("front", FRONTS)
def test_a_rung_that_does_not_lower_the_peak_is_reverted_not_called_helpful(tmp_path, front, rung, batch_size):
    data = regression_batches(3, size=batch_size)
    peak = step0_peak(front, WideStack, data, tmp_path, momentum=0.0)
    guard, _ = fit(front, WideStack(), data, tmp_path / "run", momentum=0.0, budget=int(peak / 0.95),
                   mitigations=(rung,), cpu_sample_every=1)
    events = guard.events
    assert list(events.query("action == 'apply'")["rung"]) == [rung]
    judged = events.query("action in ('keep', 'revert')")
    assert list(judged["action"]) == ["revert"], judged["reason"].tolist()
    assert guard.levels[rung] == 0


# --- a failed attempt's buffer updates are undone -----------------------------------------------------------------
class NormBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.norm = nn.Linear(width, 4 * width), nn.BatchNorm1d(4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.norm(self.up(x))))


class NormStack(nn.Module):
    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[NormBlock(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def steady_peak(front: str, model: nn.Module, data: list, root) -> int:
    guard, _ = fit(front, model, data, root, budget="64GiB", mitigations=(), cpu_sample_every=1)
    return int(guard.history["peak_bytes"].max())


@pytest.mark.parametrize("front", FRONTS)
def test_a_rescued_batch_updates_batchnorm_statistics_once(tmp_path, front):
    data = regression_batches(3)
    plain = steady_peak(front, NormStack(), data, tmp_path / "plain")
    checkpointed = NormStack()
    for block in checkpointed.blocks:
        checkpoint_module(block)
    low = steady_peak(front, checkpointed, data, tmp_path / "low")
    assert low < 0.8 * plain
    limit = (plain + low) // 2  # only a checkpointed step fits: the first attempt runs out of memory mid-step
    model = NormStack()
    guard, _ = fit(front, model, data, tmp_path / "run", budget=limit, cpu_hard_limit=limit,
                   mitigations=("checkpointing",), cpu_sample_every=1)
    events = guard.events
    assert list(events.query("action == 'rescue'")["step"]) == [0] and guard.levels["checkpointing"] > 0
    reference = unguarded(NormStack(), data)
    assert int(model.blocks[0].norm.num_batches_tracked) == len(data)  # once per step, as unguarded
    assert_same_parameters(model, reference)  # running means and variances included
