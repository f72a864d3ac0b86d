"""What the pre-flight estimate predicts a step will need at each combination of rung levels (AMP, checkpointed
blocks, micro-batches). Numbers only: the estimate builds one from the first batch
(:func:`~lightning_memguard.estimate.plan.ladder_peak_model`); the policy and the plan made before the first step
(:func:`~lightning_memguard.estimate.plan.choose_levels`) read it. Its estimates may be made when first read
(:class:`LaterPhases`, :class:`LaterPeaks`): most runs fit as they are and ask for nothing but the step as it is.

A step's memory splits into what persists across steps (parameters, gradients, optimizer state, the runtime's
workspaces and the batch), which no rung changes, and what the forward and backward add on top of it, which
checkpointing lowers block by block and micro-batching divides by the number of micro-batches. Measured on CPU,
where the estimate is exact, this model is within 3 % of real micro-batched steps (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar

if TYPE_CHECKING:  # numbers only: no torch
    from .batches import BatchSize

__all__ = ["PhaseEstimate", "PeakModel", "StepPredictor", "model_numbers", "model_from_numbers", "cheapest_levels",
           "floor_bytes", "floor_over", "LaterPeaks", "LaterPhases", "RungPredictionError", "ReservedSegments"]

_SCALARS = 4  # a PhaseEstimate's numbers besides its per-level peaks: optimizer step, held, gradients, batch
_Answer = TypeVar("_Answer")


class RungPredictionError(Exception):
    """The step ran as it is, but failed with a rung applied: the rung, not the estimate, breaks the model."""

    def __init__(self, rung: str, error: BaseException) -> None:
        super().__init__(f"{rung}: {type(error).__name__}: {error}")
        self.rung, self.error = rung, error


class _Once:
    """``make()``'s result, made at the first call; an error it raised is raised again (it is not tried twice)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make: Optional[Callable[[], Any]] = make
        self._result: Any = None
        self._error: Optional[BaseException] = None

    def __call__(self) -> Any:
        if self._make is not None:
            make, self._make = self._make, None
            try:
                self._result = make()
            except Exception as err:
                self._error = err
        if self._error is not None:
            raise self._error
        return self._result


@dataclass(frozen=True)
class PhaseEstimate:
    """One precision's estimate: ``forward`` and ``backward`` are the phase peaks at 0, 1, ..., N checkpointed
    blocks; ``optimizer_step`` the optimizer step's peak (no rung changes it); ``held_bytes`` what persists across
    steps; ``gradient_bytes`` the gradients (freed before a whole batch's backward, alive through the backward of
    every micro-batch after the first); ``batch_bytes`` the batch (part of ``held_bytes``: what persists without it
    is what no remedy of the activations or the batch can lower)."""

    forward: Sequence[int]
    backward: Sequence[int]
    optimizer_step: int
    held_bytes: int
    gradient_bytes: int
    batch_bytes: int = 0


@dataclass(frozen=True)
class PeakModel:
    """Predicted step peaks by rung levels. ``by_amp`` maps the AMP level (0, and 1 where the estimate covered mixed
    precision) to that precision's :class:`PhaseEstimate`; ``batch_size`` is the batch micro-batching splits."""

    by_amp: Mapping[int, PhaseEstimate]
    batch_size: Optional[int] = None

    def covers(self, rung: str) -> bool:
        """Whether the model predicts the effect of ``rung`` (so a level can be chosen from it)."""
        if rung == "amp":
            return 1 in self.by_amp
        if rung == "checkpointing":
            return self.n_blocks > 0
        return rung == "microbatch" and self.batch_size is not None

    @property
    def n_blocks(self) -> int:
        """How many blocks the checkpointing rung can take: the estimate holds one more point, with none taken."""
        return len(self.by_amp[0].forward) - 1

    def peak(self, levels: Mapping[str, int], size_ratio: float = 1.0, samples: Optional[int] = None) -> Optional[int]:
        """The predicted step peak with ``levels`` (rung → level; a missing rung is off), or ``None`` when a level
        is outside what the model covers.

        ``size_ratio``: a batch of that many times the estimated batch's elements
        (:func:`~lightning_memguard.base.batches.batch_elements`), of ``samples`` samples (``None``: the estimated
        batch's). What persists across steps does not grow with it, but for the batch itself; what the forward and
        backward add (the activations) grows linearly — a lower bound where a layer's memory grows faster than its
        input (attention that materialises T × T scores grows with the square of the tokens)."""
        # without a mixed-precision estimate the full-precision one stands in: the policy scales predictions to the
        # measured peak, so what remains is the change from a level to the next
        phases = self.by_amp.get(levels.get("amp", 0), self.by_amp[0])
        blocks = levels.get("checkpointing", 0)
        if blocks >= len(phases.forward):
            return None
        share = self.micro_batch_share(levels.get("microbatch", 0), samples)
        held = phases.held_bytes
        forward = held + (phases.forward[blocks] - held) * share * size_ratio
        if share < 1:
            # after the first micro-batch the gradients of the earlier ones stay through each backward, where a
            # whole batch's backward starts without them (zero_grad sets them to None after the forward)
            backward = held + (phases.backward[blocks] - held + phases.gradient_bytes) * share
        else:
            backward = phases.backward[blocks]
        # the gradients the backward makes are the parameters' size whatever the batch: only the rest grows
        backward_activations = max(0, phases.backward[blocks] - held - phases.gradient_bytes)
        backward += backward_activations * share * (size_ratio - 1)
        larger_batch = phases.batch_bytes * (size_ratio - 1)  # the batch is alive through the whole step
        return int(max(forward, backward, phases.optimizer_step) + larger_batch)

    def made(self) -> PeakModel:
        """This model with every estimate made now (:class:`LaterPhases`, :class:`LaterPeaks`: an estimate that fails
        raises here), in the order the rungs take them: a precision's blocks before the next precision."""
        by_amp = {}
        for amp in self.by_amp:
            e = self.by_amp[amp]
            by_amp[amp] = replace(e, forward=list(e.forward), backward=list(e.backward))
        return PeakModel(by_amp, self.batch_size)

    def micro_batch_share(self, level: int, samples: Optional[int] = None) -> float:
        """The largest micro-batch's share of the batch at micro-batch level ``level`` (2**level parts, capped at
        the batch size, ``samples`` or else the estimated batch's; torch.tensor_split makes the first parts one
        sample larger when the size does not divide)."""
        size = samples or self.batch_size
        if not level or not size:
            return 1.0
        parts = min(2**level, size)
        return math.ceil(size / parts) / size


class LaterPeaks(Sequence[int]):
    """A phase's peaks at 0, 1, ..., N checkpointed blocks where only the first (none taken) is estimated yet: the
    others come from ``rest`` (``() -> every count's peaks``), called the first time one of them is read. Its length
    is known without it."""

    def __init__(self, first: int, length: int, rest: Callable[[], Sequence[int]]) -> None:
        self._first, self._length, self._rest = first, length, _Once(rest)

    @staticmethod
    def pair(forward: int, backward: int, length: int,
             rest: Callable[[], tuple[Sequence[int], Sequence[int]]]) -> tuple[LaterPeaks, LaterPeaks]:
        """The forward's and the backward's peaks, the first of each given, the others from one call of ``rest``
        (``() -> (forward peaks, backward peaks)``, at every block count)."""
        both = _Once(rest)
        return LaterPeaks(forward, length, lambda: both()[0]), LaterPeaks(backward, length, lambda: both()[1])

    def make(self) -> None:
        """Estimates the peaks not estimated yet, now: an error of theirs is raised here."""
        self._rest()

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._length))]
        at = index + self._length if index < 0 else index
        if not 0 <= at < self._length:
            raise IndexError(index)
        return self._first if at == 0 else self._rest()[at]

    def __repr__(self) -> str:
        return f"LaterPeaks({self._first}, ... {self._length - 1} more)"


class LaterPhases(Mapping[int, PhaseEstimate]):
    """A :class:`PeakModel`'s ``by_amp`` whose precisions are estimated when first read: ``made`` (AMP level →
    estimate) now, ``later`` (AMP level → ``() -> estimate``) at the first read. Which levels it holds is known without
    estimating them (``in``, iteration, ``len``); a reading whose estimate fails raises its error (a
    :class:`RungPredictionError` where a rung breaks the step) each time."""

    def __init__(self, made: Mapping[int, PhaseEstimate], later: Mapping[int, Callable[[], PhaseEstimate]]) -> None:
        self._made = dict(made)
        self._later = {amp: _Once(make) for amp, make in later.items() if amp not in made}

    def __getitem__(self, amp: int) -> PhaseEstimate:
        if amp not in self._made:
            if amp not in self._later:
                raise KeyError(amp)
            self._made[amp] = self._later[amp]()  # where it raises, the level stays (and raises again when read)
            del self._later[amp]
        return self._made[amp]

    def __contains__(self, amp: object) -> bool:
        return amp in self._made or amp in self._later

    def __iter__(self) -> Iterator[int]:
        return iter(sorted({*self._made, *self._later}))

    def __len__(self) -> int:
        return len({*self._made, *self._later})

    def __repr__(self) -> str:
        return f"LaterPhases({self._made!r}, later={sorted(self._later)})"


def model_numbers(model: Optional[PeakModel], amp_levels: Sequence[int], n_levels: int) -> list[int]:
    """``model`` as a flat list of ints whose length every rank knows beforehand, so that ranks can agree on one model
    with an element-wise maximum. The first number is 1 for a model this rank could not make (or one of another
    shape): under the maximum it wins, and no rank uses a model."""
    size = len(amp_levels) * (2 * n_levels + _SCALARS) + 1
    if model is None or any(a not in model.by_amp or len(model.by_amp[a].forward) != n_levels for a in amp_levels):
        return [1] + [0] * size
    numbers: list[int] = [0]
    for a in amp_levels:
        e = model.by_amp[a]
        numbers += [*e.forward, *e.backward, e.optimizer_step, e.held_bytes, e.gradient_bytes, e.batch_bytes]
    return [int(n) for n in numbers] + [model.batch_size or 0]


def model_from_numbers(numbers: Sequence[int], amp_levels: Sequence[int], n_levels: int) -> Optional[PeakModel]:
    """The inverse of :func:`model_numbers`; ``None`` where a rank had no model."""
    if numbers[0]:
        return None
    by_amp, at = {}, 1
    for a in amp_levels:
        forward, backward = list(numbers[at:at + n_levels]), list(numbers[at + n_levels:at + 2 * n_levels])
        optimizer_step, held, gradients, batch = numbers[at + 2 * n_levels:at + 2 * n_levels + _SCALARS]
        by_amp[a] = PhaseEstimate(forward, backward, optimizer_step, held, gradients, batch)
        at += 2 * n_levels + _SCALARS
    return PeakModel(by_amp, numbers[at] or None)


def cheapest_levels(peak_at: Callable[[Mapping[str, int]], Optional[int]], now: Mapping[str, int],
                    tops: Mapping[str, int], aim: Callable[[int], float]) -> Optional[tuple[dict[str, int], int]]:
    """The cheapest rung levels, at or above ``now``, that ``peak_at`` (levels → predicted peak, ``None`` where it
    cannot say) puts under ``aim(micro-batch level)``, with that peak; ``None`` when no combination up to ``tops``
    fits. Cheapest: the fewest micro-batch halvings (each pass of the batch costs a launch of every kernel), then the
    fewest checkpointed blocks (each recomputes its forward), then full precision (AMP costs no compute, but changes
    the numbers). Every rung is combined with the others: AMP, some blocks and a few micro-batches together, not one
    rung at its top before the next is looked at. A rung missing from ``tops`` stays where ``now`` has it; the
    fewest blocks are found by bisection (the saving grows with the blocks).

    ``aim(0)``, the line of a step without micro-batches, is also what the cheap rungs (AMP, checkpointing) aim at
    with micro-batches: the micro-batch level is the fewest that fit under ``aim(level)``, and at that level the
    fewest blocks (AMP as above) that bring the peak under ``aim(0)`` are chosen where some do, else every block
    (with the AMP level that fitted ``aim(level)``). A step predicted between the two lines may cross the threshold,
    and the policy then raises the cheap rungs at once, to the first level under their aim or else to the top: the
    combination is what it would settle on."""
    levels = {name: int(now.get(name, 0)) for name in ("amp", "checkpointing", "microbatch")}
    top = {name: max(levels[name], int(tops.get(name, levels[name]))) for name in levels}

    def fewest_blocks(base: dict[str, int], limit: float) -> Optional[tuple[int, int]]:
        """The fewest blocks above ``now``'s at ``base``'s other levels under ``limit``, with their peak (``now``'s
        were read over it)."""
        low = levels["checkpointing"]

        def at(blocks: int) -> Optional[int]:
            return peak_at({**base, "checkpointing": blocks})

        last = at(top["checkpointing"]) if top["checkpointing"] > low else None
        if last is None or last > limit:
            return None
        high, high_peak = top["checkpointing"], last  # at(low) > limit >= at(high)
        while high - low > 1:
            mid = (low + high) // 2
            peak = at(mid)
            if peak is not None and peak <= limit:
                high, high_peak = mid, peak
            else:
                low = mid
        return high, high_peak

    def fits(micro: int, limit: float) -> list[tuple[int, int, int]]:
        amps = range(levels["amp"], top["amp"] + 1)
        # no more blocks than now in some precision is the cheapest there is: read before any other block count, so
        # that a model whose block counts are estimated when first read (LaterPeaks) estimates none of them
        firsts = {amp: peak_at({**levels, "amp": amp, "microbatch": micro}) for amp in amps}
        found = [(levels["checkpointing"], amp, peak) for amp, peak in firsts.items()
                 if peak is not None and peak <= limit]
        if found:
            return found
        for amp in amps:
            fit = fewest_blocks({**levels, "amp": amp, "microbatch": micro}, limit)
            if fit is not None:
                found.append((fit[0], amp, fit[1]))
        return found

    def most_blocks(micro: int, found: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        blocks, amp, _ = min(found)
        peak = peak_at({**levels, "amp": amp, "checkpointing": top["checkpointing"], "microbatch": micro})
        return [(top["checkpointing"], amp, peak)] if peak is not None and blocks < top["checkpointing"] else found

    cheap_aim = aim(0)
    for micro in range(levels["microbatch"], top["microbatch"] + 1):
        found = fits(micro, aim(micro))
        if found and micro and cheap_aim < aim(micro):
            found = fits(micro, cheap_aim) or most_blocks(micro, found)
        if found:
            blocks, amp, peak = min(found)
            return {"amp": amp, "checkpointing": blocks, "microbatch": micro}, peak
    return None


def floor_bytes(model: PeakModel, amp_levels: Sequence[int] = (0, 1)) -> int:
    """The lowest peak any rung levels can reach: what persists across steps (parameters, gradients, optimizer state,
    the runtime's workspaces and the batch, which every micro-batch's step keeps whole) or the optimizer step's
    peak, whichever is higher, in the cheapest precision of ``amp_levels`` the model covers."""
    return min(max(model.by_amp[a].held_bytes, model.by_amp[a].optimizer_step) for a in model.by_amp
               if a in amp_levels)


def floor_over(model: PeakModel, capacity: float, amp_levels: Sequence[int] = (0, 1)) -> Optional[int]:
    """:func:`floor_bytes` where it is at or over ``capacity``, else ``None``. The other precisions are read only
    where full precision's floor is over it (under it, the lowest is too): a run that fits estimates no other."""
    if 0 in model.by_amp and floor_bytes(model, (0,)) < capacity:
        return None
    floor = floor_bytes(model, amp_levels)
    return floor if floor >= capacity else None


class ReservedSegments:
    """The caching allocator's predicted segments of the rung levels a choice looks at, against ``cap``: a capacity
    that caps what the CUDA caching allocator reserves (the card, a memory fraction; not a ``budget=``). Under such a
    cap the cache's segments, not only the bytes handed out, must fit: a configuration whose allocated peak was 84 %
    of a memory fraction ran out of memory under it, its segments predicted over it. The one reading of them that the
    plan (:func:`~lightning_memguard.estimate.plan.choose_levels`), the policy's rescue and the speed trial share.

    ``whole`` (``(amp, blocks) -> reserved bytes``) reads a step of the whole batch, ``split`` (``(amp, blocks,
    micro-batch level, allocated peak) -> reserved bytes``) a split one (the ``measure_reserved`` and
    ``split_reserved`` of :class:`~lightning_memguard.estimate.plan.StepPredictions`); either may be ``None``, or
    answer ``None`` where the estimate has no reserved figure (a CPU target, allocator options the model does not
    cover): those levels are then checked by their allocated peak alone. Where ``checking``, :meth:`peak` reads
    levels whose segments are over ``cap`` as over every aim (``top_aim``), in the same proportion, so that a search
    of :func:`cheapest_levels` through it passes them over. Each reading is made once."""

    def __init__(self, whole: Optional[Callable[[bool, int], Optional[int]]],
                 split: Optional[Callable[[bool, int, int, int], Optional[int]]], cap: int, top_aim: float) -> None:
        self.whole, self.split, self.cap, self.top_aim = whole, split, cap, top_aim
        self.checking = False
        self._known: dict[tuple[int, int, int, int], Optional[int]] = {}

    def of(self, levels: Mapping[str, int], peak: int) -> Optional[int]:
        """The reserved bytes predicted at ``levels`` (allocated peak ``peak``), ``None`` where none are."""
        micro = levels.get("microbatch", 0)
        read = self.split if micro else self.whole
        if read is None:
            return None
        # a whole batch's segments do not depend on the peak it is read with
        key = (int(levels.get("amp", 0)), levels.get("checkpointing", 0), micro, peak if micro else 0)
        if key not in self._known:
            self._known[key] = self.split(bool(key[0]), *key[1:]) if micro else self.whole(bool(key[0]), key[1])
        return self._known[key]

    def over(self, levels: Mapping[str, int], peak: int) -> bool:
        """Whether the segments predicted at ``levels`` are over the cap."""
        held = self.of(levels, peak)
        return held is not None and held > self.cap

    def reading(self, levels: Mapping[str, int], peak: Optional[int], line: float) -> Optional[int]:
        """``peak``, or where the segments at ``levels`` are over the cap, them in ``line``'s units (reserved ×
        line / cap, over the line) where that is higher."""
        if peak is None:
            return None
        held = self.of(levels, peak)
        if held is None or held <= self.cap:
            return peak
        return max(peak, int(-(-held * line // self.cap)))

    def peak(self, levels: Mapping[str, int], peak: Optional[int]) -> Optional[int]:
        """What a search reads at ``levels``: ``peak`` as it is, or where ``checking`` its :meth:`reading` against
        ``top_aim`` — not read where ``peak`` is over ``top_aim`` already (the reading only raises it, and each is an
        estimate: a step run)."""
        if not self.checking or peak is None or peak > self.top_aim:
            return peak
        return self.reading(levels, peak, self.top_aim)


class StepPredictor:
    """The one owner of what a step of a fit is predicted to need: the estimate of the first batch (``predictions``,
    the :class:`~lightning_memguard.estimate.plan.StepPredictions` the plan chooses from; ``model``, its
    :class:`PeakModel`; ``batch``, the size of the batch it was made from), agreed between ranks, read by the policy
    (which level fits), the long-batch split (a larger batch's peak) and the plan, each correcting it by what a step
    measured (:meth:`correction`)."""

    def __init__(self) -> None:
        self.model: Optional[PeakModel] = None
        self.batch: Optional[BatchSize] = None
        self.predictions: Any = None
        # None, not a lambda: a guard is pickled into ddp_spawn's workers before its first batch
        self._on_rung_error: Optional[Callable[[RungPredictionError], None]] = None

    def use(self, predictions: Any, batch: BatchSize,
            on_rung_error: Optional[Callable[[RungPredictionError], None]] = None) -> None:
        """The estimate of ``batch`` (``predictions.model`` its peak model, whose estimates may be made when a
        question first needs them). ``on_rung_error``: what is done where such an estimate finds that a rung breaks
        the step (the rung turned off); the model is then dropped, as if that estimate had failed at once."""
        self.predictions, self.model, self.batch = predictions, predictions.model, batch
        if on_rung_error is not None:
            self._on_rung_error = on_rung_error

    def ask(self, question: Callable[[PeakModel], _Answer], default: _Answer) -> _Answer:
        """``question(model)``, or ``default`` where there is no model or an estimate the answer needs finds that a
        rung breaks the step (:meth:`rung_failed`)."""
        if self.model is None:
            return default
        try:
            return question(self.model)
        except RungPredictionError as err:
            self.rung_failed(err)
            return default

    def rung_failed(self, err: RungPredictionError) -> None:
        """An estimate made for a question found that ``err.rung`` breaks the step: ``on_rung_error`` turns the rung
        off, and no prediction is made from then on (as where the estimate of the first batch fails at once)."""
        self.model = self.predictions = None
        if self._on_rung_error is not None:
            self._on_rung_error(err)

    def agree(self, reduce_max: Callable[[list[int]], list[int]], amp_levels: Sequence[int], n_blocks: int) -> bool:
        """Leaves every rank the worst rank's model (``reduce_max``: element-wise maximum over the ranks; every rank
        calls it, whatever its estimate did), so that all choose the same levels. Returns False where this rank had a
        model but some rank had none (no rank uses one then)."""
        mine = self.model
        self.model = model_from_numbers(reduce_max(model_numbers(mine, amp_levels, n_blocks)), amp_levels, n_blocks)
        self.predictions = replace(self.predictions, model=self.model) if self.model is not None else None
        return self.model is not None or mine is None

    def covers(self, rung: str) -> bool:
        """Whether the estimate predicts what ``rung`` does (so a level can be chosen from it)."""
        return self.model is not None and self.model.covers(rung)

    def peak(self, levels: Mapping[str, int], scale: float = 1.0, size: Optional[BatchSize] = None) -> Optional[int]:
        """The predicted step peak at ``levels`` times ``scale`` (a :meth:`correction`), for a batch of ``size``
        (``None``: the estimated batch); ``None`` where the estimate cannot say."""
        if size is None:
            peak = self.ask(lambda model: model.peak(levels), None)
        elif self.batch is None or self.batch.elements <= 0:
            return None
        else:
            ratio = size.elements / self.batch.elements
            peak = self.ask(lambda model: model.peak(levels, ratio, size.samples), None)
        return int(scale * peak) if peak is not None else None

    def correction(self, measured_bytes: int, levels: Mapping[str, int], size: Optional[BatchSize] = None,
                   up_only: bool = False) -> Optional[float]:
        """Measured over predicted peak at ``levels`` (and ``size``): what the predictions are multiplied by.
        ``up_only`` for a measurement that falls short of a steady step (a rescue's peak, read when an allocation
        failed; a first step's, before the gradients and optimizer state exist): it may scale them up, never down."""
        predicted = self.peak(levels, size=size)
        if not predicted:
            return None
        ratio = measured_bytes / predicted
        return max(1.0, ratio) if up_only else ratio

    def held_bytes(self) -> Optional[int]:
        """What persists across steps by the estimate (gradients and optimizer state included), in the cheapest
        precision it covers."""
        return self.ask(lambda model: min(model.by_amp[a].held_bytes for a in model.by_amp), None)
