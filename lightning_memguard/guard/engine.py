"""The guard itself, framework-free: it measures (sources, per-phase peaks, history, events, CSV), decides (ladder,
rescue) and explains, driven by boundary calls from a front door.

A front door (the Lightning callback, the Fabric guard, the plain-loop guard) only translates its framework's hooks
into these calls and applies rungs the way its framework needs. One optimizer step is::

    engine.batch_start(step, batch)
    engine.boundary("after_forward")     # once per forward (per micro-batch, per retry)
    engine.boundary("after_backward")
    engine.step_end()                    # after the optimizer step: history row, policy, loggers

and around a fit ``begin_fit`` (build the rungs), ``start`` (open sources and files) and ``stop``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Optional

import pandas as pd
import torch
from torch import nn

from ..base.batches import batch_tensors
from ..base.buffers import RunningBuffers
from ..base.files import write_text
from ..base.host import Host
from ..base.keys import step_metrics, tensorboard_layout
from ..base.snapshot import PHASES, Event, MemorySnapshot, format_bytes
from ..mitigations.amp import PrecisionSwitch
from ..monitor.explain import StepExplainer
from ..monitor.history import EVENTS_CSV, HISTORY_CSV, RUN_JSON, EventLog, MemoryHistory
from ..monitor.recorder import StepRecorder
from ..sources import CpuTensorAccountant, CudaAllocatorSource, NvmlSampler
from ..sources.cpu import compiled_code, compiled_code_warning, storage_bytes
from ..sources.training_state import training_state_bytes, training_state_tensors
from .ladder import Ladder
from .oom import MemGuardOutOfMemoryError, OomFailure
from .planning import plan_at_start
from .policy import Decision, StepObservation
from .report import oom_report
from .settings import GuardSettings

__all__ = ["MemGuardEngine"]


class MemGuardEngine:
    """Measures, decides and explains for one model at a time; see the module docstring for the calls.

    Args:
        settings: the checked settings.
        name: how the front door calls its run in messages (``"the Trainer"``, ``"the loop"``).
    """

    def __init__(self, settings: GuardSettings, name: str = "the run") -> None:
        self.settings = settings
        self.name = name
        self.host = Host()
        self.ladder = Ladder(settings.mitigations, settings.threshold, settings.blocks, settings.min_gain,
                             is_default=settings.default_ladder, warn=self._warn,
                             microbatch_weight=settings.microbatch_weight)
        self.explainer = StepExplainer(settings.explain, settings.record_memory_history,
                                       settings.snapshot_max_entries)
        self.step = 0
        self.source: Optional[CpuTensorAccountant | CudaAllocatorSource] = None
        self.recorder: Optional[StepRecorder] = None
        self.files_dir: Optional[str] = None
        self.measuring = False
        #: the optimizer the estimate builds a like one of; ``None``: a LightningModule's ``configure_optimizers``
        self.estimate_optimizer: Optional[torch.optim.Optimizer] = None
        #: the module the front door calls, where it wraps the fit's module (Fabric keeps a compiled one apart from
        #: the original): searched for compiled code; ``None``: the fit's module
        self.called_module: Optional[nn.Module] = None
        self._module: Optional[nn.Module] = None
        self._device = torch.device("cpu")
        self._optimizers: Callable[[], list] = list
        self._nvml: Optional[NvmlSampler] = None
        self._history = MemoryHistory(max_rows=settings.history_max_rows)
        self._events = EventLog()
        self._planned = False
        self._interval_peaks: dict[str, int] = {}
        self._warned_no_logger = False

    def _warn(self, message: str) -> None:
        self.host.warn(message)  # a method, not a lambda: a guard is pickled into spawned DDP workers

    # --- results ----------------------------------------------------------------------------------------------------
    @property
    def history(self) -> pd.DataFrame:
        return self._history.to_dataframe()

    @property
    def events(self) -> pd.DataFrame:
        return self._events.to_dataframe()

    @property
    def levels(self) -> dict[str, int]:
        return self.ladder.levels

    @property
    def guarding(self) -> bool:
        """Whether this run has a capacity to guard (else it only monitors, and rungs and rescue never act)."""
        s = self.settings
        return self._device.type == "cuda" or s.budget_bytes is not None or s.cpu_hard_limit_bytes is not None

    # --- a fit ------------------------------------------------------------------------------------------------------
    def begin_fit(self, module: nn.Module, device: torch.device, precision: Optional[PrecisionSwitch], host: Host,
                  automatic_optimization: bool = True, restored_state: Optional[dict] = None) -> None:
        """Starts a fit clean (a reused guard keeps nothing from the last one) and builds the rungs for ``module``;
        ``restored_state`` (from :meth:`state_dict` of a checkpoint) puts them back where they were."""
        self.host = host
        self._module, self._device = module, device
        # what the estimates start from: a run already in mixed precision is predicted in it
        self._precision = getattr(precision, "base_precision", "32-true")
        self._history = MemoryHistory(max_rows=self.settings.history_max_rows)
        self._events = EventLog()
        self._planned = False
        self._interval_peaks = {}
        self._params = list(module.parameters())
        self._gradients_at_start = 0
        self.step = 0
        # several processes cannot retry a batch together: there the threshold alone must keep every rung ahead
        rescue = self.settings.rescue_oom and automatic_optimization and host.world_size == 1
        self.ladder.setup(module, device, precision, automatic_optimization, restored_state, guarding=self.guarding,
                          rescue=rescue)

    def start(self, optimizers: Callable[[], list], files_dir: Optional[str]) -> None:
        """Opens the sources and the run's files (``files_dir``: ``None`` writes none). ``optimizers`` returns the
        run's optimizers when asked (the CPU accountant counts their state)."""
        self._optimizers = optimizers
        device = self._device
        # compiled kernels allocate where live CPU tensor counting cannot see, and run no module hooks inside graphs
        called = self.called_module if self.called_module is not None else self._module
        compiled = compiled_code(called) if called is not None else []
        if device.type == "cuda":
            self.source = CudaAllocatorSource(device, budget_bytes=self.settings.budget_bytes)
            self.source.start()
            self._nvml = NvmlSampler(str(torch.cuda.get_device_properties(device).uuid), self.settings.nvml_interval_s)
            self._nvml.start()
        else:
            if compiled:  # no count at all rather than a short one; one warning instead of the notes below
                self.host.warn(compiled_code_warning(compiled))
            elif device.type != "cpu" or torch.cuda.is_available():
                self.host.warn(f"lightning-memguard: the device {device} is not CUDA, so live CPU tensor memory is "
                               "counted instead.")
            else:
                self.host.warn("lightning-memguard: there is no CUDA device, so live CPU tensor memory is counted"
                               + (" against the budget." if self.guarding else
                                  "; give budget= to guard it (until then it is only monitored)."))
            # started per measured step in batch_start
            self.source = CpuTensorAccountant(budget_bytes=self.settings.budget_bytes,
                                              limit_bytes=self.settings.cpu_hard_limit_bytes)
            if compiled:
                self.source.switch_off()
        self.recorder = StepRecorder(self.source, self._nvml)
        self.explainer.start(cuda=device.type == "cuda", compiled=bool(compiled))
        self.files_dir = files_dir
        if files_dir is not None:
            self._attach_files(files_dir)
        if self.host.rank == 0:
            self.host.add_layout(tensorboard_layout())
        if not self.host.has_logger and not self._warned_no_logger:
            self._warned_no_logger = True
            where = (f"written to {os.path.abspath(files_dir)}" if files_dir is not None
                     else "kept in memory (.history, .events)")
            self.host.warn(f"lightning-memguard: {self.name} has no logger, so no memory curves are logged; the "
                           f"history and events are {where}.")

    def stop(self) -> None:
        """Idempotent: flushes everything and releases the sources (end of training, exception or teardown)."""
        self._finish_pending()
        self._history.close()
        self._events.close()
        self.explainer.abort()  # its dispatch mode was entered after the source's: leave it first
        if self.source is not None:
            self.source.stop()
        if self._nvml is not None:
            self._nvml.stop()
            self._nvml = None
        self.recorder = None
        # the host's functions close over the framework's objects: let them go (a guard is pickled into spawned
        # workers; the results stay)
        self.host = Host(warn=self.host.warn)

    def on_exception(self) -> None:
        """One more row (phase ``exception``) with the memory at that moment, after the rows of the unfinished
        step."""
        if self.source is None or self.recorder is None:
            return
        self._finish_pending()
        self._history.add(self.recorder.snapshot_now(self.step, "exception"))

    def state_dict(self) -> dict[str, Any]:
        return {"ladder": self.ladder.state_dict()}

    # --- one optimizer step -----------------------------------------------------------------------------------------
    def batch_start(self, step: int, batch: Any, loss_fn: Optional[Callable] = None) -> None:
        """The first boundary of optimizer step ``step`` (on the step axis of the run's own metrics). ``loss_fn``
        (``(model, batch) -> loss``) is how the estimate runs the step, where the model is not a LightningModule."""
        self.step = step
        # the first batch of a fit tells the ladder how far it can split and what each level will need
        target = ("cuda" if self._device.type == "cuda" else "cpu") if self.guarding else None
        self.ladder.note_batch(batch, self._module, target, self.estimate_optimizer, loss_fn, self._rank_max,
                               self._precision)
        if self.settings.plan_at_start and not self._planned:
            self._plan(batch, loss_fn)  # before counting starts: the estimate's own memory is not ours
        self.measuring = self._begin_measuring(batch)
        if self.measuring:
            self._gradients_at_start = self._gradient_bytes()
        if self.measuring and self.explainer.armed:
            self.explainer.begin(self._module, self._optimizers())
        self.boundary("batch_start")

    def boundary(self, phase: str) -> None:
        """Reads the source at ``after_forward`` or ``after_backward`` (or ``batch_start``)."""
        if self.recorder is None or not self.measuring:
            return
        leftover = self.recorder.observe(self.step, phase)
        if phase != "batch_start":
            self.explainer.mark(phase)
        if leftover:  # a step without an optimizer step (manual optimization): keep its rows all the same
            self._end_step(leftover, False)

    def step_end(self, stopping: bool = False) -> Optional[dict[str, float]]:
        """After the optimizer step: the step's rows, the policy's decisions and, every ``log_every_n_steps`` (or
        when ``stopping``), the metrics to the loggers. Returns the metrics logged now, else ``None``."""
        self.ladder.step_ran()  # before the policy changes rungs again: the step ran with those it had
        if self.recorder is None or not self.measuring:
            return None
        self.boundary("after_optimizer_step")
        metrics = self._end_step(self.recorder.finish(), stopping)
        written = self.explainer.after_step(self.step, self.files_dir)
        if written:
            self._events.add(Event(step=self.step, action="explain", rung="", reason="wrote " + ", ".join(
                os.path.basename(p) for p in written), time=time.time()))
        return metrics

    def micro_batches(self) -> int:
        """How many micro-batches the front door runs the next batch as."""
        return self.ladder.micro_batches()

    def split_batch(self, batch: Any) -> list[tuple[Any, float]]:
        """The parts the front door runs ``batch`` as now, each with the factor its loss is multiplied by (what the
        loss averages over, :class:`~lightning_memguard.mitigations.microbatch.MicroBatching`); ``[(batch, 1.0)]``
        while the micro-batch rung is off."""
        if self.recorder is not None:  # the front door asks at the start of every attempt of a batch
            self.recorder.begin_attempt()
        k = self.micro_batches()
        return self.ladder.rungs["microbatch"].split(batch, k) if k > 1 else [(batch, 1.0)]

    def explain_next_step(self) -> None:
        self.explainer.arm()

    # --- the work ---------------------------------------------------------------------------------------------------
    def _begin_measuring(self, batch: Any) -> bool:
        """Whether this step is measured. On CPU, starts or stops the tensor counting for sampled steps."""
        source = self.source
        if not isinstance(source, CpuTensorAccountant):
            return source is not None
        measured = self.step % self.settings.cpu_sample_every == 0
        if measured and not source.started:
            # what was created while counting was off: the state that persists across steps, and this batch
            source.track(training_state_tensors(self._module, self._optimizers()))
            source.track(batch_tensors(batch))
            source.start()
            source.read(reset_peak=True)
        elif not measured and source.started:
            source.stop()
        return measured

    def _end_step(self, snapshots: list[MemorySnapshot], stopping: bool) -> Optional[dict[str, float]]:
        for snap in snapshots:
            self._history.add(snap)
            if snap.peak_bytes is not None:
                self._interval_peaks[snap.phase] = max(self._interval_peaks.get(snap.phase, 0), snap.peak_bytes)
        self._history.flush()  # every step reaches the OS: a run killed hard keeps all but the step in progress
        if snapshots and snapshots[-1].phase == "after_optimizer_step":
            self._guard(snapshots)
        if not snapshots:
            return None
        step = snapshots[0].step
        every = self.settings.log_every_n_steps or self.host.log_every_n_steps
        # the rule Lightning uses for self.log: the (step + 1)-th optimizer step, or when stopping
        if (step + 1) % every != 0 and not stopping:
            return None
        metrics = step_metrics(snapshots, self._interval_peaks)
        self._interval_peaks = {}
        self.host.log_metrics(metrics, step)
        return metrics

    def _guard(self, snapshots: list[MemorySnapshot]) -> None:
        """Between two optimizer steps: hand the step's peaks to the policy and carry out what it decides."""
        capacity = snapshots[-1].capacity_bytes
        if capacity is None or self.ladder.policy is None or snapshots[-1].peak_bytes is None:  # None: not counted
            return
        by_phase = {s.phase: s for s in snapshots}
        peaks = {phase: s.peak_bytes for phase, s in by_phase.items()}
        # without the gradients (see StepObservation): alive at batch start under Lightning, not in a plain loop
        static = by_phase["batch_start"].allocated_bytes if "batch_start" in by_phase else None
        static = static - self._gradients_at_start if static is not None else None
        end = by_phase.get("after_optimizer_step")
        held_after = end.allocated_bytes - self._gradient_bytes() if end is not None else None
        retries = snapshots[-1].alloc_retries
        if self._rank_max is not None:
            # every rank must decide the same: decide on the worst rank's numbers
            peaks, static, retries, held_after = self._reduce_max(peaks, static, retries, held_after)
        observation = StepObservation(snapshots[0].step, peaks, capacity, static, retries, held_after)
        for decision in self.ladder.after_step(observation):
            self.record(decision, capacity)

    @property
    def _rank_max(self) -> Optional[Callable[[list[int]], list[int]]]:
        """The element-wise maximum over ranks when the run has several processes (every rank must then decide the
        same), else ``None``."""
        return self.host.reduce_max if self.host.world_size > 1 else None

    def _reduce_max(self, peaks: dict[str, int], *values: Optional[int]):
        """Peaks per phase and the other step numbers, each the maximum over ranks (one collective)."""
        phases = [p for p in PHASES if p in peaks]
        reduced = [int(v) for v in self._rank_max([peaks[p] for p in phases]
                                                  + [-1 if v is None else v for v in values])]
        others = [None if v < 0 else v for v in reduced[len(phases):]]  # -1 stands for "no value"
        return (dict(zip(phases, reduced[:len(phases)])), *others)

    def _gradient_bytes(self) -> int:
        """Bytes of the gradients alive now (the policy compares steps without them)."""
        return storage_bytes(p.grad for p in self._params if p.grad is not None)

    def _plan(self, batch: Any, loss_fn: Optional[Callable]) -> None:
        self._planned = True
        capacity = self.source.capacity_bytes() if self.source is not None else None
        decision = plan_at_start(self.ladder, self._module, batch, capacity, self.settings.threshold, self.step,
                                 cuda=self._device.type == "cuda", optimizer=self.estimate_optimizer,
                                 loss_fn=loss_fn, precision=self._precision, reduce_max=self._rank_max,
                                 warn=self.host.warn)
        if decision is not None:
            self.record(decision, capacity)

    def record(self, decision: Decision, capacity: Optional[int], warn: bool = False) -> None:
        """Keeps a decision as an event, says it (as a warning with ``warn``), and logs the rung levels."""
        if decision.action == "threshold":
            self.explainer.on_first_crossing(decision.step)
        elif decision.action in ("rescue", "gave_up"):
            self.explainer.on_oom(decision.step, self.files_dir)
        event = Event(step=decision.step, action=decision.action, rung=decision.rung, reason=decision.reason,
                      peak_before_bytes=decision.peak_before_bytes, peak_after_bytes=decision.peak_after_bytes,
                      capacity_bytes=capacity, phase=decision.phase, level=decision.level, time=time.time())
        self._events.add(event)
        what = f"{event.action} {event.rung}" if event.rung else event.action
        message = f"lightning-memguard step {event.step}: {what} - {event.reason}"
        if warn or event.action in ("cannot_help", "exhausted"):
            self.host.warn(message)
        else:
            self.host.info(message)
        self.host.log_metrics({f"memguard/rung/{name}": float(level) for name, level in self.levels.items()},
                              event.step)
        if self.host.rank == 0:
            self.host.log_text(message, event.step)
        self._events.flush()

    def _attach_files(self, files_dir: str) -> None:
        suffix = self.rank_suffix
        self._history.attach_csv(os.path.join(files_dir, HISTORY_CSV.replace(".csv", f"{suffix}.csv")))
        self._events.attach_csv(os.path.join(files_dir, EVENTS_CSV.replace(".csv", f"{suffix}.csv")))
        if self.host.rank == 0:  # the settings the report command draws the threshold from
            s = self.settings
            settings = {"threshold": s.threshold, "mitigations": list(s.mitigations), "budget_bytes": s.budget_bytes,
                        "capacity_bytes": self.source.capacity_bytes(), "device": self.source.device}
            write_text(os.path.join(files_dir, RUN_JSON), json.dumps(settings, indent=1), self.host.warn)

    @property
    def rank_suffix(self) -> str:
        """Each rank's files are its own: ``memguard_history.csv`` on rank 0, ``memguard_history.rank1.csv`` on 1."""
        return "" if self.host.rank == 0 else f".rank{self.host.rank}"

    # --- out of memory ----------------------------------------------------------------------------------------------
    def on_oom(self, failure: OomFailure) -> None:
        """A forward/backward ran out of memory and was released: apply the next rung (the front door runs the batch
        again), or raise :class:`MemGuardOutOfMemoryError` with the report."""
        peak, capacity = self._peak_and_capacity()
        cause = f"out of memory in {failure.phase} of step {self.step} ({failure.error})"
        if failure.several_processes:
            why = ("the run has several processes, which cannot retry a batch together (every rank would have to "
                   "repeat the same forward and backward)")
        elif not failure.retry_safe:
            why = ("the backward failed in the middle of a gradient-accumulation window, after part of this "
                   "micro-batch's gradients were added to the window's sum; retrying would train on corrupted "
                   "gradients")
        elif not failure.retries_left:
            why = f"{failure.attempt - 1} retries of the same batch did not fit"
        else:
            static = self.recorder.pending_allocated("batch_start") if self.recorder is not None else None
            static = static - self._gradients_at_start if static is not None else None
            observation = StepObservation(self.step, {f"after_{failure.phase}": peak or 0}, capacity, static)
            decisions = self.ladder.escalate(observation, cause)
            for decision in decisions:
                self.record(decision, capacity)
            if decisions:
                if self.recorder is not None:  # the batch runs again: the failed attempt's passes do not count
                    self.recorder.forget_attempt()
                return
            why = "every rung of the ladder is at its top level or did not help"
        report = oom_report(self.step, failure.phase, peak, capacity, self.levels, self.events, why, failure.error)
        self.record(Decision(self.step, "gave_up", "", 0, why, peak, None, f"after_{failure.phase}"), capacity)
        self._keep_failure(report)
        raise MemGuardOutOfMemoryError(report["text"], report)

    def on_rung_error(self, error: str) -> bool:
        """A forward or backward failed with an error that is not an OOM. If rungs changed since the last step that
        ran, they are put back where they last ran and never raised again (one warning each) and True is returned:
        the front door runs the batch again. Else False: the error is the model's own."""
        decisions = self.ladder.revert_untried(self.step, error)
        capacity = self.source.capacity_bytes() if self.source is not None else None
        for decision in decisions:
            self.record(decision, capacity, warn=True)
        return bool(decisions)

    def running_buffers(self) -> Optional[RunningBuffers]:
        """The model's running buffers, saved before each attempt of a batch and put back after a failed one."""
        return RunningBuffers(self._module, self.host.warn) if self._module is not None else None

    def on_optimizer_oom(self, error: str, retry_safe: bool) -> None:
        """``optimizer.step`` ran out of memory after forward and backward: return to have it retried once with lower
        temporaries when nothing was updated yet, else raise the report. Activation remedies cannot help here."""
        peak, capacity = self._peak_and_capacity()
        sizes = training_state_bytes(self._module, self._optimizers())
        numbers = (f"parameters {format_bytes(sizes['parameters'])}, gradients {format_bytes(sizes['gradients'])}, "
                   f"optimizer state {format_bytes(sizes['optimizer_state'])}, capacity {format_bytes(capacity)}")
        if retry_safe:
            reason = (f"out of memory in the optimizer step of step {self.step} ({error}) before any parameter or "
                      f"state was updated; {numbers}; retrying the step with foreach=False (one parameter's "
                      "temporaries at a time)")
            self.record(Decision(self.step, "rescue", "optimizer", 0, reason, peak, None, "after_optimizer_step"),
                        capacity)
            return
        why = (f"the optimizer step ran out of memory ({numbers}). Activation remedies (AMP, checkpointing, "
               "micro-batching) cannot lower it. What helps: an optimizer with less state (SGD, 8-bit or factored "
               "Adam), foreach=False in the optimizer for smaller temporaries, sharding or offloading the optimizer "
               "state (FSDP, DeepSpeed ZeRO), or fewer trainable parameters")
        report = oom_report(self.step, "optimizer_step", peak, capacity, self.levels, self.events, why, error)
        report.update(sizes)
        self.record(Decision(self.step, "gave_up", "", 0, why, peak, None, "after_optimizer_step"), capacity)
        self._keep_failure(report)
        raise MemGuardOutOfMemoryError(report["text"], report)

    def _peak_and_capacity(self) -> tuple[Optional[int], Optional[int]]:
        """The peak since the last boundary (a new window starts) and the capacity, at an OOM."""
        if self.source is None:
            return None, None
        return self.source.read(reset_peak=True).peak_bytes, self.source.capacity_bytes()

    def _keep_failure(self, report: dict) -> None:
        """Before an OOM ends the run: the rows of the unfinished step, a row (phase ``oom``) with the memory at the
        failure, and the report file, on this rank. Not left to exception hooks: spawned DDP workers never get
        them."""
        if self.recorder is not None:
            self._finish_pending()
            self._history.add(self.recorder.snapshot_now(self.step, "oom"))
            self._history.flush()
        if self.files_dir is not None:
            write_text(os.path.join(self.files_dir, f"memguard_oom_report{self.rank_suffix}.txt"),
                       report["text"] + "\n", self.host.warn)

    def _finish_pending(self) -> None:
        if self.recorder is not None and self.recorder.pending_step is not None:
            for snap in self.recorder.finish():  # a partly recorded step (e.g. a crash mid-step) is kept too
                self._history.add(snap)

    # --- contract additions (doors) ---
    _begin_fit_with_state = begin_fit  # the method above, which the contract's begin_fit wraps
    _kept_ladder_state: Optional[dict] = None
    _automatic_optimization = True

    def begin_fit(self, module: nn.Module, device: torch.device, precision: Optional[PrecisionSwitch], host: Host,
                  *positional: Any, automatic_optimization: bool = True,
                  estimate_optimizer: Optional[torch.optim.Optimizer] = None,
                  called_module: Optional[nn.Module] = None, first_step: int = 0) -> None:
        if positional:  # the Lightning callback's call in this branch: (automatic_optimization, restored_state)
            automatic_optimization = positional[0]
            if len(positional) > 1 and positional[1]:
                self._kept_ladder_state = positional[1]
        self._automatic_optimization = automatic_optimization
        self._begin_fit_with_state(module, device, precision, host, automatic_optimization, self._kept_ladder_state)
        self._kept_ladder_state = None
        self.estimate_optimizer, self.called_module, self.step = estimate_optimizer, called_module, first_step

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._kept_ladder_state = state.get("ladder") or None
        if self._kept_ladder_state and self.ladder.policy is not None:
            self.ladder.restore(self._kept_ladder_state)
            self._kept_ladder_state = None

    @property
    def can_retry(self) -> bool:
        return self.settings.rescue_oom and self._automatic_optimization and self.host.world_size == 1
    # --- end contract additions ---
