"""MemGuardCallback: the thin Lightning adapter. Hooks → sources → history/loggers (→ policy → mitigations)."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import pandas as pd
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from torch.utils._pytree import tree_leaves

from ._trainer import (
    memguard_warn,
    optimizer_step_index,
    reduce_max,
    run_dir,
    training_state_bytes,
    training_state_tensors,
)
from .checks import check_bool, check_int, check_number, check_size
from .explain import StepExplainer
from .history import EventLog, MemoryHistory
from .keys import step_metrics, tensorboard_layout
from .ladder import DEFAULT_LADDER, Ladder, validate_ladder
from .mitigations.checkpointing import BlockSpec, validate_block_spec
from .plan import plan_configuration
from .plot import EVENTS_CSV, HISTORY_CSV, RUN_JSON
from .policy import Decision, StepObservation
from .recorder import StepRecorder
from .report import oom_report
from .rescue import BatchRunner, MemGuardOutOfMemoryError, OomFailure
from .snapshot import Event, MemorySnapshot, format_bytes
from .sources import CpuTensorAccountant, CudaAllocatorSource, NvmlSampler

__all__ = ["MemGuardCallback"]


class MemGuardCallback(Callback):
    r"""Measures memory in every phase of every training step, logs it, and acts before an out-of-memory error.

    At four boundaries of every optimizer step it reads the memory source: ``batch_start``, ``after_forward``
    (``on_before_backward``), ``after_backward`` (``on_after_backward``) and ``after_optimizer_step``
    (``on_train_batch_end`` of a batch that stepped). On CUDA the source is the caching allocator (one
    allocator-statistics read per boundary, peaks reset per phase) plus NVML sampled on a background thread; on CPU it
    is live tensor-storage accounting (:class:`~lightning_memguard.sources.CpuTensorAccountant`).

    Logged to every logger in ``trainer.loggers`` every ``log_every_n_steps`` optimizer steps, on the step axis of
    the module's own ``self.log`` metrics (``<phase>`` is one of the four boundaries):

    ==================================  =========================================================================
    key                                 meaning
    ==================================  =========================================================================
    ``memguard/<phase>/allocated_GiB``  allocated at the boundary
    ``memguard/<phase>/peak_GiB``       peak of the phase ending there, max over the logging interval
    ``memguard/reserved_GiB``           allocator reserved (CUDA)
    ``memguard/nvml_used_GiB``          device used per NVML (CUDA)
    ``memguard/nvml_process_GiB``       this process per NVML (where the driver reports it)
    ``memguard/capacity_GiB``           capacity guarded (device total, memory fraction or budget)
    ``memguard/peak_share``             highest phase peak of the step / capacity (``mem%`` in the progress bar)
    ``memguard/alloc_retries``          cumulative allocator retries (CUDA)
    ``memguard/num_ooms``               cumulative out-of-memory errors
    ``memguard/rung/<name>``            a rung's level, at each event
    ==================================  =========================================================================

    With TensorBoard, the custom-scalars layout "memguard" puts the GiB curves on one chart.

    After each optimizer step the step's peaks go to the ladder: at ``threshold × capacity`` it applies the next
    rung (``amp``, then ``checkpointing`` of as many repeated blocks as the estimate predicts are needed, then
    ``microbatch``), judges it on the next full step, keeps or reverts it, and says so once when activation remedies
    cannot help. An OOM in forward or backward is rescued by running the same batch again one rung higher; an OOM in
    the optimizer step is explained (and retried once with ``foreach=False`` when nothing was updated yet).
    :attr:`history` and :attr:`events` are pandas DataFrames of the latest fit, streamed to ``memguard_history.csv``
    and ``memguard_events.csv`` in ``trainer.log_dir`` (every step reaches the OS as it ends).

    Args:
        threshold: act when a phase peak reaches ``threshold × capacity``; in (0, 1].
        budget: the capacity to guard, as int bytes or a string like ``"1.5GiB"`` / ``"800MB"``. Needed on CPU to
            guard anything; on CUDA it replaces the device total (or the per-process memory fraction).
        mitigations: the ladder, rungs tried in order: ``"amp"`` (bf16 or fp16 mixed precision; left out of the
            default ladder on a CPU without native bf16, where it would be many times slower),
            ``"checkpointing"`` (activation checkpointing of repeated blocks) and ``"microbatch"`` (the batch run as
            2, 4, ... micro-batches inside one optimizer step) by default; ``"offload"`` (saved
            activations to pinned host memory, CUDA only) can be added last. ``()``: warn and log only.
        blocks: which modules the checkpointing rung may checkpoint: ``None`` detects repeated blocks (every
            ModuleList/Sequential of same-class children), or module classes, or a ``(name, module) -> bool``.
        min_gain: keep a rung only if the step peak fell by at least this share; otherwise revert it.
        rescue_oom: when the forward or backward of a batch runs out of memory, free the failed attempt, apply the
            next rung and run the same batch again (automatic optimization, one process; with several processes the
            failing rank reports and the run stops). When every rung is at its top,
            :class:`~lightning_memguard.rescue.MemGuardOutOfMemoryError` is raised with a memory report.
        max_retries: retries of one batch before giving up; ``None`` climbs the ladder to its top (at most 16
            attempts a batch).
        plan_at_start: before the first step, estimate the step from the first batch
            (:func:`~lightning_memguard.plan.plan_configuration`) and start with the cheapest configuration that
            fits, so a run that would run out of memory at step 1 starts mitigated. On CUDA the estimate is the CUDA
            one (``target="cuda"``: a meta-device copy through the CUDA kernel model, AMP included), in about a
            second even for a GPT-2-sized model.
        progress_bar: show the last logged step's peak as a share of capacity (``mem%``) in Lightning's progress
            bar, through Lightning's own progress-bar metrics (only when there is a capacity).
        explain: when the threshold is first crossed, record the next step with a
            :class:`~lightning_memguard.tensor_diff.TensorDiff` and write ``memguard_tensor_diff_step<N>.csv`` and
            ``memguard_top_consumers_step<N>.csv``; on CUDA also an allocator snapshot
            (``memguard_memory_snapshot_step<N>.pickle``, for pytorch.org/memory_viz), and one on every OOM.
            Snapshot pickles must only be loaded from runs you trust.
        record_memory_history: on CUDA, record allocation stacks from the start of training (costs time per
            allocation; otherwise recording starts at the first crossing and stops after one step).
        snapshot_max_entries: bound on the recorded allocation history.
        log_every_n_steps: log every N optimizer steps; ``None`` follows ``Trainer(log_every_n_steps=...)``.
        history_max_rows: rows kept in memory (the CSV keeps all); ``None`` keeps all.
        nvml_interval_s: seconds between NVML samples (CUDA only).
        cpu_hard_limit: on CPU, raise ``torch.OutOfMemoryError`` when live tensor bytes pass this (to test
            out-of-memory handling without a GPU); ``None``: no limit.
        cpu_sample_every: on CPU, count tensors during every N-th optimizer step only. Counting costs ~12 µs per
            aten op, ~20 % of a step made of thousands of small ops; the other steps run uncounted and have no
            history rows. ``None``: every step when a ``budget`` or ``cpu_hard_limit`` is given (guarding needs
            every step), else every 4th step.

    Raises:
        ValueError: on a bad argument, naming it and what is allowed.

    Example::

        guard = MemGuardCallback(budget="2GiB")
        trainer = Trainer(callbacks=[guard])
        trainer.fit(model)
        guard.history, guard.events  # pandas DataFrames
    """

    def __init__(
        self,
        threshold: float = 0.9,
        budget: Optional[int | str] = None,
        mitigations: Sequence[str] = DEFAULT_LADDER,
        blocks: BlockSpec = None,
        min_gain: float = 0.03,
        rescue_oom: bool = True,
        max_retries: Optional[int] = None,
        plan_at_start: bool = False,
        progress_bar: bool = True,
        explain: bool = True,
        record_memory_history: bool = False,
        snapshot_max_entries: int = 100_000,
        log_every_n_steps: Optional[int] = None,
        history_max_rows: Optional[int] = 100_000,
        nvml_interval_s: float = 0.2,
        cpu_hard_limit: Optional[int | str] = None,
        cpu_sample_every: Optional[int] = None,
    ) -> None:
        # every argument is checked here, so a bad one fails now and not deep inside training
        self.threshold = check_number("threshold", threshold, 0, 1, low_open=True)
        min_gain = check_number("min_gain", min_gain, 0, 1, high_open=True)
        self.mitigations = validate_ladder(mitigations)
        validate_block_spec(blocks)
        self.budget_bytes = check_size("budget", budget, none_means="the device total on CUDA; monitor only on CPU")
        self.cpu_hard_limit_bytes = check_size("cpu_hard_limit", cpu_hard_limit, none_means="no limit")
        self.rescue_oom = check_bool("rescue_oom", rescue_oom)
        self.plan_at_start = check_bool("plan_at_start", plan_at_start)
        self.progress_bar = check_bool("progress_bar", progress_bar)
        self.explain = check_bool("explain", explain)
        self.record_memory_history = check_bool("record_memory_history", record_memory_history)
        check_int("max_retries", max_retries, none_means="climb the ladder to its top, at most 16 attempts")
        self.snapshot_max_entries = check_int("snapshot_max_entries", snapshot_max_entries)
        self.log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, none_means="follow the Trainer")
        self.history_max_rows = check_int("history_max_rows", history_max_rows, none_means="keep every row")
        self.nvml_interval_s = check_number("nvml_interval_s", nvml_interval_s, 0, 3600, low_open=True)
        check_int("cpu_sample_every", cpu_sample_every, none_means="automatic")
        if cpu_sample_every is None:  # guarding a budget needs every step measured
            cpu_sample_every = 1 if self.budget_bytes is not None or self.cpu_hard_limit_bytes is not None else 4
        self.cpu_sample_every = cpu_sample_every

        self._ladder = Ladder(self.mitigations, self.threshold, blocks, min_gain,
                              is_default=mitigations is DEFAULT_LADDER)
        self._runner = BatchRunner(max_retries, on_failure=self._on_oom, on_optimizer_failure=self._on_optimizer_oom,
                                   micro_batches=self._ladder.micro_batches)
        self._explainer = StepExplainer(self.explain, self.record_memory_history, self.snapshot_max_entries)
        self._restored_state: Optional[dict] = None
        self._planned = False
        self._trainer: Optional[pl.Trainer] = None
        self._history = MemoryHistory(max_rows=history_max_rows)
        self._events = EventLog()
        self._source: Optional[CpuTensorAccountant | CudaAllocatorSource] = None
        self._nvml: Optional[NvmlSampler] = None
        self._recorder: Optional[StepRecorder] = None
        self._stepped = False
        self._measuring = False
        self._interval_peaks: dict[str, int] = {}
        self._warned_no_logger = False
        self._files_dir: Optional[str] = None

    # --- public results ---------------------------------------------------------------------------------------------
    @property
    def history(self) -> pd.DataFrame:
        """The latest fit's rows, one per phase per optimizer step (columns: step, phase, device, allocated_bytes,
        peak_bytes, reserved_bytes, alloc_retries, num_ooms, nvml_*_bytes, capacity_bytes, micro_batches, time)."""
        return self._history.to_dataframe()

    @property
    def events(self) -> pd.DataFrame:
        """The latest fit's actions and notices, one row each (columns: step, action, rung, reason,
        peak_before_bytes, peak_after_bytes, capacity_bytes, phase, level, time)."""
        return self._events.to_dataframe()

    @property
    def source(self):
        """The memory source in use during fit (CUDA allocator or CPU accountant), else ``None``."""
        return self._source

    @property
    def levels(self) -> dict[str, int]:
        """The level of each rung now (``amp``: 0/1, ``checkpointing``: number of checkpointed blocks)."""
        return self._ladder.levels

    # --- Lightning hooks: one line each -----------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # One fit, one set of results: a reused callback (a second fit, another Trainer) starts clean.
        self._history = MemoryHistory(max_rows=self.history_max_rows)
        self._events = EventLog()
        self._planned = False
        self._interval_peaks = {}
        self._trainer = trainer
        self._ladder.setup(trainer, pl_module, self._restored_state, guarding=self._guarding(trainer))
        self._restored_state = None  # applied: a later fit without a checkpoint must not apply it again
        self._install_runner(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"ladder": self._ladder.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Usually called before on_fit_start, which applies it: after the strategy set up the model, before Lightning
        # restores the scaler state. Strategies that restore after setup (FSDP, DeepSpeed) call it after
        # on_fit_start: then apply it now, still before the first step.
        self._restored_state = state_dict.get("ladder") or None
        if self._restored_state and self._ladder.policy is not None:
            self._ladder.restore(self._restored_state)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._stepped = False
        # the first batch of a fit tells the ladder how far it can split and what each level will need
        target = ("cuda" if pl_module.device.type == "cuda" else "cpu") if self._guarding(trainer) else None
        self._ladder.note_batch(batch, pl_module, target)
        if self.plan_at_start and not self._planned:
            self._plan(trainer, pl_module, batch)  # before counting starts: the estimate's own memory is not ours
        self._measuring = self._begin_step(trainer, pl_module, batch)
        if self._measuring and self._explainer.armed:
            self._explainer.begin(pl_module, trainer.optimizers)
        self._observe(trainer, "batch_start")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._runner.mark_backward()
        self._observe(trainer, "after_forward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._observe(trainer, "after_backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._stepped = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._stepped and self._measuring:
            self._observe(trainer, "after_optimizer_step")
            self._end_step(trainer, self._recorder.finish())
            self._write_explanations(trainer, optimizer_step_index(trainer))

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._final_snapshot(trainer, exception)
        self._stop(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._stop(trainer)

    # --- the work ---------------------------------------------------------------------------------------------------
    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            self._source = CudaAllocatorSource(device, budget_bytes=self.budget_bytes)
            self._source.start()
            self._nvml = NvmlSampler(str(torch.cuda.get_device_properties(device).uuid), self.nvml_interval_s)
            self._nvml.start()
        else:
            if device.type != "cpu" or torch.cuda.is_available():
                memguard_warn(f"lightning-memguard: the device {device} is not CUDA, so live CPU tensor memory is "
                              "counted instead.")
            else:
                memguard_warn("lightning-memguard: there is no CUDA device, so live CPU tensor memory is counted"
                              + (" against the budget." if self._guarding(trainer) else
                                 "; give budget= to guard it (until then it is only monitored)."))
            accountant = CpuTensorAccountant(budget_bytes=self.budget_bytes, limit_bytes=self.cpu_hard_limit_bytes)
            self._source = accountant  # started per measured step in _begin_step
        self._recorder = StepRecorder(self._source, self._nvml)
        self._explainer.start(cuda=device.type == "cuda")
        self._files_dir = None if trainer.fast_dev_run else run_dir(trainer)
        if self._files_dir is not None:
            self._attach_csv(trainer, self._files_dir)
        self._add_tensorboard_layout(trainer)
        if not trainer.loggers and not self._warned_no_logger:
            self._warned_no_logger = True
            where = (f"written to {os.path.abspath(self._files_dir)}" if self._files_dir is not None
                     else "kept in memory (callback.history, callback.events)")
            memguard_warn(f"lightning-memguard: the Trainer has no logger, so no memory curves are logged; the "
                          f"history and events are {where}.")

    def _guarding(self, trainer: pl.Trainer) -> bool:
        """Whether this run has a capacity to guard (else it only monitors, and rungs and rescue never act)."""
        on_cuda = trainer.strategy.root_device.type == "cuda"
        return on_cuda or self.budget_bytes is not None or self.cpu_hard_limit_bytes is not None

    def _begin_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> bool:
        """Whether this step is measured. On CPU, starts or stops the tensor counting for sampled steps."""
        source = self._source
        if not isinstance(source, CpuTensorAccountant):
            return source is not None
        measured = optimizer_step_index(trainer) % self.cpu_sample_every == 0
        if measured and not source.started:
            # what was created while counting was off: the state that persists across steps, and this batch
            source.track(training_state_tensors(trainer, pl_module))
            source.track(tree_leaves(batch))
            source.start()
            source.read(reset_peak=True)
        elif not measured and source.started:
            source.stop()
        return measured

    def _observe(self, trainer: pl.Trainer, phase: str) -> None:
        if self._recorder is None or not self._measuring:
            return
        leftover = self._recorder.observe(optimizer_step_index(trainer), phase)
        if phase != "batch_start":
            self._explainer.mark(phase)
        if leftover:  # a step without an optimizer step (manual optimization): keep its rows all the same
            self._end_step(trainer, leftover)

    def _end_step(self, trainer: pl.Trainer, snapshots: list[MemorySnapshot]) -> None:
        for snap in snapshots:
            self._history.add(snap)
            if snap.peak_bytes is not None:
                self._interval_peaks[snap.phase] = max(self._interval_peaks.get(snap.phase, 0), snap.peak_bytes)
        self._history.flush()  # every step reaches the OS: a run killed hard keeps all but the step in progress
        if snapshots and snapshots[-1].phase == "after_optimizer_step":
            self._guard(trainer, snapshots)
        if snapshots and self._should_log(trainer, snapshots[0].step):
            self._log(trainer, snapshots)

    def _guard(self, trainer: pl.Trainer, snapshots: list[MemorySnapshot]) -> None:
        """Between two optimizer steps: hand the step's peaks to the policy and carry out what it decides."""
        capacity = snapshots[-1].capacity_bytes
        if capacity is None or self._ladder.policy is None:
            return
        by_phase = {s.phase: s for s in snapshots}
        peaks = {phase: s.peak_bytes for phase, s in by_phase.items()}
        static = by_phase["batch_start"].allocated_bytes if "batch_start" in by_phase else None
        retries = snapshots[-1].alloc_retries
        if trainer.world_size > 1:  # every rank must decide the same: decide on the worst rank's numbers
            peaks, static, retries = reduce_max(trainer, peaks, static, retries)
        observation = StepObservation(snapshots[0].step, peaks, capacity, static, retries)
        for decision in self._ladder.after_step(observation):
            self._record(trainer, decision, capacity)

    def _plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        self._planned = True
        capacity = self._source.capacity_bytes() if self._source is not None else None
        if capacity is None or self._ladder.policy is None:
            memguard_warn("lightning-memguard: plan_at_start needs a capacity (a budget on CPU), so no plan was "
                          "made.")
            return
        target = "cuda" if pl_module.device.type == "cuda" else "cpu"
        try:
            # on CUDA the estimate runs a meta copy through the CUDA kernel model: no GPU memory, no FLOPs
            plan = plan_configuration(pl_module, batch, capacity, self.threshold, blocks=self._ladder.blocks,
                                      allow_amp="amp" in self._ladder.rungs, target=target)
        except Exception as err:  # a plan is a head start, never the reason a fit dies
            memguard_warn(f"lightning-memguard: plan_at_start could not estimate the step ({err}); the closed loop "
                           "will act on measurements instead.")
            return
        levels = {"amp": int(plan.amp)}
        if "checkpointing" in self._ladder.rungs:
            levels["checkpointing"] = plan.checkpointed_blocks
        self._ladder.apply_plan(levels)
        if not plan.fits:
            memguard_warn(f"lightning-memguard: plan_at_start: {plan.reason}")
        decision = Decision(optimizer_step_index(trainer), "plan", "", 0, plan.reason, plan.expected_peak_bytes)
        self._record(trainer, decision, capacity)

    def explain_next_step(self) -> None:
        """Records the next measured step with a tensor diff and writes the explanation files (see ``explain``)."""
        self._explainer.arm()

    def _write_explanations(self, trainer: pl.Trainer, step: int) -> None:
        written = self._explainer.after_step(step, self._files_dir)
        if written:
            self._events.add(Event(step=step, action="explain", rung="", reason="wrote " + ", ".join(
                os.path.basename(p) for p in written), time=time.time()))

    def _record(self, trainer: pl.Trainer, decision: Decision, capacity: Optional[int]) -> None:
        if decision.action == "threshold":
            self._explainer.on_first_crossing(decision.step)
        elif decision.action in ("rescue", "gave_up"):
            self._explainer.on_oom(decision.step, self._files_dir)
        event = Event(step=decision.step, action=decision.action, rung=decision.rung, reason=decision.reason,
                      peak_before_bytes=decision.peak_before_bytes, peak_after_bytes=decision.peak_after_bytes,
                      capacity_bytes=capacity, phase=decision.phase, level=decision.level, time=time.time())
        self._events.add(event)
        what = f"{event.action} {event.rung}" if event.rung else event.action
        message = f"lightning-memguard step {event.step}: {what} - {event.reason}"
        if event.action in ("cannot_help", "exhausted"):
            memguard_warn(message)
        else:
            rank_zero_info(message)
        for logger in trainer.loggers:
            logger.log_metrics({f"memguard/rung/{name}": float(level) for name, level in self.levels.items()},
                               step=event.step)
            if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
                logger.experiment.add_text("memguard/events", message, global_step=event.step)
        self._events.flush()

    def _should_log(self, trainer: pl.Trainer, step: int) -> bool:
        every = self.log_every_n_steps or trainer.log_every_n_steps
        # the same rule Lightning uses for self.log: the (step + 1)-th optimizer step, or when stopping
        return (step + 1) % every == 0 or trainer.should_stop

    def _log(self, trainer: pl.Trainer, snapshots: list[MemorySnapshot]) -> None:
        metrics = step_metrics(snapshots, self._interval_peaks)
        self._interval_peaks = {}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=snapshots[0].step)
        share = metrics.get("memguard/peak_share")
        if self.progress_bar and share is not None:
            # Lightning's own progress-bar metrics; once per logging interval, as self.log costs ~0.2 ms a call
            trainer.lightning_module.log("mem%", round(100 * share, 1), prog_bar=True, logger=False,
                                         on_step=True, on_epoch=False)

    def _attach_csv(self, trainer: pl.Trainer, log_dir: str) -> None:
        suffix = _rank_suffix(trainer)
        self._history.attach_csv(os.path.join(log_dir, HISTORY_CSV.replace(".csv", f"{suffix}.csv")))
        self._events.attach_csv(os.path.join(log_dir, EVENTS_CSV.replace(".csv", f"{suffix}.csv")))
        if trainer.is_global_zero:  # the settings the report command draws the threshold from
            settings = {"threshold": self.threshold, "mitigations": list(self.mitigations),
                        "budget_bytes": self.budget_bytes, "capacity_bytes": self._source.capacity_bytes(),
                        "device": self._source.device}
            _write_text(os.path.join(log_dir, RUN_JSON), json.dumps(settings, indent=1))

    def _add_tensorboard_layout(self, trainer: pl.Trainer) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
                logger.experiment.add_custom_scalars(tensorboard_layout())

    def _stop(self, trainer: pl.Trainer) -> None:
        """Idempotent: flushes everything and releases the sources (end of training, exception or teardown)."""
        self._finish_pending()
        self._history.close()
        self._events.close()
        self._runner.uninstall()
        self._explainer.abort()  # its dispatch mode was entered after the source's: leave it first
        if self._source is not None:
            self._source.stop()
        if self._nvml is not None:
            self._nvml.stop()
            self._nvml = None
        self._recorder = None

    # --- out of memory ----------------------------------------------------------------------------------------------
    def _install_runner(self, trainer: pl.Trainer) -> None:
        """Runs batches through MemGuard (micro-batching, OOM rescue, optimizer-step reports) under automatic
        optimization."""
        installed = self._runner.install(trainer, rescue=self.rescue_oom)
        if not installed and self.rescue_oom and self._guarding(trainer):
            memguard_warn("lightning-memguard: OOM rescue needs automatic optimization, so it is off for this "
                          "module.")
        elif installed and self.rescue_oom and trainer.world_size > 1:
            # Ranks cannot retry a batch together without a collective after every forward and backward; an OOM on
            # one rank therefore fails the run (Lightning stops the other ranks) with that rank's memory report.
            memguard_warn("lightning-memguard: with several processes an OOM cannot be retried; it fails the run "
                          "with the memory report of the rank that ran out. Threshold mitigation stays on.")

    def _on_oom(self, failure: OomFailure) -> None:
        """A forward/backward ran out of memory and was released: apply the next rung, or raise the report."""
        trainer = self._trainer
        peak, capacity = self._peak_and_capacity()
        step = optimizer_step_index(trainer)
        cause = f"out of memory in {failure.phase} of step {step} ({failure.error})"
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
            static = self._recorder.pending_allocated("batch_start") if self._recorder is not None else None
            observation = StepObservation(step, {f"after_{failure.phase}": peak or 0}, capacity, static)
            decision = self._ladder.escalate(observation, cause)
            if decision is not None:
                self._record(trainer, decision, capacity)
                return
            why = "every rung of the ladder is at its top level or did not help"
        report = oom_report(step, failure.phase, peak, capacity, self.levels, self._events.to_dataframe(), why,
                            failure.error)
        self._record(trainer, Decision(step, "gave_up", "", 0, why, peak, None, f"after_{failure.phase}"), capacity)
        self._keep_failure(trainer, report)
        raise MemGuardOutOfMemoryError(report["text"], report)

    def _on_optimizer_oom(self, error: str, retry_safe: bool) -> None:
        """``optimizer.step`` ran out of memory after forward and backward: retry it once with lower temporaries when
        nothing was updated yet, else raise the report. Activation remedies cannot help here."""
        trainer = self._trainer
        step = optimizer_step_index(trainer)
        peak, capacity = self._peak_and_capacity()
        sizes = training_state_bytes(trainer)
        numbers = (f"parameters {format_bytes(sizes['parameters'])}, gradients {format_bytes(sizes['gradients'])}, "
                   f"optimizer state {format_bytes(sizes['optimizer_state'])}, capacity {format_bytes(capacity)}")
        if retry_safe:
            reason = (f"out of memory in the optimizer step of step {step} ({error}) before any parameter or state "
                      f"was updated; {numbers}; retrying the step with foreach=False (one parameter's temporaries "
                      "at a time)")
            self._record(trainer, Decision(step, "rescue", "optimizer", 0, reason, peak, None,
                                           "after_optimizer_step"), capacity)
            return
        why = (f"the optimizer step ran out of memory ({numbers}). Activation remedies (AMP, checkpointing, "
               "micro-batching) cannot lower it. What helps: an optimizer with less state (SGD, 8-bit or factored "
               "Adam), foreach=False in the optimizer for smaller temporaries, sharding or offloading the optimizer "
               "state (FSDP, DeepSpeed ZeRO), or fewer trainable parameters")
        report = oom_report(step, "optimizer_step", peak, capacity, self.levels, self._events.to_dataframe(), why,
                            error)
        report.update(sizes)
        self._record(trainer, Decision(step, "gave_up", "", 0, why, peak, None, "after_optimizer_step"), capacity)
        self._keep_failure(trainer, report)
        raise MemGuardOutOfMemoryError(report["text"], report)

    def _peak_and_capacity(self) -> tuple[Optional[int], Optional[int]]:
        """The peak since the last boundary (a new window starts) and the capacity, at an OOM."""
        if self._source is None:
            return None, None
        return self._source.read(reset_peak=True).peak_bytes, self._source.capacity_bytes()

    def _keep_failure(self, trainer: pl.Trainer, report: dict) -> None:
        """Before an OOM ends the run: the rows of the unfinished step, a row (phase ``oom``) with the memory at the
        failure, and the report file, on this rank. Not left to ``on_exception``: spawned DDP workers never get it."""
        if self._recorder is not None:
            self._finish_pending()
            self._history.add(self._recorder.snapshot_now(optimizer_step_index(trainer), "oom"))
            self._history.flush()
        if self._files_dir is not None:
            _write_text(os.path.join(self._files_dir, f"memguard_oom_report{_rank_suffix(trainer)}.txt"),
                        report["text"] + "\n")

    def _finish_pending(self) -> None:
        if self._recorder is not None and self._recorder.pending_step is not None:
            for snap in self._recorder.finish():  # a partly recorded step (e.g. a crash mid-step) is kept too
                self._history.add(snap)

    def _final_snapshot(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """On any exception: one more row (phase ``exception``) with the memory at that moment after the rows of the
        unfinished step, and the report of an OOM that could not be rescued."""
        if self._source is None or self._recorder is None:
            return
        self._finish_pending()
        self._history.add(self._recorder.snapshot_now(optimizer_step_index(trainer), "exception"))


def _write_text(path: str, text: str) -> None:
    """Writes a small file; if it cannot be written, one warning and training goes on."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as err:
        memguard_warn(f"lightning-memguard: cannot write {path} ({err.strerror or err}); training goes on.")


def _rank_suffix(trainer: pl.Trainer) -> str:
    """Each rank's files are its own: ``memguard_history.csv`` on rank 0, ``memguard_history.rank1.csv`` on rank 1."""
    return "" if trainer.global_rank == 0 else f".rank{trainer.global_rank}"
