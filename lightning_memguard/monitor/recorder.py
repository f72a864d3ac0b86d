"""Turns boundary reads into one snapshot per phase per optimizer step (framework-free).

With gradient accumulation (or a batch split into parts) a step has several micro-batches; each phase's peak is the
maximum over them, the other values are the last micro-batch's, and every row of the step counts them all.
"""

from __future__ import annotations

import time
from typing import Optional

from ..base.snapshot import PHASES, MemorySnapshot
from ..sources.base import AllocatorReading, MemorySource
from ..sources.nvml import NvmlReading, NvmlSampler

_NO_NVML = NvmlReading()
_new_row = tuple.__new__


class StepRecorder:
    """Reads a source at each boundary and aggregates the reads of one optimizer step.

    Args:
        source: the allocator-like source (CUDA allocator or CPU accountant).
        nvml: an optional NVML sampler; only its latest sample is read (no driver call here).
    """

    def __init__(self, source: MemorySource, nvml: Optional[NvmlSampler] = None) -> None:
        self.source = source
        self.nvml = nvml
        self._step: Optional[int] = None
        self._pending: dict[str, tuple[AllocatorReading, int]] = {}
        #: the table when the current attempt of a batch began (its counts: the passes counted before it)
        self._before_attempt: dict[str, tuple[AllocatorReading, int]] = {}
        self._nvml_reading = _NO_NVML

    @property
    def pending_step(self) -> Optional[int]:
        return self._step

    def pending_allocated(self, phase: str) -> Optional[int]:
        """Allocated bytes at ``phase`` of the step being recorded, if it was reached."""
        entry = self._pending.get(phase)
        return entry[0].allocated_bytes if entry is not None else None

    def pending_peak(self, phase: str) -> Optional[int]:
        """The peak of ``phase`` of the step being recorded so far (over its passes), if it was reached."""
        entry = self._pending.get(phase)
        return entry[0].peak_bytes if entry is not None else None

    def pending_ooms(self, phase: str) -> Optional[int]:
        """The source's cumulative count of out-of-memory errors at ``phase`` of the step being recorded."""
        entry = self._pending.get(phase)
        return entry[0].num_ooms if entry is not None else None

    def observe(self, step: int, phase: str) -> list[MemorySnapshot]:
        """Records a boundary. Returns the snapshots of an older step that was left unfinished (manual
        optimization without an optimizer step), so nothing is lost; usually an empty list."""
        reading = self.source.read(reset_peak=True)
        finished = self.finish() if step != self._step and self._step is not None else []
        self._step = step
        pending = self._pending
        previous = pending.get(phase)
        if previous is None:
            pending[phase] = (reading, 1)
        else:
            old, count = previous
            if reading.peak_bytes is not None and old.peak_bytes is not None and old.peak_bytes > reading.peak_bytes:
                # None: a source that does not count (compiled code on CPU)
                reading = reading._replace(peak_bytes=old.peak_bytes)
            pending[phase] = (reading, count + 1)
        if self.nvml is not None:
            self._nvml_reading = self.nvml.latest()
        return finished

    def begin_attempt(self) -> None:
        """An attempt of the batch starts (it may fail with an OOM and run again)."""
        # the entries as they are now (each a (reading, count) pair, replaced, never changed, by a later read): a
        # copy of the table, its counts read only if the attempt fails
        self._before_attempt = dict(self._pending)

    def forget_attempt(self) -> None:
        """The attempt failed and the batch runs again: its passes are not micro-batches the step ran, so the counts
        go back to where the attempt started; the peaks it reached are kept (the step did need them)."""
        before = self._before_attempt
        self._pending = {phase: (reading, before[phase][1] if phase in before else 0)
                         for phase, (reading, _) in self._pending.items()}

    def finish(self) -> list[MemorySnapshot]:
        """Closes the current step: one snapshot per observed phase, in boundary order."""
        if self._step is None:
            return []
        step, pending = self._step, self._pending
        self._step = None
        capacity, now, device, nvml = self.source.capacity_bytes(), time.time(), self.source.device, self._nvml_reading
        nvml_used, nvml_total, nvml_process = nvml.used_bytes, nvml.total_bytes, nvml.process_bytes
        # the step's micro-batches, on each of its rows: its forward and backward are read once a part, its batch
        # start and optimizer step once a batch and once a step, yet they are the same step's
        parts = max(count for _, count in pending.values()) if pending else 1
        rows = []
        for phase in PHASES:
            entry = pending.get(phase)
            if entry is not None:  # as _snapshot builds a row, its loop-invariant fields read once a step
                reading = entry[0]
                rows.append(_new_row(MemorySnapshot, (
                    step, phase, device, reading.allocated_bytes, reading.peak_bytes, reading.reserved_bytes,
                    reading.alloc_retries, reading.num_ooms, nvml_used, nvml_total, nvml_process, capacity, parts,
                    now, reading.inactive_split_bytes)))
        pending.clear()  # the table serves the next step (an attempt's copy of it is its own)
        return rows

    def snapshot_now(self, step: int, phase: str) -> MemorySnapshot:
        """A snapshot outside the boundaries (say, when an exception stops training); the peak window is kept."""
        return self._snapshot(step, phase, self.source.read(reset_peak=False), 1, self.source.capacity_bytes(),
                              time.time())

    def snapshot_read(self, step: int, phase: str, micro_batches: int) -> MemorySnapshot:
        """A snapshot of a batch outside the training steps (an evaluation batch run in ``micro_batches`` parts):
        the peak since the last reset, which starts a new peak window."""
        return self._snapshot(step, phase, self.source.read(reset_peak=True), micro_batches,
                              self.source.capacity_bytes(), time.time())

    def _snapshot(self, step: int, phase: str, reading: AllocatorReading, count: int, capacity: Optional[int],
                  now: float) -> MemorySnapshot:
        nvml = self._nvml_reading
        # every field, in the columns' order, straight into the tuple: the cheapest way to build the row (no call of
        # the named tuple's own constructor), four times a step on the training thread
        return _new_row(MemorySnapshot, (step, phase, self.source.device, reading.allocated_bytes, reading.peak_bytes,
                                         reading.reserved_bytes, reading.alloc_retries, reading.num_ooms,
                                         nvml.used_bytes, nvml.total_bytes, nvml.process_bytes, capacity, count, now,
                                         reading.inactive_split_bytes))
