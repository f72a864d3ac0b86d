"""An out-of-memory error that reaches Python as another error is still one when the allocator counted it: on an H100
an OOM inside a checkpointed bf16 forward, while the allocator's history was recorded, came out as ``SystemError: ...
returned NULL without setting an exception``, and the guard took it for a rung that broke the step."""

import pytest

from lightning_memguard.guard.attempts import run_attempts


class Allocator:
    """A cumulative OOM count, as the CUDA allocator's ``num_ooms``."""

    def __init__(self) -> None:
        self.ooms = 0

    def count(self) -> int:
        return self.ooms


def into(found: list):
    """An ``on_oom`` that keeps each failure's error line and lets the batch run again."""
    return lambda line, combining: found.append(line)


def attempts(allocator: Allocator, errors: list[BaseException], ran_out: list[bool]):
    """Each call raises the next error (counting an OOM in the allocator where ``ran_out`` says so), then returns."""
    calls = []

    def attempt():
        calls.append(len(calls))
        if len(calls) <= len(errors):
            allocator.ooms += ran_out[len(calls) - 1]
            raise errors[len(calls) - 1]
        return "done"

    return attempt, calls


def test_an_error_while_the_allocator_counted_an_oom_is_rescued_as_one():
    allocator, failures, reverted = Allocator(), [], []
    attempt, calls = attempts(allocator, [SystemError("<built-in function linear> returned NULL without setting an "
                                                      "exception")], [True])
    result = run_attempts(attempt, into(failures), on_error=lambda line: reverted.append(line) or True,
                          oom_count=allocator.count, ooms_before=0)
    assert result == "done" and len(calls) == 2
    assert len(failures) == 1 and "SystemError" in failures[0] and not reverted


def test_the_same_error_without_an_oom_counted_goes_to_the_rung_check():
    allocator, failures, reverted = Allocator(), [], []
    attempt, _ = attempts(allocator, [SystemError("returned NULL without setting an exception")], [False])
    assert run_attempts(attempt, into(failures), on_error=lambda line: reverted.append(line) or True,
                        oom_count=allocator.count, ooms_before=0) == "done"
    assert not failures and len(reverted) == 1


def test_after_a_rescued_oom_the_count_it_raised_is_the_new_baseline():
    """A real OOM raises the count; a rung error in the retry must not be taken for a second OOM."""
    import torch

    allocator, failures, reverted = Allocator(), [], []
    attempt, calls = attempts(allocator, [torch.OutOfMemoryError("CUDA out of memory"), ValueError("rung broke")],
                              [True, False])
    assert run_attempts(attempt, into(failures), on_error=lambda line: reverted.append(line) or True,
                        oom_count=allocator.count, ooms_before=0) == "done"
    assert len(failures) == 1 and reverted == ["ValueError: rung broke"] and len(calls) == 3


def test_without_a_count_nothing_changes():
    attempt, _ = attempts(Allocator(), [SystemError("returned NULL without setting an exception")], [True])
    with pytest.raises(SystemError):
        run_attempts(attempt, lambda line, combining: None, on_error=lambda line: False)
