"""The explanation files written near the threshold, read back."""

import pandas as pd
import pytest
import torch

from lightning_memguard import MemGuardCallback
from tests.helpers import fit_module
from tests.models import BlockStack


class MakesAMarker(BlockStack):
    """Holds a distinctive 123 x 457 tensor from the forward until after the backward. (The module's
    on_after_backward runs after the callbacks' on_after_backward, so the tensor is freed after that boundary.)"""

    def training_step(self, batch, batch_idx):
        self.marker = torch.zeros(123, 457)
        return super().training_step(batch, batch_idx)

    def on_after_backward(self):
        self.marker = None


def fit(guard, root, model=None):
    return fit_module(model or MakesAMarker(), guard, root, max_steps=4)


def test_first_crossing_writes_the_tensor_diff_and_top_consumers_of_the_next_step(tmp_path):
    guard = MemGuardCallback(budget="1MiB", mitigations=())  # crossed at step 0
    fit(guard, tmp_path)
    explain = guard.events[guard.events["action"] == "explain"]
    assert list(explain["step"]) == [1]
    diff = pd.read_csv(tmp_path / "memguard_tensor_diff_step1.csv")
    marker = diff[diff["shape"] == "[123, 457]"]
    assert marker[["between", "change", "bytes"]].values.tolist() == [
        ["batch_start -> after_forward", "+", 123 * 457 * 4],
        ["after_backward -> after_optimizer_step", "-", 123 * 457 * 4]]
    consumers = pd.read_csv(tmp_path / "memguard_top_consumers_step1.csv")
    assert {"parameter", "gradient", "optimizer_state", "activation_or_other"} >= set(consumers["category"])
    assert "blocks.0.up" in set(consumers["module"])
    assert consumers["at"].nunique() == 1


def test_on_demand_and_switched_off(tmp_path):
    guard = MemGuardCallback(explain=False, cpu_sample_every=1)
    guard.explain_next_step()
    fit(guard, tmp_path / "demand")
    assert (tmp_path / "demand" / "memguard_tensor_diff_step0.csv").exists()  # asked for: written
    quiet = MemGuardCallback(budget="1MiB", mitigations=(), explain=False)
    fit(quiet, tmp_path / "off")
    assert not list((tmp_path / "off").glob("memguard_tensor_diff_*"))


def test_a_crash_while_explaining_leaves_no_dispatch_mode_behind(tmp_path):
    class Crashes(MakesAMarker):
        def on_before_backward(self, loss):
            if self.trainer.global_step == 1:
                raise RuntimeError("boom")

    guard = MemGuardCallback(budget="1MiB", mitigations=())
    with pytest.raises(RuntimeError, match="boom"):
        fit(guard, tmp_path, model=Crashes())
    assert torch._C._len_torch_dispatch_stack() == 0
