"""Real out-of-memory errors on CPU in a Trainer, where only Lightning has the case: the accountant's hard limit
raises torch.OutOfMemoryError the way the CUDA allocator does under a memory fraction, and an accumulation window
that cannot be retried. (Rescue and give-up through every front door are in test_scenarios.py.)"""

import pytest
import torch

from lightning_memguard import MemGuardOutOfMemoryError
from tests.helpers import checkpoint_every_block, limit_between, probe, run
from tests.models import BackwardBallast, Stack, regression_batches

MAX_STEPS = 5


@pytest.fixture(scope="module")
def hard_limit(tmp_path_factory):
    """Between the fully checkpointed peak and the plain peak: plain training runs out of memory."""
    root = tmp_path_factory.mktemp("limit")
    plain = probe("lightning", Stack(), regression_batches(3), root / "plain").highest()
    low = probe("lightning", checkpoint_every_block(Stack()), regression_batches(3), root / "low").highest()
    return limit_between(plain, low)


def test_plain_training_really_runs_out_of_memory(tmp_path, hard_limit):
    result = run("lightning", Stack(), regression_batches(MAX_STEPS), tmp_path, cpu_hard_limit=hard_limit,
                 threshold=1.0, rescue_oom=False, mitigations=(), raises=torch.OutOfMemoryError)  # plain: no rung
    assert "CPU tensor memory limit exceeded" in str(result.error)


class OddBatchesNeedMore(Stack):
    """Odd batches' backward needs ``ballast_bytes`` more (``batch_index`` is set before each batch)."""

    def __init__(self, ballast_bytes):
        super().__init__()
        self.ballast_bytes, self.batch_index, self.started = ballast_bytes, 0, []

    def forward(self, x):
        h = self.inp(x)
        if self.batch_index % 2 == 1:
            h = BackwardBallast.apply(h, self.ballast_bytes)
        return self.head(self.blocks(h))


def test_backward_oom_inside_an_accumulation_window_fails_cleanly(tmp_path, hard_limit):
    model = OddBatchesNeedMore(ballast_bytes=hard_limit)

    def before_batch(m, index):
        m.batch_index = index
        m.started.append(index)

    result = run("lightning", model, regression_batches(2 * MAX_STEPS), tmp_path, accumulate=2,
                 before_batch=before_batch, cpu_hard_limit=hard_limit, threshold=1.0, mitigations=("checkpointing",),
                 raises=MemGuardOutOfMemoryError)
    assert "accumulation window" in str(result.error)
    assert max(model.started) == 1  # the first micro-batch finished; the second failed in backward ...
    assert result.steps_done == 0  # ... and the window never stepped: nothing half-applied
    events = result.guard.events
    assert events["action"].iloc[-1] == "gave_up"
    assert "accumulation window" in events["reason"].iloc[-1]
    # OOMs before it (any forward, or the first micro-batch's backward, which re-zeroes the gradients) were safe
    # to retry and were rescued; the second micro-batch's backward was not
