"""Out-of-memory rescue: when the forward or backward of a training step runs out of memory, free what the failed
attempt held, climb the ladder and run the same batch again.

Lightning runs ``training_step``, ``zero_grad`` and ``backward`` of one batch inside a closure object that the
automatic-optimization loop builds per batch (and that the optimizer calls from ``optimizer.step``). Wrapping that
closure is the one place where a retry covers forward *and* backward, before the optimizer has touched anything.
"""

from __future__ import annotations

import gc
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.memory import is_oom_error

__all__ = ["MemGuardOutOfMemoryError", "OomRescue", "OomFailure"]


class MemGuardOutOfMemoryError(torch.OutOfMemoryError):
    """Raised when a batch cannot be rescued: the ladder is exhausted, the retries are used up, or a retry would
    train on corrupted gradients. Its message is the memory report; ``report`` holds the same as a dict. A subclass
    of ``torch.OutOfMemoryError``, so code that handles OOMs still recognises it."""

    def __init__(self, message: str, report: Optional[dict] = None) -> None:
        super().__init__(message)
        self.report = report or {}


@dataclass(frozen=True)
class OomFailure:
    """What went wrong in one attempt."""

    phase: str  # "forward" or "backward"
    first_micro_batch: bool  # the closure zeroes the gradients itself: partial gradients are harmless
    error: str
    attempt: int  # 1 for the first retry
    max_retries: int

    @property
    def retry_safe(self) -> bool:
        """A backward that failed in the middle of an accumulation window has already added part of this
        micro-batch's gradients to the window's sum; they cannot be told apart, so a retry would double them."""
        return self.phase == "forward" or self.first_micro_batch

    @property
    def retries_left(self) -> bool:
        return self.attempt <= self.max_retries


class OomRescue:
    """Wraps the closures of the automatic-optimization loop so an OOM in forward/backward is retried.

    Args:
        max_retries: retries per batch.
        on_failure: called with each :class:`OomFailure` after the failed attempt was released; it applies the next
            rung and returns (the batch is run again), or raises :class:`MemGuardOutOfMemoryError` — it must when
            the failure is not ``retry_safe`` or has no ``retries_left``.
    """

    def __init__(self, max_retries: int, on_failure: Callable[[OomFailure], None]) -> None:
        self.max_retries = max_retries
        self.on_failure = on_failure
        self._loop = None
        self._in_backward = False

    def install(self, trainer: pl.Trainer) -> bool:
        """Hooks into the loop. Returns False (nothing installed) under manual optimization."""
        if not trainer.lightning_module.automatic_optimization:
            return False
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        if "_make_closure" in vars(loop):  # already installed (fit called again)
            return True
        make_closure = loop._make_closure

        def make_rescued_closure(kwargs, optimizer, batch_idx):
            closure = make_closure(kwargs, optimizer, batch_idx)
            # A weak reference: a strong one (or the bound method) from the closure's own attribute would make a
            # reference cycle that keeps the step's loss and outputs alive until the garbage collector runs.
            closure_ref, run_closure = weakref.ref(closure), type(closure).closure
            first_micro_batch = closure._zero_grad_fn is not None

            def rescued(*args, **kw):
                return self._run(lambda: run_closure(closure_ref(), *args, **kw), first_micro_batch, optimizer)

            closure.closure = rescued
            return closure

        loop._make_closure = make_rescued_closure
        self._loop = loop
        return True

    def uninstall(self) -> None:
        if self._loop is not None:
            vars(self._loop).pop("_make_closure", None)
            self._loop = None

    def mark_backward(self) -> None:
        """Called from ``on_before_backward``: an OOM from here on happened in backward."""
        self._in_backward = True

    def _run(self, attempt_batch: Callable[[], Any], first_micro_batch: bool, optimizer) -> Any:
        attempt = 0
        while True:
            self._in_backward = False
            try:
                return attempt_batch()
            except BaseException as err:
                if not _is_oom(err) or isinstance(err, MemGuardOutOfMemoryError):
                    raise
                attempt += 1
                message = str(err).splitlines()[0] if str(err) else ""
                failure = OomFailure("backward" if self._in_backward else "forward", first_micro_batch,
                                     f"{type(err).__name__}: {message}", attempt, self.max_retries)
                # the traceback's frames hold the failed graph (outputs, loss, saved activations): drop them
                traceback.clear_frames(err.__traceback__)
                del err
            self._release(failure, optimizer)
            self.on_failure(failure)

    def _release(self, failure: OomFailure, optimizer) -> None:
        if failure.first_micro_batch:
            # The closure zeroes the gradients before its backward anyway: free them now (the previous step's, or
            # a failed backward's partial ones) so the retry has that memory too.
            optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _is_oom(err: BaseException) -> bool:
    # Lightning's check recognises the CUDA, cuDNN and CPU-allocator messages; torch.OutOfMemoryError covers the
    # rest (the CPU accountant's hard limit, other accelerators).
    return isinstance(err, torch.OutOfMemoryError) or is_oom_error(err)
