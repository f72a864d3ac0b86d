"""The ladder: the rungs of one fit and their levels, the policy that decides them, and the bookkeeping that makes them
survive a resume and a rung that breaks the step. The rungs hold the levels; the ladder hands them to the policy
(policy.py) and carries out its decisions. Framework-free: the front door hands in the model, its device and its way
of switching precision."""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..base.batches import BatchSize
from ..base.checks import warn as default_warn
from ..base.prediction import StepPredictor
from ..mitigations.amp import AmpSwitch, PrecisionSwitch
from ..mitigations.checkpointing import ActivationCheckpointing, BlockSpec
from ..mitigations.microbatch import MicroBatching
from ..mitigations.offload import ActivationOffload
from ..mitigations.rung import BoundRung, Rung, check_rung
from .oom import error_line
from .parts import BatchParts
from .policy import Decision, MitigationPolicy, StepObservation
from .rung_search import BrokenRungSearch
from .speed_trial import SpeedTrial

#: Rung names a ladder may hold.
RUNGS: tuple[str, ...] = ("amp", "checkpointing", "offload", "microbatch")
#: The ladder used unless told otherwise. Micro-batching comes last: it keeps the optimizer's batch but runs it in
#: several passes, the slowest remedy. Offload trades GPU memory for PCIe traffic: opt-in.
DEFAULT_LADDER: tuple[str, ...] = ("amp", "checkpointing", "microbatch")
LadderRung = Union[AmpSwitch, ActivationCheckpointing, ActivationOffload, MicroBatching, BoundRung]
#: One entry of ``mitigations=``: a built-in rung's name or a user's :class:`~lightning_memguard.Rung`.
Mitigation = Union[str, Rung]


def validate_ladder(mitigations: Sequence[Mitigation]) -> tuple[Mitigation, ...]:
    """Checks a ``mitigations=`` argument: a sequence of distinct built-in rung names and user rungs
    (:class:`~lightning_memguard.Rung`), in climbing order (may be empty: warn only)."""
    if not isinstance(mitigations, (list, tuple)):
        raise ValueError(f"mitigations={mitigations!r} must be a list or tuple of rung names from {RUNGS} or "
                         "lightning_memguard.Rung objects, e.g. ('amp',); () only warns and logs")
    unknown = [m for m in mitigations if isinstance(m, str) and m not in RUNGS]
    if unknown:
        raise ValueError(f"mitigations={tuple(mitigations)!r}: unknown rung(s) {unknown}; allowed: {RUNGS} or a "
                         "lightning_memguard.Rung")
    taken: set[str] = set()
    for mitigation in mitigations:
        try:
            name = mitigation if isinstance(mitigation, str) else check_rung(mitigation).name
        except ValueError as err:
            raise ValueError(f"mitigations={tuple(mitigations)!r}: {err}") from None
        if not isinstance(mitigation, str) and name in RUNGS:
            raise ValueError(f"mitigations={tuple(mitigations)!r}: the rung {type(mitigation).__name__} is named "
                             f"{name!r}, the name of a built-in rung; give it a name other than {RUNGS}")
        if name in taken:
            raise ValueError(f"mitigations={tuple(mitigations)!r}: two rungs are named {name!r} (a name given "
                             "twice); each rung needs its own name")
        taken.add(name)
    return tuple(mitigations)


class Ladder:
    """Builds the rungs for a trainer and model, feeds step observations and the rungs' levels to the policy and
    carries out its decisions. Each rung's ``level`` is the one record of its level: every change goes through
    :meth:`_set_levels`."""

    def __init__(self, mitigations: tuple[Mitigation, ...], threshold: float, blocks: BlockSpec, min_gain: float,
                 is_default: bool = False, warn: Callable[[str], None] = default_warn,
                 microbatch_weight: Optional[Callable] = None) -> None:
        self.warn = warn  # a front door with several processes warns on rank zero only
        self.names = tuple(m if isinstance(m, str) else m.name for m in mitigations)
        #: the user's rungs by name, bound to the model of each fit in :meth:`setup`
        self.custom: dict[str, Rung] = {m.name: m for m in mitigations if not isinstance(m, str)}
        self.is_default = is_default  # the default ladder adapts to the hardware; one the user names is kept
        self.threshold = threshold
        self.blocks = blocks
        self.min_gain = min_gain
        self.microbatch_weight = microbatch_weight  # what a batch's loss averages over (None: labels or samples)
        self.rungs: dict[str, LadderRung] = {}
        self.automatic = True  # the front door runs forward and backward (set per fit)
        self.policy: Optional[MitigationPolicy] = None
        #: whether :meth:`note_batch` took this fit's first batch (asked before every batch)
        self.batch_seen = False
        #: rung -> its level at the last step that ran, for the rungs changed since: a rung on probation
        self._untried: dict[str, int] = {}
        #: which of several rungs changed together broke the step, while an attempt tells (``None``: no search)
        self._search: Optional[BrokenRungSearch] = None
        #: how many parts each batch runs in (the micro-batch rung's level, one-off splits, evaluation loops' parts)
        self.parts = BatchParts()
        #: what the estimate of the first batch predicts, read by the policy, the long-batch split and the plan
        self.predictor = StepPredictor()
        #: times the settled levels against one more micro-batch halving with fewer blocks (built in :meth:`setup`)
        self.speed: Optional[SpeedTrial] = None

    def setup(self, module: nn.Module, device: torch.device, precision: Optional[PrecisionSwitch],
              automatic_optimization: bool = True, state: Optional[dict] = None, guarding: bool = True,
              rescue: bool = True, speed_trial: bool = False, capped: bool = False) -> None:
        """Builds the rungs for ``module`` training on ``device`` (dropping those this run cannot use, with one
        warning each when ``guarding``: a run with no capacity to guard only monitors, and a rung it could not use is
        no news) and, when ``state`` comes from a checkpoint, puts every rung back at its saved level before the
        first step. ``precision`` is the front door's way of switching to mixed precision (``None``: no AMP rung);
        ``automatic_optimization``: the front door runs forward and backward itself (micro-batching needs that);
        ``rescue``: an OOM in forward or backward will be rescued, so micro-batching may wait for one instead of
        costing throughput as soon as the threshold is crossed; ``speed_trial``: time the settled levels against one
        more micro-batch halving with fewer checkpointed blocks and keep the faster
        (:class:`~lightning_memguard.guard.speed_trial.SpeedTrial`; one process only); ``capped``: the capacity caps
        what the CUDA caching allocator reserves (the combination an OOM rescue goes to and the trial's alternative
        must fit their predicted segments under it; one process only: the segments are this rank's estimate)."""
        self.rungs = {}
        self.automatic = automatic_optimization
        for name in self.names:
            rung = self._build(name, module, device, precision, automatic_optimization, guarding)
            if rung is None:
                continue
            reason = rung.unavailable_reason()
            if reason:
                if guarding:
                    self.warn(f"lightning-memguard: the {name} rung is off for this run: {reason}.")
                continue
            self.rungs[name] = rung
        self.predictor = StepPredictor()
        self.policy = MitigationPolicy(self.threshold, tuple(self.rungs),
                                       {name: rung.max_level for name, rung in self.rungs.items()}, self.min_gain,
                                       single_step=("microbatch",), predictor=self.predictor,
                                       last_resort=("microbatch",) if rescue else (), capped=capped)
        # a split known to change the numbers (BatchNorm, a router loss) is for memory only, never for speed
        inexact = getattr(self.rungs.get("microbatch"), "inexact_reason", lambda: None)()
        self.speed = SpeedTrial(self.policy, self.predictor, enabled=speed_trial and guarding and inexact is None,
                                capped=capped)
        self.batch_seen = False
        self._untried, self._search = {}, None
        self.parts.begin(self.rungs.get("microbatch"))
        if state:  # else a rung left on by an earlier fit of the same model stays on: its level is the rung's
            self.restore(state)

    def restore(self, state: dict) -> None:
        """Puts the policy and every rung back where a checkpoint (:meth:`state_dict`) left them; a rung the
        checkpoint has no level for is off.

        Raises:
            ValueError: the checkpoint holds a level this run's rungs cannot take (say, more checkpointed blocks
                than ``blocks=`` finds now), saying so and what to pass.
        """
        saved = state.get("levels") or {}
        for name, level in saved.items():
            rung = self.rungs.get(name)
            if rung is not None and not 0 <= int(level) <= rung.max_level:
                hint = (" Resume with the blocks= the run was saved with (or blocks=None to detect them), or "
                        "start without the checkpoint's MemGuard state." if name == "checkpointing" else "")
                raise ValueError(f"the checkpoint being resumed saved MemGuard's {name} rung at level {level}, but "
                                 f"this run allows levels 0-{rung.max_level} for it.{hint}")
        self.policy.load_state_dict(state)
        self.policy.settle_trial()
        if self.speed is not None:  # a trial in progress is not saved; levels it timed are not timed again
            self.speed.load_state_dict(state.get("speed_tried", ()))
        self._set_levels({name: int(saved.get(name, 0)) for name in self.rungs})

    def _build(self, name: str, module: nn.Module, device: torch.device, precision: Optional[PrecisionSwitch],
               automatic_optimization: bool, guarding: bool) -> Optional[LadderRung]:
        if name in self.custom:
            return BoundRung(self.custom[name], module)
        if name == "amp":
            return AmpSwitch(precision, explicit=not self.is_default) if precision is not None else None
        if name == "offload":
            return ActivationOffload(module, device.type)
        if name == "microbatch":
            return MicroBatching(module, automatic_optimization, self.microbatch_weight, self.warn)
        try:
            return ActivationCheckpointing(module, self.blocks)
        except ValueError:
            if self.blocks is not None:
                raise  # the user named blocks that are not there: say so instead of training unguarded
            if guarding:
                self.warn(f"lightning-memguard: no repeated blocks found in {type(module).__name__}, so the "
                              "checkpointing rung is off; name the blocks with blocks=... to use it.")
            return None

    def _judge_layout(self, rung, batch, module: nn.Module, loss_fn) -> None:
        """Every tensor of the batch has one leading size and the model has layers that read their input's leading size
        as time steps: one forward on the meta device shows whether they receive the batch's (then the rung is off:
        a split would cut sequences, mitigations/sequence_layout.py). A forward that cannot run there says so once
        and the batches are split as their shapes say."""
        from ..estimate.probe import first_inputs  # the estimator is loaded where a model has such layers only

        try:
            rung.judge_layout(first_inputs(module, batch, rung.time_axis_layers, loss_fn))
        except Exception as err:
            rung.needs_layout = False
            self.warn(f"lightning-memguard: {type(module).__name__} has layers that read their input time-major "
                      f"({', '.join(rung.time_axis_layers[:3])}), and its forward could not run on the meta device "
                      f"to see whether they receive the batch's leading size ({type(err).__name__}: "
                      f"{str(err)[:200]}); micro-batches split the leading size, which is right only if it counts the "
                      "samples.")

    def note_batch(self, batch, module: nn.Module, target: Optional[str], optimizer=None, loss_fn=None,
                   reduce_max: Optional[Callable[[list[int]], list[int]]] = None, precision: str = "32-true",
                   data_parallel: Optional[tuple[str, int]] = None) -> None:
        """Called at each batch start. The first batch tells micro-batching how far it can split and, when a
        ``target`` is given (the run guards a capacity), lets the estimate predict what each rung level will need
        (``optimizer`` and ``loss_fn`` as :func:`~lightning_memguard.estimate_memory` takes them). With several
        processes ``reduce_max`` (the element-wise maximum over ranks) gives every rank the same predictions — the
        worst rank's — so that all choose the same levels (a rank with other micro-batches would mismatch DDP's
        collectives). ``precision`` is the run's own (a mixed one is estimated as it is); ``data_parallel`` how the
        module trains over the ranks where the module does not show it (``("ddp", ranks)``: its buckets are memory of
        every rank's step)."""
        if self.batch_seen or self.policy is None:
            return
        self.batch_seen = True
        rung = self.rungs.get("microbatch")
        if rung is not None:
            rung.observe_batch(batch)
            if rung.needs_layout:
                self._judge_layout(rung, batch, module, loss_fn)
            if not rung.splittable:
                self.warn(f"lightning-memguard: the microbatch rung is off for this run: {rung.unsplittable}.")
            top = rung.max_level if rung.splittable else 0
            self.policy.set_max_level("microbatch", top, rung.no_levels_reason)
            if rung.level > top:  # restored from a checkpoint taken with larger batches: not a change to try out
                self._set_levels({"microbatch": top}, probation=False)
        if target is None or not {"checkpointing", "microbatch"} & set(self.rungs):
            return
        checkpointing = "checkpointing" in self.rungs
        # mixed precision is predicted for a run in full precision (a mixed one has no AMP rung to predict), on meta
        # with the target's autocast emulated (CUDA's or the CPU's casting rules)
        amp = "amp" in self.rungs and precision == "32-true"
        # the estimator is loaded by the first run that predicts: one that only monitors never loads it
        from ..estimate.plan import RungPredictionError, ladder_predictions

        name = type(module).__name__
        try:
            # one process: the estimates of other levels are made when a question first reads them (most runs fit
            # as they are); several ranks agree on every number now
            predictions = ladder_predictions(module, batch, self.blocks, target, optimizer, loss_fn, checkpointing,
                                             amp, precision, later=reduce_max is None, data_parallel=data_parallel)
            self.predictor.use(predictions, BatchSize.of(batch), lambda err: self._rung_fails(name, err))
        except RungPredictionError as err:
            self._rung_fails(name, err)
        except Exception as err:  # an estimate it cannot make: the closed loop measures instead
            why = f"{type(err).__name__}: {str(err)[:200]}"
            self.warn(f"lightning-memguard: the rung levels cannot be predicted for {name} "
                      f"({why}); they are found by measuring steps instead.")
        n_blocks = self.rungs["checkpointing"].max_level + 1 if checkpointing else 1
        if reduce_max is not None and not self.predictor.agree(reduce_max, (0, 1) if amp else (0,), n_blocks):
            self.warn("lightning-memguard: the rung levels could not be predicted on every rank; they are found "
                      "by measuring steps instead.")

    def usable(self, name: str) -> bool:
        """Whether the rung is on this ladder and may still be raised (not reverted or turned off)."""
        return name in self.rungs and self.policy is not None and not self.policy.is_disabled(name)

    def _rung_fails(self, model_name: str, err) -> None:
        """The step ran, and ran again with the rung (``err``, a RungPredictionError): the rung breaks this model, so
        it is never applied blind."""
        self._turn_off(err.rung, f"the {err.rung} rung is off for this run: {model_name} fails with it "
                                 f"({error_line(err.error)}, in the estimate of the first batch)")

    def _turn_off(self, name: str, why: str) -> None:
        self.policy.disable(name)
        self._set_levels({name: 0})
        self.warn(f"lightning-memguard: {why}.")

    @property
    def untried(self) -> bool:
        """Whether rungs changed since the last optimizer step completed: an error now may be theirs
        (:meth:`revert_untried`)."""
        return bool(self._untried)

    def untried_levels(self) -> dict[str, tuple[int, int]]:
        """The rungs changed since the last optimizer step completed: name -> (the level it last ran at, its level
        now)."""
        return {name: (level, self.rungs[name].level) for name, level in self._untried.items()
                if self.rungs[name].level != level}

    def step_ran(self) -> None:
        """An optimizer step completed: the rungs changed before it work with this model."""
        if self._untried:  # most steps changed nothing: no new table
            self._untried = {}
        self._search = None  # a search's attempt ran (its finding was taken where the attempt ended)

    def revert_untried(self, step: int, error: str) -> list[Decision]:
        """A step failed with an error that is not an out-of-memory error before any step ran with the rungs that
        changed last: puts the one that broke it back at the level it last ran at and never raises it again. Returns
        the decisions (none when no rung changed: the error is the model's own). One rung changed: that one. Several
        changed together (a plan, a rescue): they are searched (:mod:`~lightning_memguard.guard.rung_search`), one put
        back a failed attempt, so that those that work keep their levels. The levels put back ran: they are not on
        probation, so the same error again is the model's own."""
        changed = {name: level for name, level in self._untried.items() if self.rungs[name].level != level}
        search = self._search
        if search is None and len(changed) < 2:
            return self._revert(changed, step, error)
        decisions = []
        if search is None:
            search = self._search = BrokenRungSearch({name: (level, self.rungs[name].level)
                                                      for name, level in changed.items()})
        elif search.testing is not None:  # the step failed with that rung put back too: not the one that broke it
            name, level = search.testing, search.changed[search.testing][1]
            decisions.append(Decision(step=step, action="apply", rung=name, level=level, reason=(
                f"{name} back to level {level}: the step failed with it put back too ({error}), so it is not what "
                "broke the step")))
            self._set_levels({name: level}, probation=False)
        suspect = search.next_suspect()
        if suspect is None:  # one left: the culprit, without a trial
            culprit, self._search = search.culprit, None
            others = {name: old for name, (old, _) in search.changed.items() if name != culprit}
            decisions += self._revert({culprit: search.changed[culprit][0]}, step, error, (
                f"; of the rungs changed together ({search.names()}) the others were put back in turn and the step "
                "failed the same way, so they keep their levels"))
            self._untried = others  # still on probation: a further break is theirs
            return decisions
        old = search.changed[suspect][0]
        decisions.append(Decision(step=step, action="revert", rung=suspect, level=old, reason=(
            f"the step failed ({error}) after {len(search.changed)} rungs changed together ({search.names()}): "
            f"{suspect} is put back to level {old} and the batch runs again to find which broke it; if it runs, "
            f"{suspect} stays off for the run and the others keep their levels")))
        self._set_levels({suspect: old}, probation=False)
        return decisions

    @property
    def searching(self) -> bool:
        """Whether an attempt runs with one of several rungs changed together put back
        (:meth:`revert_untried`)."""
        return self._search is not None

    def broken_rung_found(self, step: int) -> list[Decision]:
        """An attempt ran while :attr:`searching`: the rung put back for it broke the step, and is never raised again;
        the others changed with it keep their levels."""
        search, self._search = self._search, None
        if search is None or search.testing is None:
            return []
        name = search.testing
        old, new = search.changed[name]
        self.policy.disable(name)
        return [Decision(step=step, action="revert", rung=name, level=old, reason=(
            f"{name} at level {new} broke the step: the batch ran with it back at level {old}; never raised again in "
            f"this run; the rungs changed with it keep their levels"))]

    def end_search(self, step: int, why: str) -> list[Decision]:
        """An out-of-memory error while :attr:`searching`: every rung changed together goes back where it last ran,
        never raised again (as where one rung broke the step); the OOM is then met by the rungs left."""
        search, self._search = self._search, None
        if search is None:
            return []
        for name in search.changed:
            self.policy.disable(name)
        changed = {name: old for name, (old, _) in search.changed.items()}
        decisions = [Decision(step=step, action="revert", rung=name, level=old, reason=(
            f"{why} while the rungs changed together after a step failed ({search.names()}) were put back one at a "
            f"time: {name} back to level {old}, never raised again in this run")) for name, old in changed.items()]
        self._set_levels(changed, probation=False)
        self._untried = {}
        return decisions

    def _revert(self, changed: Mapping[str, int], step: int, error: str, found: str = "") -> list[Decision]:
        decisions = []
        for name, level in changed.items():
            self.policy.disable(name)
            decisions.append(Decision(step=step, action="revert", rung=name, level=level, reason=(
                f"{name} at level {self.rungs[name].level} broke the step ({error}){found}; reverted to level "
                f"{level} and never raised again in this run; the batch runs again")))
        self._set_levels(changed, probation=False)
        self._untried = {}
        return decisions

    def after_step(self, observation: StepObservation, levels: Optional[dict[str, int]] = None,
                   seconds: Optional[float] = None) -> list[Decision]:
        """Between two optimizer steps: what the policy decides after ``observation``, then what the speed trial
        does, carried out. ``levels``: what :attr:`levels` returned since the last change (read once a step by a
        caller that needs them too); ``seconds``: the step's wall time, where the speed trial asked for it."""
        if self.policy is None:
            return []
        ran = self.levels if levels is None else levels
        decisions = self._carry_out(self.policy.decide(observation, ran))
        if self.speed is not None and self.speed.enabled:
            decisions += self._carry_out(self.speed.after_step(observation, ran, decisions, seconds))
        return decisions

    def escalate(self, observation: StepObservation, cause: str, retrying: bool = True,
                 size: Optional[BatchSize] = None) -> list[Decision]:
        """Applies at once what the policy says an OOM rescue needs (one rung, or several where the estimate predicts
        one is not enough); no decision if the ladder is exhausted. ``retrying``: the batch that ran out of memory
        runs again with it (else it already ran, and the change serves the next batches); ``size``: that batch's
        (``None``: as the estimated one)."""
        if self.policy is None:
            return []
        # a 16-mixed switch mid-step would scale this retry's loss while the optimizer step that is already running
        # (under the old plugin) would not unscale the gradients: only bf16 AMP may be switched inside a step
        skip = [name for name, rung in self.rungs.items() if not rung.safe_mid_step]
        return self._carry_out(self.policy.escalate(observation, self.levels, cause, skip, retrying, size))

    def apply_plan(self, levels: Mapping[str, int]) -> None:
        """Sets rungs to planned levels before training (outside the closed loop, which then corrects them); rungs
        this ladder does not have, or that were turned off, are left alone."""
        self._set_levels({name: level for name, level in levels.items() if self.usable(name)})

    def _carry_out(self, decisions: list[Decision]) -> list[Decision]:
        """Sets the levels the decisions set, in order; returns the decisions."""
        if not decisions:  # most steps: nothing to set
            return decisions
        levels = self.levels
        levels.update((d.rung, d.level) for d in decisions if d.sets_level)
        self._set_levels(levels)
        return decisions

    def _set_levels(self, levels: Mapping[str, int], probation: bool = True) -> None:
        """Sets each named rung to its level. With ``probation`` a rung that changes is suspect until a step runs
        with it (see :meth:`revert_untried`). A rung that engages says its caveats (micro-batching's)."""
        for name, level in levels.items():
            rung = self.rungs[name]
            if level == rung.level:
                continue
            if probation:
                self._untried.setdefault(name, rung.level)
            engaging, before = not rung.level, rung.level
            try:
                rung.set_level(level)
            except Exception as err:  # a rung that breaks the model must not end the run
                self._untried.pop(name, None)
                self._put_back(name, rung, before, err)
                continue
            for notice in getattr(rung, "notices", ()) if engaging else ():
                self.warn(f"lightning-memguard: {notice}.")

    def close(self) -> None:
        """Takes off the model what a rung left there for the fit only (micro-batching's one-shot hook that reads the
        flags of the model's first split call), where it is still there: the fit's end, however it ended."""
        for rung in self.rungs.values():
            close = getattr(rung, "close", None)
            if callable(close):
                close()

    def _put_back(self, name: str, rung: LadderRung, level: int, err: Exception) -> None:
        """A rung's ``set_level`` raised: it goes back to ``level`` and is never raised again in this run."""
        if self.policy is not None:
            self.policy.disable(name)
        try:
            rung.set_level(level)
            where = f"put back at level {level}"
        except Exception as again:
            where = f"and could not be put back at level {level} ({error_line(again)})"
        self.warn(f"lightning-memguard: the {name} rung failed to change level ({error_line(err)}); it was {where} "
                  "and is not used again in this run.")

    @property
    def levels(self) -> dict[str, int]:
        """The level each rung is at now (rung name → level, in ladder order)."""
        return {name: rung.level for name, rung in self.rungs.items()}

    def state_dict(self) -> dict:
        """The levels and the policy's state, for a checkpoint: ``{"levels": {rung: level}, "failed": [...],
        "trial": ..., "warned": [...], "gain_per_level": {...}, "last_retries": ..., "speed_tried": [...]}``
        (``speed_tried``: the levels the speed trial has timed)."""
        if self.policy is None:
            return {}
        speed = {"speed_tried": self.speed.state_dict()} if self.speed is not None else {}
        return {"levels": self.levels, **self.policy.state_dict(), **speed}
