"""EvaluationRescue: a validation, test or predict batch that runs out of memory runs again in parts, and the loop's
later batches run in as many parts (framework-free).

Evaluation runs without gradients, so running a batch in parts is exact: each part's outputs are its samples'
outputs, combined into the whole batch's (:func:`~lightning_memguard.base.outputs.combine_outputs`). The number of
parts is kept per loop, apart from training's micro-batch level: an evaluation batch is often larger than a training
batch, and a split that one needs says nothing about the other.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..base.batches import batch_size_of, split_batch
from ..base.outputs import combine_outputs
from ..base.snapshot import EVALUATION_PHASES, Event
from ..mitigations.microbatch import MicroBatching, MicroBatchWeight
from ..monitor.monitor import MemoryMonitor
from .fragmentation import Fragmentation
from .oom import MemGuardOutOfMemoryError, error_line, free_cached_memory, is_oom
from .ranks import Ranks
from .report import oom_report

__all__ = ["EvaluationRescue"]

#: ``call(part, share) -> outputs``: the step on one part of the batch (the whole batch, share 1.0, when it runs in
#: one part); ``share`` is the part's weight in a mean over the whole batch (the parts' shares add up to 1)
StepCall = Callable[[Any, float], Any]
#: ``(batch, k) -> [(part, share), ...]``: a batch in at most ``k`` parts, each with its weight in the batch's means
Split = Callable[[Any, int], list]
#: called before each attempt of a batch; returns the function that undoes what a failed attempt logged
Savepoint = Callable[[], Callable[[], None]]
#: set on an error raised while the parts' outputs were put together (every part had run)
_COMBINING = "_memguard_combining_outputs"
#: ``(error, peak, capacity, phase) -> Fragmentation or None``: whether an OOM was fragmentation (recorded once a fit)
Explain = Callable[[str, Optional[int], Optional[int], str], Optional[Fragmentation]]


class EvaluationRescue:
    """Runs evaluation batches in the number of parts each loop needs, and splits further after an out-of-memory
    error.

    Args:
        monitor: where the peak at a failure is read and events, rows and the report go.
        levels: the ladder's rung levels now (for the report).
    """

    def __init__(self, monitor: MemoryMonitor, levels: Callable[[], dict[str, int]],
                 fragmentation: Optional[Explain] = None) -> None:
        #: how a batch is cut and its parts weighed (:meth:`weigh_parts_for` the module's rule; by samples until then)
        self.split: Split = split_batch
        self.monitor = monitor
        self.levels = levels
        self.fragmentation = fragmentation
        #: the parts each loop's batches run in (a loop not named runs them whole)
        self.parts: dict[str, int] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"parts": dict(self.parts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Puts back the parts of :meth:`state_dict` (an older checkpoint without them: every loop runs whole).

        Raises:
            ValueError: a number of parts that is not a positive int.
        """
        parts = dict((state or {}).get("parts") or {})
        for phase, count in parts.items():
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ValueError(f"the checkpoint's evaluation parts {phase}={count!r} must be a positive int")
        self.parts = {phase: count for phase, count in parts.items() if phase in EVALUATION_PHASES}

    def weigh_parts_for(self, module: nn.Module, weight: Optional[MicroBatchWeight],
                        warn: Callable[[str], None]) -> None:
        """Parts are weighed as training's micro-batches are, by what the loss averages over
        (:class:`~lightning_memguard.mitigations.microbatch.MicroBatching`: ``weight``, else labelled tokens when the
        batch has transformers-style labels — after a causal LM's shift —, else samples): a transformers model's
        evaluation loss, a mean over labelled tokens, comes back as the unsplit batch's."""
        self.split = MicroBatching(module, weight=weight, warn=warn).split

    def run(self, phase: str, batch: Any, call: StepCall, *, rescue: bool, ranks: Ranks,
            savepoint: Optional[Savepoint] = None) -> tuple[Any, int]:
        """Runs ``call`` on ``batch`` in the loop's number of parts, each under ``torch.no_grad()``, and returns the
        combined outputs with the number of parts they ran in. After an out-of-memory error (when ``rescue``) the
        failed attempt is freed, ``savepoint``'s undo puts back what it logged, and the batch runs again in twice as
        many parts (at most one sample each), kept for the loop's later batches; an event (action ``eval_split``,
        its ``level`` the parts now) says so.

        Raises:
            MemGuardOutOfMemoryError: the batch cannot be split further, or the run has several processes (all would
                have to split alike); its message is the report.
            ValueError: ``phase`` is not an evaluation loop.
        """
        if phase not in EVALUATION_PHASES:
            raise ValueError(f"phase={phase!r}; allowed: {', '.join(EVALUATION_PHASES)}")
        size = batch_size_of(batch)
        while True:
            parts = min(self.parts.get(phase, 1), size) if size else 1
            undo, combining = None, False
            try:
                # what an attempt logs is saved only where a failed one runs again
                if savepoint is not None and rescue and ranks.can_retry:
                    undo = savepoint()
                return self._attempt(batch, call, parts), parts
            except Exception as err:
                if isinstance(err, MemGuardOutOfMemoryError) or not is_oom(err) or not rescue:
                    raise  # without rescue an OOM stays the caller's to handle, as in training
                combining = getattr(err, _COMBINING, False)
                error = error_line(err)
                traceback.clear_frames(err.__traceback__)  # its frames hold the failed attempt's tensors
                del err
            if undo is not None:
                undo()
            free_cached_memory()
            if combining:  # every part ran: more parts cannot make the whole batch's outputs smaller
                self._give_up(phase, _batch_words(phase, size), *self._failure_numbers(), (
                    f"its {parts} parts ran, but their outputs put together do not fit; return less from the step "
                    "(no key/value cache: use_cache=False; logits only where needed)"), error, None)
            self._split_further(phase, size, parts, error, ranks)

    def _attempt(self, batch: Any, call: StepCall, parts: int) -> Any:
        with torch.no_grad():
            if parts == 1:
                return call(batch, 1.0)
            pieces = self.split(batch, parts)
            # a mean's weights add up to 1 (a loss given num_items_in_batch has shares of 1 a part: it adds up)
            total = sum(share for _, share in pieces) or 1.0
            outputs = [call(part, share / total) for part, share in pieces]
            try:
                return combine_outputs(outputs, [batch_size_of(part) for part, _ in pieces], [s for _, s in pieces])
            except Exception as err:
                setattr(err, _COMBINING, True)  # every part ran: it failed putting their outputs together
                raise

    def _failure_numbers(self) -> tuple[Optional[int], Optional[int]]:
        """The peak since the last boundary (a new peak window starts) and the capacity, at a failure."""
        return self.monitor.peak_since_boundary(), self.monitor.capacity_bytes()

    def _split_further(self, phase: str, size: Optional[int], parts: int, error: str, ranks: Ranks) -> None:
        monitor = self.monitor
        peak, capacity = self._failure_numbers()  # a new peak window for the retry
        what = _batch_words(phase, size)
        # an OOM with enough free memory in the cache is fragmentation: said once a fit, and in the report
        found = self.fragmentation(error, peak, capacity, phase) if self.fragmentation is not None else None
        why = None
        if not ranks.can_retry:
            why = Ranks.NO_RETRY
        elif size is None:
            why = "it has no tensor with a sample dimension to split"
        elif parts >= size:
            why = f"{'its one sample' if size == 1 else f'each of its {size} samples'} alone does not fit"
        if why is not None:
            self._give_up(phase, what, peak, capacity, why, error, found)
        more = min(2 * parts, size)
        self.parts[phase] = more
        reason = (f"out of memory in {_batch_words(phase, size)[2:]}"
                  + (f" run in {parts} parts" if parts > 1 else "")
                  + f" ({error}); it and later {phase} batches run in {more} parts")
        monitor.record(Event(step=monitor.step, action="eval_split", rung="", reason=reason, peak_before_bytes=peak,
                             capacity_bytes=capacity, phase=phase, level=more, time=time.time()))

    def _give_up(self, phase: str, what: str, peak: Optional[int], capacity: Optional[int], why: str,
                 error: str, fragmentation: Optional[Fragmentation]) -> None:
        """Records the end of the run, keeps its row and report file on this rank, and raises the report."""
        monitor, step = self.monitor, self.monitor.step
        report = oom_report(step, phase, peak, capacity, self.levels(), monitor.events, why, error, fragmentation,
                            subject=what)
        monitor.record(Event(step=step, action="gave_up", rung="", reason=f"{what}: {why}", peak_before_bytes=peak,
                             capacity_bytes=capacity, phase=phase, time=time.time()))
        monitor.keep_failure(report["text"])
        raise MemGuardOutOfMemoryError(report["text"], report)


def _batch_words(phase: str, size: Optional[int]) -> str:
    """``"a validation batch of 32 samples"``."""
    return f"a {phase} batch" + (f" of {size} sample{'s' if size != 1 else ''}" if size else "")
