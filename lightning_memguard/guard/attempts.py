"""The one attempt loop. Every batch a front door runs — a training batch's forward and backward, an evaluation
batch — runs through :func:`run_attempts`, and :class:`Attempts` decides what a failure leads to: the next rung (or
a one-off split) and the same batch again, an evaluation batch in twice as many parts, or the memory report and the
end of the run (one give-up, one report format). Framework-free."""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from ..base.batches import NO_SAMPLES, batch_size_of
from ..base.buffers import RunningBuffers
from ..base.step_signature import ITERATOR_PARAMETER
from ..base.outputs import combine_outputs
from ..base.optimizer_step import steps_one_parameter_at_a_time
from ..base.randomness import save_random_state
from ..base.snapshot import EVALUATION_PHASES, Event
from ..monitor.fragmentation import Fragmentation
from ..monitor.monitor import MemoryMonitor
from ..monitor.report import oom_report, optimizer_oom_texts
from ..sources.training_state import training_state_bytes
from .evaluation_parts import EvaluationParts
from .ladder import Ladder
from .long_batch import LongBatches
from .oom import MemGuardOutOfMemoryError, OomFailure, error_line, free_cached_memory, is_oom
from .policy import Decision, StepObservation
from .ranks import PeerOutOfMemoryError, PeerRungError, Ranks

__all__ = ["BatchState", "run_attempts", "Attempts", "StepCall", "Savepoint"]

#: ``call(part, share) -> outputs``: an evaluation step on one part of the batch (the whole batch, share 1.0, when it
#: runs in one part); ``share`` is the part's weight in a mean over the whole batch (the shares add up to 1)
StepCall = Callable[[Any, float], Any]
#: called before each attempt of an evaluation batch; returns the function that undoes what a failed attempt logged
Savepoint = Callable[[], Callable[[], None]]


class BatchState:
    """Where an attempt of one training batch got to: set by the front door as forward and backward run.
    ``buffers``: the model's running buffers, saved before every attempt and put back after a failed one.
    ``savepoint``: saves what the training step updates beside the model (its metrics, the values it logged) before
    every attempt that may run again, and returns what puts that back after a failed one (a front door's; ``None``:
    nothing to save). ``parts_done``: the parts of a split attempt whose forward and backward completed (counted by a
    front door that says whether the training step has collectives of its own:
    :attr:`~lightning_memguard.guard.ranks.Ranks.step_collectives`). ``stepped``: an optimizer stepped inside the
    attempt (a training step that optimizes manually): what it changed cannot be undone, so the attempt never runs
    again. ``may_run_again``: whether a failed attempt of this batch may run again (set before each attempt)."""

    def __init__(self, buffers: Optional[RunningBuffers] = None, savepoint: Optional[Savepoint] = None) -> None:
        self.in_backward = False
        self.partial_gradients = False
        self.stepped = False
        self.may_run_again = False
        self.parts_done = 0
        self.buffers = buffers
        self.savepoint = savepoint
        # the parameters this attempt's backwards may have added to, each without a gradient before (None: no
        # backward tracked); a gradient from before the attempt, which a failed backward may have added to, rules out
        self._emptied: Optional[list[torch.Tensor]] = None
        self._ruled_out = False

    def reset(self) -> None:
        self.in_backward = self.partial_gradients = self.stepped = self.may_run_again = False
        self.parts_done = 0
        self._emptied, self._ruled_out = None, False

    def backward_begins(self, parameters: Iterable[torch.Tensor]) -> None:
        """A backward of a training step that runs its optimizers itself begins. Where every parameter it can add to
        (``requires_grad``) has no gradient, or one an earlier backward of this attempt made, a failed attempt can
        empty them again (:meth:`empty_gradients`) and run again: the usual step zeroes its gradients to ``None``
        before its backward. One gradient from before the attempt (summed over batches) rules that out."""
        if self._ruled_out:
            return
        emptied = self._emptied if self._emptied is not None else []
        known = {id(p) for p in emptied}
        for p in parameters:
            if p.requires_grad and id(p) not in known:
                if p.grad is not None:
                    self._emptied, self._ruled_out = None, True
                    return
                emptied.append(p)
        self._emptied = emptied

    @property
    def gradients_undoable(self) -> bool:
        """Whether :meth:`empty_gradients` puts back every gradient a failed attempt's backwards added to."""
        return self._emptied is not None

    def empty_gradients(self) -> None:
        for p in self._emptied or ():
            p.grad = None

    def failure(self, error: str, *, first_micro_batch: bool, attempt: int,
                max_retries: Optional[int]) -> OomFailure:
        """What this attempt's failure with ``error`` was: the one description that says whether the batch may run
        again (:attr:`OomFailure.may_run_again`), whether the error was an OOM or a rung that broke the step. A
        backward that began on empty gradients added nothing :meth:`empty_gradients` does not take back, so it counts
        as the first of its window."""
        return OomFailure(phase="backward" if self.in_backward else "forward",
                          first_micro_batch=first_micro_batch or self.gradients_undoable, error=error,
                          attempt=attempt, max_retries=max_retries, partial_gradients=self.partial_gradients,
                          stepped=self.stepped)


#: set on an error raised while an evaluation batch's parts' outputs were put together (every part had run)
_COMBINING = "_memguard_combining_outputs"


def run_attempts(attempt: Callable[[], Any], on_oom: Callable[[str, bool], None], *,
                 before: Optional[Callable[[], Optional[Callable[[], None]]]] = None,
                 on_error: Optional[Callable[[str], bool]] = None, rescue: bool = True,
                 oom_count: Optional[Callable[[], Optional[int]]] = None, ooms_before: Optional[int] = None) -> Any:
    """Runs ``attempt()`` until it returns. ``before()`` runs before each attempt and may return what undoes a
    failed one. After an out-of-memory error (when ``rescue``) the failed attempt's frames are cleared (they hold its
    graph: outputs, loss, saved activations), the undo runs, cached memory is freed, and ``on_oom(error line,
    combining)`` decides: it returns to run the batch again, or raises the report (``combining``: the error came
    while an evaluation batch's outputs were put together). Another error runs again only where ``on_error(error
    line)`` returns True (a rung that broke the step was reverted).

    ``oom_count()`` (CUDA: the allocator's count of out-of-memory errors, read only after an error) and
    ``ooms_before`` (that count when the batch began) make an error an OOM when the allocator counted one during the
    attempt, whatever reached Python: on an H100 an OOM inside a checkpointed bf16 forward, while the allocator's
    history was recorded, came out as ``SystemError: ... returned NULL without setting an exception``."""
    while True:
        undo = before() if before is not None else None
        try:
            return attempt()
        except Exception as err:
            if isinstance(err, MemGuardOutOfMemoryError):
                raise
            oom, combining = is_oom(err), getattr(err, _COMBINING, False)
            if oom_count is not None:
                now = oom_count()
                oom = oom or (now is not None and ooms_before is not None and now > ooms_before)
                ooms_before = now
            if (oom and not rescue) or (not oom and (on_error is None or not on_error(error_line(err)))):
                raise
            line = error_line(err)
            traceback.clear_frames(err.__traceback__)
            del err
        if undo is not None:
            undo()
        free_cached_memory()
        if oom:
            on_oom(line, combining)


class Attempts:
    """What the out-of-memory errors of one guard's batches lead to, and the attempt loops that meet them.

    Args:
        ladder: the rungs to climb and the parts batches run in (``ladder.parts``).
        monitor: what was measured (the peak at a failure, the step's start), where events and files go.
    """

    def __init__(self, ladder: Ladder, monitor: MemoryMonitor, long_batches: Optional[LongBatches] = None) -> None:
        self.ladder = ladder
        self.monitor = monitor
        #: a batch split once for its size runs again in more parts, that batch only (``None``: the ladder decides)
        self.long_batches = long_batches
        self.module: Optional[nn.Module] = None
        self.ranks, self.cuda = Ranks(), False
        #: how an evaluation batch is cut and its parts weighed (``(batch, k) -> [(part, share)]``, set per fit)
        self.split_evaluation: Optional[Callable[[Any, int], list]] = None
        #: what rows of token ids a split evaluation batch's parts generated are padded with to one length (the
        #: model's generation pad id; ``None``: listed), and who warns, once a run, where the parts' rows stay a list
        self.pad_value: Optional[int] = None
        self.warn: Optional[Callable[[str], None]] = None
        self._warned_listed = False
        self._agreed: Optional[list[int]] = None  # the ranks' numbers for the failure in progress, where agreed
        #: this rank's numbers (and last error) for the OOMs it rescued alone since the ranks last raised the ladder
        self._alone: Optional[tuple[list[int], str]] = None
        self._first_micro_batch = True  # whether the training batch in progress begins its accumulation window
        #: at this rank's OOM: whether the training step's own collectives had all run in the failed attempt (it ran
        #: out of memory in the backward of its last part; see Ranks.step_collectives)
        self._step_ran = False
        #: said on the error that ends the run where a rung that broke a step could not be put back (several ranks)
        self.rung_error_note: Optional[str] = None

    def begin(self, module: nn.Module, ranks: Ranks, cuda: bool = False) -> None:
        """A fit (or an evaluation on its own) of ``module`` in these processes (several cannot run a batch again);
        ``cuda``: on a CUDA device, whose allocator counts its out-of-memory errors."""
        self.module, self.ranks, self.cuda = module, ranks, cuda
        self._alone = None  # an OOM rescued alone in a window an earlier fit ended in is no part of this one

    # --- a training batch -------------------------------------------------------------------------------------------
    def train(self, attempt_batch: Callable[[], Any], state: BatchState, *, first_micro_batch: bool,
              release: Callable[[], None], max_retries: Optional[int], rescue: bool) -> Any:
        """Runs a training batch's forward and backward (``attempt_batch``) until it returns. After an OOM
        ``release`` frees what the front door holds (partial gradients), the running buffers, the step's metrics and
        torch's random number generators are put back, then :meth:`on_oom` climbs or gives up. Another error runs the
        batch again where :meth:`on_rung_error` reverted a rung, and only where no gradient of it was added to an
        accumulation window's sum (``first_micro_batch``: the gradients are zeroed before this batch's backward, so a
        failed attempt's partial gradients are harmless; or its backwards began on empty gradients, emptied again:
        :meth:`BatchState.backward_begins`) and no optimizer stepped in it (``state.stepped``: a step that optimizes
        manually).

        With several processes, an error of a collective after another rank gave up (its process ended) stops this
        rank with that rank's report (:class:`MemGuardOutOfMemoryError`), not the collective's closed connection."""
        attempts = 0
        self._first_micro_batch = first_micro_batch
        restore_metrics: list[Callable[[], None]] = []
        restore_random: list[Callable[[], None]] = []

        def before() -> Callable[[], None]:
            state.reset()
            if self.ranks.recovery is not None:
                self.ranks.recovery.begin_attempt()
            if state.buffers is not None:
                state.buffers.save()
            # a batch run again must count once in the step's metrics and draw what it drew: saved only where a failed
            # attempt may run again (after an OOM, or after an error of a rung not yet tried, which is then reverted)
            again = state.may_run_again = rescue or self.ladder.untried
            restore_metrics[:] = [state.savepoint()] if state.savepoint is not None and again else []
            restore_random[:] = [save_random_state(python=False)] if again else []
            return undo

        def undo() -> None:
            release()
            if state.gradients_undoable:  # a manual step's backward began on empty gradients: empty again
                state.empty_gradients()
            if state.buffers is not None:
                state.buffers.restore()
            for restore in restore_metrics + restore_random:  # the retry counts once and draws what the attempt drew
                restore()

        def failure(line: str) -> OomFailure:
            # whether the step's own collectives had all run (the backward of its last part): the ranks' recovery asks
            self._step_ran = state.in_backward and state.parts_done >= self.ranks.parts - 1
            return state.failure(line, first_micro_batch=first_micro_batch, attempt=attempts, max_retries=max_retries)

        def on_error(line: str) -> bool:
            failed = failure(line)
            return failed.may_run_again and self.on_rung_error(line, failed.phase)

        def on_oom(line: str, combining: bool) -> None:
            nonlocal attempts
            attempts += 1
            self.on_oom(failure(line))

        # on CUDA the allocator's count of OOMs tells an OOM that reached Python as another error: the count at the
        # batch-start boundary (no read), against a reading taken only after an error
        recorder = self.monitor.recorder
        before_batch = recorder.pending_ooms("batch_start") if self.cuda and recorder is not None else None
        try:
            result = run_attempts(attempt_batch, on_oom, before=before, on_error=on_error, rescue=rescue,
                                  oom_count=self._allocator_ooms if self.cuda else None, ooms_before=before_batch)
            complete = getattr(self.ranks.recovery, "attempt_complete", None)
            if complete is not None:  # what the step's own collectives are, for an OOM in a later attempt
                complete(self.ranks.parts)
            if self.ladder.searching:  # it ran with one of the rungs changed together put back: that one broke it
                capacity = self.monitor.capacity_bytes()
                for decision in self.ladder.broken_rung_found(self.monitor.step):
                    self.record(decision, capacity, warn=True)
            return result
        except Exception as err:
            if self.rung_error_note is not None:  # a rung that broke the step could not be put back: this rank's own
                err.add_note(self.rung_error_note)
                self.ranks.say_rung_error(f"{error_line(err)} ({self.rung_error_note})")
                self.rung_error_note = None
            elif self.ranks.world_size > 1 and not isinstance(err, torch.OutOfMemoryError):
                self._stop_with_peer(err)
            raise

    def _stop_with_peer(self, error: Exception) -> None:
        """After ``error`` (a collective's, most likely) on a rank of several: where another rank gave up (its report
        is posted), this rank stops with that report, recorded as its own end (a ``gave_up`` event, the report file).
        A rank that gives up alone (see :meth:`_together`) ends its process, and the others' next collective fails."""
        posted = self.ranks.peer_report()
        if posted is None:
            self._note_peer_rung_error(error)
            return
        rank, _, text = posted.partition(": ")
        monitor = self.monitor
        self.record(Decision(step=monitor.step, action="gave_up", phase="after_backward", reason=(
            f"{rank} ran out of memory and could not be rescued ({text.splitlines()[0]}); this rank stopped with "
            f"its report at its next collective with it (that collective's error is this one's cause)")),
                    monitor.capacity_bytes())
        monitor.keep_failure(text)
        raise MemGuardOutOfMemoryError(text, {"text": text, "rank": rank}) from error

    def _note_peer_rung_error(self, error: Exception) -> None:
        """Where another rank ended with an error of its own in a step with rungs the guard changed, which the ranks
        could not put back together (:meth:`_rung_error_together`): ``error`` (this rank's: most often its next
        collective's, which the other's ending closed) gets a note saying so, and a ``gave_up`` event records it."""
        posted = self.ranks.peer_rung_error()
        if posted is None:
            return
        rank, _, text = posted.partition(": ")
        why = (f"{rank} ended with an error other than out of memory in a step run with rungs the guard had changed, "
               f"which the ranks could not put back and run again together, and this rank stopped with it. {rank}'s "
               f"error: {text}")
        self.record(Decision(step=self.monitor.step, action="gave_up", phase="after_backward", reason=why),
                    self.monitor.capacity_bytes())
        error.add_note(f"lightning-memguard: {why}")

    def _allocator_ooms(self) -> Optional[int]:
        source = self.monitor.source
        try:
            return source.read(reset_peak=False).num_ooms if source is not None else None
        except Exception:  # a reading that fails must not change how the error is handled
            return None

    def on_oom(self, failure: OomFailure) -> None:
        """A forward/backward ran out of memory and was released: apply the next rung (the front door runs the batch
        again), or raise :class:`MemGuardOutOfMemoryError` with the report."""
        monitor, step = self.monitor, self.monitor.step
        # not an OOM: a rung broke another rank's step, which it puts back (unless a rank said it cannot run the batch
        # again: then it ends with its error, and every rank stops with the report, below)
        if self._agreed is not None and self._agreed[0] == _RUNG_BROKE and not self._agreed[4]:
            self._agreed = None
            self._put_back_untried(failure.error)
            monitor.forget_attempt()  # the batch runs again: the failed attempt's passes do not count
            return
        peak, capacity = monitor.peak_since_boundary(), monitor.capacity_bytes()
        fragmentation = self.monitor.fragmentation_at(failure.error, peak, capacity, f"after_{failure.phase}")
        for decision in self.ladder.end_search(step, f"out of memory in {failure.phase} of step {step}"):
            self.record(decision, capacity, warn=True)
        why = Ranks.NO_RETRY if not self.ranks.can_retry else failure.why_no_retry
        if self._agreed is not None:  # another rank ran out of memory: whether the ranks run the batch again is agreed
            why = None
        static = monitor.without_gradients_at_start(monitor.allocated_at("batch_start"))
        parts = None  # in one process this rank alone says whether its batch runs again split once
        if self.ranks.recovery is not None and why is None and self._agreed is None:
            if self._run_alone(failure, peak, static, capacity):
                return
        if self.ranks.recovery is not None:  # every rank decides on the same, worst, numbers
            failure, peak, static, capacity, why, parts = self._together(failure, peak, static, capacity, why)
        if why is None:
            observation = StepObservation(step=step, peaks={f"after_{failure.phase}": peak or 0},
                                          capacity_bytes=capacity, static_bytes=static)
            cause = f"out of memory in {failure.phase} of step {step} ({failure.error})"
            long = self.long_batches
            one_off = long.after_oom(step, self.ladder, cause, parts) if long is not None else None
            # one process: the rescue predicts for this batch's size (ranks with batches of their own sizes would
            # choose different levels from the same agreed numbers)
            size = long.batch_size if long is not None and self.ranks.world_size == 1 else None
            decisions = [one_off] if one_off is not None else self.ladder.escalate(observation, cause, size=size)
            for decision in decisions:
                self.record(decision, capacity)
            if decisions:
                monitor.forget_attempt()  # the batch runs again: the failed attempt's passes do not count
                return
            policy = self.ladder.policy
            # the policy's own words where it has any: rungs at their top, reverted, or predicted not to help
            why = (policy.exhausted_reason if policy is not None else "") or "no rung of the ladder can be raised"
        self.give_up(failure.phase, f"after_{failure.phase}", peak, capacity, why, failure.error, fragmentation)

    def check_peers(self) -> None:
        """After a backward on a rank with a recovery
        (:class:`~lightning_memguard.adapters.ddp_recovery.DDPRecovery`,
        :class:`~lightning_memguard.adapters.fsdp_recovery.FSDPRecovery`): when gradients (a DDP bucket, an FSDP2
        reduce-scatter) came back marked by a rank that ran out of memory, the ranks agree (one small collective) and
        this rank's attempt fails too (:class:`~lightning_memguard.guard.ranks.PeerOutOfMemoryError`), so that every
        rank takes the same rung and runs the batch again. A quiet step reads one flag and costs no collective.

        A batch that is not the first of its gradient-accumulation window cannot run again here: the reduction just
        received summed the window's earlier batches' gradients with the failed rank's zeros. The ranks then agree
        that every rank stops, with the same report (:data:`ACCUMULATION_WINDOW`). Where the reduction says instead
        that a rank ran a batch of the window again alone (:meth:`_run_alone`), the ranks raise their ladders
        together (:meth:`_raise_together`)."""
        recovery = self.ranks.recovery
        if recovery is None:
            return
        if not recovery.peer_failed():
            rescued = getattr(recovery, "rescued", None)
            if rescued:
                self._raise_together(recovery)
            elif rescued is False:  # a reduction carried the flag and no rank had rescued a batch alone
                self._alone = None
            return
        monitor = self.monitor
        static = monitor.without_gradients_at_start(monitor.allocated_at("batch_start"))
        # phase: the lowest code, so the maximum over the ranks is the phase the failing rank ran out of memory in
        why = None if self._first_micro_batch else ACCUMULATION_WINDOW
        agreed = recovery.agree(_numbers(0, "forward", monitor.peak_since_boundary(), static, why,
                                         monitor.capacity_bytes(), 0, self._one_off_parts()))
        if agreed[0]:  # else a genuine NaN in a gradient: not ours to act on
            recovery.reset()
            self._agreed = agreed
            if agreed[0] == _RUNG_BROKE:
                raise PeerRungError(f"another rank's {_PHASES[agreed[1]]} of step {monitor.step} failed with the rungs "
                                    "changed since the last step that ran; every rank puts them back and runs the "
                                    "batch again")
            raise PeerOutOfMemoryError(f"another rank ran out of memory in {_PHASES[agreed[1]]} of step "
                                       f"{monitor.step}; every rank runs the batch again")

    def _run_alone(self, failure: OomFailure, peak: Optional[int], static: Optional[int],
                   capacity: Optional[int]) -> bool:
        """Whether this rank runs the batch that ran out of memory again alone, in more parts (this batch only, the
        levels unchanged), with no collective: where the attempt under DistributedDataParallel issued none and added
        no gradient the ranks reduce (:attr:`~lightning_memguard.adapters.ddp_recovery.DDPRecovery.can_run_alone`) —
        a batch of a gradient-accumulation window before its last (``no_sync``: the others go on to their next batch),
        or the window's last, failed before its backward (the others wait in its first gradient reduction, which sums
        nothing before this rank joins it) — and the batch can be split further. The rung the rescue would raise is
        raised on every rank together after the window's last backward, whose reduction carries this rank's flag
        (:meth:`_raise_together`). A batch that begins its window and reduces (no accumulation) runs again on every
        rank, together (:meth:`_together`)."""
        recovery = self.ranks.recovery
        if self.ranks.step_collectives or not getattr(recovery, "can_run_alone", False) \
                or (recovery.reduces and failure.first_micro_batch):
            return False
        monitor, long = self.monitor, self.long_batches
        cause = f"out of memory in {failure.phase} of step {monitor.step} ({failure.error})"
        decision = long.split_alone(monitor.step, self.ladder, cause) if long is not None else None
        if decision is None:
            return False
        self.record(decision, capacity)
        mine = _numbers(_OUT_OF_MEMORY, failure.phase, peak, static, None, capacity, failure.attempt, 0)
        if self._alone is not None:  # an earlier batch of the window too: the worst of them
            mine = [max(a, b) for a, b in zip(self._alone[0], mine)]
        self._alone = (mine, failure.error)
        recovery.say_rescued()
        monitor.forget_attempt()  # the batch runs again: the failed attempt's passes do not count
        return True

    def _raise_together(self, recovery) -> None:
        """After a backward whose reduction said that a rank ran a batch again alone since the last one (every rank
        reads the same flag): the ranks agree in one small collective on the worst numbers of those OOMs, and every
        rank raises the ladder as the rescue would have in one process, so that all run the same levels from the
        next batch on."""
        monitor = self.monitor
        static = monitor.without_gradients_at_start(monitor.allocated_at("batch_start"))
        mine, error = self._alone or (_numbers(0, "forward", 0, static, None, monitor.capacity_bytes(), 0, 0), "")
        self._alone = None
        recovery.rescued = None
        failed, phase, peak, static, _, capacity, _, _ = recovery.agree(mine)
        if not failed:
            return
        phase = _PHASES[phase]
        capacity = -capacity if capacity < 0 else None
        observation = StepObservation(step=monitor.step, peaks={f"after_{phase}": peak}, capacity_bytes=capacity,
                                      static_bytes=static - 1 if static > 0 else None)
        where = f"this rank ({error})" if error else "another rank"
        cause = (f"out of memory in {phase} of step {monitor.step} on {where}, inside a gradient-accumulation window: "
                 "that batch ran again alone in more parts; every rank raises the ladder together after the window's "
                 "last backward")
        for decision in self.ladder.escalate(observation, cause, retrying=False):  # the batch already ran
            self.record(decision, capacity)

    def _together(self, failure: OomFailure, peak: Optional[int], static: Optional[int], capacity: Optional[int],
                  why: Optional[str]) -> tuple:
        """The failure as every rank sees it: this rank's, where it ran out of memory (it shadows the gradient
        reductions it had not run, then the ranks agree), or the agreed one a peer's mark led to; and the parts every
        rank's batch runs again in, split once (0: the ladder decides for all), the same on every rank.

        A rank whose attempt reduces no gradients (a batch of an accumulation window before its last, under
        DistributedDataParallel's ``no_sync``) and that cannot run it again alone (:meth:`_run_alone`) gives up
        alone: the other ranks' next collective is not a gradient reduction this rank could stand in for (Lightning
        broadcasts before every batch; DDP's comes at the window's last batch), so it neither shadows nor agrees; its
        process ends and the others stop with its report at their next collective (:meth:`_stop_with_peer`).

        So does a rank whose training step has collectives of its own
        (:attr:`~lightning_memguard.guard.ranks.Ranks.step_collectives`) and that ran out of memory before they had all
        run (anywhere but the backward of its last part): the others wait in one of them, not in a gradient reduction
        it could stand in for."""
        agreed, self._agreed = self._agreed, None
        recovery, own = self.ranks.recovery, self.ranks.step_collectives
        window = ACCUMULATION_WINDOW + (STEP_COLLECTIVES_NOTE if own else "")
        if agreed is None and not getattr(recovery, "reduces", True):
            return failure, peak, static, capacity, why or window, None
        pending = self._own_collectives_pending() if agreed is None else None
        if pending is not None:
            return failure, peak, static, capacity, why or (pending if failure.first_micro_batch else window), None
        if agreed is None:
            if why is None and not recovery.settled:
                why = getattr(recovery, "unsettled_reason", _DDP_UNSETTLED)
            recovery.shadow()
            agreed = recovery.agree(_numbers(_OUT_OF_MEMORY, failure.phase, peak, static, why, capacity,
                                             failure.attempt, self._one_off_parts()))
        kind, phase, peak, static, unsafe, capacity, attempt, parts = agreed
        failure = OomFailure(phase=_PHASES[phase], first_micro_batch=failure.first_micro_batch, error=failure.error,
                             attempt=attempt, max_retries=failure.max_retries,
                             partial_gradients=failure.partial_gradients)
        if unsafe == _UNSAFE_WINDOW:  # every rank stops with the same report (this rank's own reason aside)
            why = window
        elif why is None and unsafe:  # the rank that cannot: out of memory (its report), or a rung error (its note)
            why = _PEER_RUNG_ERROR if kind == _RUNG_BROKE else _PEER_CANNOT
        elif why is None and kind == _RUNG_BROKE:  # that rank puts rungs back, this one would climb: stop alike
            why = _PEER_RUNG_BROKE
        return failure, peak, static - 1 if static > 0 else None, -capacity if capacity < 0 else None, why, parts

    def _own_collectives_pending(self) -> Optional[str]:
        """After this rank's OOM: why the other ranks may wait in a collective of the training step's own that the
        failed attempt had not issued, else ``None`` — as the recovery counted them (fewer issued than a complete
        attempt issues: :data:`OWN_COLLECTIVES`), or, where the front door found them
        (:attr:`~lightning_memguard.guard.ranks.Ranks.logged_collectives`: a value logged with ``sync_dist`` on_step
        in the training step), anywhere but the backward of the last part (:data:`STEP_COLLECTIVES`); or, before any
        attempt or the first batch's estimate showed the step, because it is not known (:data:`FIRST_STEP_UNKNOWN`,
        or the recovery's unsettled reason with :data:`FIRST_STEP_NOTE`)."""
        if self.ranks.logged_collectives and not self._step_ran:  # said with what to log instead
            return STEP_COLLECTIVES
        recovery = self.ranks.recovery
        counted = getattr(recovery, "own_collectives_pending", None)
        if counted is None or not counted(self.ranks.parts, self.ranks.source_collectives):
            return None
        if getattr(recovery, "own_collectives_known", True) or self.ranks.source_collectives:
            return OWN_COLLECTIVES
        # the first step, before the step's own collectives are known: a stand-in reduction must not meet another
        # rank's gather (where the recovery is not settled yet, every rank stops anyway)
        if recovery.settled:
            return FIRST_STEP_UNKNOWN
        return getattr(recovery, "unsettled_reason", _DDP_UNSETTLED) + FIRST_STEP_NOTE

    def _one_off_parts(self) -> int:
        return self.long_batches.oom_parts(self.ladder) if self.long_batches is not None else 0

    def on_rung_error(self, error: str, phase: str = "forward") -> bool:
        """A forward or backward failed with an error that is not an OOM. If rungs changed since the last step that
        ran, they are put back where they last ran and never raised again (one warning each) and True is returned:
        the batch runs again. Else False: the error is the model's own.

        With several processes every rank must put the same rungs back (their ladders stay alike): this rank reduces
        what its backward had not, as after an OOM, and the ranks agree once (a rank whose step ran learns of it in
        the gradients it received, :meth:`check_peers`); every rank then puts the rungs back and runs the batch again.
        ``phase``: where the attempt failed (``"forward"`` or ``"backward"``).
        Where an OOM could not be run again together (DDP's first step, before its buckets settled; a collective of
        the step's own not yet issued; a batch inside a gradient-accumulation window), False: the run ends as
        without the guard."""
        if self.ranks.world_size > 1:
            return self._rung_error_together(error, phase)
        return self._put_back_untried(error)

    def _rung_error_together(self, error: str, phase: str) -> bool:
        if not self.ladder.untried:  # the model's own error
            return False
        if self.ranks.peer_rung_error() is not None:  # another rank ended so: this rank stops with it (its note)
            return False
        recovery = self.ranks.recovery
        if recovery is None or not self.ranks.can_retry:
            why = _NO_RECOVERY
        elif not getattr(recovery, "reduces", True):
            why = _IN_A_WINDOW
        elif not recovery.settled:
            why = _BUCKETS_UNSETTLED
            # as after an OOM there: the others' backward completes, and they stop with the report at once (their
            # check_peers), not at a collective this rank never joins
            recovery.shadow()
            recovery.agree(_numbers(_RUNG_BROKE, phase, 0, None, why, None, 0, 0))
        elif self._own_collectives_pending() is not None:
            why = _OWN_PENDING
        else:
            recovery.shadow()
            agreed = recovery.agree(_numbers(_RUNG_BROKE, phase, 0, None, None, None, 0, 0))
            if not agreed[4]:
                return self._put_back_untried(error)
            why = _PEER_CANNOT  # a rank cannot run the batch again: every rank stops
        changed = ", ".join(f"{name} {before} -> {now}" for name, (before, now) in self.ladder.untried_levels().items())
        self.rung_error_note = (
            f"lightning-memguard: this error came in step {self.monitor.step}, the first to run with rungs the guard "
            f"changed ({changed}); with several processes they could not be put back and the batch run again on every "
            f"rank ({why}). If a rung broke the model, leave it out of mitigations=")
        return False

    def _put_back_untried(self, error: str) -> bool:
        decisions = self.ladder.revert_untried(self.monitor.step, error)
        capacity = self.monitor.capacity_bytes()
        for decision in decisions:
            self.record(decision, capacity, warn=True)
        return bool(decisions)

    def on_optimizer_oom(self, error: str, retry_safe: bool) -> None:
        """``optimizer.step`` ran out of memory after forward and backward: return to have it retried once with lower
        temporaries when nothing was updated yet, else raise the report. Activation remedies cannot help here."""
        monitor, step = self.monitor, self.monitor.step
        peak, capacity = monitor.peak_since_boundary(), monitor.capacity_bytes()
        optimizers = monitor.optimizers()
        sizes = training_state_bytes(self.module, optimizers)
        foreach_helps = not all(steps_one_parameter_at_a_time(optimizer) for optimizer in optimizers)
        retry_reason, why = optimizer_oom_texts(step, error, sizes, capacity, foreach_helps)
        fragmentation = self.monitor.fragmentation_at(error, peak, capacity, "after_optimizer_step")
        if retry_safe:
            self.record(Decision(step=step, action="rescue", rung="optimizer", level=0, reason=retry_reason,
                                 peak_before_bytes=peak, phase="after_optimizer_step"), capacity)
            return
        self.give_up("optimizer_step", "after_optimizer_step", peak, capacity, why, error, fragmentation, extra=sizes)

    # --- an evaluation batch ----------------------------------------------------------------------------------------
    def evaluate(self, phase: str, batch: Any, call: StepCall, *, rescue: bool,
                 savepoint: Optional[Savepoint] = None) -> tuple[Any, int]:
        """Runs ``call`` on ``batch`` in the loop's number of parts, each under ``torch.no_grad()``, and returns the
        combined outputs with the number of parts they ran in. After an out-of-memory error (when ``rescue``) the
        batch runs again in twice as many parts (at most one sample each), kept for the loop's later batches; an
        event (action ``eval_split``, its ``level`` the parts now) says so. ``savepoint`` is called before each
        attempt (one that may run again) and returns what undoes a failed attempt's logging.

        With several processes a rank splits its batch alone only where its parts issue no collective the other
        ranks do not: under DistributedDataParallel (or a module evaluated unwrapped outside a fit), where neither the
        failed attempt nor a completed batch of the loop issued a collective of the step's own — before any batch
        completed, its parts refuse one, which ends the run with the report (``Ranks.evaluation``,
        :class:`~lightning_memguard.adapters.ddp_evaluation.EvaluationAlone`); elsewhere the run ends with the report.

        Raises:
            MemGuardOutOfMemoryError: the batch cannot be split further, or on this rank alone; its message is the
                report.
            ValueError: ``phase`` is not an evaluation loop.
        """
        if phase not in EVALUATION_PHASES:
            raise ValueError(f"phase={phase!r}; allowed: {', '.join(EVALUATION_PHASES)}")
        size, counts = batch_size_of(batch), self.ladder.parts
        ran: list[int] = []
        alone = self.ranks.evaluation
        # what an attempt logs is saved only where a failed one runs again: before each part, so that a failed
        # part's is undone and the parts that ran before it keep theirs (they do not run again)
        saving = savepoint is not None and rescue and (self.ranks.world_size == 1 or alone is not None)
        undo: list[Optional[Callable[[], None]]] = [None]
        parts_run = EvaluationParts(self.split_evaluation) if self.split_evaluation is not None else None

        def save() -> None:
            undo[0] = savepoint() if saving else None

        def attempt() -> Any:
            ran.append(counts.for_evaluation(phase, size))
            if ran[-1] == 1 or parts_run is None:
                save()
                with torch.no_grad():
                    return call(batch, 1.0)
            if len(ran) > 1 and ran[-2] > 1:  # a part ran out of memory: what has not run yet, in more parts
                parts_run.split_pending()
            else:
                parts_run.start(batch, ran[-1])
            with torch.no_grad():
                parts_run.run(call, save)
            return self._combined(phase, parts_run, ran[-1])

        def before() -> Optional[Callable[[], None]]:
            if alone is not None:
                alone.begin(phase)
            return restore if saving else None

        def restore() -> None:
            if undo[0] is not None:
                undo[0]()

        oom_lines: list[str] = []

        def on_oom(line: str, combining: bool) -> None:
            oom_lines.append(line)
            if alone is not None:
                alone.end(phase, complete=False)
            self._split_further(phase, size, ran[-1], line, combining, fetches=isinstance(batch, Iterator),
                                alone=alone)

        if alone is None:
            return run_attempts(attempt, on_oom, before=before, rescue=rescue), ran[-1]
        complete = False
        try:
            output = run_attempts(attempt, on_oom, before=before, rescue=rescue)
            complete = True
        except Exception as err:
            why = alone.refusal(phase, err)  # its parts, alone, tried a collective the others would never meet
            if why is None:
                raise
            monitor = self.monitor
            self.give_up(phase, phase, monitor.peak_since_boundary(), monitor.capacity_bytes(), why, oom_lines[-1],
                         subject=_evaluation_batch(phase, size))
        finally:
            alone.end(phase, complete)
        return output, ran[-1]

    def _combined(self, phase: str, parts_run: EvaluationParts, parts: int) -> Any:
        """The outputs of the parts that ran, put together as the whole batch's."""
        done = parts_run.done
        try:
            return combine_outputs([outputs for outputs, _, _ in done], [n for _, n, _ in done],
                                   [share for _, _, share in done], pad_value=self.pad_value,
                                   on_listed=lambda why: self._warn_listed(phase, parts, why))
        except Exception as err:
            setattr(err, _COMBINING, True)  # every part ran: it failed putting their outputs together
            raise

    def _warn_listed(self, phase: str, parts: int, why: str) -> None:
        """Says once a run that a split batch's outputs hold the parts' tensors as a list where the whole batch's hold
        one tensor: code that reads rows from it would pair them wrongly."""
        if self.warn is not None and not self._warned_listed:
            self._warned_listed = True
            self.warn(f"lightning-memguard: a {phase} batch ran in {parts} parts whose outputs hold {why}: that output "
                      "is the list of the parts' values, in order, where an unsplit batch's is one tensor or sequence "
                      "(return values of one shape a sample; for generated token ids, set the model's "
                      "generation_config.pad_token_id)")

    def _split_further(self, phase: str, size: Optional[int], parts: int, error: str, combining: bool,
                       fetches: bool = False, alone: Any = None) -> None:
        """After an OOM in an evaluation batch run in ``parts`` parts: more parts next, or the report where none can
        help. ``fetches``: the step fetches its own batches (it was handed their iterator); ``alone``: with several
        processes, what says whether this rank may split its batch alone (``None``: it may not)."""
        monitor = self.monitor
        peak, capacity = monitor.peak_since_boundary(), monitor.capacity_bytes()  # a new peak window for the retry
        what = _evaluation_batch(phase, size)
        # an OOM with enough free memory in the cache is fragmentation: said once a fit, and in the report
        found = None if combining else self.monitor.fragmentation_at(error, peak, capacity, phase)
        why = None
        if combining:  # more parts cannot make the whole batch's outputs smaller
            why = (f"its {parts} parts ran, but their outputs put together do not fit; return less from the step "
                   "(no key/value cache: use_cache=False; logits only where needed)")
        elif self.ranks.world_size > 1 and alone is None:  # the ranks' parts would differ: so would collectives
            why = Ranks.NO_EVALUATION_SPLIT
        elif fetches:
            why = (f"its step fetches its own batches (it takes {ITERATOR_PARAMETER}), so no batch is in hand to "
                   "split; give its dataloader a smaller batch size")
        elif size is None:
            why = f"it {NO_SAMPLES}"
        elif parts >= size:
            why = f"{'its one sample' if size == 1 else f'each of its {size} samples'} alone does not fit"
        elif alone is not None:  # last: it marks DDP's broadcast done where the batch runs again
            why = alone.why_not(phase)
        if why is not None:
            self.give_up(phase, phase, peak, capacity, why, error, found, subject=what)
        more = min(2 * parts, size)
        self.ladder.parts.evaluation[phase] = more
        reason = (f"out of memory in {what[2:]}" + (f" run in {parts} parts" if parts > 1 else "")
                  + f" ({error}); it and later {phase} batches run in {more} parts")
        monitor.record(Event(step=monitor.step, action="eval_split", rung="", reason=reason, peak_before_bytes=peak,
                             capacity_bytes=capacity, phase=phase, level=more, time=time.time()))

    # --- giving up -------------------------------------------------------------------------------------------------
    def give_up(self, phase: str, boundary: str, peak: Optional[int], capacity: Optional[int], why: str, error: str,
                fragmentation: Optional[Fragmentation] = None, *, subject: Optional[str] = None,
                extra: Optional[dict] = None) -> None:
        """Records the end of the run (a ``gave_up`` event at ``boundary``), keeps its rows and report file on this
        rank, and raises the report. ``subject``: what could not be rescued where it is not the step in progress
        (``"a validation batch of 32 samples"``).

        Raises:
            MemGuardOutOfMemoryError: always; its message is the report, ``report`` the same as a dict.
        """
        monitor, step = self.monitor, self.monitor.step
        report = oom_report(step, phase, peak, capacity, self.ladder.levels, monitor.events, why, error,
                            fragmentation, subject=subject)
        report.update(extra or {})
        self.record(Decision(step=step, action="gave_up", reason=f"{subject}: {why}" if subject else why,
                             peak_before_bytes=peak, phase=boundary), capacity)
        monitor.keep_failure(report["text"])
        self.ranks.say_gave_up(report["text"])
        raise MemGuardOutOfMemoryError(report["text"], report)

    def record(self, decision: Decision, capacity: Optional[int], warn: bool = False) -> None:
        """Records ``decision`` as an event, now, with the rung levels it left."""
        self.monitor.record(decision.to_event(capacity, time.time()), self.ladder.levels, warn=warn)


def _evaluation_batch(phase: str, size: Optional[int]) -> str:
    """What a report names an evaluation batch it could not rescue: ``"a validation batch of 32 samples"``."""
    return f"a {phase} batch" + (f" of {size} sample{'s' if size != 1 else ''}" if size else "")


#: why a batch is not run again before DistributedDataParallel settled its buckets (a recovery's ``unsettled_reason``
#: where it has its own)
_DDP_UNSETTLED = ("out of memory in the first step under DistributedDataParallel, before its gradient buckets were "
                  "settled: the ranks cannot run it again alike")
#: why every rank stops after an OOM on any rank inside a gradient-accumulation window (the same on every rank)
ACCUMULATION_WINDOW = (
    "out of memory inside a gradient-accumulation window with several processes, in a batch that cannot run again: "
    "the ranks sum the window's gradients together, so a rank runs one of its batches again only alone, in more "
    "micro-batches, and only where its failed attempt added nothing to that sum and issued no collective (under "
    "DistributedDataParallel, with the micro-batch rung in the ladder and more than one sample a part left); not at "
    "the window's last batch once its reduction summed the earlier batches' gradients, nor after a backward that "
    "added gradients, nor under FSDP2 after the window's first batch. Every rank stops. Without accumulation "
    "(accumulate_grad_batches=1, larger batches that the micro-batch rung splits when they do not fit) the ranks run "
    "a batch that ran out of memory again together")
#: added to :data:`ACCUMULATION_WINDOW` where the training step has collectives of its own (Ranks.step_collectives)
STEP_COLLECTIVES_NOTE = (
    ". Here no batch runs again alone: the training step issues collectives of its own (a value reduced across the "
    "ranks as it is logged, each step: self.log(..., sync_dist=True) with on_step; an all_gather across the ranks), "
    "which a rank running a batch again alone would issue alone")
#: why every rank stops after an OOM on a rank whose training step's own collectives had not all run
STEP_COLLECTIVES = (
    "out of memory with several processes whose training step reduces a value across the ranks as it logs it, each "
    "step (self.log(..., sync_dist=True) with on_step), before that reduction ran on this rank: the other ranks wait "
    "in it, and this rank cannot stand in for it. The ranks run a batch again together only after an OOM in the "
    "backward of its last part; log with on_epoch=True and on_step=False (reduced once, at the epoch's end) to have "
    "every OOM rescued. Every rank stops")
#: why every rank stops after an OOM on a rank that had not issued all the collectives its training step issues of its
#: own (counted: DDPRecovery.own_collectives_pending)
OWN_COLLECTIVES = (
    "out of memory with several processes whose training step issues collectives of its own (an all_gather across "
    "the ranks, SyncBatchNorm's statistics, a value reduced as it is logged), before this rank had issued them all: "
    "the other ranks wait in one, and this rank cannot stand in for it (only the model knows its arguments). The "
    "ranks run a batch again together only after an OOM once the step's own collectives have all run on this rank. "
    "Every rank stops")
#: why every rank stops after an OOM before any step (or the first batch's estimate) showed whether the training step
#: issues collectives of its own; :data:`FIRST_STEP_NOTE` is added to a recovery's unsettled reason
_NOT_KNOWN = (
    "whether the training step issues collectives of its own (an all_gather, SyncBatchNorm, a metric synced each "
    "step), which the other ranks may be waiting in, was not known yet (the first batch's estimate did not run the "
    "step), so this rank stops without standing in for the others' reductions. Every rank stops")
FIRST_STEP_NOTE = "; " + _NOT_KNOWN
FIRST_STEP_UNKNOWN = "out of memory with several processes before a step had run to its end: " + _NOT_KNOWN
#: why a rank stops when another rank's own reason (its report) keeps the batch from running again
_PEER_CANNOT = "another rank cannot run this batch again (see its report)"
#: why a rung that broke a step under several processes is not put back (in the note on the error)
_NO_RECOVERY = ("the ranks run a batch again together only through the guard's recovery: DistributedDataParallel "
                "without a communication hook of the user's or FSDP2, automatic optimization, rescue_oom=True")
_IN_A_WINDOW = "the batch is inside a gradient-accumulation window, whose gradients the ranks sum together"
_BUCKETS_UNSETTLED = "DistributedDataParallel's gradient buckets are not settled before its first steps have run"
_OWN_PENDING = "the training step's own collectives (sync_dist on_step, all_gather) had not all run on this rank"
_PEER_RUNG_ERROR = ("another rank's attempt of this batch failed with an error other than out of memory in a step run "
                    "with rungs the guard had just changed, and the ranks cannot run it again alike (that rank's error "
                    "names the rungs and why)")
_PEER_RUNG_BROKE = ("another rank's attempt of this batch failed with an error of the rungs just changed, while this "
                    "rank ran out of memory: the ranks cannot run it again alike")
#: the agreement's codes for whether the batch may run again: the largest over the ranks wins
_UNSAFE_OWN, _UNSAFE_WINDOW = 1, 2
#: what failed on the worst rank, the first of the numbers the ranks agree on: an OOM, or an error of a rung changed
#: since the last step that ran (the larger wins: every rank puts those rungs back before any climbs)
_OUT_OF_MEMORY, _RUNG_BROKE = 1, 2
#: the phases of a forward/backward failure, as the ranks' agreement codes them
_PHASES = ("forward", "backward")


def _numbers(failed: int, phase: str, peak: Optional[int], static: Optional[int], why: Optional[str],
             capacity: Optional[int], attempt: int, one_off_parts: int) -> list[int]:
    """What the ranks agree on, as ints whose maximum over the ranks is the worst case: what failed on a rank (0:
    nothing, :data:`_OUT_OF_MEMORY`, :data:`_RUNG_BROKE`), its phase, the peak, the static bytes (+1, 0: unknown),
    whether a retry is unsafe (0: safe; 2: inside an accumulation window, said alike on every rank; 1: for a reason of
    one rank's own), the capacity (negated: the smallest wins; 0: unknown), the attempt and the parts a rank's larger
    batch runs again in, split once (0: none; a rank whose batch is larger than its reference decides for all, as
    before a batch)."""
    return [failed, _PHASES.index(phase), peak or 0, static + 1 if static is not None else 0,
            0 if why is None else _UNSAFE_WINDOW if why == ACCUMULATION_WINDOW else _UNSAFE_OWN,
            -capacity if capacity else 0, attempt, one_off_parts]
