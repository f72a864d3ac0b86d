"""Out-of-memory errors, framework-free: recognising one, what one attempt's failure was, freeing what a failed
attempt left, and an optimizer step retried only where that is provably safe. The attempt loop that retries a batch
is :mod:`~lightning_memguard.guard.attempts`."""

from __future__ import annotations

import gc
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..base.optimizer_step import state_holder, steps_one_parameter_at_a_time

__all__ = ["MemGuardOutOfMemoryError", "OomFailure", "MAX_ATTEMPTS", "is_oom", "free_cached_memory",
           "step_optimizer", "error_line"]

#: Attempts of one batch when ``max_retries`` is not given: the ladder decides when to give up; this only bounds it.
MAX_ATTEMPTS = 16


class MemGuardOutOfMemoryError(torch.OutOfMemoryError):
    """Raised when a batch cannot be rescued: the ladder is exhausted, the retries are used up, a retry would train
    on corrupted gradients, or the optimizer step ran out of memory. Its message is the memory report; ``report``
    holds the same as a dict. A subclass of ``torch.OutOfMemoryError``, so code that handles OOMs still recognises
    it."""

    def __init__(self, message: str, report: Optional[dict] = None) -> None:
        super().__init__(message)
        self.report = report or {}


@dataclass(frozen=True)
class OomFailure:
    """What went wrong in one attempt of a batch."""

    phase: str  # "forward" or "backward"
    first_micro_batch: bool  # the gradients are zeroed before this batch's backward: partial gradients are harmless
    error: str
    attempt: int  # 1 for the first retry
    max_retries: Optional[int]  # None: as many as the ladder has rungs to climb (bounded by MAX_ATTEMPTS)
    partial_gradients: bool = False  # a backward of this batch (or of one of its micro-batches) already ran
    stepped: bool = False  # an optimizer stepped in the attempt (a step that optimizes itself)

    @property
    def retry_safe(self) -> bool:
        """Gradients this batch already added to an accumulation window's sum cannot be told apart, so a retry would
        double them: safe only when the gradients are zeroed before the batch, or nothing was added yet."""
        added = self.phase == "backward" or self.partial_gradients
        return self.first_micro_batch or not added

    @property
    def may_run_again(self) -> bool:
        """Whether running the batch again leaves training as if the failed attempt had not run (however many
        retries are left): no optimizer stepped in it, and no gradient of it is mixed into a window's sum."""
        return not self.stepped and self.retry_safe

    @property
    def retries_left(self) -> bool:
        return self.attempt <= (self.max_retries if self.max_retries is not None else MAX_ATTEMPTS - 1)

    @property
    def why_no_retry(self) -> Optional[str]:
        """Why this batch must not run again (for the report), or ``None`` when it may."""
        if self.stepped:
            return ("an optimizer had already stepped in this training step (it optimizes manually): running it again "
                    "would step that optimizer twice")
        if not self.retry_safe:
            return ("the backward failed in the middle of a gradient-accumulation window, after part of this "
                    "micro-batch's gradients were added to the window's sum; retrying would train on corrupted "
                    "gradients")
        if not self.retries_left:
            return f"{self.attempt - 1} retries of the same batch did not fit"
        return None


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is an out-of-memory error: ``torch.OutOfMemoryError`` (CUDA, the CPU accountant's hard limit,
    other accelerators) or the messages older code paths raise as a plain RuntimeError (CUDA, cuDNN, CPU allocator)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    if not isinstance(err, RuntimeError) or not err.args or not isinstance(err.args[0], str):
        return False
    text = err.args[0]
    return (("CUDA" in text and "out of memory" in text) or "CUDNN_STATUS_NOT_SUPPORTED" in text
            or "DefaultCPUAllocator: can't allocate memory" in text)


def error_line(err: BaseException) -> str:
    """``Type: first line of the message``, for events and reports."""
    message = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {message}"


def free_cached_memory() -> None:
    """Collects what the failed attempt left in reference cycles and hands cached CUDA blocks back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _Untouched:
    """Remembers, before an optimizer step, what the step could change, to tell afterwards whether it changed any of
    it. In-place updates bump a tensor's version counter, which costs no device sync to read. Taken only before the
    first step of a fit: that is the step that creates the optimizer state."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.state = state_holder(optimizer).state  # ZeroRedundancyOptimizer's is its local optimizer's
        self.had_state = set(self.state)
        self.versions = {id(t): t._version for t in self._tensors()}

    def _tensors(self):
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                yield param
                for value in self.state.get(param, {}).values():
                    if isinstance(value, torch.Tensor):
                        yield value

    def roll_back(self) -> bool:
        """True if no parameter or pre-existing state tensor was changed; then the state the failed step created
        is dropped, so a retry starts from where this step started."""
        for tensor in self._tensors():
            version = self.versions.get(id(tensor))
            if version is not None and tensor._version != version:
                return False
        for param in [p for p in self.state if p not in self.had_state]:
            del self.state[param]
        return True


def step_optimizer(optimizer: torch.optim.Optimizer, run_step: Callable[[bool], Any], first_step: bool,
                   on_failure: Callable[[str, bool], None],
                   failed_elsewhere: Callable[[], bool] = lambda: False) -> Any:
    """Runs ``run_step(retry)`` (the optimizer's step). When it runs out of memory, ``on_failure(error, retry_safe)``
    raises the report, or returns to have the step retried once with ``foreach=False`` (one parameter's temporaries
    at a time) — it may only when ``retry_safe``: this is the fit's first step (the one that creates the optimizer
    state), no parameter or state tensor was updated yet, and ``foreach=False`` changes something (a group runs
    group-wide kernels). ``failed_elsewhere()`` says the OOM came from a closure
    the step ran (forward and backward, rescued or reported there), which is re-raised untouched."""
    untouched = _Untouched(optimizer) if first_step else None
    for attempt in range(2):
        try:
            return run_step(attempt > 0)
        except BaseException as err:
            if not is_oom(err) or isinstance(err, MemGuardOutOfMemoryError) or failed_elsewhere():
                raise
            message = error_line(err)
            traceback.clear_frames(err.__traceback__)
            del err
        # foreach=False changes nothing where every group runs one parameter at a time or fused already
        safe = (attempt == 0 and untouched is not None and not steps_one_parameter_at_a_time(optimizer)
                and untouched.roll_back())
        free_cached_memory()
        on_failure(message, safe)  # raises the report unless a retry is safe
        for group in optimizer.param_groups:
            group["foreach"] = False
    raise AssertionError("unreachable: the second failure raised in on_failure")
