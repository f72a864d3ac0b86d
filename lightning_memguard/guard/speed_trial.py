"""The speed trial: which of two configurations that both fit runs faster, measured on real steps.

The policy and the plan choose levels in a fixed order of cost: the fewest micro-batch halvings, then the fewest
checkpointed blocks (:func:`~lightning_memguard.base.prediction.cheapest_levels`). Which of the two is really cheaper
depends on the device and the model: checkpointing recomputes each block's forward, each micro-batch pass launches
every kernel again and reads the weights again. So once the levels settle on a configuration that checkpoints blocks,
and the estimate says that one more micro-batch halving with fewer checkpointed blocks fits under the same aim too,
both are timed on real steps and the faster is kept, with a ``speed_keep`` event that gives both timings.

Framework-free: the ladder hands in each step's observation, the levels it ran at, what the policy decided and the
step's wall time (the engine times steps only while a trial runs); what it returns is carried out like the policy's
decisions. One process only: with several, every rank would have to agree on the timings.
"""

from __future__ import annotations

import statistics
from typing import Mapping, Optional

from ..base.prediction import ReservedSegments, StepPredictor, cheapest_levels
from ..base.snapshot import format_bytes, format_bytes_apart
from .policy import Decision, MitigationPolicy, StepObservation

__all__ = ["SpeedTrial", "TIMED_STEPS"]

#: Steps timed with each configuration (after one warm-up step); the median of them is compared.
TIMED_STEPS = 3
#: Consecutive quiet steps at the same levels before they count as settled: the first is the warm-up of the
#: settled configuration (the first step after a change may build caches, the first of a fit the optimizer state).
_SETTLED_STEPS = 2


def _key(levels: Mapping[str, int]) -> tuple:
    return tuple(sorted(levels.items()))


def _text(levels: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {level}" for name, level in levels.items())


class SpeedTrial:
    """Times the settled levels against the alternative the estimate predicts to fit, and keeps the faster.

    Args:
        policy: the ladder's policy (its line, its aims, the rungs' top levels and those it turned off).
        predictor: what the estimate of the first batch predicts (the same the policy reads).
        enabled: ``speed_trial=True`` with one process; otherwise :meth:`after_step` does nothing.
        capped: the capacity caps what the CUDA caching allocator reserves (the card, a memory fraction; not a
            ``budget=``): the alternative's segments, estimated at its micro-batch's size, must fit under it too.
    """

    def __init__(self, policy: MitigationPolicy, predictor: StepPredictor, enabled: bool, capped: bool = False) -> None:
        self.policy, self.predictor, self.enabled, self.capped = policy, predictor, enabled, capped
        self.reset()

    def reset(self) -> None:
        """Forgets a trial in progress and the levels already tried (a resume puts other levels in place)."""
        self._tried: set[tuple] = set()  # settled levels timed once (or found without an alternative) in this fit
        self._quiet: tuple[dict, int] = ({}, 0)  # the levels of the last quiet steps, and how many in a row
        self._phase = ""  # "" no trial, "settled" timing the settled levels, "alternative" timing the other
        self._settled: dict[str, int] = {}
        self._alternative: dict[str, int] = {}
        self._predicted: Optional[int] = None  # the alternative's scaled predicted peak
        self._times: dict[str, list[float]] = {"settled": [], "alternative": []}
        self._warm_up = False  # the next step is the alternative's first: not timed

    def state_dict(self) -> list[dict[str, int]]:
        """The settled levels already timed (or found to have no alternative), for a checkpoint: a resumed run does
        not time its restored configuration again. A trial in progress is not saved (see :meth:`load_state_dict`)."""
        return [dict(key) for key in sorted(self._tried)]

    def load_state_dict(self, tried: list) -> None:
        """Forgets a trial in progress (the restored levels settle afresh) and takes the configurations ``tried``
        (:meth:`state_dict`) as timed."""
        self.reset()
        self._tried = {_key({str(name): int(level) for name, level in levels.items()}) for levels in tried}

    @property
    def timing(self) -> bool:
        """Whether the next step is to be timed (the engine then synchronises the device around it)."""
        return bool(self._phase)

    def after_step(self, obs: StepObservation, levels: Mapping[str, int], decided: list[Decision],
                   seconds: Optional[float]) -> list[Decision]:
        """What to change after ``obs.step``, which ran at ``levels`` and took ``seconds`` (``None``: not timed),
        once the policy's ``decided`` decisions are carried out: the levels of the configuration to time next, or of
        the faster one. Most steps: nothing."""
        if not self.enabled or obs.capacity_bytes is None:
            return []
        crossed = obs.peak_bytes >= self.policy.limit_bytes(obs.capacity_bytes)
        moved = bool(decided) and any(d.sets_level for d in decided)  # most steps: no decision
        if self._phase:
            return self._go_on(obs, levels, crossed, decided if moved else [], seconds)
        # a step the policy said anything of but that a rung it tried helped (``keep``) is not a settled one: it
        # crossed the threshold, or the allocator retried
        if moved or crossed or self.policy.judging or (decided and any(d.action != "keep" for d in decided)):
            self._quiet = ({}, 0)
            return []
        # most steps: the same levels as the last quiet ones (compared as dicts: no sorted key a step)
        quiet_levels, count = self._quiet
        if count and quiet_levels == levels:
            count += 1
        else:
            quiet_levels, count = dict(levels), 1
        self._quiet = (quiet_levels, count)
        if count >= _SETTLED_STEPS and levels.get("checkpointing", 0) > 0:
            key = _key(levels)
            if key not in self._tried:
                self._tried.add(key)
                self._start(obs, levels)
        return []

    def _start(self, obs: StepObservation, levels: Mapping[str, int]) -> None:
        alternative = self._alternative_levels(obs, levels)
        if alternative is None:
            return
        self._alternative, self._predicted = alternative
        self._settled, self._phase = dict(levels), "settled"
        self._times = {"settled": [], "alternative": []}

    def _alternative_levels(self, obs: StepObservation,
                            levels: Mapping[str, int]) -> Optional[tuple[dict[str, int], int]]:
        """One more micro-batch halving with the fewest checkpointed blocks (fewer than now, the precision as now)
        that the estimate, scaled to this step's measured peak, puts under the aim of the checkpointing rung (5 %
        under the threshold's line) — and, ``capped``, whose predicted segments fit under the capacity (estimated
        where the fewest blocks' do not, at the micro-batch's size: see ``split_reserved`` of
        :class:`~lightning_memguard.estimate.plan.StepPredictions`); ``None`` where there is no such configuration
        or the estimate cannot say."""
        policy, predictor = self.policy, self.predictor
        if "microbatch" not in levels or policy.is_disabled("microbatch") or not predictor.covers("microbatch") \
                or not predictor.covers("checkpointing"):
            return None
        micro, blocks = levels["microbatch"] + 1, levels["checkpointing"]
        if micro > policy.max_levels.get("microbatch", 0):
            return None
        scale = predictor.correction(obs.peak_bytes, levels)
        if scale is None:
            return None
        aim = policy.aim("checkpointing", obs.capacity_bytes)
        amp = levels.get("amp", 0)
        now = {**levels, "checkpointing": 0, "microbatch": micro}
        tops = {"amp": amp, "checkpointing": blocks - 1, "microbatch": micro}
        found = cheapest_levels(lambda at: predictor.peak(at, scale), now, tops, lambda _: aim)
        split = getattr(predictor.predictions, "split_reserved", None) if self.capped else None
        # the segments' one reading (base/prediction.py), shared with the plan and the policy's rescue
        segments = ReservedSegments(None, split, obs.capacity_bytes, aim)
        if found is not None and segments.over(*found):  # its segments over the cap: the fewest blocks whose fit
            segments.checking = True
            found = cheapest_levels(lambda at: segments.peak(at, predictor.peak(at, scale)), now, tops, lambda _: aim)
        if found is None:
            return None
        chosen, peak = found
        return {**levels, **{name: level for name, level in chosen.items() if name in levels}}, peak

    def _go_on(self, obs: StepObservation, levels: Mapping[str, int], crossed: bool, moves: list[Decision],
               seconds: Optional[float]) -> list[Decision]:
        """A step of the trial ran at ``levels``; ``moves``: the policy's decisions after it that set levels."""
        phase = self._phase
        expected = self._settled if phase == "settled" else self._alternative
        if moves or _key(levels) != _key(expected):
            self._phase = ""
            now = {**levels, **{d.rung: d.level for d in moves if d.rung in levels}}  # the step's, then the policy's
            return [self._say(obs, "speed_abandon", f"the levels changed for memory (now {_text(now)}) while "
                                                    f"{_text(expected)} was being timed: the speed trial stops")]
        if crossed:
            self._phase = ""
            if phase == "settled":  # the policy holds (or has nothing left): the settled levels are its to change
                return [self._say(obs, "speed_abandon", f"a step at {_text(levels)} crossed the threshold while it "
                                                        "was being timed: the speed trial stops")]
            self._tried.add(_key(levels))
            why = (f"the speed trial's {_text(levels)} crossed the threshold (peak {format_bytes(obs.peak_bytes)}, "
                   f"predicted {format_bytes(self._predicted)}): back to {_text(self._settled)}")
            return self._set(obs, self._settled, levels, why)
        if phase == "alternative" and self._warm_up:
            self._warm_up = False
            return []
        if seconds is not None:
            self._times[phase].append(seconds)
        if len(self._times[phase]) < TIMED_STEPS:
            return []
        if phase == "settled":
            self._phase, self._warm_up = "alternative", True
            aim = int(self.policy.aim("checkpointing", obs.capacity_bytes))
            predicted, under = format_bytes_apart(self._predicted, aim)
            why = (f"{_text(levels)} settled at {self._ms('settled')} a step; timing {_text(self._alternative)}, "
                   f"predicted to fit too (step peak {predicted}, under {under}): "
                   "checkpointing recomputes each block's forward, each micro-batch pass runs every kernel again")
            return self._set(obs, self._alternative, levels, why)
        return self._verdict(obs, levels)

    def _verdict(self, obs: StepObservation, levels: Mapping[str, int]) -> list[Decision]:
        self._phase = ""
        self._tried.add(_key(self._alternative))
        faster = statistics.median(self._times["alternative"]) < statistics.median(self._times["settled"])
        kept = self._alternative if faster else self._settled
        timings = (f"{_text(self._alternative)}: {self._ms('alternative')} a step; {_text(self._settled)}: "
                   f"{self._ms('settled')} a step (median of {TIMED_STEPS} timed steps each, after a warm-up step)")
        decisions = [] if faster else self._set(obs, self._settled, levels, f"slower, back: {timings}")
        return decisions + [self._say(obs, "speed_keep", f"kept {_text(kept)}, the faster: {timings}")]

    def _ms(self, phase: str) -> str:
        return f"{1000 * statistics.median(self._times[phase]):.1f} ms"

    def _set(self, obs: StepObservation, target: Mapping[str, int], now: Mapping[str, int],
             why: str) -> list[Decision]:
        """``speed_trial`` decisions that set the rungs that differ between ``now`` and ``target``."""
        return [Decision(step=obs.step, action="speed_trial", rung=name, level=level, reason=why,
                         peak_before_bytes=obs.peak_bytes, phase=obs.peak_phase)
                for name, level in target.items() if now.get(name) != level]

    @staticmethod
    def _say(obs: StepObservation, action: str, why: str) -> Decision:
        return Decision(step=obs.step, action=action, reason=why, peak_before_bytes=obs.peak_bytes,
                        phase=obs.peak_phase)
