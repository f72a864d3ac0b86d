"""LongBatches: a training batch predicted, before it runs, not to fit whole runs as micro-batches, that batch only.

With variable sequence lengths one batch in many is far larger than the rest, and runs out of memory after thousands
of steps. Before each batch larger than the reference (the last step measured whole, else the first batch) its peak
at the ladder's levels is predicted from its elements: by the estimate
(:class:`~lightning_memguard.base.prediction.StepPredictor`, corrected up, never down, by the last step measured), or
without one by scaling that step's activations. A batch predicted over what micro-batching aims under
(:meth:`~lightning_memguard.guard.policy.MitigationPolicy.aim`) runs as the fewest power-of-two micro-batches predicted
to fit — the micro-batch rung's own split, so the loss weighting is exact — and no level changes.

Linear is a lower bound where memory grows faster than the batch (attention that materialises T × T scores). A larger
batch that runs out of memory all the same runs again in twice as many parts, that batch only, and a later batch at
least as large starts in the parts it needed: one OOM for what the prediction misses, no lasting slowdown. The
prediction walks the batch's shapes, nothing on the device. With several processes each rank splits its own batch
alone where the ranks' collectives match whatever the counts (DDP; FSDP2 with shadow parts,
:meth:`~lightning_memguard.guard.ranks.Ranks.part_ran`); elsewhere one small collective a batch makes every rank run
the same number of micro-batches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ..base.batches import BatchSize
from ..base.checks import warn as default_warn
from ..base.snapshot import format_bytes
from .ladder import Ladder
from .policy import ACTIVATION_PHASES, AIM_SHARE, Decision, StepObservation

__all__ = ["MeasuredStep", "LongBatches"]


@dataclass(frozen=True)
class MeasuredStep:
    """The last step that ran at the ladder's own levels, on the worst rank's numbers. ``size`` is its largest batch;
    ``peaks`` phase → peak; ``start_bytes`` allocated at its start (gradients alive then included); ``grown_bytes``
    what it left allocated on top of what it started with (a first step's optimizer state); ``new_gradient_bytes``
    the gradients its backward made that were not alive at its start."""

    step: int
    size: BatchSize
    levels: Mapping[str, int]
    peaks: Mapping[str, int]
    start_bytes: int
    grown_bytes: int
    new_gradient_bytes: int

    @property
    def parts(self) -> int:
        level = self.levels.get("microbatch", 0)
        return 2**level if level else 1

    @property
    def peak_bytes(self) -> int:
        """The step's peak as the next step with the same batch will reach it: the forward and backward also hold
        what this step left behind; the optimizer step already created it."""
        peaks = [self.peaks[p] + self.grown_bytes for p in ACTIVATION_PHASES if p in self.peaks]
        peaks += [self.peaks["after_optimizer_step"]] if "after_optimizer_step" in self.peaks else []
        return max(peaks, default=0)

    def scaled_peak(self, size: BatchSize, parts: int) -> int:
        """The peak of a batch of ``size`` run as ``parts`` micro-batches, from this step alone (no estimate): its
        phase peaks with the forward's and backward's own additions (the gradients the backward makes left out) scaled
        by the largest micro-batch's elements, the gradients every micro-batch after the first holds through its
        forward and backward (where this step ran whole), and the batch's extra bytes."""
        ratio = size.part_elements(parts) / self.size.part_elements(self.parts)
        larger_batch = size.bytes - self.size.bytes
        kept_gradients = self.new_gradient_bytes if parts > 1 and self.parts == 1 else 0
        predicted = []
        for phase, peak in self.peaks.items():
            if phase == "after_forward":
                added = peak - self.start_bytes
            elif phase == "after_backward":
                added = peak - self.start_bytes - self.new_gradient_bytes
            elif phase == "after_optimizer_step":
                predicted.append(peak + larger_batch)
                continue
            else:  # batch_start: what ran between steps (validation, data loading), no part of the step
                continue
            predicted.append(peak + self.grown_bytes + max(0, added) * (ratio - 1) + kept_gradients + larger_batch)
        return int(max(predicted, default=0))


@dataclass(frozen=True)
class _Prediction:
    size: BatchSize
    reference: BatchSize
    reference_name: str
    whole_bytes: int  # at the ladder's own levels
    parts: int
    parts_bytes: int
    aim_bytes: float
    aim_words: str


class LongBatches:
    """Predicts each training batch's peak before it runs and splits, once, a batch predicted not to fit. Driven by
    the engine: :meth:`begin` a fit, :meth:`before_batch` before each batch is counted, :meth:`after_oom` when an
    attempt of it ran out of memory, :meth:`after_step` with each measured step."""

    def __init__(self) -> None:
        self.begin()

    def begin(self) -> None:
        """A fit starts: nothing measured yet."""
        self._first: Optional[BatchSize] = None  # the batch the ladder's estimate was made from
        self._measured_from: Optional[tuple] = None  # what the last step measured whole is built from, when asked
        self._measured_step: Optional[MeasuredStep] = None  # built from it
        self._measured_size: Optional[BatchSize] = None  # its largest batch
        self._step: Optional[int] = None  # the step of the batch in progress, and its largest batch
        self._step_size: Optional[BatchSize] = None
        self._size: Optional[BatchSize] = None  # the batch in progress's, where it was predicted
        self._rescued_parts: Optional[int] = None  # the parts the batch in progress runs in after its OOM
        #: the batch in progress's size, whatever the rungs (``None``: unread), for the ladder's rescue of it
        self.batch_size: Optional[BatchSize] = None
        self._said_failure = False
        #: the last step in which a batch ran split once (the policy does not judge it)
        self.split_step: Optional[int] = None

    # --- before a batch ---------------------------------------------------------------------------------------------
    def before_batch(self, step: int, batch: Any, ladder: Ladder, capacity: Optional[int],
                     reduce_max: Optional[Callable[[list[int]], list[int]]] = None,
                     warn: Callable[[str], None] = default_warn) -> Optional[Decision]:
        """Before ``batch`` of optimizer step ``step`` is counted: runs it as more micro-batches than the ladder's
        (``ladder.parts.split_once``) when it is predicted not to fit whole, and returns the ``predicted_split``
        decision to record; else ``None``. ``reduce_max``: the element-wise maximum over ranks, with several
        processes (each rank predicts its own batch, all run the largest count). Never raises: a batch it cannot
        predict runs as the ladder says (one warning a fit)."""
        batch_parts = ladder.parts
        batch_parts.split_once(1)
        self._size, self._rescued_parts, self.batch_size = None, None, None
        rung = ladder.rungs.get("microbatch")
        # what decides whether the ranks meet in the collective is the same on every rank: the agreed ladder
        if capacity is None or ladder.policy is None or rung is None or not rung.splittable \
                or not ladder.usable("microbatch"):
            if capacity is not None and ladder.predictor.model is not None:  # a rescue predicts for its size
                try:
                    self.batch_size = BatchSize.of(batch)
                except Exception:  # a rescue then predicts for the estimated batch
                    pass
            return None
        prediction = None
        try:
            size = self.batch_size = BatchSize.of(batch)
            self._note_size(step, size)
            prediction = self._predict(size, ladder, capacity)
        except Exception as err:  # MemGuard must never be why a run dies: the batch runs as the ladder says
            if not self._said_failure:
                self._said_failure = True
                warn(f"lightning-memguard: a batch's peak could not be predicted ({type(err).__name__}: "
                     f"{str(err)[:200]}); larger batches are left to the out-of-memory rescue.")
        parts = prediction.parts if prediction is not None else 1
        size = self._size
        learned = batch_parts.learned_for(size.elements, size.samples) if size is not None else 1
        if learned > parts:
            parts = learned
        if reduce_max is not None:
            parts = int(reduce_max([parts])[0])
        if parts <= batch_parts.training():
            return None
        batch_parts.split_once(parts)
        self.split_step = step
        level = math.ceil(math.log2(parts))
        return Decision(step=step, action="predicted_split", rung="microbatch", level=level,
                        reason=_reason(prediction, parts, self._size, learned),
                        peak_before_bytes=prediction.whole_bytes if prediction is not None else None,
                        peak_after_bytes=prediction.parts_bytes if prediction is not None else None)

    def oom_parts(self, ladder: Ladder) -> int:
        """The parts the batch in progress would run again in after an out-of-memory error, this batch only: twice
        the parts it ran in, for a batch larger than the reference (at most one sample a part); 0 for another batch,
        whose rescue the ladder decides. Changes nothing: with several processes the ranks agree on the largest."""
        size, reference = self._size, self._reference()
        if size is None or reference is None or size.elements <= reference.elements or not size.samples:
            return 0
        now = ladder.parts.training()
        return 0 if now >= size.samples else min(2 * now, size.samples)

    def after_oom(self, step: int, ladder: Ladder, cause: str, agreed: Optional[int] = None) -> Optional[Decision]:
        """An attempt of the batch in progress ran out of memory (``cause`` says where). A batch larger than the
        reference runs again in twice as many parts, this batch only — its size, not the levels, is what failed: the
        ladder stays where it is, and the next batches run as it says. Returns the ``rescue_split`` decision to record
        (its ``level`` is this batch's, not the rung's), or
        ``None`` (not such a batch, or already one sample a part): the ladder's rescue decides. ``agreed``: with
        several processes, the largest :meth:`oom_parts` over the ranks — every rank splits its batch into as many
        parts (DDP's collectives must match), or none does; only a rank whose own batch needed it learns the size."""
        own = self.oom_parts(ladder)
        parts = own if agreed is None else agreed
        if not parts:
            return None
        size, reference, now = self._size, self._reference(), ladder.parts.training()
        ladder.parts.split_once(parts)
        self.split_step, self._rescued_into = step, ladder.parts
        self._rescued_parts = parts if own else None
        if not own:
            return Decision(step=step, action="rescue_split", rung="microbatch", level=math.ceil(math.log2(parts)),
                            reason=f"{cause}, a larger batch on another rank; every rank runs its batch again as "
                                   f"{parts} micro-batches, this batch only (the levels stay)")
        return Decision(step=step, action="rescue_split", rung="microbatch", level=math.ceil(math.log2(parts)), reason=(
            f"{cause}, a batch of {size.elements} elements ({size.elements / reference.elements:.1f}x the "
            f"reference's {reference.elements}) in {now} part{'s' if now > 1 else ''}; it runs again as {parts} "
            f"micro-batches, this batch only (the levels stay), and a batch of at least {size.elements} elements "
            f"runs as {parts} from now on"))

    def split_alone(self, step: int, ladder: Ladder, cause: str) -> Optional[Decision]:
        """An attempt of the batch in progress ran out of memory on this rank, which runs it again alone (the other
        ranks unaware, see :meth:`~lightning_memguard.guard.attempts.Attempts.on_oom`): in twice as many parts, this
        batch only (at most one sample a part), the levels unchanged — they change on every rank together, later.
        Returns the ``rescue_split`` decision to record, or ``None`` where the batch cannot be split further (no
        micro-batch rung, a batch it cannot split, one sample a part already)."""
        rung, size = ladder.rungs.get("microbatch"), self._size
        if (rung is None or not rung.splittable or not ladder.usable("microbatch") or size is None
                or not size.samples):
            return None
        now = ladder.parts.training()
        if now >= size.samples:
            return None
        parts = min(2 * now, size.samples)
        ladder.parts.split_once(parts)
        self.split_step, self._rescued_parts = step, None  # not judged; nothing learned (not a larger batch)
        return Decision(step=step, action="rescue_split", rung="microbatch", level=math.ceil(math.log2(parts)),
                        reason=f"{cause}; this rank runs the batch again alone as {parts} micro-batches, this batch "
                               "only (the levels stay until every rank raises them together at the window's last "
                               "batch)")

    def _reference(self) -> Optional[BatchSize]:
        return self._measured_size if self._measured_size is not None else self._first

    @property
    def _measured(self) -> Optional[MeasuredStep]:
        """The last step measured whole, built when a prediction asks for it (a batch larger than the reference),
        not after every step."""
        if self._measured_from is not None:
            self._measured_step, self._measured_from = MeasuredStep(*self._measured_from), None
        return self._measured_step

    def _note_size(self, step: int, size: BatchSize) -> None:
        if self._first is None:
            self._first = size
        self._size = size
        # with gradient accumulation a step has several batches: the largest is what its peak came from
        if step != self._step or self._step_size is None or size.elements > self._step_size.elements:
            self._step, self._step_size = step, size

    def _predict(self, size: BatchSize, ladder: Ladder, capacity: int) -> Optional[_Prediction]:
        reference = self._reference()
        if reference is None or reference.elements <= 0 or size.elements <= reference.elements or not size.samples:
            return None  # only a batch larger than the reference can need more than the ladder gives it
        measured = self._measured
        peak_at = self._peak_function(size, ladder)
        if peak_at is None:
            return None
        policy = ladder.policy
        aim = policy.aim("microbatch", capacity)
        level_now = ladder.levels.get("microbatch", 0)
        whole = peak_at(level_now)
        if whole is None or whole <= aim:
            return None
        top = math.ceil(math.log2(size.samples)) if size.samples > 1 else 0
        level, peak = level_now, whole
        while level < top and peak > aim:
            level += 1
            peak = peak_at(level)
            if peak is None:
                return None
        if level == level_now:
            return None  # one sample a micro-batch already: nothing to split
        line = (f"the capacity {format_bytes(capacity)}" if "microbatch" in policy.last_resort
                else f"the {policy.threshold:.0%} line of {format_bytes(policy.limit_bytes(capacity))}")
        words = f"{AIM_SHARE:.0%} of {line}"
        name = f"step {measured.step} (the last step measured whole)" if measured is not None else "the first batch"
        return _Prediction(size, reference, name, whole, min(2**level, size.samples), peak, aim, words)

    def _peak_function(self, size: BatchSize, ladder: Ladder) -> Optional[Callable[[int], Optional[int]]]:
        """micro-batch level → the batch's predicted peak at the ladder's other levels; ``None`` without a basis."""
        levels, predictor, measured = ladder.levels, ladder.predictor, self._measured
        if predictor.covers("microbatch"):
            scale = 1.0
            if measured is not None:
                # corrected by the last step measured whole, as the policy corrects its predictions, but never down:
                # a whole step can measure less than the estimate for what its micro-batches will hold (a loop that
                # frees the gradients before the forward, where every micro-batch after the first keeps them); too
                # low a prediction costs an OOM, too high one a split of one batch
                scale = predictor.correction(measured.peak_bytes, measured.levels, measured.size, up_only=True) or 1.0
            return lambda level: predictor.peak({**levels, "microbatch": level}, scale, size)
        if measured is not None:
            return lambda level: measured.scaled_peak(size, 2**level if level else 1)
        return None

    # --- after a step -----------------------------------------------------------------------------------------------
    def after_step(self, observation: StepObservation, levels: Mapping[str, int], gradients_at_start: int,
                   gradients: int) -> bool:
        """A measured step ended with the rungs at ``levels`` (``gradients_at_start``, ``gradients``: the gradients'
        bytes alive at its start and its end). Returns whether the policy may judge it: not a step whose batch ran
        split once (its peaks are not the levels' doing); the others become the reference."""
        if observation.step == self.split_step:
            if self._rescued_parts is not None and self._size is not None:  # what the batch needed, remembered
                self._rescued_into.learn(self._size.elements, self._rescued_parts)
                self._rescued_parts = None
            return False
        size = self._step_size if self._step == observation.step else None
        if size is not None and size.elements > 0 and observation.static_bytes is not None:
            held_after = observation.held_after_bytes
            grown = max(0, held_after - observation.static_bytes) if held_after is not None else 0
            # MeasuredStep's fields in order (step, size, levels, peaks, start_bytes, grown_bytes,
            # new_gradient_bytes); built only where a prediction needs it
            self._measured_from = (observation.step, size, dict(levels), dict(observation.peaks),
                                   observation.static_bytes + gradients_at_start, grown,
                                   max(0, gradients - gradients_at_start))
            self._measured_size, self._measured_step = size, None
        return True


def _reason(prediction: Optional[_Prediction], parts: int, size: Optional[BatchSize], learned: int) -> str:
    if size is not None and learned >= parts and learned > (prediction.parts if prediction is not None else 1):
        # a batch of no more elements ran out of memory in fewer parts: the prediction fell short for this model
        return (f"a batch of {size.elements} elements, at least as large as one that ran out of memory in fewer "
                f"parts, runs as {parts} micro-batches, as that one needed, this batch only")
    if prediction is None:  # another rank's batch: every rank must run as many micro-batches
        return (f"a batch on another rank is predicted not to fit whole; every rank runs its batch as {parts} "
                "micro-batches, this batch only")
    p = prediction
    if parts > p.parts:
        then = (f"runs as {parts} micro-batches, as a batch on another rank needs ({p.parts} predicted at "
                f"{format_bytes(p.parts_bytes)} here), this batch only")
    elif p.parts_bytes <= p.aim_bytes:
        then = f"runs as {parts} micro-batches (predicted {format_bytes(p.parts_bytes)}), this batch only"
    else:
        then = (f"runs as {parts} micro-batches, as many as it has samples, still predicted at "
                f"{format_bytes(p.parts_bytes)}: the out-of-memory rescue stands behind it")
    return (f"a batch of {p.size.elements} elements, {p.size.elements / p.reference.elements:.1f}x the "
            f"{p.reference.elements} of {p.reference_name}, is predicted to peak at {format_bytes(p.whole_bytes)}, "
            f"over {p.aim_words}; it {then}")
