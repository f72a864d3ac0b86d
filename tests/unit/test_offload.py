"""The offload rung's mechanics on CPU (its memory effect needs a GPU: tests/gpu)."""

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_memguard import MemGuardCallback
from lightning_memguard.mitigations.offload import ActivationOffload
from tests.models import BlockStack, trainer_kwargs


class RecordsHooks(BlockStack):
    """Notes whether autograd's saved-tensor hooks (what save_on_cpu installs) are set during training_step."""

    def __init__(self):
        super().__init__(width=32, depth=2)
        self.hooked = []

    def training_step(self, batch, batch_idx):
        self.hooked.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
        return super().training_step(batch, batch_idx)


def test_level_one_runs_the_training_step_under_save_on_cpu_and_level_zero_undoes_it():
    model = RecordsHooks()
    rung = ActivationOffload(model, "cuda")
    batch = next(iter(model.train_dataloader()))
    rung.set_level(1)
    rung.set_level(1)  # idempotent: wrapped once
    model.training_step(batch, 0)
    assert vars(model)["training_step"]._memguard_previous is None  # wrapped once, around the class's method
    rung.set_level(0)
    model.training_step(batch, 1)
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


def test_bad_level():
    with pytest.raises(ValueError, match="level=2"):
        ActivationOffload(BlockStack(), "cuda").set_level(2)
