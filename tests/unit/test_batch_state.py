"""BatchState.failure: the one rule that says whether a failed training attempt may run again, for an OOM and for
a rung that broke the step alike."""

import torch

from lightning_memguard.guard.attempts import BatchState


def _failure(state, first_micro_batch):
    return state.failure("RuntimeError: scripted", first_micro_batch=first_micro_batch, attempt=1, max_retries=None)


def test_a_forward_failure_may_run_again_anywhere_in_a_window():
    state = BatchState()
    assert _failure(state, first_micro_batch=False).may_run_again
    assert _failure(state, first_micro_batch=True).phase == "forward"


def test_a_backward_failure_mid_window_may_not_as_its_gradients_are_mixed_into_the_sum():
    state = BatchState()
    state.in_backward = True
    assert _failure(state, first_micro_batch=True).may_run_again
    mixed = _failure(state, first_micro_batch=False)
    assert not mixed.may_run_again and "gradient-accumulation window" in mixed.why_no_retry
    state.in_backward, state.partial_gradients = False, True  # an earlier micro-batch's backward ran
    assert not _failure(state, first_micro_batch=False).may_run_again


def test_backwards_begun_on_empty_gradients_are_taken_back_so_the_batch_may_run_again():
    layer = torch.nn.Linear(2, 2)
    state = BatchState()
    state.backward_begins(layer.parameters())
    state.in_backward, state.partial_gradients = True, True
    assert _failure(state, first_micro_batch=False).may_run_again
    layer(torch.ones(1, 2)).sum().backward()
    state.reset()
    state.backward_begins(layer.parameters())  # a gradient from before the attempt: nothing tells its part apart
    state.in_backward = True
    assert not _failure(state, first_micro_batch=False).may_run_again


def test_an_attempt_in_which_an_optimizer_stepped_never_runs_again():
    state = BatchState()
    state.stepped = True
    failure = _failure(state, first_micro_batch=True)
    assert not failure.may_run_again and "stepped" in failure.why_no_retry
