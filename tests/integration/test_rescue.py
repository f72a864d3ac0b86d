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


class HeadHeavy(torch.nn.Module):
    """Two 16-wide blocks under a 4096-wide head: the head's activations are the peak, which no checkpointed block
    lowers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
                                            for _ in range(2)])
        self.head = torch.nn.Linear(16, 4096)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x))).relu().mean(-1, keepdim=True)


def test_a_give_up_where_no_rung_is_predicted_to_help_says_so_not_that_rungs_did_not_help(tmp_path):
    """The checkpointing rung was never applied: the estimate puts its top level at the peak as it is. The report
    says that, with the figures, not that every rung "is at its top level or did not help"."""
    peak = probe("lightning", HeadHeavy(), regression_batches(2), tmp_path / "probe").highest(from_step=1)
    result = run("lightning", HeadHeavy(), regression_batches(3), tmp_path / "run", cpu_hard_limit=int(0.9 * peak),
                 mitigations=("checkpointing",), plan_at_start=False, explain=False, raises=MemGuardOutOfMemoryError)
    events = result.guard.events
    assert events["action"].tolist() == ["gave_up"] and result.guard.levels == {"checkpointing": 0}
    why = result.error.report["why"]
    assert why == events["reason"].iloc[-1] and why in str(result.error)
    assert "checkpointing at 0/2: predicted not to help: at its top level, 2, the step peak is predicted at" in why
    assert "did not help" not in why.replace("not to help", ""), why
