"""MemGuardEngine: the guard of one model, framework-free. It composes the monitor (what is measured, logged and
written, :class:`~lightning_memguard.monitor.monitor.MemoryMonitor`) with what acts on it: the ladder of rungs, the
one attempt loop that retries, splits or gives up (:class:`~lightning_memguard.guard.attempts.Attempts`), the plan
made before the first step, and the agreement between ranks (:class:`~lightning_memguard.guard.ranks.Ranks`).

A front door (the Lightning callback, the Fabric guard, the plain-loop guard) translates its framework's hooks into
these calls and applies rungs the way its framework needs. One optimizer step is::

    engine.batch_start(step, batch)
    engine.train_batch(forward_and_backward, state, release=...)   # the attempt loop: run, retry, split, give up
        # inside: engine.split_batch(batch), engine.boundary("after_forward"), engine.boundary("after_backward")
    engine.step_end()                    # after the optimizer step: history row, policy, loggers

around a fit ``begin_fit`` (build the rungs), ``start`` (open sources and files) and ``stop``. An optimizer step
that runs out of memory goes to ``engine.attempts.on_optimizer_oom``.

A batch of an evaluation loop is one call, ``evaluation_batch(phase, batch, call)``, through the same attempt loop;
an evaluation with no fit in progress is framed by ``begin_evaluation`` and ``end_evaluation``.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Callable, Optional

import pandas as pd
import torch
from torch import nn

from ..base.buffers import RunningBuffers
from ..base.collection import collection_paused
from ..base.host import Host
from ..base.sharding import data_parallel_of
from ..base.snapshot import MemorySnapshot
from ..mitigations.amp import PrecisionSwitch
from ..mitigations.ddp_reach import reaching_every_parameter, waits_for_every_parameter
from ..mitigations.fsdp_unused import UnusedReduced
from ..mitigations.microbatch import MicroBatching, generation_pad_id
from ..monitor.monitor import MemoryMonitor
from ..monitor.recorder import StepRecorder
from ..monitor.source_choice import held_beside_step
from ..sources.base import MemorySource
from .attempts import Attempts, BatchState, Savepoint, StepCall
from .ladder import Ladder
from .long_batch import LongBatches
from .planning import needs_plan, plan_at_start
from .policy import Decision, StepObservation
from .ranks import Ranks
from .settings import GuardSettings

__all__ = ["MemGuardEngine"]


class MemGuardEngine:
    """Measures, decides and explains for one model at a time; see the module docstring for the calls.

    Args:
        settings: the checked settings.
        name: how the front door calls its run in messages (``"the Trainer"``, ``"the loop"``).
        source: a memory source to read instead of the one chosen for the device (a scripted one in tests).
    """

    def __init__(self, settings: GuardSettings, name: str = "the run", *,
                 source: Optional[MemorySource] = None) -> None:
        s = self.settings = settings
        self.monitor = MemoryMonitor(name, s, source=source, on_step=self._guard)
        self.ladder = Ladder(s.mitigations, s.threshold, s.blocks, s.min_gain, is_default=s.default_ladder,
                             warn=self._warn, microbatch_weight=s.microbatch_weight)
        self._long_batches = LongBatches()
        #: the one attempt loop of every batch, and what its failures lead to
        self.attempts = Attempts(self.ladder, self.monitor, self._long_batches)
        self._evaluating = False  # an evaluation with no fit in progress (begin_evaluation)
        self.ranks = Ranks()
        self._module: Optional[nn.Module] = None
        self._device = torch.device("cpu")
        self._precision = "32-true"
        self._automatic = True
        self._data_parallel: Optional[tuple[str, int]] = None  # ("ddp", ranks): estimates add its buckets
        self._waits_for_every_parameter = False  # DDP without find_unused_parameters (last_part_loss)
        self._unused_reduced: Optional[UnusedReduced] = None  # FSDP2: split steps reduce every parameter
        self._estimate_optimizer: Optional[torch.optim.Optimizer] = None
        self._planned = False
        self._local_retries: Optional[int] = None  # this rank's allocator retries at its last measured step
        self._estimate_target: Optional[str] = None
        self._restored: Optional[dict] = None  # a checkpoint's ladder state, for the next begin_fit
        self._resume_notice: Optional[str] = None  # says, at the next batch, at which levels a run goes on
        self._in_fit = False
        self._step_began: Optional[float] = None  # when a step timed for the speed trial began
        self._step_seconds: Optional[float] = None  # the wall time of the step just ended, where it was timed

    def _warn(self, message: str) -> None:
        self.host.warn(message)  # a method, not a lambda: a guard is pickled into spawned DDP workers

    # --- results and state ------------------------------------------------------------------------------------------
    @property
    def history(self) -> pd.DataFrame:
        return self.monitor.history

    @property
    def events(self) -> pd.DataFrame:
        return self.monitor.events

    @property
    def history_csv(self) -> Optional[str]:
        return self.monitor.files.history.path

    @property
    def levels(self) -> dict[str, int]:
        return self.ladder.levels

    @property
    def source(self) -> Optional[MemorySource]:
        return self.monitor.source

    @property
    def recorder(self) -> Optional[StepRecorder]:
        """The monitor's recorder of the step in progress (``None`` outside a fit)."""
        return self.monitor.recorder

    @property
    def host(self) -> Host:
        return self.monitor.host

    @property
    def step(self) -> int:
        return self.monitor.step

    @property
    def guarding(self) -> bool:
        """Whether this run has a capacity to guard (else it only monitors, and rungs and rescue never act)."""
        return self.monitor.guarding

    @property
    def can_retry(self) -> bool:
        """Whether a batch that ran out of memory runs again one rung higher: ``rescue_oom``, and ranks that can
        retry together (see :class:`Ranks`) under automatic optimization (the front door runs forward and backward),
        or one process under manual optimization (where the step is caught before an optimizer stepped)."""
        return self.settings.rescue_oom and self.ranks.can_retry and (self._automatic or self.ranks.world_size == 1)

    def state_dict(self) -> dict[str, Any]:
        return {"ladder": self.ladder.state_dict(), "evaluation": self.ladder.parts.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Puts the rungs back where :meth:`state_dict` of a checkpoint left them: during a fit at once (strategies
        that restore after setup: the rungs must be set before the first step); otherwise at the next
        :meth:`begin_fit` (a resumed fit or loop), and at once too where an earlier fit built the rungs. The parts
        evaluation batches run in are put back at once.

        Raises:
            ValueError: the checkpoint holds a level this run's rungs cannot take.
        """
        self.ladder.parts.load_state_dict(state.get("evaluation") or {})  # absent from older checkpoints
        ladder_state = state.get("ladder") or None
        if ladder_state and self.ladder.policy is not None:
            self.ladder.restore(ladder_state)
            if self._in_fit:
                self._note_resume("resumed from a saved state")
        if not self._in_fit:
            self._restored = ladder_state

    # --- a fit ------------------------------------------------------------------------------------------------------
    def begin_fit(self, module: nn.Module, device: torch.device, precision: Optional[PrecisionSwitch], host: Host, *,
                  automatic_optimization: bool = True, estimate_optimizer: Optional[torch.optim.Optimizer] = None,
                  called_module: Optional[nn.Module] = None, first_step: int = 0,
                  recovery: Optional[Any] = None, data_parallel: Optional[nn.Module] = None,
                  alone: Optional[Callable[[], Any]] = None) -> None:
        """Starts a fit clean (a reused guard keeps nothing from the last one) and builds the rungs for ``module``.
        ``estimate_optimizer``: the optimizer the estimate builds a like one of (``None``: a LightningModule's
        ``configure_optimizers``); ``called_module``: the module the front door calls where it wraps ``module``;
        ``first_step``: the step counter a resumed run starts at; ``recovery``: how several processes recover an OOM
        together (:class:`~lightning_memguard.adapters.ddp_recovery.DDPRecovery`,
        :class:`~lightning_memguard.adapters.fsdp_recovery.FSDPRecovery`; ``None``: they stop together);
        ``data_parallel``: the module the ranks train through (a DistributedDataParallel module: its gradient buckets
        are in every estimate of this rank's step); ``alone()``: with several processes, what says whether an
        evaluation batch may be split on one rank alone
        (:class:`~lightning_memguard.adapters.ddp_evaluation.EvaluationAlone`), made once, as for
        :meth:`begin_evaluation`."""
        previous_module = self._module
        self.monitor.begin(module, device, host, called_module=called_module, first_step=first_step,
                           data_parallel=data_parallel)
        self.ranks = Ranks.of(host)
        if self.ranks.world_size > 1 and self.settings.rescue_oom and automatic_optimization:
            self.ranks.recovery = recovery
        if alone is not None and self.ranks.world_size > 1:  # no gradients: whatever the step's optimization
            self.ranks.evaluation = alone()
        self._begin_attempts(module, device)
        self._long_batches.begin()
        self._module, self._device, self._automatic = module, device, automatic_optimization
        # what the estimates start from: a run already in mixed precision is predicted in it
        self._precision = getattr(precision, "base_precision", "32-true")
        self._estimate_optimizer = estimate_optimizer
        self._data_parallel = data_parallel_of(data_parallel)  # a tuple: the module is not held beyond the fit's start
        self._waits_for_every_parameter = waits_for_every_parameter(data_parallel)
        self._unused_reduced = UnusedReduced.of(data_parallel if data_parallel is not None else module)
        self._planned = False
        self._local_retries: Optional[int] = None
        # A checkpoint's levels, else (a second fit of the same model, on this Trainer or another) the levels the last
        # fit ended at: the run goes on where it was, and the state it saves is what runs
        state, how = self._restored, "resumed from a saved state"
        if state is None and module is previous_module and self.ladder.policy is not None:
            state, how = self.ladder.state_dict(), "a further fit of the same model"
        # what the first batch's estimate predicts for (asked at every batch: worked out once)
        self._estimate_target = ("cuda" if device.type == "cuda" else "cpu") if self.guarding else None
        # without a retry the threshold alone must keep every rung ahead: micro-batching may not wait for an OOM
        # the speed trial times steps on one process only: ranks would each measure their own and could disagree
        timed = self.settings.speed_trial and self.ranks.world_size == 1 and automatic_optimization
        # the segments a rescue reads are this rank's own estimate (the ranks agree on the allocated peaks only): with
        # several processes ranks could choose different levels from them, so they are read with one only
        self.ladder.setup(module, device, precision, automatic_optimization, state, guarding=self.guarding,
                          rescue=self.can_retry, speed_trial=timed, capped=self._capped and self.ranks.world_size == 1)
        self._step_began = self._step_seconds = None
        self._restored, self._in_fit, self._resume_notice = None, True, None
        if state:
            self._note_resume(how)
        if self.settings.rescue_oom and not automatic_optimization and self.ranks.world_size > 1 and self.guarding:
            self.host.warn("lightning-memguard: OOM rescue under manual optimization needs one process (the ranks "
                           "cannot agree on running again a step they run themselves), so it is off for this run.")
        elif self.settings.rescue_oom and automatic_optimization and not self.ranks.can_retry:
            self.host.warn(Ranks.NO_RETRY_WARNING)

    def start(self, optimizers: Callable[[], list], files_dir: Optional[str],
              first_step: Optional[int] = None) -> None:
        """Opens the sources and the run's files (``files_dir``: ``None`` writes none). ``optimizers`` returns the
        run's optimizers when asked (the CPU accountant counts their state); ``first_step``: the step the fit starts
        at, where :meth:`begin_fit` was not told (a further fit goes on in the last one's files:
        :meth:`~lightning_memguard.monitor.monitor.MemoryMonitor.start`)."""
        s = self.settings
        self.monitor.start(optimizers, files_dir, {"threshold": s.threshold, "mitigations": list(self.ladder.names)},
                           first_step)

    def stop(self) -> None:
        """Idempotent: flushes everything and releases the sources (end of training, exception or teardown)."""
        if self._unused_reduced is not None:  # the model reduces as the user set it after the fit
            self._unused_reduced.restore()
        self.monitor.stop()
        self.ladder.close()
        self._in_fit = False
        # the ranks' reduction closes over the framework's objects: let it go
        self.ranks = self.attempts.ranks = Ranks()

    def on_exception(self, error: Optional[BaseException] = None) -> None:
        """One more row (phase ``exception``) with the memory at that moment, after the rows of the unfinished
        step. An ``error`` of a collective whose peer gave up gets that rank's report (a note, a ``gave_up`` event)."""
        self.monitor.on_exception()
        # not an Exception (Ctrl-C, SystemExit): the user's doing, not a peer's; the store is not asked (it may wait)
        if not isinstance(error, Exception) or isinstance(error, torch.OutOfMemoryError) or self.ranks.world_size == 1:
            return
        report = self.ranks.peer_report()
        if report is not None:
            rank, _, text = report.partition(": ")
            self.attempts.record(Decision(step=self.step, action="gave_up", reason=(
                f"{rank} ran out of memory and could not be rescued ({text.splitlines()[0]}); this rank stopped with "
                f"{type(error).__name__} at its next collective with it")), self.monitor.capacity_bytes())
            error.add_note(f"lightning-memguard: {report}")

    # --- one optimizer step -----------------------------------------------------------------------------------------
    def batch_start(self, step: int, batch: Any, loss_fn: Optional[Callable] = None) -> None:
        """The first boundary of optimizer step ``step`` (on the step axis of the run's own metrics). ``loss_fn``
        (``(model, batch) -> loss``) is how the estimate runs the step, where the model is not a LightningModule. A
        batch larger than the last one measured is predicted first, and runs as micro-batches, that batch only, where
        it is predicted not to fit whole (:class:`~lightning_memguard.guard.long_batch.LongBatches`)."""
        if self._resume_notice is not None:  # now that the run's files are open and the step is known
            self.attempts.record(Decision(step=step, action="resume", reason=self._resume_notice), None)
            self._resume_notice = None
        ladder, monitor = self.ladder, self.monitor
        # no batch in hand (a step that fetches its own: Lightning hands the hooks the batch fetched last, at the first
        # step none): the first batch start that has one notes it and plans
        if batch is not None and not (ladder.batch_seen and self._planned):
            # the estimates and the plan, one burst of short-lived objects (base/collection.py); the collectives the
            # step issues in its estimates are its own (a recovery counts them: an OOM must not shadow what the other
            # ranks wait in)
            counted = getattr(self.ranks.recovery, "estimates_counted", None)
            ran = lambda: ladder.predictor.predictions is not None  # noqa: E731 - the step's estimate ran it through
            with collection_paused(), counted(ran) if counted is not None else nullcontext():
                if not ladder.batch_seen:
                    self._note_batch(batch, loss_fn)
                if not self._planned:
                    self._plan(step, batch, loss_fn)  # before counting starts: the estimate's own memory is not ours
        if self._automatic and monitor.guarding:
            # a batch predicted not to fit whole runs as micro-batches, this batch only (guard/long_batch.py);
            # predicted before counting starts, its cost outside the step
            capacity = monitor.capacity_bytes()
            # a rank splits its own batch alone under DDP (its gradients are reduced once, after the last part) and
            # FSDP2 once a step showed its collectives (a rank whose parts ran meets the others' in shadow parts)
            ranks = self.ranks  # one process: nothing to agree on (no property asked a step)
            together = None if ranks.world_size == 1 or ranks.splits_alone else ranks.reduce_max
            decision = self._long_batches.before_batch(step, batch, ladder, capacity, together, monitor.host.warn)
            if decision is not None:
                self.attempts.record(decision, capacity)
        monitor.batch_start(step, batch)
        speed = ladder.speed
        if speed is not None and speed.timing:  # most steps: not timed, no synchronisation
            self._step_began = self._clock()

    def batch_fetched(self, batch: Any, loss_fn: Optional[Callable] = None) -> None:
        """The batch a step that fetches its own batches fetched in an attempt that failed, where no batch start has
        shown one yet (Lightning hands such a step's hooks none at its first step): the ladder notes it now, so that
        the rescue of this attempt predicts what fits, as at any other step, rather than climbing a rung an OOM. The
        plan waits for the next batch start. One process only: the ranks of several note a batch together."""
        if batch is None or self.ladder.batch_seen or self.ranks.world_size > 1 or not self.guarding:
            return
        with collection_paused():
            self._note_batch(batch, loss_fn)

    def _note_batch(self, batch: Any, loss_fn: Optional[Callable]) -> None:
        """The first batch of a fit tells the ladder how far it can split and what each level will need (the ranks'
        worst, with several)."""
        self.ladder.note_batch(batch, self._module, self._estimate_target, self._estimate_optimizer, loss_fn,
                               self.ranks.reduce_max, self._precision, self._data_parallel)

    def boundary(self, phase: str) -> None:
        """Reads the source at ``after_forward`` or ``after_backward``; after a backward, with ranks that recover
        together, fails this attempt when another rank's ran out of memory (see
        :meth:`~lightning_memguard.guard.attempts.Attempts.check_peers`). Where the ranks hear each other's news, a
        forward whose peak reached the policy's line is news the same step's backward carries, so that the ranks
        decide on it at this step's end rather than the next's. Where this rank's parts of the batch have all run
        while another rank's have not (FSDP2), it runs shadow parts here until none has parts left
        (:meth:`~lightning_memguard.guard.ranks.Ranks.part_ran`)."""
        self.monitor.boundary(phase)
        if phase == "after_forward" and self.ranks.hears_news:
            self._forward_news()
        elif phase == "after_backward" and self.ranks.recovery is not None:
            self.attempts.check_peers()
            ranks = self.ranks
            while ranks.part_ran():  # another rank's batch has parts left, this rank's has none: FSDP2's collectives
                ranks.recovery.shadow_part()
                self.attempts.check_peers()  # a rank that ran out of memory meanwhile fails this attempt too

    def _forward_news(self) -> None:
        monitor, policy = self.monitor, self.ladder.policy
        if policy is None or self._long_batches.split_step == monitor.step:  # split once: not the levels' doing
            return
        peak, capacity = monitor.peak_at("after_forward"), monitor.capacity_bytes()
        if peak is not None and capacity is not None and peak >= policy.limit_bytes(capacity):
            self.ranks.recovery.say(True)  # said until the ranks have agreed (Ranks.step_numbers)

    def step_end(self, stopping: bool = False) -> Optional[dict[str, float]]:
        """After the optimizer step: the step's rows, the policy's decisions and, every ``log_every_n_steps`` (or
        when ``stopping``), the metrics to the loggers. Returns the metrics logged now, else ``None``."""
        self.ladder.step_ran()  # before the policy changes rungs again: the step ran with those it had
        began, self._step_began = self._step_began, None
        self._step_seconds = self._clock() - began if began is not None else None
        return self.monitor.step_end(stopping)

    def _clock(self) -> float:
        """Seconds on a monotonic clock once the device has finished what was queued: on CUDA the step end does not
        wait for the kernels (nothing in it synchronises), so a timed step waits for them at both ends."""
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def outside_steps_ended(self) -> None:
        """Work that ran between the measured steps, not one of them (a learning-rate search's trial steps in the
        middle of a fit), ended: a new peak window starts, so that the next step's ``batch_start`` peak is its own."""
        self.monitor.peak_since_boundary()

    def split_batch(self, batch: Any) -> list[tuple[Any, float]]:
        """The parts the front door runs ``batch`` as now, each with the factor its loss is multiplied by (what the
        loss averages over, :class:`~lightning_memguard.mitigations.microbatch.MicroBatching`); ``[(batch, 1.0)]``
        while the micro-batch rung is off and the batch is not predicted too large to run whole. Asked at the start of
        every attempt of a batch."""
        self.monitor.begin_attempt()
        parts = self.ladder.parts.split(batch)
        self.ranks.begin_parts(len(parts))
        if self._unused_reduced is not None:  # FSDP2: every rank's parts reduce the same parameters
            self._reduce_unused_in(len(parts))
        return parts

    def _reduce_unused_in(self, parts: int) -> None:
        try:
            self._unused_reduced.split(parts)
        except Exception as err:  # torch's switch refused: the step as it was, said once (never the run's end)
            self._unused_reduced = None
            self.host.warn(f"lightning-memguard: could not have FSDP2 reduce a zero for parameters without a gradient "
                           f"in micro-batched steps ({type(err).__name__}: {err}); a parameter that only some ranks' "
                           "parts reach may then be reduced with another's gradient")

    def last_part_loss(self, loss: Any) -> Any:
        """The loss of a split step's last micro-batch, before its backward (each front door's, once a step). Under
        DDP without ``find_unused_parameters`` only that backward all-reduces, and it waits for every parameter's
        gradient: a parameter the earlier parts reached and this one does not gets a zero-valued term
        (:mod:`~lightning_memguard.mitigations.ddp_reach`), else the ranks would fail or hang where plain DDP
        trains. Elsewhere ``loss`` itself."""
        if not self._waits_for_every_parameter or not isinstance(loss, torch.Tensor) or self._module is None:
            return loss
        try:
            return reaching_every_parameter(loss, self._module.parameters())
        except Exception as err:  # a graph it cannot walk: the part as it was, said once (never the run's end)
            self._waits_for_every_parameter = False
            self.host.warn(f"lightning-memguard: could not make the last micro-batch reach every parameter DDP waits "
                           f"for ({type(err).__name__}: {err}); where that part misses one, set "
                           "find_unused_parameters=True on the DDP strategy")
            return loss

    def running_buffers(self) -> Optional[RunningBuffers]:
        """The model's running buffers, saved before each attempt of a batch and put back after a failed one."""
        return RunningBuffers(self._module, self.host.warn) if self._module is not None else None

    # --- deciding ---------------------------------------------------------------------------------------------------
    def _guard(self, snapshots: list[MemorySnapshot]) -> None:
        """Between two optimizer steps (the monitor's ``on_step``): hand the step's peaks to the policy and carry
        out what it decides."""
        last = snapshots[-1]
        capacity, ladder = last.capacity_bytes, self.ladder
        policy = ladder.policy
        if capacity is None or policy is None or last.peak_bytes is None:  # None: not counted
            return
        # one pass over the step's rows (this runs on the training thread after every step)
        peaks, start, end = {}, None, None
        for snap in snapshots:
            phase = snap.phase
            peaks[phase] = snap.peak_bytes
            if phase == "batch_start":
                start = snap.allocated_bytes
            elif phase == "after_optimizer_step":
                end = snap.allocated_bytes
        monitor = self.monitor
        # without the gradients (see StepObservation): alive at batch start under Lightning, not in a plain loop
        static = start - monitor.gradients_at_start if start is not None else None  # without_gradients_at_start
        gradients = monitor.gradient_bytes()
        held_after = end - gradients if end is not None else None
        split = self._long_batches.split_step == snapshots[0].step  # ran split once: not the levels' doing
        ranks = self.ranks
        if ranks.reduce_max is None:  # one process: its own numbers, as step_numbers returns them (no call a step)
            numbers = (peaks, static, last.alloc_retries, held_after, int(split))
        else:  # every rank must decide the same: on the worst rank's numbers, where and when every rank decides
            numbers = ranks.step_numbers(peaks, static, last.alloc_retries, held_after, int(split),
                                         due=policy.judging,
                                         news=ranks.world_size > 1 and self._has_news(peaks, last, capacity, split))
        if numbers is None:  # no rank had news: nothing to decide; the step is this rank's reference for long batches
            observation = StepObservation.of_step(snapshots[0].step, peaks, capacity, static, last.alloc_retries,
                                                  held_after)
            self._long_batches.after_step(observation, ladder.levels, monitor.gradients_at_start, gradients)
            return
        peaks, static, retries, held_after, split = numbers
        observation = StepObservation.of_step(snapshots[0].step, peaks, capacity, static, retries, held_after)
        levels = ladder.levels  # a new dict, read by both (neither changes it)
        if not self._long_batches.after_step(observation, levels, monitor.gradients_at_start, gradients) or split:
            policy.pass_over(observation)  # a batch split once (on any rank): its peaks are not the levels' doing
            return
        decisions = ladder.after_step(observation, levels, self._step_seconds)
        for decision in decisions:  # most steps: none
            self.attempts.record(decision, capacity)

    @property
    def _capped(self) -> bool:
        """Whether the capacity caps what the CUDA caching allocator reserves: a budget= is a line; without one, on
        CUDA, the capacity is the card's or a memory fraction's cap."""
        return self._device.type == "cuda" and self.settings.budget is None

    def _has_news(self, peaks: dict[str, int], last: MemorySnapshot, capacity: int, split: bool) -> bool:
        """Whether this rank's step is news for the other ranks: its peak reached the policy's line, or its allocator
        retried since its last step (a step split once is not: its peaks are not the levels' doing)."""
        retries, before, self._local_retries = last.alloc_retries, self._local_retries, last.alloc_retries
        retried = retries is not None and before is not None and retries > before
        return not split and (retried or max(peaks.values()) >= self.ladder.policy.limit_bytes(capacity))

    def _plan(self, step: int, batch: Any, loss_fn: Optional[Callable]) -> None:
        """The plan before the first step: with ``plan_at_start=True``; by default where the ladder's estimate of the
        first batch predicts the step does not fit (guard/planning.py); never with ``False``."""
        self._planned = True
        asked = self.settings.plan_at_start
        if asked is False:
            return
        capacity = self.monitor.capacity_bytes()
        beside = self._held_beside_step(batch, capacity)
        room = capacity - beside if beside else capacity  # what the step itself may use
        capped = self._capped
        if asked is None and not (self.guarding and needs_plan(self.ladder, room, capped, beside)):
            return
        decisions = plan_at_start(self.ladder, self._module, batch, room, step,
                                  cuda=self._device.type == "cuda", optimizer=self._estimate_optimizer,
                                  loss_fn=loss_fn, precision=self._precision, reduce_max=self.ranks.reduce_max,
                                  warn=self.host.warn, asked=bool(asked), capped=capped, beside_bytes=beside,
                                  data_parallel=self._data_parallel)
        for decision in decisions:  # what no rung can help is said as a warning too: the run is likely to end
            self.attempts.record(decision, capacity, warn=decision.action == "cannot_help")

    def _held_beside_step(self, batch: Any, capacity: Optional[int]) -> int:
        """What the run holds beside the step at its first batch (data the model keeps, another model or averaged
        weights on the device), which the step's estimate does not count and the plan must leave room for; 0 below
        1 % of the capacity, with several processes (each rank plans from the worst rank's estimate), or where it
        is not less than the capacity (then the closed loop, which measures it, decides). On CUDA the runtime's
        workspaces, which the estimate counts itself, are taken off: a sanity check may have made them already."""
        if capacity is None or self.ranks.world_size != 1 or not self.guarding:
            return 0
        held = held_beside_step(self.monitor.source, self._module, self.monitor.optimizers, batch,
                                self.host.held_elsewhere)
        predictions = self.ladder.predictor.predictions
        if self._device.type == "cuda" and predictions is not None:
            held -= predictions.sizes.get("runtime", 0)
        return held if 0.01 * capacity < held < capacity else 0

    def _note_resume(self, how: str) -> None:
        """A run goes on at levels it did not reach itself: one ``resume`` event at its next batch says which."""
        levels = {name: level for name, level in self.ladder.levels.items() if level}
        if levels:
            self._resume_notice = (f"{how}: the run goes on at "
                                   + ", ".join(f"{name} {level}" for name, level in levels.items()))

    # --- out of memory ----------------------------------------------------------------------------------------------
    def train_batch(self, attempt_batch: Callable[[], Any], state: BatchState, *, release: Callable[[], None],
                    first_micro_batch: bool = True) -> Any:
        """Runs a training batch's forward and backward (``attempt_batch``) through the one attempt loop, with the
        settings' retries: :meth:`~lightning_memguard.guard.attempts.Attempts.train` (arguments as there). Under
        manual optimization (the step runs forward, backward and its optimizers itself) the batch runs again, after an
        OOM or a rung that broke it, only where no optimizer stepped yet and its backwards began on empty gradients;
        an OOM only in one process (the ranks of several have no way to agree inside a step they run themselves)."""
        return self.attempts.train(attempt_batch, state, first_micro_batch=first_micro_batch, release=release,
                                   max_retries=self.settings.max_retries, rescue=self.can_retry)

    # --- evaluation -------------------------------------------------------------------------------------------------
    def evaluation_parts(self, phase: str) -> int:
        """The parts the loop ``phase`` runs its batches in now (1: whole)."""
        return self.ladder.parts.evaluation.get(phase, 1)

    def begin_evaluation(self, phase: str, module: nn.Module, device: torch.device, host: Host,
                         files_dir: Optional[str], *, called_module: Optional[nn.Module] = None,
                         alone: Optional[Callable[[], Any]] = None) -> bool:
        """Starts measuring an evaluation that runs with no fit in progress (Lightning's ``validate``, ``test`` or
        ``predict``; a loop that evaluates before it trains): sources and files, no rungs. Its files carry the loop's
        name (``memguard_test_history.csv``), so a fit's are not overwritten. ``alone()``: with several processes, what
        says whether a batch may be split on one rank alone
        (:class:`~lightning_memguard.adapters.ddp_evaluation.EvaluationAlone`), made once. Returns False, doing
        nothing, inside a fit (its evaluation uses the fit's monitor) or an evaluation already begun."""
        if self._in_fit or self._evaluating:
            return False
        self.monitor.begin(module, device, host, called_module=called_module, files_name=phase)
        self.ranks = Ranks.of(host)
        if alone is not None and self.ranks.world_size > 1:
            self.ranks.evaluation = alone()
        self._begin_attempts(module, device)
        self.monitor.start(list, files_dir, {"evaluation": phase})
        self._evaluating = True
        return True

    def end_evaluation(self) -> None:
        """Ends what :meth:`begin_evaluation` began (flushes and releases); the results stay. Idempotent."""
        if self._evaluating:
            self._evaluating = False
            self.stop()

    def evaluation_batch(self, phase: str, batch: Any, call: StepCall, savepoint: Optional[Savepoint] = None) -> Any:
        """Runs one batch of the loop ``phase`` through ``call(part, share) -> outputs``, measured (one history row)
        and rescued by :meth:`~lightning_memguard.guard.attempts.Attempts.evaluate` (arguments and errors as there);
        returns the whole batch's outputs."""
        self.monitor.evaluation_start(phase, batch)
        parts = None
        try:
            output, parts = self.attempts.evaluate(phase, batch, call, rescue=self.settings.rescue_oom,
                                                   savepoint=savepoint)
        finally:
            self.monitor.evaluation_end(phase, parts)
        return output

    def _begin_attempts(self, module: nn.Module, device: torch.device) -> None:
        """The attempt loop for a fit or an evaluation of ``module``: an evaluation batch's parts are weighed as
        training's micro-batches are, by what the loss averages over (:class:`MicroBatching`), so that a
        transformers model's evaluation loss comes back as the unsplit batch's."""
        self.attempts.begin(module, self.ranks, cuda=device.type == "cuda")
        self.attempts.split_evaluation = MicroBatching(module, weight=self.settings.microbatch_weight,
                                                       warn=self._warn).split
        # a split batch's generated rows are padded to one length with the model's pad id, as generate() pads a batch
        self.attempts.pad_value, self.attempts.warn = generation_pad_id(module), self._warn
