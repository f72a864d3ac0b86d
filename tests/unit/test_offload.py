"""The offload rung's mechanics on CPU (its memory effect needs a GPU: tests/gpu)."""

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memguard import MemGuard, MemGuardCallback
from lightning_memguard.guard.ladder import Ladder
from lightning_memguard.mitigations.offload import ActivationOffload
from tests.models import Block, BlockStack, trainer_kwargs


class RecordsHooks(BlockStack):
    """Notes whether autograd's saved-tensor hooks (what save_on_cpu installs) are set during training_step."""

    def __init__(self):
        super().__init__(width=32, depth=2)
        self.hooked = []

    def training_step(self, batch, batch_idx):
        self.hooked.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
        return super().training_step(batch, batch_idx)


def test_the_wrapped_step_keeps_the_signature_lightning_reads_at_every_batch():
    """Lightning passes ``batch_idx`` where the step's signature takes one, read at every batch: the wrapper's
    ``(*args, **kwargs)`` said it does, so a ``training_step(self, batch)`` was handed an index and raised (the rung
    then reverted as one that breaks the step)."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    class WithoutIndex(RecordsHooks):
        def training_step(self, batch):
            return super().training_step(batch, 0)

    model = WithoutIndex()
    batch = next(iter(model.train_dataloader()))
    ActivationOffload(model, "cuda").set_level(1)
    assert not is_param_in_hook_signature(model.training_step, "batch_idx", min_args=2)
    model.training_step(batch)
    assert model.hooked == [True]


def test_level_one_runs_the_training_step_under_save_on_cpu_and_level_zero_undoes_it():
    model = RecordsHooks()
    rung = ActivationOffload(model, "cuda")
    batch = next(iter(model.train_dataloader()))
    rung.set_level(1)
    rung.set_level(1)  # idempotent: wrapped once
    model.training_step(batch, 0)
    rung.set_level(0)
    model.training_step(batch, 1)
    # wrapped once, around the class's method: undoing it once leaves no hook and no attribute on the instance
    assert model.hooked == [True, False]
    assert "training_step" not in vars(model)
    assert ActivationOffload(model, "cuda").level == 0


def test_gradients_are_unchanged():
    torch.manual_seed(0)
    model = RecordsHooks()
    reference = copy.deepcopy(model)
    batch = next(iter(model.train_dataloader()))
    ActivationOffload(model, "cuda").set_level(1)
    for m in (model, reference):
        m.training_step(batch, 0).backward()
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_it_is_off_on_cpu_with_one_warning(tmp_path):
    assert ActivationOffload(BlockStack(), "cpu").unavailable_reason() is not None
    guard = MemGuardCallback(budget="1MiB", mitigations=("offload",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
                   **trainer_kwargs(max_steps=2)).fit(BlockStack(width=32, depth=2))
    assert len([w for w in caught if "the offload rung is off" in str(w.message)]) == 1
    assert guard.levels == {}


def test_a_module_without_training_step_cannot_take_it_even_on_cuda():
    reason = ActivationOffload(nn.Linear(2, 2), "cuda").unavailable_reason()
    assert reason is not None and "Linear has no training_step" in reason
    assert ActivationOffload(BlockStack(), "cuda").unavailable_reason() is None


def test_the_ladder_of_a_cuda_loop_drops_it_with_the_reason():
    """What a plain or Fabric loop on a GPU builds: no offload rung that would fail when applied."""
    warned = []
    ladder = Ladder(("offload",), 0.9, None, 0.03, warn=warned.append)
    ladder.setup(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), torch.device("cuda"), None)
    assert ladder.rungs == {} and ladder.levels == {}
    assert len(warned) == 1 and "the offload rung is off" in warned[0] and "no training_step" in warned[0]


def test_a_plain_loop_asked_for_it_warns_once_and_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Sequential(Block(32), Block(32)), nn.Linear(32, 1))
    before = [p.detach().clone() for p in model.parameters()]
    guard = MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), budget="64MiB", mitigations=("offload",))
    x = torch.randn(32, 16)
    with warnings.catch_warnings(record=True) as caught, guard:
        warnings.simplefilter("always")
        losses = [float(guard.step((x, x.sum(1, keepdim=True)), lambda m, b: F.mse_loss(m(b[0]), b[1])))
                  for _ in range(3)]
    assert len([w for w in caught if "the offload rung is off" in str(w.message)]) == 1
    assert guard.levels == {} and guard.global_step == 3 and all(map(torch.isfinite, torch.tensor(losses)))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it trained


def test_bad_level():
    with pytest.raises(ValueError, match="level=2"):
        ActivationOffload(BlockStack(), "cuda").set_level(2)
