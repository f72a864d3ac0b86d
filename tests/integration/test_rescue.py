"""Real out-of-memory errors on CPU: the accountant's hard limit raises torch.OutOfMemoryError the way the CUDA
allocator does under a memory fraction."""

import copy

import pandas as pd
import pytest
import torch

from lightning_memguard import MemGuardCallback
from lightning_memguard.guard.oom import MemGuardOutOfMemoryError
from lightning_memguard.mitigations.checkpointing import ActivationCheckpointing
from tests.models import BlockStack, pl, trainer_kwargs

MAX_STEPS = 5


class CountsBatches(BlockStack):
    def __init__(self, **kw):
        super().__init__(**{"width": 64, "depth": 8, "batch_size": 512, "n_samples": 8192, **kw})
        self.step_calls, self.finished = [], []

    def training_step(self, batch, batch_idx):
        self.step_calls.append(batch_idx)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.finished.append(batch_idx)


def fit(model, guard, root, **overrides):
    callbacks = [guard] if guard is not None else []
    trainer = pl.Trainer(callbacks=callbacks, default_root_dir=str(root), logger=False,
                         **trainer_kwargs(**{"max_steps": MAX_STEPS, **overrides}))
    trainer.fit(model)
    return trainer


def peak_of(tmp_path, checkpoint_all):
    model = CountsBatches()
    if checkpoint_all:
        rung = ActivationCheckpointing(model)
        rung.set_level(rung.max_level)
    guard = MemGuardCallback(cpu_sample_every=1)
    fit(model, guard, tmp_path / f"probe{checkpoint_all}", max_steps=3)
    return int(guard.history.groupby("step")["peak_bytes"].max().max())


@pytest.fixture(scope="module")
def hard_limit(tmp_path_factory):
    """Between the fully checkpointed peak and the plain peak: plain training runs out of memory."""
    root = tmp_path_factory.mktemp("limit")
    plain, mitigated = peak_of(root, False), peak_of(root, True)
    return (plain + mitigated) // 2


def test_plain_training_really_runs_out_of_memory(tmp_path, hard_limit):
    guard = MemGuardCallback(cpu_hard_limit=hard_limit, threshold=1.0, rescue_oom=False)
    with pytest.raises(torch.OutOfMemoryError, match="CPU tensor memory limit exceeded"):
        fit(CountsBatches(), guard, tmp_path)


def test_oom_is_rescued_and_every_batch_is_trained_exactly_once(tmp_path, hard_limit):
    model = CountsBatches()
    # threshold 1.0: no warning before the OOM, so the rescue path is what saves the run
    guard = MemGuardCallback(cpu_hard_limit=hard_limit, threshold=1.0, mitigations=("checkpointing",))
    trainer = fit(model, guard, tmp_path)
    assert trainer.global_step == MAX_STEPS
    assert model.finished == list(range(MAX_STEPS))  # each batch once, none skipped
    rescues = guard.events[guard.events["action"] == "rescue"]
    assert len(rescues) >= 1
    for step, retries in rescues["step"].value_counts().items():
        assert model.step_calls.count(step) == 1 + retries  # the same batch, run again
    assert len(model.step_calls) == MAX_STEPS + len(rescues)
    assert "out of memory in forward" in rescues["reason"].iloc[0] or "in backward" in rescues["reason"].iloc[0]
    assert guard.levels["checkpointing"] > 0
    assert (guard.history["peak_bytes"] <= hard_limit).all()


def test_parameters_after_a_rescue_equal_a_clean_runs(tmp_path, hard_limit):
    torch.manual_seed(0)
    rescued_model = CountsBatches()
    clean_model = copy.deepcopy(rescued_model)
    guard = MemGuardCallback(cpu_hard_limit=hard_limit, threshold=1.0, mitigations=("checkpointing",))
    fit(rescued_model, guard, tmp_path / "rescued")
    assert (guard.events["action"] == "rescue").any()
    fit(clean_model, None, tmp_path / "clean")
    for (name, rescued), (_, clean) in zip(rescued_model.named_parameters(), clean_model.named_parameters()):
        assert torch.equal(rescued, clean), name  # no doubled gradients, no half-applied step


def test_a_model_that_cannot_fit_ends_with_the_report_not_a_hang(tmp_path, hard_limit):
    guard = MemGuardCallback(cpu_hard_limit=hard_limit // 3, threshold=1.0)
    with pytest.raises(MemGuardOutOfMemoryError) as info:
        fit(CountsBatches(), guard, tmp_path)
    text = str(info.value)
    assert "could not rescue step" in text and "capacity" in text and "what was tried" in text
    assert info.value.report["capacity_bytes"] == hard_limit // 3
    assert "gave_up" in set(guard.events["action"])
    assert (tmp_path / "memguard_oom_report.txt").read_text().startswith("lightning-memguard could not rescue")
    rows = pd.read_csv(tmp_path / "memguard_history.csv")
    assert rows["phase"].iloc[-1] == "exception"  # the final snapshot


class BackwardBallast(torch.autograd.Function):
    """Identity whose backward allocates ``nbytes`` while it runs: memory that only backward needs."""

    @staticmethod
    def forward(ctx, x, nbytes):
        ctx.nbytes = nbytes
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ballast = torch.ones(ctx.nbytes // 4)
        return grad + ballast[:1] * 0, None


class OddMicroBatchesNeedMore(CountsBatches):
    def __init__(self, ballast_bytes, **kw):
        super().__init__(**kw)
        self.ballast_bytes = ballast_bytes

    def forward(self, x):
        h = self.inp(x)
        if self.trainer.fit_loop.batch_idx % 2 == 1:
            h = BackwardBallast.apply(h, self.ballast_bytes)
        return self.head(self.blocks(h))


def test_backward_oom_inside_an_accumulation_window_fails_cleanly(tmp_path, hard_limit):
    guard = MemGuardCallback(cpu_hard_limit=hard_limit, threshold=1.0, mitigations=("checkpointing",))
    model = OddMicroBatchesNeedMore(ballast_bytes=hard_limit)
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
                         **trainer_kwargs(max_steps=MAX_STEPS, accumulate_grad_batches=2))
    with pytest.raises(MemGuardOutOfMemoryError, match="accumulation window"):
        trainer.fit(model)
    assert model.finished == [0]  # the first micro-batch finished; the second failed in backward ...
    assert trainer.global_step == 0  # ... and the window never stepped: nothing half-applied
    events = guard.events
    assert events["action"].iloc[-1] == "gave_up"
    assert "accumulation window" in events["reason"].iloc[-1]
    # OOMs before it (any forward, or the first micro-batch's backward, which re-zeroes the gradients) were safe
    # to retry and were rescued; the second micro-batch's backward was not
