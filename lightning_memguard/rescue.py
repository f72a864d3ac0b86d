"""How Lightning runs a batch, under MemGuard: split into micro-batches when the micro-batch rung asks, retried after
an out-of-memory error in forward or backward, and an optimizer step that runs out of memory explained (and retried
where that is provably safe).

Lightning runs ``training_step``, ``zero_grad`` and ``backward`` of one batch inside a closure object that the
automatic-optimization loop builds per batch (and that the optimizer calls from ``optimizer.step``). Wrapping that
closure is the one place where a retry covers forward *and* backward before the optimizer has touched anything, and
where one batch can run as several micro-batches inside one optimizer step.
"""

from __future__ import annotations

import gc
import traceback
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior
from lightning.pytorch.utilities.memory import is_oom_error

from .mitigations.microbatch import split_batch

__all__ = ["MemGuardOutOfMemoryError", "BatchRunner", "OomFailure", "MAX_ATTEMPTS"]

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
    """What went wrong in one attempt."""

    phase: str  # "forward" or "backward"
    first_micro_batch: bool  # the closure zeroes the gradients itself: partial gradients are harmless
    error: str
    attempt: int  # 1 for the first retry
    max_retries: Optional[int]  # None: as many as the ladder has rungs to climb (bounded by MAX_ATTEMPTS)
    several_processes: bool = False
    partial_gradients: bool = False  # a backward of this batch (or of one of its micro-batches) already ran

    @property
    def retry_safe(self) -> bool:
        """Gradients this batch already added to an accumulation window's sum cannot be told apart, so a retry would
        double them: safe only when the closure zeroes the gradients itself, or nothing was added yet. Several
        processes cannot retry together without a collective after every forward and backward."""
        added = self.phase == "backward" or self.partial_gradients
        return not self.several_processes and (self.first_micro_batch or not added)

    @property
    def retries_left(self) -> bool:
        return self.attempt <= (self.max_retries if self.max_retries is not None else MAX_ATTEMPTS - 1)


class BatchRunner:
    """Wraps the closures and optimizer steps of Lightning's automatic-optimization loop.

    Args:
        max_retries: retries per batch; ``None``: until ``on_failure`` gives up (bounded by :data:`MAX_ATTEMPTS`).
        on_failure: called with each :class:`OomFailure` after the failed attempt was released; it applies the next
            rung and returns (the batch is run again), or raises :class:`MemGuardOutOfMemoryError` — it must when
            the failure is not ``retry_safe`` or has no ``retries_left``.
        on_optimizer_failure: called with ``(error text, retry_safe)`` when ``optimizer.step`` itself ran out of
            memory; returns to retry the step once with ``foreach=False`` (it may only when ``retry_safe``: no
            parameter or optimizer state was touched yet), else raises :class:`MemGuardOutOfMemoryError`.
        micro_batches: how many micro-batches to run each batch as, asked at every batch.
    """

    def __init__(self, max_retries: Optional[int], on_failure: Callable[[OomFailure], None],
                 on_optimizer_failure: Callable[[str, bool], None], micro_batches: Callable[[], int]) -> None:
        self.max_retries = max_retries
        self.on_failure = on_failure
        self.on_optimizer_failure = on_optimizer_failure
        self.micro_batches = micro_batches
        self.rescue = True
        self.several_processes = False
        self._loop = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._in_backward = False
        self._partial_gradients = False
        self._steps_done = 0

    # --- installing -------------------------------------------------------------------------------------------------
    def install(self, trainer: pl.Trainer, rescue: bool) -> bool:
        """Hooks into the loop. Returns False (nothing installed) under manual optimization."""
        if not trainer.lightning_module.automatic_optimization:
            return False
        self.rescue = rescue
        self.several_processes = trainer.world_size > 1
        self._steps_done = 0
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        if "_make_closure" not in vars(loop):  # not installed yet (a second fit reuses the loop)
            make_closure = loop._make_closure

            def make_guarded_closure(kwargs, optimizer, batch_idx):
                closure = make_closure(kwargs, optimizer, batch_idx)
                # A weak reference: a strong one (or the bound method) from the closure's own attribute would make a
                # reference cycle that keeps the step's loss and outputs alive until the garbage collector runs.
                closure_ref = weakref.ref(closure)
                first_micro_batch = closure._zero_grad_fn is not None

                def guarded(*args, **kw):
                    return self._run(lambda: self._run_batch(closure_ref(), loop, kwargs, trainer.strategy),
                                     first_micro_batch, optimizer)

                closure.closure = guarded
                return closure

            loop._make_closure = make_guarded_closure
        self._loop = loop
        for optimizer in trainer.optimizers:
            self._guard_optimizer(optimizer)
        return True

    def uninstall(self) -> None:
        if self._loop is not None:
            vars(self._loop).pop("_make_closure", None)
            self._loop = None
        for optimizer in self._optimizers:
            step = vars(optimizer).get("step")
            if getattr(step, "_memguard_previous", None) is not None:
                optimizer.step = step._memguard_previous  # an LR scheduler's wrapper, say, was there before
            elif step is not None:
                del optimizer.step
        self._optimizers = []

    def mark_backward(self) -> None:
        """Called from ``on_before_backward``: an OOM from here on happened in backward."""
        self._in_backward = True

    # --- forward and backward ---------------------------------------------------------------------------------------
    def _run_batch(self, closure, loop, kwargs: OrderedDict, strategy) -> ClosureResult:
        k = self.micro_batches()
        run_closure = type(closure).closure
        if k <= 1:
            return run_closure(closure)
        step_fn, zero_grad_fn = closure._step_fn, closure._zero_grad_fn
        chunks = split_batch(kwargs["batch"], k)
        total, result = None, None
        try:
            for i, (chunk, share) in enumerate(chunks):
                micro_kwargs = OrderedDict(kwargs)
                micro_kwargs["batch"] = chunk
                closure._step_fn = partial(_scaled_step, partial(loop._training_step, micro_kwargs), share)
                closure._zero_grad_fn = zero_grad_fn if i == 0 else None  # zero once, then accumulate
                # gradients are synchronised across processes once, with the last micro-batch's backward
                with _block_parallel_sync_behavior(strategy, block=i < len(chunks) - 1):
                    result = run_closure(closure)
                self._partial_gradients = True  # this micro-batch's gradients are in the sum now
                if result.loss is not None:
                    total = result.loss if total is None else total + result.loss
        finally:
            closure._step_fn, closure._zero_grad_fn = step_fn, zero_grad_fn
        return ClosureResult(total, extra=result.extra if result is not None else {})

    def _run(self, attempt_batch: Callable[[], Any], first_micro_batch: bool, optimizer) -> Any:
        attempt = 0
        while True:
            self._in_backward = self._partial_gradients = False
            try:
                return attempt_batch()
            except BaseException as err:
                if not _is_oom(err) or isinstance(err, MemGuardOutOfMemoryError) or not self.rescue:
                    raise  # with rescue off, an OOM stays the caller's to handle
                attempt += 1
                message = str(err).splitlines()[0] if str(err) else ""
                failure = OomFailure("backward" if self._in_backward else "forward", first_micro_batch,
                                     f"{type(err).__name__}: {message}", attempt, self.max_retries,
                                     self.several_processes, self._partial_gradients)
                # the traceback's frames hold the failed graph (outputs, loss, saved activations): drop them
                traceback.clear_frames(err.__traceback__)
                del err
            self._release(first_micro_batch, optimizer)
            self.on_failure(failure)

    def _release(self, first_micro_batch: bool, optimizer) -> None:
        if first_micro_batch:
            # The closure zeroes the gradients before its backward anyway: free them now (the previous step's, or
            # a failed backward's partial ones) so the retry has that memory too.
            optimizer.zero_grad(set_to_none=True)
        _free_cached_memory()

    # --- the optimizer step -----------------------------------------------------------------------------------------
    def _guard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if getattr(vars(optimizer).get("step"), "_memguard", False):
            return
        # LR schedulers wrap optimizer.step on the instance: wrap whatever is there, and put it back at the end
        previous = vars(optimizer).get("step")
        original = optimizer.step

        def step(closure=None, **kwargs):
            results: list = []

            def recording_closure():  # a retried step must not run forward and backward again
                results[:] = [closure()]
                return results[0]

            def replayed_closure():
                return results[0]

            guarded_closure = recording_closure if closure is not None else None
            untouched = _Untouched(optimizer) if self._steps_done == 0 else None  # the step that creates the state
            for attempt in range(2):
                try:
                    out = original(closure=guarded_closure, **kwargs)
                    break
                except BaseException as err:
                    # an OOM in the closure was rescued or reported there; with no closure (a GradScaler step) the
                    # closure ran before this call
                    in_closure = closure is not None and not results
                    if not _is_oom(err) or isinstance(err, MemGuardOutOfMemoryError) or in_closure:
                        raise
                    message = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                    traceback.clear_frames(err.__traceback__)
                    del err
                safe = attempt == 0 and untouched is not None and untouched.roll_back()
                _free_cached_memory()
                self.on_optimizer_failure(message, safe)  # raises the report unless a retry is safe
                for group in optimizer.param_groups:
                    group["foreach"] = False  # one parameter's temporaries at a time, not the whole group's
                if closure is not None:
                    guarded_closure = replayed_closure
            self._steps_done += 1
            return out

        step._memguard = True
        step._memguard_previous = previous
        optimizer.step = step
        self._optimizers.append(optimizer)


class _Untouched:
    """Remembers, before an optimizer step, what the step could change, to tell afterwards whether it changed any of
    it. In-place updates bump a tensor's version counter, which costs no device sync to read. Taken only before the
    first step of a fit: that is the step that creates the optimizer state."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.had_state = set(optimizer.state)
        self.versions = {id(t): t._version for t in self._tensors()}

    def _tensors(self):
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                yield param
                for value in self.optimizer.state.get(param, {}).values():
                    if isinstance(value, torch.Tensor):
                        yield value

    def roll_back(self) -> bool:
        """True if no parameter or pre-existing state tensor was changed; then the state the failed step created
        is dropped, so a retry starts from where this step started."""
        for tensor in self._tensors():
            version = self.versions.get(id(tensor))
            if version is not None and tensor._version != version:
                return False
        for param in [p for p in self.optimizer.state if p not in self.had_state]:
            del self.optimizer.state[param]
        return True


def _scaled_step(step_fn: Callable[[], ClosureResult], share: float) -> ClosureResult:
    """One micro-batch's training step with its loss weighted by its share of the batch (mean-reduced losses then sum
    to the whole batch's, as with gradient accumulation)."""
    result = step_fn()
    if result.closure_loss is not None:
        result.closure_loss = result.closure_loss * share
        result._clone_loss()
    return result


def _free_cached_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _is_oom(err: BaseException) -> bool:
    # Lightning's check recognises the CUDA, cuDNN and CPU-allocator messages; torch.OutOfMemoryError covers the
    # rest (the CPU accountant's hard limit, other accelerators).
    return isinstance(err, torch.OutOfMemoryError) or is_oom_error(err)
