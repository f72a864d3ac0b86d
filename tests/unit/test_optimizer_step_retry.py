"""guard.oom.step_optimizer: the provably safe retry of a first optimizer step that ran out of memory."""

import pytest
import torch

from lightning_memguard.guard.oom import step_optimizer


class FailsOnce:
    """Makes the optimizer's step raise an out-of-memory error the first time, before it touched anything (as the
    foreach temporaries of a first AdamW step do)."""

    def __init__(self, optimizer):
        self.optimizer, self.step, self.calls = optimizer, optimizer.step, 0
        optimizer.step = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return self.step(*args, **kwargs)


def test_a_retry_under_a_grad_scaler_unscales_once_and_steps_once():
    """fp16 training steps through GradScaler.step: the failed attempt already unscaled the gradients; the retry
    must neither unscale them again nor skip the step."""
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1, foreach=True)  # group-wide kernels, as on a GPU by default
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale((2 * param).sum()).backward()  # the gradient is 2, scaled by 8
    FailsOnce(optimizer)
    failures = []

    def run_step(retry):
        scaler.step(optimizer)
        scaler.update()

    step_optimizer(optimizer, run_step, first_step=True, on_failure=lambda message, safe: failures.append(safe))
    assert failures == [True] and optimizer.param_groups[0]["foreach"] is False
    torch.testing.assert_close(param.detach(), torch.full((4,), 0.8))  # 1 - 0.1 * 2: unscaled once, stepped once
    assert scaler.get_scale() == 8.0  # no inf was seen, nothing skipped


def test_a_later_step_is_not_retried():
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.ones(4)
    FailsOnce(optimizer)

    def report(message, safe):
        assert not safe and "Tried to allocate" in message
        raise RuntimeError("the report")

    with pytest.raises(RuntimeError, match="the report"):
        step_optimizer(optimizer, lambda retry: optimizer.step(), first_step=False, on_failure=report)
    torch.testing.assert_close(param.detach(), torch.ones(4))


@pytest.mark.parametrize("keywords", [dict(foreach=False), dict(), dict(fused=True)],
                         ids=["foreach=False", "CPU default", "fused"])
def test_a_step_that_runs_one_parameter_at_a_time_or_fused_is_not_retried(keywords):
    """foreach=False would change nothing: the step is reported, not run again."""
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([param], lr=0.1, **keywords)
    param.grad = torch.ones(4)
    FailsOnce(optimizer)
    failures = []

    def report(message, safe):
        failures.append(safe)
        raise RuntimeError("the report")

    with pytest.raises(RuntimeError, match="the report"):
        step_optimizer(optimizer, lambda retry: optimizer.step(), first_step=True, on_failure=report)
    assert failures == [False]
