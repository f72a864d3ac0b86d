"""OomRescue: what an out-of-memory error leads to — the next rung and the same batch again, or the memory report and
the end of the run (framework-free; the front door catches the error and frees the failed attempt,
:mod:`~lightning_memguard.guard.oom`)."""

from __future__ import annotations

import time
from typing import Callable, Optional

from torch import nn

from ..base.snapshot import Event, MemorySnapshot
from ..monitor.monitor import MemoryMonitor
from ..sources.cuda import expandable_segments_on
from ..sources.training_state import training_state_bytes
from .fragmentation import Fragmentation, FragmentationWatch
from .ladder import Ladder
from .oom import MemGuardOutOfMemoryError, OomFailure, optimizer_oom_texts
from .policy import Decision, StepObservation
from .ranks import Ranks
from .report import oom_report

__all__ = ["OomRescue", "record_decision"]


def record_decision(monitor: MemoryMonitor, ladder: Ladder, decision: Decision, capacity: Optional[int],
                    warn: bool = False) -> None:
    """Records ``decision`` as an event, now, with the rung levels it left."""
    monitor.record(decision.to_event(capacity, time.time()), ladder.levels, warn=warn)


class OomRescue:
    """Handles the out-of-memory errors of one guard's fits.

    Args:
        ladder: the rungs to climb.
        monitor: what was measured (the peak at the failure, the step's start), where events and files go.
    """

    def __init__(self, ladder: Ladder, monitor: MemoryMonitor) -> None:
        self.ladder = ladder
        self.monitor = monitor
        self.module: Optional[nn.Module] = None
        self.ranks = Ranks()
        self.fragmentation = FragmentationWatch(expandable_segments_on)
        #: ``(step, cause) -> decision or None``: a batch split once for its size runs again in more parts, that batch
        #: only (:meth:`~lightning_memguard.guard.long_batch.LongBatches.after_oom`); ``None``: the ladder decides
        self.split_this_batch: Optional[Callable[[int, str], Optional[Decision]]] = None

    def begin(self, module: nn.Module, ranks: Ranks) -> None:
        """A fit of ``module`` in these processes (several cannot run a batch again)."""
        self.module, self.ranks = module, ranks
        self.fragmentation.begin()

    def after_step(self, snapshots: list[MemorySnapshot]) -> None:
        """A step's snapshots: allocator retries while the cache held free memory are recorded as fragmentation,
        once a fit."""
        found = self.fragmentation.after_step(snapshots)
        if found is not None:
            self._record_fragmentation(found, snapshots[-1].peak_bytes, snapshots[-1].capacity_bytes)

    def on_oom(self, failure: OomFailure) -> None:
        """A forward/backward ran out of memory and was released: apply the next rung (the front door runs the batch
        again), or raise :class:`MemGuardOutOfMemoryError` with the report."""
        monitor, step = self.monitor, self.monitor.step
        peak, capacity = monitor.peak_since_boundary(), monitor.capacity_bytes()
        fragmentation = self.fragmentation_at(failure.error, peak, capacity, f"after_{failure.phase}")
        why = Ranks.NO_RETRY if not self.ranks.can_retry else failure.why_no_retry
        if why is None:
            static = monitor.without_gradients_at_start(monitor.allocated_at("batch_start"))
            observation = StepObservation(step=step, peaks={f"after_{failure.phase}": peak or 0},
                                          capacity_bytes=capacity, static_bytes=static)
            cause = f"out of memory in {failure.phase} of step {step} ({failure.error})"
            one_off = self.split_this_batch(step, cause) if self.split_this_batch is not None else None
            decisions = [one_off] if one_off is not None else self.ladder.escalate(observation, cause)
            for decision in decisions:
                self._record(decision, capacity)
            if decisions:
                monitor.forget_attempt()  # the batch runs again: the failed attempt's passes do not count
                return
            stuck = self.ladder.policy.stuck_reason if self.ladder.policy is not None else ""
            why = stuck or "every rung of the ladder is at its top level or did not help"
        self._give_up(failure.phase, peak, capacity, why, failure.error, fragmentation=fragmentation)

    def on_rung_error(self, error: str) -> bool:
        """A forward or backward failed with an error that is not an OOM. If rungs changed since the last step that
        ran, they are put back where they last ran and never raised again (one warning each) and True is returned:
        the front door runs the batch again. Else False: the error is the model's own (or the run has several
        processes, which cannot run a batch again)."""
        if not self.ranks.can_retry:
            return False
        decisions = self.ladder.revert_untried(self.monitor.step, error)
        capacity = self.monitor.capacity_bytes()
        for decision in decisions:
            self._record(decision, capacity, warn=True)
        return bool(decisions)

    def on_optimizer_oom(self, error: str, retry_safe: bool) -> None:
        """``optimizer.step`` ran out of memory after forward and backward: return to have it retried once with lower
        temporaries when nothing was updated yet, else raise the report. Activation remedies cannot help here."""
        monitor, step = self.monitor, self.monitor.step
        peak, capacity = monitor.peak_since_boundary(), monitor.capacity_bytes()
        sizes = training_state_bytes(self.module, monitor.optimizers())
        retry_reason, why = optimizer_oom_texts(step, error, sizes, capacity)
        fragmentation = self.fragmentation_at(error, peak, capacity, "after_optimizer_step")
        if retry_safe:
            self._record(Decision(step=step, action="rescue", rung="optimizer", level=0, reason=retry_reason,
                                  peak_before_bytes=peak, phase="after_optimizer_step"), capacity)
            return
        self._give_up("optimizer_step", peak, capacity, why, error, sizes, fragmentation)

    def fragmentation_at(self, error: str, peak: Optional[int], capacity: Optional[int],
                         phase: str) -> Optional[Fragmentation]:
        """Whether this OOM is fragmentation (the first such one of the fit is recorded as an event)."""
        source = self.monitor.source
        if source is None:
            return None
        try:
            # the message's own figure is the one at the failure; the reading (after the cache was emptied) is the
            # fallback where the message has none
            reading = source.read(reset_peak=False)
            free = (max(reading.reserved_bytes - reading.allocated_bytes, 0)
                    if reading.reserved_bytes is not None and reading.allocated_bytes is not None else None)
            found, first = self.fragmentation.at_oom(self.monitor.step, error, free, reading.inactive_split_bytes)
        except Exception as err:  # an explanation must never stand in the way of the rescue or the report
            self.monitor.host.warn(f"lightning-memguard: could not tell whether the OOM was fragmentation ({err!r})")
            return None
        if first:
            self._record_fragmentation(found, peak, capacity, phase)
        return found

    def _record_fragmentation(self, found: Fragmentation, peak: Optional[int], capacity: Optional[int],
                              phase: Optional[str] = None) -> None:
        self.monitor.record(Event(step=found.step, action="fragmentation", rung="", reason=found.text,
                                  peak_before_bytes=peak, capacity_bytes=capacity, phase=phase, time=time.time()),
                            self.ladder.levels, warn=True)

    def _give_up(self, phase: str, peak: Optional[int], capacity: Optional[int], why: str, error: str,
                 extra: Optional[dict] = None, fragmentation: Optional[Fragmentation] = None) -> None:
        """Records the end of the run, keeps its rows and report file on this rank, and raises the report.

        Raises:
            MemGuardOutOfMemoryError: always; its message is the report, ``report`` the same as a dict.
        """
        step = self.monitor.step
        report = oom_report(step, phase, peak, capacity, self.ladder.levels, self.monitor.events, why, error,
                            fragmentation)
        report.update(extra or {})
        boundary = "after_optimizer_step" if phase == "optimizer_step" else f"after_{phase}"
        self._record(Decision(step=step, action="gave_up", rung="", level=0, reason=why, peak_before_bytes=peak,
                              phase=boundary), capacity)
        self.monitor.keep_failure(report["text"])
        raise MemGuardOutOfMemoryError(report["text"], report)

    def _record(self, decision: Decision, capacity: Optional[int], warn: bool = False) -> None:
        record_decision(self.monitor, self.ladder, decision, capacity, warn)
