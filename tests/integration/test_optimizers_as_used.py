"""Optimizers as users train with them, through a real Trainer on CPU: each guarded fit against the same fit unguarded
(same seed), the estimate against the real step a monitor-only fit measured, under a budget of 0.6-0.75 x that fit's
peak, also as a hard limit.

- ``torch.optim.LBFGS``: Lightning passes its closure, which LBFGS calls several times a step (its line search runs
  forward and backward again). An OOM in a later call is the closure's forward or backward (rescued there, or left to
  the user without rescue), not the optimizer step's; the estimate steps it with such a closure, so a fit under a hard
  limit is planned; its history (tensors in lists) counts as optimizer state.
- ``nn.Embedding(sparse=True)`` with ``SparseAdam``: sparse gradients are measured, estimated and split into
  micro-batches (they crashed the guard: a sparse tensor has no storage of its own).
- ``Adagrad`` makes its state when it is built: the estimate counts it from the start, as the run holds it.
- A plain loop's guard runs forward and backward once, then ``optimizer.step()``: LBFGS is refused at construction.
- A backbone unfrozen mid-fit (``BackboneFinetuning``): its gradients and AdamW state put the optimizer step over the
  budget; the split goes no further than what saves memory.
- Tied embeddings and spectrally normalised layers in checkpointed blocks train bit for bit as unguarded.
- An optimizer step that runs one parameter at a time or fused is not retried, nor told, with ``foreach=False``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_memguard import MemGuard, MemGuardCallback, MemGuardOutOfMemoryError, estimate_memory
from lightning_memguard.sources.cpu import optimizer_state_tensors, storage_bytes
from tests.models import Block, Stack, WideLinears, lightning_class, pl, regression_batches, trainer_kwargs

STEPS = 3
LADDER = ("checkpointing", "microbatch")  # named: AMP (in the default ladder where the CPU has bf16) changes numerics


class Fitted(pl.LightningModule):
    """Trains ``model`` on fixed ``(x, y)`` batches with the MSE loss and the optimizer ``make_optimizer(params)``."""

    def __init__(self, model: nn.Module, batches: list, make_optimizer) -> None:
        super().__init__()
        self.model, self.batches, self.make_optimizer = model, batches, make_optimizer

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.model(batch[0]), batch[1])
        self.log("train_loss", loss.detach())
        return loss

    def configure_optimizers(self):
        return self.make_optimizer(self.model.parameters())

    def train_dataloader(self):
        return DataLoader(self.batches, batch_size=None, shuffle=False)


def fit(make_model, batches: list, make_optimizer, root, guard=None, raises: type = None):
    """The fitted module (its ``warned``: the fit's warnings) and the error the fit ended with (one of ``raises``:
    else it is raised)."""
    torch.manual_seed(0)
    module = Fitted(make_model(), batches, make_optimizer)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=STEPS, callbacks=[guard] if guard else [], logger=False,
                                          default_root_dir=str(root)))
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module)
        except Exception as err:
            if raises is None or not isinstance(err, raises):
                raise
            error = err
    module.warned = [str(w.message) for w in caught]
    return module, trainer, error


def assert_same_parameters(a: nn.Module, b: nn.Module, atol: float = 0.0) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(x, y, rtol=0.0, atol=atol), (name, (x - y).abs().max())


def monitored(make_model, batches: list, make_optimizer, root) -> MemGuardCallback:
    """A monitor-only fit's guard: its history holds the real steps' phase peaks."""
    guard = MemGuardCallback(mitigations=(), budget="1GiB", cpu_sample_every=1, explain=False)
    fit(make_model, batches, make_optimizer, root, guard)
    assert guard.events.empty
    return guard


# --- LBFGS --------------------------------------------------------------------------------------------------------
def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def lbfgs(params):
    return torch.optim.LBFGS(params, lr=0.5, max_iter=3, history_size=2)


def lbfgs_stack() -> nn.Module:
    return Stack(width=64, depth=4)


@pytest.fixture(scope="module")
def lbfgs_run(tmp_path_factory):
    """``(batches, unguarded module, monitor-only guard)`` of the LBFGS fit."""
    batches = regression_batches(STEPS, size=512)
    reference, _, _ = fit(lbfgs_stack, batches, lbfgs, tmp_path_factory.mktemp("unguarded"))
    return batches, reference, monitored(lbfgs_stack, batches, lbfgs, tmp_path_factory.mktemp("monitored"))


def test_lbfgs_out_of_memory_in_a_later_closure_call_is_not_called_the_optimizer_steps(tmp_path, lbfgs_run):
    batches, _, probe = lbfgs_run
    limit = int(0.6 * probe.history["peak_bytes"].max())  # the first closure call fits, a later forward does not
    guard = MemGuardCallback(budget=limit, cpu_hard_limit=limit, rescue_oom=False, plan_at_start=False,
                             cpu_sample_every=1, explain=False, mitigations=LADDER)
    _, _, error = fit(lbfgs_stack, batches, lbfgs, tmp_path, guard, raises=torch.OutOfMemoryError)
    # without rescue an OOM in a forward is the user's, as it is: not a report that blames the optimizer step and
    # says activation remedies cannot lower it (they can: LBFGS's later forwards are checkpointed too)
    assert not isinstance(error, MemGuardOutOfMemoryError), str(error)
    assert "optimizer step" not in " ".join(guard.events["reason"].astype(str))


def test_lbfgs_rescued_from_its_estimate_trains_like_unguarded(tmp_path, lbfgs_run):
    batches, reference, probe = lbfgs_run
    limit = int(0.75 * probe.history["peak_bytes"].max())
    guard = MemGuardCallback(budget=limit, cpu_hard_limit=limit, plan_at_start=False, threshold=1.0,
                             cpu_sample_every=1, explain=False, mitigations=LADDER)
    module, _, _ = fit(lbfgs_stack, batches, lbfgs, tmp_path, guard)
    assert list(guard.events.query("action == 'rescue'")["rung"]) == ["checkpointing"]
    assert_same_parameters(module, reference)  # checkpointed blocks recompute exactly


def test_lbfgs_is_estimated_with_its_history_and_planned_under_a_hard_limit(tmp_path, lbfgs_run):
    batches, reference, probe = lbfgs_run
    model = lbfgs_stack()
    optimizer = lbfgs(model.parameters())
    estimate = estimate_memory(model, batches[0], optimizer, target="cpu",
                               loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]))
    # its history: two vectors of every parameter per remembered step (in lists), the direction, the last gradient
    _, trainer, _ = fit(lbfgs_stack, batches, lbfgs, tmp_path / "unguarded")
    held = storage_bytes(optimizer_state_tensors(trainer.optimizers))
    params = sum(p.numel() * 4 for p in model.parameters())
    assert held >= 6 * params and estimate.optimizer_state_bytes == held
    measured = probe.history.query("step == 1")["peak_bytes"].max()
    assert abs(estimate.peak_bytes / measured - 1) < 0.03, (estimate.peak_bytes, measured)

    limit = int(0.75 * probe.history["peak_bytes"].max())
    guard = MemGuardCallback(budget=limit, cpu_hard_limit=limit, rescue_oom=False, cpu_sample_every=1,
                             explain=False, mitigations=LADDER)
    module, _, _ = fit(lbfgs_stack, batches, lbfgs, tmp_path / "guarded", guard)
    assert "plan" in set(guard.events["action"])
    assert_same_parameters(module, reference, atol=1e-5)  # micro-batches: the whole batch's loss, up to rounding


# --- sparse gradients -----------------------------------------------------------------------------------------------
VOCAB = 5000


class SparseEmbedded(nn.Module):
    """Token ids through a sparse embedding (its gradient a sparse tensor) and residual MLP blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, 64, sparse=True)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                      for _ in range(4)])
        self.head = nn.Linear(64, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embedding(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h).mean(1)


def sparse_adam(params):
    return torch.optim.SparseAdam(list(params)[:1], lr=1e-2)  # the embedding's weight


def token_batches() -> list:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randint(0, VOCAB, (64, 32), generator=generator), torch.randn(64, 1, generator=generator))
            for _ in range(STEPS)]


@pytest.fixture(scope="module")
def sparse_run(tmp_path_factory):
    batches = token_batches()
    reference, _, _ = fit(SparseEmbedded, batches, sparse_adam, tmp_path_factory.mktemp("unguarded"))
    return batches, reference, monitored(SparseEmbedded, batches, sparse_adam, tmp_path_factory.mktemp("monitored"))


def test_sparse_gradients_are_measured_and_estimated_like_the_real_step(sparse_run):
    batches, reference, probe = sparse_run
    model = SparseEmbedded()
    estimate = estimate_memory(model, batches[0], sparse_adam(model.parameters()), target="cpu",
                               loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]))
    assert estimate.optimizer_state_bytes == 2 * VOCAB * 64 * 4  # SparseAdam's moments are dense
    measured = probe.history.query("step == 1").set_index("phase")["peak_bytes"]
    for phase in ("forward", "backward", "optimizer_step"):
        real = measured[f"after_{phase}"]
        assert abs(estimate.phase_peaks[phase] / real - 1) < 0.02, (phase, estimate.phase_peaks[phase], real)


@pytest.mark.parametrize("plan", [True, False], ids=["planned-hard-limit", "rescued"])
def test_sparse_gradients_fit_a_hard_limit_and_train_like_unguarded(tmp_path, sparse_run, plan):
    batches, reference, probe = sparse_run
    limit = int(0.6 * probe.history["peak_bytes"].max())
    settings = dict(rescue_oom=False) if plan else dict(plan_at_start=False, threshold=1.0)
    guard = MemGuardCallback(budget=limit, cpu_hard_limit=limit, cpu_sample_every=1, explain=False,
                             mitigations=LADDER, **settings)
    module, _, _ = fit(SparseEmbedded, batches, sparse_adam, tmp_path, guard)
    assert set(guard.events["action"]) & ({"plan"} if plan else {"rescue"})
    assert_same_parameters(module, reference)


def test_sparse_gradients_of_micro_batches_add_up_to_the_whole_batchs(tmp_path, sparse_run):
    batches, reference, probe = sparse_run
    limit = int(0.6 * probe.history["peak_bytes"].max())
    guard = MemGuardCallback(budget=limit, cpu_hard_limit=limit, rescue_oom=False, cpu_sample_every=1,
                             explain=False, mitigations=("microbatch",))
    module, _, _ = fit(SparseEmbedded, batches, sparse_adam, tmp_path, guard)
    assert guard.levels["microbatch"] >= 1
    assert_same_parameters(module, reference, atol=1e-6)


# --- optimizer state made with the optimizer -------------------------------------------------------------------------
def test_adagrads_state_made_when_it_is_built_is_in_the_estimates_peaks(tmp_path):
    batches = regression_batches(STEPS, size=256)

    def adagrad(params):
        return torch.optim.Adagrad(params, lr=0.01)

    probe = monitored(lbfgs_stack, batches, adagrad, tmp_path)
    model = lbfgs_stack()
    estimate = estimate_memory(model, batches[0], adagrad(model.parameters()), target="cpu",
                               loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]))
    measured = probe.history.query("step == 1").set_index("phase")["peak_bytes"]
    for phase in ("forward", "backward", "optimizer_step"):  # 13 % short in forward before
        real = measured[f"after_{phase}"]
        assert abs(estimate.phase_peaks[phase] / real - 1) < 0.03, (phase, estimate.phase_peaks[phase], real)


def test_a_loop_guard_refuses_an_optimizer_that_needs_a_closure_at_construction():
    model = lbfgs_stack()
    with pytest.raises(ValueError, match="optimizer=LBFGS evaluates the loss again inside its step"):
        MemGuard(model, lbfgs(model.parameters()), budget="1GiB")
    MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), budget="1GiB").close()  # a closure is optional


# --- a frozen backbone unfrozen mid-fit -----------------------------------------------------------------------------
class WithBackbone(nn.Module):
    """A backbone of residual blocks (frozen at first) and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(16, 128), *[Block(128) for _ in range(4)])
        self.head = nn.Linear(128, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class FineTuned(Fitted):
    """Lightning's BackboneFinetuning freezes ``backbone`` before the fit and adds it to the optimizer at an epoch."""

    @property
    def backbone(self) -> nn.Module:
        return self.model.backbone

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def fine_tune(root, guard=None) -> FineTuned:
    torch.manual_seed(0)
    module = FineTuned(WithBackbone(), regression_batches(2, size=256), None)
    unfreeze = lightning_class("callbacks", "BackboneFinetuning")(
        unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.0, backbone_initial_ratio_lr=0.1, verbose=False)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=6, callbacks=[unfreeze, *([guard] if guard else [])],
                                          logger=False, default_root_dir=str(root)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return module


def test_a_backbone_unfrozen_mid_fit_splits_no_further_than_what_saves_memory(tmp_path):
    """After the unfreezing (step 2: the backbone's gradients and AdamW state appear) no step fits the budget: the
    optimizer step's peak is over it whatever the split. Micro-batches beyond what saves a trial's 3 % are not taken:
    256 micro-batches of one sample were, for 1.5 % of the peak, for the rest of the fit."""
    reference = fine_tune(tmp_path / "unguarded")
    probe = MemGuardCallback(mitigations=(), budget="1GiB", cpu_sample_every=1, explain=False)
    fine_tune(tmp_path / "monitored", probe)
    guard = MemGuardCallback(budget=int(0.6 * probe.history["peak_bytes"].max()), cpu_sample_every=1,
                             explain=False, mitigations=LADDER)
    module = fine_tune(tmp_path / "guarded", guard)
    assert 1 <= guard.levels["microbatch"] <= 4, guard.events[["step", "action", "rung", "level"]]
    grew = guard.events.query("action == 'keep' and step == 3")["reason"].iloc[0]
    assert "parameters that began training" in grew and "first step" not in grew  # step 3, not the first
    assert_same_parameters(module, reference, atol=1e-6)


# --- parametrized and tied weights --------------------------------------------------------------------------------
class NormedBlock(nn.Module):
    """A residual MLP block whose first linear is spectrally normalised: its power-iteration vectors are buffers that
    every training forward reads and moves."""

    def __init__(self, width: int, spectral) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = spectral(nn.Linear(width, 4 * width)), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


SPECTRAL = {"parametrization": torch.nn.utils.parametrizations.spectral_norm,
            "hook": torch.nn.utils.spectral_norm}


class TiedLM(nn.Module):
    """Token embeddings tied to the output layer, spectrally normalised blocks between."""

    def __init__(self, spectral: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(64, 64)
        self.blocks = nn.Sequential(*[NormedBlock(64, SPECTRAL[spectral]) for _ in range(4)])
        self.head = nn.Linear(64, 64, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embedding(ids))).flatten(0, 1)


def next_tokens() -> list:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 64, (32, 16), generator=generator),
             F.one_hot(torch.randint(0, 64, (32 * 16,), generator=generator), 64).float())
            for _ in range(STEPS)]


@pytest.mark.parametrize("plan", [True, False], ids=["planned", "rescued"])
@pytest.mark.parametrize("spectral", list(SPECTRAL))
def test_spectral_norm_in_checkpointed_blocks_and_tied_weights_train_like_unguarded(tmp_path, spectral, plan):
    """Checkpointed from the first step on (planned, or after an OOM): the first recomputation moved the spectral
    norm's vectors a second time, and a rescued batch moved them in the failed attempt too (said as buffers not
    saved): parameters 5e-5 to 3e-3 off the unguarded fit's."""
    def make():
        return TiedLM(spectral)

    batches = next_tokens()
    reference, _, _ = fit(make, batches, adamw, tmp_path / "unguarded")
    probe = monitored(make, batches, adamw, tmp_path / "monitored")
    limit = int(0.6 * probe.history["peak_bytes"].max())
    settings = dict(rescue_oom=False) if plan else dict(plan_at_start=False, threshold=1.0)
    guard = MemGuardCallback(budget=limit, cpu_hard_limit=limit, cpu_sample_every=1, explain=False,
                             mitigations=("checkpointing",), **settings)
    module, _, _ = fit(make, batches, adamw, tmp_path / "guarded", guard)
    assert guard.levels["checkpointing"] >= 3
    assert not [said for said in module.warned if "not saved" in said]
    assert module.model.head.weight is module.model.embedding.weight
    assert_same_parameters(module, reference)


# --- an optimizer step that runs out of memory ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["foreach=False", "fused=True", "default"])
def test_an_optimizer_step_that_runs_one_parameter_at_a_time_is_not_told_to(tmp_path, kind):
    """AdamW one parameter at a time (``foreach=False``, CPU's default) or fused runs out of memory in its first
    step: ``foreach=False`` changes nothing there. It was retried with it (fused) and named among what helps."""
    keywords = {"foreach=False": dict(foreach=False), "fused=True": dict(fused=True), "default": {}}[kind]

    def adamw_as_given(params):
        return torch.optim.AdamW(params, lr=1e-3, **keywords)

    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 256, generator=generator), torch.randn(8, 256, generator=generator))
               for _ in range(STEPS)]
    probe = monitored(WideLinears, batches, adamw_as_given, tmp_path / "monitored")
    peaks = probe.history.query("step == 0").set_index("phase")["peak_bytes"]
    limit = peaks["after_optimizer_step"] - 64 * 1024  # the forward and backward fit, the state's creation not
    assert limit > peaks[["after_forward", "after_backward"]].max()
    guard = MemGuardCallback(budget=limit, cpu_hard_limit=limit, plan_at_start=False, explain=False,
                             cpu_sample_every=1)
    _, _, error = fit(WideLinears, batches, adamw_as_given, tmp_path / "guarded", guard,
                      raises=MemGuardOutOfMemoryError)
    assert list(guard.events["action"]) == ["gave_up"]  # no retry that could not change anything
    assert "the optimizer step ran out of memory" in str(error) and "foreach=False" not in str(error)
    assert "an optimizer with less state" in str(error)
