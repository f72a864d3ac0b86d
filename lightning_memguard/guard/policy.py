"""The policy: when memory is near the threshold, which rung of the ladder to try next, and whether a rung that was
tried helped (keep) or not (revert). No torch, no Lightning: a step's numbers and the rungs' levels in, decisions out.

A *rung* is a named remedy with levels 0 (off) .. ``max_level``: AMP has one level, activation checkpointing has one
level per block (the number of checkpointed blocks). The levels are the ladder's (guard/ladder.py): it hands them to
every call and carries out the decisions that change them; the policy keeps only what it judges with (the rung on
trial, the rungs that failed, the measured saving per level, what it has said).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Optional, Sequence

from ..base.advice import what_would_help
from ..base.frozen import frozen_from_fields
from ..base.prediction import ReservedSegments, StepPredictor, cheapest_levels
from ..base.snapshot import PHASES, Event, format_bytes

if TYPE_CHECKING:  # numbers only: no torch
    from ..base.batches import BatchSize

__all__ = ["StepObservation", "Decision", "MitigationPolicy", "ACTIVATION_PHASES", "AIM_SHARE", "LEVEL_ACTIONS"]

#: Phases whose peak holds the activations saved for backward: the phases activation remedies can lower.
ACTIVATION_PHASES = ("after_forward", "after_backward")
#: What a predicted peak must stay under, as a share of the line it aims at: an estimate a few per cent short must not
#: cost an OOM
AIM_SHARE = 0.95


@dataclass(frozen=True)
class StepObservation:
    """What one optimizer step measured. ``peaks`` maps phase → peak bytes; ``static_bytes`` is what was allocated
    at batch start (parameters, optimizer state, the batch); ``held_after_bytes`` what was allocated when the step
    ended (more than at its start after a first step: its optimizer state stays). Both without the gradients: a
    front door zeroes them at some point of every step (Lightning after the forward, a plain loop before it), and
    counting them would make the steps of one front door differ from another's, and step 0 from step 1."""

    step: int
    peaks: Mapping[str, int]
    capacity_bytes: Optional[int]
    static_bytes: Optional[int] = None
    alloc_retries: Optional[int] = None
    held_after_bytes: Optional[int] = None

    @classmethod
    def of_step(cls, step: int, peaks: Mapping[str, int], capacity_bytes: Optional[int],
                static_bytes: Optional[int], alloc_retries: Optional[int],
                held_after_bytes: Optional[int]) -> "StepObservation":
        """The observation the constructor builds from the same values, at half its cost (after every optimizer step,
        on the training thread)."""
        return frozen_from_fields(cls, step=step, peaks=peaks, capacity_bytes=capacity_bytes, static_bytes=static_bytes,
                                  alloc_retries=alloc_retries, held_after_bytes=held_after_bytes)

    @property
    def peak_bytes(self) -> int:
        return max(self.peaks.values()) if self.peaks else 0

    @property
    def next_peak_bytes(self) -> int:
        """The peak the next step is expected to reach with the same configuration: this one's, plus what this step
        left allocated on top of what it started with (the optimizer state a first step creates)."""
        if self.static_bytes is None or self.held_after_bytes is None:
            return self.peak_bytes
        return self.peak_bytes + max(0, self.held_after_bytes - self.static_bytes)

    @property
    def next_step_peak_bytes(self) -> int:
        """:attr:`next_peak_bytes` of the step's own phases: ``batch_start`` covers what ran between two optimizer
        steps (an evaluation under ``torch.no_grad()``, data loading), which no rung of the training step changes."""
        own = [peak for phase, peak in self.peaks.items() if phase != "batch_start"]
        if not own:
            return self.next_peak_bytes
        return self.next_peak_bytes - self.peak_bytes + max(own)

    @property
    def activation_peak_bytes(self) -> Optional[int]:
        """The highest forward or backward peak (what the rungs change), ``None`` if neither was measured."""
        peaks = [self.peaks[p] for p in ACTIVATION_PHASES if p in self.peaks]
        return max(peaks) if peaks else None

    @property
    def peak_phase(self) -> Optional[str]:
        if not self.peaks:
            return None
        return max((p for p in PHASES if p in self.peaks), key=lambda p: self.peaks[p])


#: Actions that set ``rung`` to ``level``; the others report. ``speed_trial``: the speed trial's
#: (:mod:`~lightning_memguard.guard.speed_trial`) switch to the configuration it times, or back from it.
LEVEL_ACTIONS = ("apply", "revert", "rescue", "speed_trial")


@dataclass(frozen=True, kw_only=True)
class Decision:
    """One thing to do (``apply``, ``revert``, ``rescue``, ``speed_trial``: set ``rung`` to ``level``) or to report
    (``keep``, ``hold``, ``threshold``, ``cannot_help``, ``exhausted``, ``plan``, ``gave_up``, ``predicted_split``: one
    batch runs as more micro-batches, :mod:`~lightning_memguard.guard.long_batch`; ``speed_keep``, ``speed_abandon``:
    the speed trial's outcome, :mod:`~lightning_memguard.guard.speed_trial`). Built by keyword."""

    step: int
    action: str
    reason: str
    rung: str = ""
    level: int = 0
    peak_before_bytes: Optional[int] = None
    peak_after_bytes: Optional[int] = None
    phase: Optional[str] = None

    @property
    def sets_level(self) -> bool:
        """Whether carrying the decision out sets ``rung`` to ``level`` (the holder of the levels does so, in order;
        an engine's own ``rescue`` of the optimizer step names no rung of the ladder and is only recorded)."""
        return self.action in LEVEL_ACTIONS

    def to_event(self, capacity_bytes: Optional[int], time: float) -> Event:
        """The decision as the event the run's events table keeps (``time``: seconds since the epoch)."""
        return Event(step=self.step, action=self.action, rung=self.rung, reason=self.reason,
                     peak_before_bytes=self.peak_before_bytes, peak_after_bytes=self.peak_after_bytes,
                     capacity_bytes=capacity_bytes, phase=self.phase, level=self.level, time=time)


@dataclass
class _Trial:
    rung: str
    from_level: int
    to_level: int
    step: int  # applied at the end of this step; the next step is the first measured with it
    peak_before: int
    static_before: Optional[int]
    rescued: bool = False  # applied to rescue an OOM: the batch then ran, so it is kept whatever the numbers say
    activation_before: Optional[int] = None  # the step's highest forward/backward peak, what the rung changes


@dataclass
class _State:
    """What the policy judges with (the levels are the ladder's, handed to each call)."""

    failed: set[str] = field(default_factory=set)  # rungs reverted for not helping or for breaking the step
    broken: set[str] = field(default_factory=set)  # those of them the step failed with (said where no rung climbs)
    trial: Optional[_Trial] = None
    warned: set[str] = field(default_factory=set)
    gain_per_level: dict[str, float] = field(default_factory=dict)  # measured bytes saved per level of a kept rung
    last_retries: Optional[int] = None
    #: why no rung is ever raised in this run (the estimate found that nothing they lower is what does not fit)
    stuck: str = ""


class MitigationPolicy:
    """Decides what to do after each optimizer step, given the level each rung is at (``levels``: rung name → level,
    every rung of ``ladder``). It never changes a level itself: whoever holds the levels sets ``rung`` to ``level``
    for each decision whose :attr:`Decision.sets_level`, in order.

    Args:
        threshold: act when a phase peak reaches ``threshold × capacity``; in (0, 1].
        ladder: rung names in the order to try them.
        max_levels: rung name → its highest level (e.g. ``{"amp": 1, "checkpointing": 12}``).
        min_gain: a rung is kept only if the step peak fell by at least this fraction.
        first_fraction: the share of levels tried first on a multi-level rung (checkpoint a quarter of the blocks,
            then as many more as the measured saving per block says are needed).
        single_step: rungs that climb one level at a time (micro-batching: each level halves the micro-batch, so
            its saving per level is not additive).
        last_resort: rungs that cost much throughput (micro-batching runs the batch in several passes): a threshold
            crossing raises them only when the step does not fit (its peak reached the capacity itself, or will at
            the next step, which holds the optimizer state a first step creates, or the allocator had to retry);
            between the threshold and the capacity they hold, said once per level. An
            out-of-memory rescue raises them like any rung. Give them only when an OOM can be rescued: without a
            rescue the threshold is the only protection.
        capped: the capacity caps what the CUDA caching allocator reserves (the card, a memory fraction; not a
            ``budget=``): the combination a rescue (or a threshold crossing that needs several rungs at once) goes
            to must keep the allocator's predicted segments under it too (:meth:`escalate`). One process only: the
            segments are this rank's own estimate, and ranks that read their own could choose different levels.
    """

    def __init__(
        self,
        threshold: float,
        ladder: Sequence[str],
        max_levels: Mapping[str, int],
        min_gain: float = 0.03,
        first_fraction: float = 0.25,
        single_step: Sequence[str] = (),
        last_resort: Sequence[str] = (),
        predictor: Optional[StepPredictor] = None,
        capped: bool = False,
    ) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold={threshold!r} must be in (0, 1]")
        if not 0 <= min_gain < 1:
            raise ValueError(f"min_gain={min_gain!r} must be in [0, 1)")
        missing = [name for name in ladder if name not in max_levels]
        if missing:
            raise ValueError(f"rungs {missing} have no max level")
        self.threshold = threshold
        self.ladder = tuple(ladder)
        self.max_levels = dict(max_levels)
        self._no_levels: dict[str, Optional[str]] = {}  # rung -> why it has no level to climb to, where known
        self.min_gain = min_gain
        self.first_fraction = first_fraction
        self.single_step = frozenset(single_step)
        self.last_resort = tuple(name for name in last_resort if name in self.ladder)
        #: the estimate's predictions (:class:`~lightning_memguard.base.prediction.StepPredictor`): with them a rung
        #: goes straight to the level predicted to fit, scaled to the measured peak (instead of a quarter of the
        #: blocks, or one halving of the micro-batch, at a time), and an OOM rescue applies in one go every rung a
        #: fit needs
        self.predictor = predictor if predictor is not None else StepPredictor()
        self.capped = capped
        self._state = _State()
        #: rung -> (predicted step peak at its level now, at its top) for the rungs the last climb passed over, their
        #: top predicted to save less than a trial must show (said where no rung climbs)
        self._passed_over: dict[str, tuple[int, int]] = {}
        #: why the last :meth:`escalate` raised no rung (``""``: it raised one)
        self._exhausted = ""

    # --- state ------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What the policy judges with, for a checkpoint (the levels are saved beside it by the ladder)."""
        s = self._state
        trial = None if s.trial is None else vars(s.trial).copy()
        return {"failed": sorted(s.failed), "trial": trial, "warned": sorted(s.warned),
                "gain_per_level": dict(s.gain_per_level), "last_retries": s.last_retries,
                # saved only when set: older checkpoints read alike
                **({"stuck": s.stuck} if s.stuck else {}), **({"broken": sorted(s.broken)} if s.broken else {})}

    def load_state_dict(self, state: dict) -> None:
        """Back to where :meth:`state_dict` left it; keys it does not hold (the ladder's ``levels``) are ignored and
        missing ones start fresh."""
        trial = state.get("trial")
        self._state = _State(
            failed=set(state.get("failed", ())),
            trial=_Trial(**trial) if trial else None,
            warned=set(state.get("warned", ())),
            gain_per_level=dict(state.get("gain_per_level", {})),
            last_retries=state.get("last_retries"),
            stuck=state.get("stuck", ""),
            broken=set(state.get("broken", ())),
        )

    def settle_trial(self) -> None:
        """Keeps a rung that is still on trial without judging it: after a resume the next step is not comparable
        with the one before the checkpoint (a new process starts with no gradients and a fresh accounting)."""
        self._state.trial = None

    def set_max_level(self, rung: str, top: int, why_none: Optional[str] = None) -> None:
        """A rung's highest level, learned during training (micro-batching learns it from the batch size). The
        holder of the levels brings a rung above it down. ``why_none``: where ``top`` is 0, why (the report says it
        where no rung can be raised: a batch of one sample, one that cannot be split)."""
        self.max_levels[rung] = top
        self._no_levels[rung] = why_none if top <= 0 else None

    def disable(self, rung: str) -> None:
        """Never raises ``rung`` again in this run (it broke the step, or the estimate found that it would). A trial
        of it is dropped: there is nothing left to judge."""
        s = self._state
        s.failed.add(rung)
        s.broken.add(rung)
        if s.trial is not None and s.trial.rung == rung:
            s.trial = None

    def stop_climbing(self, reason: str) -> None:
        """Never raises a rung again in this run, and says nothing more about it: the estimate found, before the
        first step, that what does not fit is what no rung lowers (``reason``, said once as a ``cannot_help`` by
        whoever found it). An out-of-memory error is then reported at once, with ``reason``."""
        self._state.stuck = reason
        self._state.warned.add("cannot_help")

    @property
    def stuck_reason(self) -> str:
        """The reason given to :meth:`stop_climbing`, else ``""``."""
        return self._state.stuck

    @property
    def exhausted_reason(self) -> str:
        """Why the last :meth:`escalate` raised no rung: :attr:`stuck_reason` where set, else each rung's own reason
        (at its top, reverted, predicted not to help and by how much, not switchable inside a step); ``""`` where it
        raised one."""
        return self._state.stuck or self._exhausted

    def is_disabled(self, rung: str) -> bool:
        """Whether ``rung`` was reverted (it did not help, or it broke the step) and is never raised again."""
        return rung in self._state.failed

    # --- deciding ---------------------------------------------------------------------------------------------------
    @property
    def judging(self) -> bool:
        """Whether a rung is on trial: the next step's decision judges it (every rank must then decide)."""
        return self._state.trial is not None

    def limit_bytes(self, capacity_bytes: int) -> int:
        return int(self.threshold * capacity_bytes)

    def decide(self, obs: StepObservation, levels: Mapping[str, int]) -> list[Decision]:
        """Everything to do after ``obs.step`` with the rungs at ``levels``: at most one rung reverted and one raised,
        plus notices."""
        s = self._state
        retries = obs.alloc_retries
        retries_rose = retries is not None and s.last_retries is not None and retries > s.last_retries
        if retries is not None:
            s.last_retries = retries
        if obs.capacity_bytes is None or not obs.peaks:
            return []
        limit = self.limit_bytes(obs.capacity_bytes)
        over = obs.peak_bytes >= limit
        near = over or retries_rose
        if s.trial is None and not near:  # most steps: nothing to judge, nothing near (nothing built to say so)
            return []
        levels = dict(levels)  # as the decisions leave them
        why_near = (f"peak {format_bytes(obs.peak_bytes)} in {obs.peak_phase} >= {self.threshold:.0%} of capacity "
                    f"{format_bytes(obs.capacity_bytes)}" if over
                    else "the allocator had to flush its cache and retry (num_alloc_retries rose)")
        decisions: list[Decision] = []

        if s.trial is not None:
            if obs.step <= s.trial.step:
                return []
            judged = self._judge(obs)
            levels.update((d.rung, d.level) for d in judged if d.sets_level)
            decisions += judged
            if not near:
                return decisions

        if "threshold" not in s.warned:
            s.warned.add("threshold")
            decisions.append(Decision(step=obs.step, action="threshold", reason=why_near,
                                      peak_before_bytes=obs.peak_bytes, phase=obs.peak_phase))

        if s.stuck:  # the estimate found before the first step that no rung can help; said then
            return decisions
        # Activation remedies lower the forward and backward peaks only. Try them when one of those is over the
        # limit (or the allocator retried while they were the peak), and not when what persists across steps alone
        # fills the limit.
        activation_over = any(obs.peaks.get(phase, 0) >= limit for phase in ACTIVATION_PHASES)
        static_over = obs.static_bytes is not None and obs.static_bytes >= limit
        if static_over or not (activation_over or (retries_rose and obs.peak_phase in ACTIVATION_PHASES)):
            decisions += self._cannot_help(obs, limit)
            return decisions
        # the step fits (between the threshold and the capacity, also once the memory a first step leaves behind is
        # added): costly rungs wait for a step that does not. Its own phases: a peak between two steps over the
        # capacity (the loop's evaluation) is no reason to split the training batch, which would not lower it
        held = self.last_resort if obs.next_step_peak_bytes < obs.capacity_bytes and not retries_rose else ()
        if obs.peak_phase == "batch_start" and obs.next_step_peak_bytes < obs.capacity_bytes <= obs.peak_bytes:
            decisions += self._cannot_help(obs, limit)  # said once: what ran between the steps is over the capacity
        steps = self._steps_up(obs, levels, limit, skip=held)
        if not steps:
            waiting = [r for r in held if r not in s.failed and levels[r] < self.max_levels[r]]
            if waiting:
                decisions += self._hold(obs, waiting[0], levels[waiting[0]], why_near)
            elif "exhausted" not in s.warned:
                s.warned.add("exhausted")
                why_not = self._why_no_rung(levels, held)
                decisions.append(Decision(step=obs.step, action="exhausted", reason=f"{why_near}, and {why_not}",
                                          peak_before_bytes=obs.peak_bytes, phase=obs.peak_phase))
            return decisions
        (rung, level, predicted), = steps  # between steps one rung at a time: the next step measures it
        reserved = None
        if predicted is not None and level == self.max_levels[rung] \
                and predicted > self._aim(rung, obs.capacity_bytes, limit):
            # the estimate puts this rung at its top over what it must reach: the cheapest combination predicted to
            # fit goes on at once (the next step would run over, and on a GPU run out of memory, first)
            scale = self._scale(obs, levels, rescue=False)
            joint = self._cheapest_combination(obs, levels, limit, held, scale) if scale is not None else None
            if joint is not None and len(joint.steps) > 1:
                decisions += [Decision(step=obs.step, action="apply", rung=other, level=other_level,
                                       reason=f"{why_near}; {_combination_text(other, other_level, joint.steps)}",
                                       peak_before_bytes=obs.peak_bytes, phase=obs.peak_phase)
                              for other, other_level, _ in joint.steps[:-1]]
                rung, level, predicted = joint.steps[-1]
                reserved = joint.reserved
        s.trial = _Trial(rung, levels[rung], level, obs.step, obs.peak_bytes, obs.static_bytes,
                         activation_before=obs.activation_peak_bytes)
        why = why_near
        if rung in self.last_resort and obs.peak_bytes < obs.capacity_bytes <= obs.next_peak_bytes:
            why += (f", and the next step will need about {format_bytes(obs.next_peak_bytes)} (this one left "
                    f"{format_bytes(obs.next_peak_bytes - obs.peak_bytes)} more allocated than it started with: "
                    "gradients and optimizer state), over the capacity")
        decisions.append(Decision(step=obs.step, action="apply", rung=rung, level=level,
                                  reason=f"{why}; trying {rung} at level {level}"
                                         f"{_predicted_text(predicted, reserved, obs.capacity_bytes)}",
                                  peak_before_bytes=obs.peak_bytes, phase=obs.peak_phase))
        return decisions

    def pass_over(self, obs: StepObservation) -> None:
        """A step not to judge (its batch ran as more micro-batches than the levels say, once: its peaks are not the
        levels' doing). Only its allocator retries are kept, so that the next step's rise is its own."""
        if obs.alloc_retries is not None:
            self._state.last_retries = obs.alloc_retries

    def escalate(self, obs: StepObservation, levels: Mapping[str, int], cause: str,
                 skip: Sequence[str] = (), retrying: bool = True, size: Optional[BatchSize] = None) -> list[Decision]:
        """What to change now from ``levels``, without waiting for a step to end: an out-of-memory error happened
        mid-step. A pending trial is dropped (an OOM leaves no time to judge it); the change is judged at the next
        full step. With the estimate's predictions this is the cheapest combination of levels predicted to fit
        (:func:`~lightning_memguard.base.prediction.cheapest_levels`: AMP, some blocks and a few micro-batches
        together where that is what fits), the predictions scaled up to what the failed attempt needed at least
        (more than the capacity: the estimate fell short by at least that much), so one OOM is enough; without them
        one rung. ``capped``, the combination's predicted segments must fit under the capacity too (see
        :meth:`_cheapest_combination`). ``skip`` names rungs that cannot be switched mid-step; ``retrying`` as
        :meth:`~lightning_memguard.guard.ladder.Ladder.escalate` takes it. ``size``: the size of the batch that ran
        out of memory; one larger than the estimated batch is predicted at its size (what the forward and backward
        add grows with it, what persists across steps does not), so that one rescue is enough for it too; a smaller
        one is predicted as the estimated batch (the levels stay for the batches after it). Returns no decision when
        the ladder is exhausted, or when the estimate found that no rung can help (:meth:`stop_climbing`)."""
        s = self._state
        s.trial = None
        self._exhausted = ""
        if s.stuck:
            return []
        estimated = self.predictor.batch
        if size is not None and (estimated is None or size.elements <= estimated.elements):
            size = None
        limit = self.limit_bytes(obs.capacity_bytes) if obs.capacity_bytes else obs.peak_bytes
        combination = None
        if obs.capacity_bytes is not None:
            # the attempt at these levels failed, so it needed more than the capacity
            scale = self.predictor.correction(max(obs.peak_bytes, obs.capacity_bytes), levels, size, up_only=True)
            if scale is not None:
                combination = self._cheapest_combination(obs, levels, limit, skip, scale, size)
        joint = combination is not None
        steps = combination.steps if joint else self._steps_up(obs, levels, limit, skip, rescue=True, size=size)
        reserved = combination.reserved if joint else None
        if not steps:
            self._exhausted = self._why_no_rung(levels, skip, unsafe=True)
        decisions = []
        for i, (rung, level, predicted) in enumerate(steps):
            if i == len(steps) - 1:
                s.trial = _Trial(rung, levels[rung], level, obs.step, obs.peak_bytes, obs.static_bytes,
                                 rescued=True, activation_before=obs.activation_peak_bytes)
                # retrying: the batch that ran out runs again with it (else it already ran: the rung serves the next)
                when = "retrying the batch" if retrying else "from the next batch on"
                what = f"{when} with {rung} at level {level}" + (" too" if i else "")
            elif joint:
                what = _combination_text(rung, level, steps)
            else:
                top = "its top level" if level == self.max_levels[rung] else "level"  # past it, next to no saving
                what = f"{rung} to {top}, {level}, is predicted not to be enough alone"
            if predicted is not None and size is not None:
                what += (f", predicted for this batch of {size.elements} elements, "
                         f"{size.elements / estimated.elements:.1f}x the estimated batch's {estimated.elements}")
            decisions.append(Decision(step=obs.step, action="rescue", rung=rung, level=level,
                                      reason=f"{cause}; {what}"
                                             f"{_predicted_text(predicted, reserved, obs.capacity_bytes)}",
                                      peak_before_bytes=obs.peak_bytes, phase=obs.peak_phase))
        return decisions

    def _cheapest_combination(self, obs: StepObservation, now: Mapping[str, int], limit: int,
                              skip: Sequence[str], scale: float,
                              size: Optional[BatchSize] = None) -> Optional[_Combination]:
        """The rungs to change, in ladder order, to reach from ``now`` the cheapest combination the estimate,
        its predictions multiplied by ``scale`` (for a batch of ``size``; ``None``: the estimated batch), puts under
        each rung's aim (:meth:`_aim`), or ``None`` where it cannot say (no estimate, no capacity, or none of its
        combinations fits: the rungs then climb as :meth:`_steps_up` says). ``skip``: rungs not to raise.

        ``capped`` (a cap on what the CUDA caching allocator reserves), the combination chosen is checked against the
        allocator's predicted segments too (:class:`~lightning_memguard.base.prediction.ReservedSegments`, read as
        the plan reads them, with the scaled allocated peak): one reading (an estimate of one micro-batch's step, or
        of a whole batch at a block count not yet estimated) where it fits, and only where its segments are over the
        capacity is the choice made again with every combination looked at read so. Where none fits so, the
        allocated peaks' choice stands (the estimate's best guess); where the estimate has no reserved figure (a CPU
        target, allocator options the model does not cover), the allocated peaks alone decide."""
        if self.predictor.model is None or obs.capacity_bytes is None:
            return None
        tops = {rung: self.max_levels[rung] for rung in self.ladder
                if rung not in self._state.failed and rung not in skip and self.predictor.covers(rung)}

        def aim(micro: int) -> float:  # aim(0), the cheap rungs' line, is theirs with micro-batches too
            return self._aim("microbatch" if micro else "checkpointing", obs.capacity_bytes, limit)

        segments = self._segments(obs.capacity_bytes, max(aim(0), aim(1)))

        def peak_at(levels: Mapping[str, int]) -> Optional[int]:
            return segments.peak(levels, self.predictor.peak(levels, scale, size))

        found = cheapest_levels(peak_at, now, tops, aim)
        if found is not None and segments.over(*found):  # its segments over the cap: every combination checked
            segments.checking = True
            found = cheapest_levels(peak_at, now, tops, aim) or found
        if found is None:
            return None
        levels, predicted = found
        changed = [rung for rung in self.ladder if rung in levels and levels[rung] != now.get(rung, 0)]
        if not changed:
            return None
        steps = [(rung, levels[rung], predicted if i == len(changed) - 1 else None) for i, rung in enumerate(changed)]
        return _Combination(steps, segments.of(levels, predicted) if self.capped else None)

    def _segments(self, capacity: int, top_aim: float) -> ReservedSegments:
        """The allocator's predicted segments against ``capacity`` where ``capped`` and the estimate reads them (an
        estimate that fails reads as none: a rescue must never be what ends a run), else a check that finds none."""
        predictions = self.predictor.predictions if self.capped else None
        return ReservedSegments(_none_where_it_fails(getattr(predictions, "measure_reserved", None)),
                                _none_where_it_fails(getattr(predictions, "split_reserved", None)), capacity, top_aim)

    def _judge(self, obs: StepObservation) -> list[Decision]:
        s = self._state
        trial, s.trial = s.trial, None
        # Rungs change only what the forward and backward allocate on top of what persists across steps (batch_start,
        # gradients not counted: every front door hands in static bytes without them). Comparing that part keeps the
        # judgement fair when the steps differ in persistent memory (step 0 has no optimizer state yet, step 1 has)
        # and when the optimizer step was a step's peak (the optimizer state is created there at step 0).
        before, after = format_bytes(trial.peak_before), format_bytes(obs.peak_bytes)
        if trial.static_before is not None and obs.static_bytes is not None:
            active_after = obs.activation_peak_bytes
            if trial.activation_before is not None and active_after is not None:
                added_before = trial.activation_before - trial.static_before
                added_after = active_after - obs.static_bytes
            else:
                added_before, added_after = trial.peak_before - trial.static_before, obs.peak_bytes - obs.static_bytes
            saving = added_before - added_after
            gain = saving / trial.peak_before if trial.peak_before else 0.0
            numbers = (f"added above batch start {format_bytes(added_before)} -> {format_bytes(added_after)}, "
                       f"{format_bytes(saving)} less ({gain:.1%} of the step peak)")
            grew = obs.static_bytes - trial.static_before
            if obs.peak_bytes > trial.peak_before and grew > 0:  # say why, or a kept rung reads as if memory rose
                numbers += (f"; the step peak still rose, {before} -> {after}, because memory held across steps "
                            f"grew by {format_bytes(grew)} ("
                            + ("the optimizer state appears after the first step)" if trial.step == 0 else
                               "gradients and optimizer state of parameters that began training, or tensors kept "
                               "between steps)"))
            elif obs.peak_bytes > trial.peak_before:
                numbers += f"; the step peak rose, {before} -> {after}"
            else:
                numbers += f"; step peak {before} -> {after}"
        else:
            saving = trial.peak_before - obs.peak_bytes
            gain = saving / trial.peak_before if trial.peak_before else 0.0
            numbers = f"step peak {before} -> {after}, {format_bytes(saving)} less ({gain:.1%})"
        if saving > 0:
            s.gain_per_level[trial.rung] = saving / max(1, trial.to_level - trial.from_level)
        if trial.rescued:
            # The peak before was measured when the allocation failed, short of what the step needed, so the
            # saving is understated; what counts is that the batch then ran. Reverting would bring the OOM back.
            if saving <= 0:  # the failed attempt stopped where its allocation failed: no like-with-like numbers
                numbers = (f"the failed attempt reached {before} where its allocation failed, short of what the step "
                           f"needed; the step then ran, peaking at {after}")
            else:
                numbers += " against the failed attempt"
            reason = f"{trial.rung} rescued an out-of-memory step: kept ({numbers})"
            action, level = "keep", trial.to_level
        elif gain >= self.min_gain:
            reason, action, level = f"{trial.rung} helped: {numbers}", "keep", trial.to_level
        else:
            s.failed.add(trial.rung)
            reason = f"{trial.rung} did not help enough (needs {self.min_gain:.0%}): {numbers}"
            action, level = "revert", trial.from_level
        return [Decision(step=obs.step, action=action, rung=trial.rung, level=level, reason=reason,
                         peak_before_bytes=trial.peak_before, peak_after_bytes=obs.peak_bytes, phase=obs.peak_phase)]

    def _steps_up(self, obs: StepObservation, now: Mapping[str, int], limit: int, skip: Sequence[str] = (),
                  rescue: bool = False, size: Optional[BatchSize] = None) -> list[tuple[str, int, Optional[int]]]:
        """``(rung, level, predicted peak or None)`` to apply from the levels ``now``: the first rung of the ladder
        that can still climb, and, in a rescue, the rungs after it while the prediction says those before are not
        enough (predicted for a batch of ``size``; ``None``: the estimated batch)."""
        s = self._state
        levels = dict(now)  # with the steps taken so far
        scale = self._scale(obs, now, rescue, size)
        steps: list[tuple[str, int, Optional[int]]] = []
        self._passed_over = {}
        for rung in self.ladder:
            level, top = levels[rung], self.max_levels[rung]
            if rung in s.failed or rung in skip or level >= top or top <= 0:
                continue
            predicted = self._predictions(rung, levels, scale, size)
            if predicted is None:
                return steps + [(rung, self._measured_level(rung, level, obs, limit), None)]
            aim = self._aim(rung, obs.capacity_bytes, limit)
            fitting = _first_under(predicted, aim)
            if fitting is not None:
                return steps + [(rung, *fitting)]
            current = self.predictor.peak(levels, scale, size)
            if current is not None and predicted[-1][1] > current * (1 - self.min_gain):
                # its top is predicted to save less than a trial must show: a step spent on it for nothing (the
                # blocks of a model whose peak is what no block holds), then reverted; the next rung instead
                self._passed_over[rung] = (current, predicted[-1][1])
                continue
            # no level fits: the fewest that come within what a trial must show of the top's peak. Levels beyond
            # save next to nothing where what no level lowers is the peak (an optimizer step's state and
            # temporaries), and each costs throughput: 256 micro-batches of one sample were taken for 1.5 %
            worth = predicted[-1][1] + self.min_gain * (current if current is not None else predicted[-1][1])
            level_taken, peak_taken = next((lv, pk) for lv, pk in predicted if pk <= worth)
            steps.append((rung, level_taken, peak_taken))
            levels[rung] = level_taken
            if not rescue:
                return steps
        return steps

    def aim(self, rung: str, capacity_bytes: Optional[int]) -> float:
        """The predicted peak a level of ``rung`` must stay under at ``capacity_bytes`` (see :meth:`_aim`)."""
        return self._aim(rung, capacity_bytes, self.limit_bytes(capacity_bytes)) if capacity_bytes else 0.0

    def _aim(self, rung: str, capacity: Optional[int], limit: int) -> float:
        """A predicted peak to stay under, with a 5 % margin: the threshold's limit, or for a last-resort rung the
        capacity itself (between the two it holds, see ``last_resort``)."""
        return AIM_SHARE * (capacity if rung in self.last_resort and capacity else limit)

    def _scale(self, obs: StepObservation, levels: Mapping[str, int], rescue: bool,
               size: Optional[BatchSize] = None) -> Optional[float]:
        """What the predictions (for a batch of ``size``, else the estimated one) are multiplied by: the estimate is
        of a steady step; a rescue's peak (read when an allocation failed) and a first step's (before its gradients
        and optimizer state) fall short of one, and may scale it up, never down."""
        return self.predictor.correction(obs.peak_bytes, levels, size,
                                         up_only=rescue or obs.next_peak_bytes > obs.peak_bytes)

    def _predictions(self, rung: str, levels: Mapping[str, int], scale: Optional[float],
                     size: Optional[BatchSize] = None):
        """``[(level, scaled predicted peak)]`` for each level of ``rung`` above the present one (for a batch of
        ``size``; ``None``: the estimated batch), or ``None`` when the estimate does not cover it."""
        if scale is None or not self.predictor.covers(rung):
            return None
        predicted = [(level, self.predictor.peak({**levels, rung: level}, scale, size))
                     for level in range(levels[rung] + 1, self.max_levels[rung] + 1)]
        return None if any(peak is None for _, peak in predicted) else predicted

    def _measured_level(self, rung: str, level: int, obs: StepObservation, limit: int) -> int:
        """The next level of a rung the estimate does not cover (at ``level`` now): one level of a single-step rung,
        a first fraction of a multi-level one, then as many levels as the measured saving per level says are
        needed."""
        s = self._state
        top = self.max_levels[rung]
        if rung in self.single_step:
            return level + 1
        if level == 0:
            return max(1, math.ceil(top * self.first_fraction))
        per_level = s.gain_per_level.get(rung)
        if per_level and per_level > 0:
            # enough levels to bring the peak under the threshold with a 5 % margin, by the measured saving
            needed = math.ceil((obs.peak_bytes - AIM_SHARE * limit) / per_level)
            return min(top, level + max(1, needed))
        return min(top, level + max(1, math.ceil(top * self.first_fraction)))

    def _hold(self, obs: StepObservation, rung: str, level: int, why_near: str) -> list[Decision]:
        s = self._state
        key = f"hold:{rung}:{level}"
        if key in s.warned:
            return []
        s.warned.add(key)
        reason = (f"{why_near}, but under the capacity: {rung} stays at level {level}. Each further level "
                  "costs throughput, so it is raised only when a step does not fit (an out-of-memory error, rescued "
                  "on the same batch, or a peak over the capacity)")
        return [Decision(step=obs.step, action="hold", rung=rung, level=level, reason=reason,
                         peak_before_bytes=obs.peak_bytes, phase=obs.peak_phase)]

    def _cannot_help(self, obs: StepObservation, limit: int) -> list[Decision]:
        s = self._state
        if "cannot_help" in s.warned:
            return []
        s.warned.add("cannot_help")
        if obs.peak_phase == "batch_start" and (obs.static_bytes is None or obs.static_bytes < limit):
            reason = (f"the peak ({format_bytes(obs.peak_bytes)}) is between optimizer steps (batch_start covers data "
                      f"loading, validation, checkpointing and logging), limit {format_bytes(limit)}; remedies of "
                      "the training step cannot lower it. What would: smaller validation batches, fewer prefetched "
                      "batches, or dropping references to outputs kept between steps.")
        else:
            static = f"{format_bytes(obs.static_bytes)} held across steps (parameters, optimizer state, the batch)"
            steady = self.predictor.held_bytes()
            if steady is not None and obs.static_bytes is not None and steady > obs.static_bytes:
                # a first step starts before the gradients and the optimizer state exist: the estimate's steady step
                # holds them
                static += (f" now, {format_bytes(steady)} from the next step on by the estimate (gradients and "
                           "optimizer state included)")
            sizes = getattr(self.predictor.predictions, "sizes", None)  # the estimate's parts, where it was made
            # foreach=False lowers the optimizer step's temporaries only: named where the step peaked there
            foreach_helps = obs.peak_phase == "after_optimizer_step"
            reason = (f"the peak ({format_bytes(obs.peak_bytes)}) is in {obs.peak_phase}, limit {format_bytes(limit)}; "
                      f"{static}. Activation remedies (AMP, checkpointing) cannot lower it. What would: "
                      f"{what_would_help(sizes, obs.peak_bytes - limit, foreach_helps=foreach_helps)}.")
        return [Decision(step=obs.step, action="cannot_help", reason=reason, peak_before_bytes=obs.peak_bytes,
                         phase=obs.peak_phase)]

    def _why_no_rung(self, levels: Mapping[str, int], skip: Sequence[str], unsafe: bool = False) -> str:
        """Why no rung at ``levels`` climbs, rung by rung, as the last :meth:`_steps_up` found: at its top, reverted,
        passed over (``skip``: held as a last resort, or with ``unsafe`` not switchable inside a step), or predicted
        at its top to save less than a kept rung must (the estimate's figures: a rung never applied is not one that
        "did not help")."""
        s = self._state
        if not self.ladder:
            return "no mitigations are configured (warn only)"
        parts = []
        for rung in self.ladder:
            level, top = levels[rung], self.max_levels[rung]
            if rung in s.broken:
                said = "off (the step failed with it)"
            elif rung in s.failed:
                said = "reverted (it did not help enough)"
            elif top <= 0:
                said = self._no_levels.get(rung) or "has no level to climb to"
            elif level >= top:
                said = "at its top level"
            elif rung in skip:
                said = "cannot be switched inside a step" if unsafe else "held (it costs throughput)"
            elif rung in self._passed_over:
                now, at_top = self._passed_over[rung]
                said = (f"predicted not to help: at its top level, {top}, the step peak is predicted at "
                        f"{format_bytes(at_top)} against {format_bytes(now)} at level {level}, "
                        f"{(now - at_top) / now if now else 0.0:.1%} less (a rung is kept for {self.min_gain:.0%})")
            else:
                said = "not raised"
            parts.append(f"{rung} at {level}/{top}: {said}")
        return "no rung of the ladder can be raised to lower it: " + "; ".join(parts)


def _first_under(predicted: Sequence[tuple[int, int]], aim: float) -> Optional[tuple[int, int]]:
    """The lowest ``(level, predicted peak)`` whose peak is under ``aim``."""
    return next(((level, peak) for level, peak in predicted if peak <= aim), None)


def _combination_text(rung: str, level: int, steps: Sequence[tuple[str, int, Optional[int]]]) -> str:
    others = ", ".join(f"{r} at {lv}" for r, lv, _ in steps if r != rung)
    return f"{rung} to level {level}, with {others}: the cheapest combination predicted to fit"


class _Combination(NamedTuple):
    """What :meth:`MitigationPolicy._cheapest_combination` chose: the rungs to change, in ladder order, as ``(rung,
    level, predicted step peak)`` (the peak on the last only), and the allocator's segments predicted at the levels
    reached, where the capacity caps them and the estimate reads them (else ``None``)."""

    steps: list[tuple[str, int, Optional[int]]]
    reserved: Optional[int]


def _predicted_text(predicted: Optional[int], reserved: Optional[int] = None, cap: Optional[int] = None) -> str:
    """An event's figures: the predicted step peak, and where read, the allocator's predicted segments against the
    cap (over it where no combination's segments fit: the allocated peaks' choice, the estimate's best guess)."""
    if predicted is None:
        return ""
    if reserved is None or cap is None:
        return f" (predicted step peak {format_bytes(predicted)})"
    side = "under" if reserved <= cap else "still over"
    return (f" (predicted step peak {format_bytes(predicted)}; the caching allocator's segments "
            f"{format_bytes(reserved)}, {side} the capacity {format_bytes(cap)})")


def _none_where_it_fails(read: Optional[Callable[..., Optional[int]]]) -> Optional[Callable[..., Optional[int]]]:
    """``read``, answering ``None`` (no figure) where it raises; ``None`` where ``read`` is."""
    if read is None:
        return None

    def reading(*args) -> Optional[int]:
        try:
            return read(*args)
        except Exception:
            return None

    return reading
