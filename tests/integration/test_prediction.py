"""The peak model the guard picks rung levels from, against real steps: a Trainer on CPU with the rungs set to fixed
levels, peaks read by the CPU accountant, compared with what the first batch's estimate predicted."""

import pytest
import torch

from lightning_memguard import MemGuardCallback
from lightning_memguard.estimate.plan import ladder_peak_model
from tests.models import BlockStack, pl, trainer_kwargs


class AtLevels(pl.Callback):
    """Puts the guard's rungs at fixed levels before the first step (the policy is told, so it does not undo them)."""

    def __init__(self, guard, levels):
        self.guard, self.levels = guard, levels

    def on_train_start(self, trainer, pl_module):
        self.guard.engine.ladder.apply_plan(self.levels)


def model():
    torch.manual_seed(0)
    return BlockStack(width=64, depth=4, batch_size=256, n_samples=4096, optimizer="adam")


def measured_peak(tmp_path, levels):
    guard = MemGuardCallback(mitigations=("checkpointing", "microbatch"), budget="1GiB", cpu_sample_every=1,
                             explain=False)
    pl.Trainer(callbacks=[guard, AtLevels(guard, levels)], default_root_dir=str(tmp_path), logger=False,
               **trainer_kwargs(max_steps=4)).fit(model())
    assert guard.levels == {"checkpointing": 0, "microbatch": 0, **levels}  # nothing moved them
    steady = guard.history[guard.history["step"] >= 2]  # steps with gradients and Adam state, like the estimate's
    return int(steady["peak_bytes"].max())


@pytest.mark.parametrize("levels", [{"microbatch": 1}, {"microbatch": 2}, {"microbatch": 3},
                                    {"checkpointing": 4}, {"checkpointing": 2, "microbatch": 1},
                                    {"checkpointing": 4, "microbatch": 2}])
def test_predicted_peaks_of_checkpointed_and_micro_batched_steps_are_within_3_percent(tmp_path, levels):
    m = model()
    predicted = ladder_peak_model(m, next(iter(m.train_dataloader())), target="cpu").peak(levels)
    assert predicted == pytest.approx(measured_peak(tmp_path, levels), rel=0.03)


def test_the_peak_model_covers_amp_only_where_the_cuda_kernel_model_runs_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    m = model()
    batch = next(iter(m.train_dataloader()))
    cuda = ladder_peak_model(m, batch, target="cuda", amp=True)
    assert cuda.covers("amp") and cuda.covers("checkpointing") and cuda.batch_size == 256
    # bf16 autocast keeps half-size activations: the prediction at AMP is lower, and lower again with checkpointing
    assert cuda.peak({"amp": 1}) < cuda.peak({}) and cuda.peak({"amp": 1, "checkpointing": 4}) < cuda.peak({"amp": 1})
    plain = ladder_peak_model(m, batch, target="cpu", checkpointing=False)
    assert not plain.covers("amp") and not plain.covers("checkpointing") and plain.covers("microbatch")


class Keeps(pl.Callback):
    """Keeps the first batch."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch = getattr(self, "batch", batch)


def test_a_run_already_in_mixed_precision_is_predicted_in_it(tmp_path):
    """A bf16-mixed Trainer: the AMP rung is off (the run is mixed already) and the predictions start from bf16, not
    from an fp32 step the run never takes (a rescue only scales a prediction up: an fp32 one would over-split)."""
    guard = MemGuardCallback(mitigations=("amp", "checkpointing", "microbatch"), budget="1GiB", explain=False)
    keeps = Keeps()
    with pytest.warns(UserWarning, match="the amp rung is off for this run: the trainer already runs"):
        pl.Trainer(callbacks=[guard, keeps], default_root_dir=str(tmp_path), logger=False, precision="bf16-mixed",
                   **trainer_kwargs(max_steps=1)).fit(model())
    used = guard.engine.ladder.predictor.model
    m = model()
    assert used == ladder_peak_model(m, keeps.batch, target="cpu", precision="bf16-mixed")
    assert used.peak({}) < ladder_peak_model(m, keeps.batch, target="cpu").peak({})  # bf16 activations are smaller
