"""MemoryMonitor: what MemGuard measures, logs and writes, with no ladder — the memory source, one history row per
phase of every optimizer step, the events, their CSV files, the metrics to the loggers every ``log_every_n_steps``
steps and the files that explain a step (framework-free). Driven by boundary calls::

    monitor.begin(module, device, host)    # a fit: results start clean
    monitor.start(optimizers, files_dir)   # open the source and the files
    monitor.batch_start(step, batch)
    monitor.boundary("after_forward")      # once per forward (per micro-batch, per retry)
    monitor.boundary("after_backward")
    monitor.step_end()                     # rows, the ``on_step`` hook, metrics
    monitor.stop()

and, for each batch of an evaluation loop (validation, test, predict; inside a fit or on its own)::

    monitor.evaluation_start(phase, batch)
    monitor.evaluation_end(phase, parts)   # one row, its metrics on the loop's own axis
"""

from __future__ import annotations

import os
import time
from itertools import chain
from operator import attrgetter
from typing import Any, Callable, Optional

import pandas as pd
import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..base.host import Host
from ..base.keys import evaluation_metrics, rung_key, step_metrics, tensorboard_layout
from ..base.snapshot import Event, MemorySnapshot
from ..sources.base import MemorySource
from ..sources.cpu import CpuTensorAccountant, dense_tensors, storage_bytes
from ..sources.cuda import expandable_segments_on
from ..sources.ddp_buckets import FirstBuckets
from .explain import StepExplainer
from .fragmentation import Fragmentation, FragmentationWatch
from .leaks import LeakWatch
from .recorder import StepRecorder
from .run_files import RunFiles
from .settings import MonitorSettings
from .source_choice import measures_step, open_source, resume_counting

__all__ = ["MemoryMonitor"]

_GRAD = attrgetter("grad")
_STRIDED = torch.strided


class MemoryMonitor:
    """Measures one model's training steps; see the module docstring for the calls.

    Args:
        name: how messages call the run (``"the Trainer"``, ``"the loop"``).
        settings: what is measured and where it goes (``None``: the defaults), read at each :meth:`start`.
        source: a source to read instead of the one chosen at :meth:`start` (a scripted one in tests).
        on_step: called with the snapshots of every optimizer step that ended, after its rows are kept and before
            its metrics are logged (the guard's policy).
    """

    def __init__(self, name: str = "the run", settings: Optional[MonitorSettings] = None, *,
                 source: Optional[MemorySource] = None,
                 on_step: Optional[Callable[[list[MemorySnapshot]], None]] = None) -> None:
        self.name = name
        self.settings = s = settings if settings is not None else MonitorSettings()
        self.explainer = StepExplainer(s.explain, s.record_memory_history, s.snapshot_max_entries)
        #: allocator retries or an OOM while the cache held enough free memory: fragmentation, said once a fit
        self.fragmentation = FragmentationWatch(expandable_segments_on)
        self.on_step = on_step
        self.host = Host()
        self.step = 0
        self.measuring = False
        self.source: Optional[MemorySource] = None
        self.recorder: Optional[StepRecorder] = None
        self._given_source = source
        self._nvml = None
        self._module: Optional[nn.Module] = None
        self._called_module: Optional[nn.Module] = None
        self._data_parallel: Optional[nn.Module] = None  # from begin to start: a DDP module's buckets are counted
        self._first_buckets: Optional[FirstBuckets] = None
        self._device = torch.device("cpu")
        self._on_cuda = False  # asked at every batch: a torch.device's type is slow to read
        self.optimizers: Callable[[], list] = list
        self.files = RunFiles(s.history_max_rows)
        self._interval_peaks: dict[str, int] = {}
        self._latest: list[MemorySnapshot] = []  # the last counted step's rows: logged on uncounted logging steps
        self._warned_no_logger = False
        self._params: list[nn.Parameter] = []  # the module's plain parameters
        self._wrapped_params: list[nn.Parameter] = []  # and those of a tensor subclass (FSDP2's DTensor)
        self._gradients_seen: tuple[tuple[int, ...], int] = ((), 0)  # gradient_bytes' last answer
        #: bytes of the gradients alive at the measured step's start (a guard compares steps without them)
        self.gradients_at_start = 0
        self.leaks = LeakWatch()
        self._evaluation_batches: dict[str, int] = {}  # evaluation batches measured so far, per loop: their axis
        self._counting_for_evaluation = False  # the CPU accountant was started for the evaluation batch only
        #: whether :meth:`step_end` returns the metrics when there is no logger to log them to (a progress bar may
        #: show them); a front door that never reads them sets it False
        self.metrics_without_logger = True
        self._said: Optional[tuple] = None  # (step, action, reason) of the event said last
        #: the directory of the last fit's files, the last step it recorded and the files' version: a further fit
        #: whose steps go on from there (the same Trainer fitting again) adds its rows to those files
        self._last_fit_files: Optional[tuple[str, int, int]] = None

    # --- results ----------------------------------------------------------------------------------------------------
    @property
    def history(self) -> pd.DataFrame:
        return self.files.history.to_dataframe()

    @property
    def events(self) -> pd.DataFrame:
        return self.files.events.to_dataframe()

    @property
    def guarding(self) -> bool:
        """Whether there is a capacity to guard: a CUDA device, a budget or a CPU hard limit."""
        s = self.settings
        return self._on_cuda or s.budget_bytes is not None or s.cpu_hard_limit_bytes is not None

    @property
    def files_dir(self) -> Optional[str]:
        return self.files.files_dir

    def capacity_bytes(self) -> Optional[int]:
        return self.source.capacity_bytes() if self.source is not None else None

    # --- a fit ------------------------------------------------------------------------------------------------------
    def begin(self, module: nn.Module, device: torch.device, host: Host, *, called_module: Optional[nn.Module] = None,
              first_step: int = 0, files_name: str = "", data_parallel: Optional[nn.Module] = None) -> None:
        """Starts a fit clean (a reused monitor keeps nothing from the last one). ``called_module``: the module the
        front door calls where it wraps ``module`` (searched for compiled code); ``first_step``: the step a resumed
        run starts at; ``files_name``: what the run's file names carry (a run that only evaluates: its loop, so a
        fit's files are not overwritten); ``data_parallel``: the module the ranks train through (the CPU accountant
        counts a DistributedDataParallel module's first gradient buckets, made before it started)."""
        self.host = host
        self._module, self._device = module, device
        self._on_cuda = device.type == "cuda"
        self._called_module = called_module
        self._data_parallel = data_parallel
        self.step = first_step
        self.files = RunFiles(self.settings.history_max_rows, host.rank, files_name)
        self.fragmentation.begin()
        self._interval_peaks = {}
        self._latest = []
        self._evaluation_batches = {}
        # split once: a wrapper subclass's gradient (an FSDP2 DTensor) holds its bytes in its local shard, which its
        # own nbytes (the global shape's) does not tell
        params = list(module.parameters())
        self._params = [p for p in params if not is_traceable_wrapper_subclass(p)]
        self._wrapped_params = [p for p in params if is_traceable_wrapper_subclass(p)]
        self._gradients_seen: tuple[tuple[int, ...], int] = ((), 0)  # gradient_bytes' last answer
        self.gradients_at_start = 0
        self.leaks = LeakWatch()

    def start(self, optimizers: Callable[[], list], files_dir: Optional[str],
              run_info: Optional[dict[str, Any]] = None, first_step: Optional[int] = None) -> None:
        """Opens the source and the run's files (``files_dir``: ``None`` writes none; ``run_info`` goes into
        ``memguard_run.json`` with the capacity). ``optimizers`` returns the run's optimizers when asked (the CPU
        accountant counts their state). ``first_step``: the step the fit starts at, where :meth:`begin` was not told
        (``None``: that one). A fit whose first step comes after the last step the previous fit's files in the same
        directory hold goes on in them (the same Trainer fitting again: its steps, its loggers' curves and Lightning's
        own ``metrics.csv`` go on too), so an earlier fit's rows and events are not lost; otherwise the run gets new
        files, versioned where the directory holds another run's (``memguard_history-v1.csv``)."""
        self.optimizers = optimizers
        called = self._called_module if self._called_module is not None else self._module
        self.source, self._nvml, compiled = open_source(
            self._device, called, self.host.warn, self.guarding, given=self._given_source,
            budget_bytes=self.settings.budget_bytes, cpu_hard_limit_bytes=self.settings.cpu_hard_limit_bytes,
            nvml_interval_s=self.settings.nvml_interval_s)
        if isinstance(self.source, CpuTensorAccountant) and self._data_parallel is not None:
            self._first_buckets = FirstBuckets(self.source, self._data_parallel)
        self._data_parallel = None  # held no longer than the watch needs it
        self.recorder = StepRecorder(self.source, self._nvml)
        self.explainer.start(cuda=self._device.type == "cuda", compiled=compiled)
        first = self.step if first_step is None else first_step
        last = self._last_fit_files
        goes_on = (not self.files.name and files_dir is not None and last is not None
                   and last[0] == os.path.abspath(files_dir) and first > last[1])
        self.files.attach(files_dir, {**(run_info or {}), "budget_bytes": self.settings.budget_bytes,
                                      "capacity_bytes": self.source.capacity_bytes(), "device": self.source.device},
                          self.host.warn, goes_on_in=last[2] if goes_on else None)
        if self.host.rank == 0:
            self.host.add_layout(tensorboard_layout())
        if not self.host.has_logger and not self._warned_no_logger:
            self._warned_no_logger = True
            where = (f"written to {os.path.abspath(files_dir)}" if files_dir is not None
                     else "kept in memory (.history, .events)")
            if self.host.logger_off_by_choice:
                self.host.info(f"lightning-memguard: logging is off for {self.name}; the history and events are "
                               f"{where}.")
            else:
                self.host.warn(f"lightning-memguard: {self.name} has no logger, so no memory curves are logged; the "
                               f"history and events are {where}.")

    def stop(self) -> None:
        """Idempotent: flushes everything and releases the source (end of training, exception or teardown)."""
        self._finish_pending()
        self.files.close()
        if not self.files.name and self.files.files_dir is not None:  # a fit's files (not an evaluation's own)
            self._last_fit_files = (os.path.abspath(self.files.files_dir), self.step, self.files.version)
        self.explainer.abort()  # its dispatch mode was entered after the source's: leave it first
        if self._first_buckets is not None:
            self._first_buckets.close()
            self._first_buckets = None
        if self.source is not None:
            self.source.stop()
        if self._nvml is not None:
            self._nvml.stop()
            self._nvml = None
        self.recorder = None
        # the host's functions and the optimizers' getter close over the framework's objects: let them go (the
        # results stay); its way of warning is kept
        self.host = Host(warn=self.host.warn)
        self.optimizers = list

    def on_exception(self) -> None:
        """One more row (phase ``exception``) with the memory at that moment, after the rows of the unfinished
        step."""
        self._keep_moment("exception")

    def keep_failure(self, report_text: str) -> None:
        """Before an OOM ends the run: the rows of the unfinished step, a row (phase ``oom``) with the memory at the
        failure, and the report file, on this rank. Not left to exception hooks: spawned DDP workers never get
        them."""
        self._keep_moment("oom")
        self.files.write_oom_report(report_text, self.host.warn)

    # --- one optimizer step -----------------------------------------------------------------------------------------
    def batch_start(self, step: int, batch: Any) -> bool:
        """The first boundary of optimizer step ``step``. Returns whether the step is measured (on CPU, every
        ``cpu_sample_every``-th)."""
        self.step = step
        measuring = self.measuring = measures_step(self.source, step, self.settings.cpu_sample_every, self._module,
                                                   self.optimizers, batch, self.host.held_elsewhere)
        if not measuring:
            return False
        self.gradients_at_start = self.gradient_bytes()
        if self.explainer.armed:
            self.explainer.begin(self._module, self.optimizers())
        self.boundary("batch_start")
        # memory that grows every step: two integer comparisons unless it does
        self.leaks.observe(step, self.allocated_at("batch_start"), self, batch)
        return True

    def boundary(self, phase: str) -> None:
        """Reads the source at ``after_forward`` or ``after_backward`` (or ``batch_start``)."""
        recorder = self.recorder
        if recorder is None or not self.measuring:
            return
        leftover = recorder.observe(self.step, phase)
        if phase != "batch_start":
            self.explainer.mark(phase)
        if leftover:  # a step without an optimizer step (manual optimization): keep its rows all the same
            self._log(self._keep(leftover), False)

    def step_end(self, stopping: bool = False) -> Optional[dict[str, float]]:
        """After the optimizer step: the step's rows, ``on_step`` and, every ``log_every_n_steps`` (or when
        ``stopping``), the metrics to the loggers. Returns the metrics logged now, else ``None``."""
        if self.recorder is None:
            return None
        if not self.measuring:  # a step left uncounted (cpu_sample_every): the loggers' cadence is kept, with the
            return self._log(self._latest, stopping, self.step)  # latest counted values
        self.boundary("after_optimizer_step")
        snapshots = self._keep(self.recorder.finish())
        found = self.fragmentation.after_step(snapshots)
        if found is not None:
            self._record_fragmentation(found, snapshots[-1].peak_bytes, snapshots[-1].capacity_bytes)
        if self.on_step is not None:
            self.on_step(snapshots)
        metrics = self._log(snapshots, stopping)
        written = self.explainer.after_step(self.step, self.files_dir)
        if written:
            self.add_event(Event(step=self.step, action="explain", rung="", reason="wrote " + ", ".join(
                os.path.basename(p) for p in written), time=time.time()))
        return metrics

    def begin_attempt(self) -> None:
        """An attempt of the batch starts (it may fail with an OOM and run again)."""
        if self.recorder is not None:
            self.recorder.begin_attempt()

    def forget_attempt(self) -> None:
        """The attempt failed and the batch runs again: its passes are not micro-batches the step ran."""
        if self.recorder is not None:
            self.recorder.forget_attempt()

    def allocated_at(self, phase: str) -> Optional[int]:
        """Allocated bytes at ``phase`` of the step being recorded, if it was reached."""
        return self.recorder.pending_allocated(phase) if self.recorder is not None else None

    def peak_at(self, phase: str) -> Optional[int]:
        """The peak of ``phase`` of the step being recorded so far, if it was reached and counted."""
        return self.recorder.pending_peak(phase) if self.recorder is not None and self.measuring else None

    def gradient_bytes(self) -> int:
        """Bytes of the gradients alive now, each storage once. Twice a step on the training thread, so one pass with
        one attribute read per parameter and two per gradient: a gradient that is no view is its own storage, so its
        ``nbytes`` is enough; views (a DDP bucket's, say) count the storage of their base, each base once. A wrapper
        subclass's gradient (an FSDP2 DTensor's, whose own ``nbytes`` is the global shape's) counts the tensors it
        holds (its local shard) the same way, and a sparse gradient the storages of its indices and values.

        The same gradient tensors as at the last call are the same bytes, told from their ids alone: under Lightning
        the step's start sees the gradients the last step ended with. (Ids, not the tensors: holding them would keep
        a step's gradients alive into the next. A new gradient at a freed one's address is of the same parameter, so
        of the same shape and dtype.)"""
        grads = list(map(_GRAD, self._params))
        wrapped = list(map(_GRAD, self._wrapped_params)) if self._wrapped_params else []
        ids = tuple(map(id, grads + wrapped if wrapped else grads))
        seen_ids, seen_total = self._gradients_seen
        if ids == seen_ids:
            return seen_total
        total = self._count_gradient_bytes(grads, wrapped)
        self._gradients_seen = (ids, total)
        return total

    @staticmethod
    def _count_gradient_bytes(grads: list, wrapped: list) -> int:
        total, bases = 0, None
        if wrapped:
            grads = chain(grads, (dense for grad in wrapped if grad is not None for dense in dense_tensors(grad)))
        for grad in grads:
            if grad is not None:
                if grad.layout is not _STRIDED:  # a sparse gradient (nn.Embedding(sparse=True)): its indices and values
                    total += storage_bytes(dense_tensors(grad))
                    continue
                base = grad._base
                if base is None:
                    total += grad.nbytes
                elif bases is None:
                    bases = {id(base): base}
                else:
                    bases[id(base)] = base
        return total + storage_bytes(bases.values()) if bases is not None else total

    def peak_since_boundary(self) -> Optional[int]:
        """The peak since the last boundary (a new peak window starts), at an OOM."""
        return self.source.read(reset_peak=True).peak_bytes if self.source is not None else None

    # --- one evaluation batch -------------------------------------------------------------------------------------
    def evaluation_start(self, phase: str, batch: Any) -> None:
        """An evaluation batch of loop ``phase`` starts: a new peak window. On CPU the accountant counts it even where
        ``cpu_sample_every`` has it stopped between training steps (it learns the tensors created meanwhile: the
        training state and this batch), and is stopped again at :meth:`evaluation_end`."""
        source = self.source
        if source is None or self.recorder is None:  # not started, or stopped (Lightning's sanity check runs before
            return                                    # the fit's sources open)
        if isinstance(source, CpuTensorAccountant) and not source.started and source.counting:
            resume_counting(source, self._module, self.optimizers, batch, self.host.held_elsewhere)
            self._counting_for_evaluation = True
        source.read(reset_peak=True)

    def evaluation_end(self, phase: str, parts: Optional[int]) -> Optional[MemorySnapshot]:
        """The evaluation batch ended, run in ``parts`` parts (``None``: it failed; no row): one history row (phase
        ``phase``, step: the last training step) and its metrics, logged at this loop's count of batches. Returns
        the row."""
        source, snapshot = self.source, None
        if source is not None and self.recorder is not None and parts is not None:
            snapshot = self.recorder.snapshot_read(self.step, phase, parts)
            self.files.history.add(snapshot)
            self.files.history.flush()
            index = self._evaluation_batches.get(phase, 0)
            self._evaluation_batches[phase] = index + 1
            metrics = evaluation_metrics(phase, snapshot)
            if metrics:
                self.host.log_metrics(metrics, index)
        if self._counting_for_evaluation and isinstance(source, CpuTensorAccountant):
            source.stop()  # as the training's cpu_sample_every had it
        self._counting_for_evaluation = False
        return snapshot

    # --- events and explanations ------------------------------------------------------------------------------------
    def record(self, event: Event, levels: Optional[dict[str, int]] = None, warn: bool = False) -> None:
        """Keeps an event (a row of :attr:`events`, at once in the CSV), says it (as a warning with ``warn`` or when
        nothing can be done, else as a notice), logs the rung ``levels`` (where the event comes from a ladder) and,
        on CUDA, explains a threshold crossing (the next step) or an OOM (the allocator now)."""
        if event.action == "threshold":
            self.explainer.on_first_crossing(event.step)
        elif event.action in ("rescue", "rescue_split", "gave_up"):
            self.explainer.on_oom(event.step, self.files_dir)
        self.add_event(event)
        what = f"{event.action} {event.rung}" if event.rung else event.action
        said, self._said = self._said, (event.step, event.action, event.reason)
        # one decision that moves several rungs is an event each, with one reason: said in full once
        reason = "the same decision as the line before" if said == self._said else event.reason
        message = f"lightning-memguard step {event.step}: {what} - {reason}"
        host = self.host
        if warn or event.action in ("cannot_help", "exhausted"):
            host.warn(message)
        else:
            host.info(message)
        if levels is not None:
            host.log_metrics({rung_key(name): float(level) for name, level in levels.items()}, event.step)
        if host.rank == 0:
            host.log_text(message, event.step)

    def fragmentation_at(self, error: str, peak: Optional[int], capacity: Optional[int],
                         phase: str) -> Optional[Fragmentation]:
        """Whether the OOM ``error`` is fragmentation (the first such one of the fit is recorded as an event)."""
        if self.source is None:
            return None
        try:
            # the message's own figure is the one at the failure; the reading (after the cache was emptied) is the
            # fallback where the message has none
            reading = self.source.read(reset_peak=False)
            free = (max(reading.reserved_bytes - reading.allocated_bytes, 0)
                    if reading.reserved_bytes is not None and reading.allocated_bytes is not None else None)
            found, first = self.fragmentation.at_oom(self.step, error, free, reading.inactive_split_bytes)
        except Exception as err:  # an explanation must never stand in the way of the rescue or the report
            self.host.warn(f"lightning-memguard: could not tell whether the OOM was fragmentation ({err!r})")
            return None
        if first:
            self._record_fragmentation(found, peak, capacity, phase)
        return found

    def _record_fragmentation(self, found: Fragmentation, peak: Optional[int], capacity: Optional[int],
                              phase: Optional[str] = None) -> None:
        self.record(Event(step=found.step, action="fragmentation", rung="", reason=found.text,
                          peak_before_bytes=peak, capacity_bytes=capacity, phase=phase, time=time.time()), warn=True)

    def without_gradients_at_start(self, allocated: Optional[int]) -> Optional[int]:
        """``allocated`` (read at this step's start) less the gradients alive then: what the policy compares steps by
        (a front door zeroes the gradients at some point of every step: Lightning after the forward, a plain loop
        before it)."""
        return allocated - self.gradients_at_start if allocated is not None else None

    def add_event(self, event: Event) -> None:
        """Keeps an event (a row of :attr:`events`, at once in the CSV)."""
        self.files.events.add(event)
        self.files.events.flush()

    def explain_next_step(self) -> None:
        self.explainer.arm()

    # --- the work ---------------------------------------------------------------------------------------------------
    def _keep(self, snapshots: list[MemorySnapshot]) -> list[MemorySnapshot]:
        """History rows and the logging interval's phase peaks."""
        history, peaks = self.files.history, self._interval_peaks
        history.extend(snapshots)
        for snap in snapshots:
            peak = snap.peak_bytes
            if peak is not None and peak > peaks.get(snap.phase, -1):
                peaks[snap.phase] = peak
        history.flush()  # every step reaches the OS: a run killed hard keeps all but the step in progress
        self._latest = snapshots
        return snapshots

    def _log(self, snapshots: list[MemorySnapshot], stopping: bool,
             step: Optional[int] = None) -> Optional[dict[str, float]]:
        """Logs the metrics of ``snapshots`` at ``step`` (default: theirs) when it is a logging step."""
        if not snapshots:
            return None
        step = snapshots[0].step if step is None else step
        host = self.host
        every = self.settings.log_every_n_steps or host.log_every_n_steps
        if every < 1:  # the front door logs nothing: Trainer(log_every_n_steps=0), as barebones=True sets it
            return None
        # the rule Lightning uses for self.log: the (step + 1)-th optimizer step, or when stopping
        if (step + 1) % every != 0 and not stopping:
            return None
        if not host.has_logger and not self.metrics_without_logger:
            return None  # nobody would read them (a loop with no writer logs at every step by default)
        metrics = step_metrics(snapshots, self._interval_peaks)
        self._interval_peaks = {}
        self.host.log_metrics(metrics, step)
        return metrics

    def _keep_moment(self, phase: str) -> None:
        """The rows of the unfinished step, then one row with the memory now."""
        if self.source is None or self.recorder is None:
            return
        self._finish_pending()
        self.files.history.add(self.recorder.snapshot_now(self.step, phase))
        self.files.history.flush()

    def _finish_pending(self) -> None:
        if self.recorder is not None and self.recorder.pending_step is not None:
            # a partly recorded step (e.g. a crash mid-step) is kept too
            self.files.history.extend(self.recorder.finish())
