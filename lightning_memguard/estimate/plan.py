"""The peak model of a step (what each rung level is predicted to need, from estimates of the first batch) and the
cheapest levels that fit a capacity, chosen from it (framework-free)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from ..base.advice import what_would_help
from ..base.batches import map_tensors
from ..base.checks import check_bool, check_number, check_size
from ..base.prediction import (
    LaterPeaks,
    LaterPhases,
    PeakModel,
    PhaseEstimate,
    ReservedSegments,
    RungPredictionError,
    cheapest_levels,
)
from ..base.optimizer_step import zero_redundancy_ranks
from ..base.sharding import data_parallel_of
from ..base.snapshot import format_bytes, format_bytes_apart
from ..mitigations.checkpointing import BlockSpec, find_blocks
from ..mitigations.microbatch import batch_size_of, micro_batches_of
from .copies import (
    OptimizerSpec,
    device_of,
    meta_copy,
    optimizer_like,
    own_copy,
    sharding_of,
    unsharded_meta_copy,
    unwrap_parallel,
)
from .memory import PRECISIONS, check_estimate_arguments, estimate_memory, resolve_target
from .plan_search import PlanReader

__all__ = ["Plan", "plan_configuration", "choose_levels", "ladder_peak_model", "ladder_predictions", "StepPredictions",
           "step_peaks", "state_bytes", "state_text", "RungPredictionError"]


@dataclass(frozen=True)
class Plan:
    """The cheapest configuration expected to fit: ``amp`` (bool), ``checkpointed_blocks`` (of ``n_blocks``), and
    where only smaller micro-batches fit ``micro_batch_level`` (``2**level`` micro-batches; only
    :func:`choose_levels` with micro-batch levels splits)."""

    amp: bool
    checkpointed_blocks: int
    n_blocks: int
    expected_peak_bytes: int
    limit_bytes: int
    fits: bool
    reason: str
    micro_batch_level: int = 0


def plan_configuration(
    model: nn.Module,
    example_batch: Any,
    capacity_bytes: int | str,
    threshold: float = 0.9,
    optimizer: OptimizerSpec = None,
    loss_fn: Optional[Callable] = None,
    blocks: BlockSpec = None,
    allow_amp: bool = True,
    target: Optional[str] = None,
    allow_checkpointing: bool = True,
    precision: str = "32-true",
) -> Plan:
    """The cheapest configuration whose estimated peak stays under ``threshold × capacity``.

    Ranked by expected extra compute: checkpointing k blocks recomputes ~k/N of a forward, AMP adds none. So the
    plan is the configuration with the fewest checkpointed blocks that fits — no change, AMP alone, or k blocks
    with or without AMP — keeping full precision at a tie. If nothing fits, the lowest estimated peak is returned
    with ``fits=False``. The configurations are predicted by the peak model the guard's ladder uses
    (:func:`ladder_peak_model`: the step as it is, with one and with every block checkpointed, in each precision)
    and the levels chosen from it by :func:`choose_levels`, which estimates a block count in between where the
    model's line picks it (a plan costs a handful of estimates).

    ``capacity_bytes`` is bytes or a size string (``"20GiB"``); ``target`` (``"cuda"``, ``"cpu"``, default: cuda
    where it is available) is the device the run will train on (on CUDA the capacity is taken as a cap on what the
    caching allocator reserves, the card or a memory fraction: a configuration's predicted reserved bytes must fit
    under it too, see :func:`choose_levels`); ``allow_amp`` / ``allow_checkpointing``: whether
    the plan may use AMP / checkpointing (a guard whose ladder lacks the rung); ``precision``: the run's own (in a
    mixed-precision run every configuration is estimated in it, and AMP is no choice); the other arguments are those of
    :func:`~lightning_memguard.estimate.estimate_memory`.

    Raises:
        ValueError: a bad argument, naming it and what is allowed.
    """
    capacity_bytes = check_size("capacity_bytes", capacity_bytes)
    threshold = check_number("threshold", threshold, 0, 1, low_open=True)
    check_bool("allow_amp", allow_amp)
    check_estimate_arguments(model, example_batch, optimizer, precision, loss_fn, blocks)
    target = resolve_target(target)
    check_bool("allow_checkpointing", allow_checkpointing)
    # AMP is estimated on meta with the target's autocast emulated (CUDA's or the CPU's), on any model device
    amp = allow_amp and precision == "32-true"
    estimates = _StepEstimates(model, example_batch, blocks, target, optimizer, loss_fn)
    try:
        peaks = _peak_model(estimates, checkpointing=allow_checkpointing, amp=amp, precision=precision)
    except RungPredictionError as err:  # a plan has no rung to turn off: the step's own error is the answer
        raise err.error from None
    # the block counts between none and all are estimated where the choice looks at them, as the model only draws
    # a line there
    # on CUDA the capacity caps what the caching allocator reserves, not only what it hands out
    return choose_levels(peaks, int(threshold * capacity_bytes), amp=amp, checkpointing=allow_checkpointing,
                         precision=precision, measure=estimates.peak_function(precision),
                         base=configuration_base(precision, model),
                         sizes=_sizes(estimates.run(precision, 0), estimates.optimizer_spec),
                         reserved=estimates.reserved_function(precision), reserved_limit=capacity_bytes)


def configuration_base(precision: str, model: Optional[nn.Module] = None) -> str:
    """How a plan names the configurations without AMP: the run's mixed precision, or in full precision the
    parameters' own dtype — ``"fp32"``, or ``"bf16"``/``"fp16"`` for a model already cast to half precision (a
    Trainer's ``precision="bf16-true"``, ``model.half()``), whose step the estimate runs as it is."""
    if precision != "32-true":
        return precision
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None) if model is not None else None
    return _DTYPE_NAMES.get(dtype, "fp32")


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def choose_levels(peaks: PeakModel, limit_bytes: int, *, amp: bool = True, checkpointing: bool = True,
                  precision: str = "32-true", micro_batch_levels: int = 0, micro_batch_aim: Optional[float] = None,
                  cheap_rungs_aim: Optional[float] = None, measure: Optional[Callable[[bool, int], int]] = None,
                  measure_phases: Optional[Callable[[bool, int], tuple[int, int]]] = None, base: Optional[str] = None,
                  sizes: Optional[Mapping[str, int]] = None,
                  reserved: Optional[Callable[[bool, int], Optional[int]]] = None,
                  reserved_limit: Optional[int] = None,
                  split_reserved: Optional[Callable[[bool, int, int, int], Optional[int]]] = None) -> Plan:
    """The cheapest levels ``peaks`` predicts to fit under ``limit_bytes``: the fewest checkpointed blocks, with or
    without AMP (full precision at a tie); if none fits, the lowest predicted peak with ``fits=False``. With
    ``micro_batch_levels`` (the micro-batch rung's top level) a step that fits no other way is split: the fewest
    micro-batches, then the fewest blocks, with or without AMP, predicted under ``micro_batch_aim`` (bytes; default
    ``limit_bytes``) is the plan — all three together where that is what fits
    (:func:`~lightning_memguard.base.prediction.cheapest_levels`); at that micro-batch level, the fewest blocks (with
    or without AMP) that bring the step under ``cheap_rungs_aim`` (bytes; default ``limit_bytes``: what the closed
    loop aims AMP and checkpointing at) where some do, so that the first steps do not cross the threshold and have
    the loop raise them at once.

    ``amp`` / ``checkpointing``: whether the plan may use them (AMP only where ``peaks`` covers it); ``precision``
    names the run's own in the reason. The fewest blocks are found by bisection (the saving grows with the blocks);
    the reason lists each configuration estimated with its predicted peak. ``peaks`` is exact with no block, one
    and every block checkpointed and a line between; ``measure`` (``(amp, blocks) -> peak``, from
    :func:`step_peaks`) estimates a block count in between, and ``measure_phases`` (``(amp, blocks) -> (forward
    peak, backward peak)``) does so for a split step — where the search on the line picks it, or reads it within
    :data:`~lightning_memguard.estimate.plan_search.LINE_MARGIN` of the limit at no more cost than its pick, and
    the search is then made again (:class:`~lightning_memguard.estimate.plan_search.PlanReader`): the pick is what a
    bisection over estimates would choose where the line is within that margin, for a few estimates where the
    bisection makes one at each count it passes (each a step run).
    Where parameters, gradients, optimizer state and the runtime alone are over ``limit_bytes`` the reason says so
    first, with what would help (no activation remedy lowers them): for the parts ``sizes`` gives
    (:func:`state_text`).

    ``reserved`` (``(amp, blocks) -> reserved bytes``, from :class:`StepPredictions`) with ``reserved_limit``: a
    capacity that caps what the CUDA caching allocator reserves (the card, a memory fraction), against which a
    configuration of a whole batch must keep its predicted reserved bytes under too: one whose reserved bytes are over
    it counts as its share of ``limit_bytes`` (reserved × limit_bytes / reserved_limit, over the line). The cache's
    segments, not only the bytes handed out, must fit under such a cap: a configuration whose allocated peak was 84 %
    of a memory fraction ran out of memory under it, its segments predicted over it.

    ``split_reserved`` (``(amp, blocks, micro-batch level, allocated peak) -> reserved bytes``, from
    :meth:`StepPredictions.split_reserved`: an estimate of one micro-batch's step each) with ``reserved_limit`` does
    the same for a split: the split the allocated peaks choose is estimated, and only where its segments are over the
    cap is the choice made again with every split it looks at estimated so (one estimate where the split fits, none
    without a split). Where no split's segments fit, the allocated peaks' choice is kept with ``fits=False``.
    """
    amp_ok = amp and peaks.covers("amp")
    n_blocks = peaks.n_blocks if checkpointing else 0
    # the segments' one reading (base/prediction.py), shared with the policy's rescue and the speed trial
    segments = ReservedSegments(reserved if reserved_limit else None, split_reserved if reserved_limit else None,
                                reserved_limit or 0, limit_bytes)
    reader = PlanReader(peaks, n_blocks, limit_bytes, segments, measure, measure_phases)
    peak_of = reader.peak

    base = base or configuration_base(precision)  # how the tried configurations without AMP are named
    now = {"amp": 0, "checkpointing": 0, "microbatch": 0}
    tops = {"amp": int(amp_ok), "checkpointing": n_blocks, "microbatch": 0}
    whole = reader.settled(lambda read: cheapest_levels(read, now, tops, lambda micro: limit_bytes), peak_of,
                           limit_bytes)
    listed = reader.tried
    if whole is not None:
        levels, peak = whole
        return _plan(bool(levels["amp"]), levels["checkpointing"], n_blocks, peak, limit_bytes, listed, base=base)
    with_amp, blocks, lowest = min(listed, key=lambda t: t[2])
    plan = _plan(with_amp, blocks, n_blocks, lowest, limit_bytes, listed, fits=False, base=base)
    state = state_bytes(peaks, amp_ok)
    if state >= limit_bytes:  # say it before step 1: the optimizer step is where this run would die
        plan = replace(plan, reason=state_text(state, limit_bytes, "limit", sizes) + " " + plan.reason)
    if micro_batch_levels and peaks.covers("microbatch"):
        aim = limit_bytes if micro_batch_aim is None else micro_batch_aim
        cheap = limit_bytes if cheap_rungs_aim is None else cheap_rungs_aim
        segments.top_aim = max(limit_bytes, aim, cheap)

        def search() -> Optional[tuple[dict[str, int], int]]:
            return reader.settled(lambda read: cheapest_levels(read, {**now, "microbatch": 1},
                                                               {**tops, "microbatch": micro_batch_levels},
                                                               lambda micro: aim if micro else cheap),
                                  reader.split_peak, max(aim, cheap))

        split = search()
        if split is not None and segments.over(*split):  # its segments over the cap: every split checked
            over, segments.checking = split, True
            split = search()
            # none fits the cap (every block taken for the cheap aim may not either): the allocated peaks' choice,
            # said not to fit
            if split is None or segments.over(split[0], peak_of(split[0]) or split[1]):
                return _split_plan(plan, *over, n_blocks, aim, peak_of, segments, fits=False)
        if split is not None:  # only smaller micro-batches fit: split from the first step, not after an OOM
            plan = _split_plan(plan, *split, n_blocks, aim, peak_of, segments)
        else:  # nothing fits: the lowest peak, split or whole, as the closed loop would climb to it
            lowest = _lowest_split(reader, int(amp_ok), n_blocks, micro_batch_levels)
            if lowest is not None and lowest[1] < plan.expected_peak_bytes:
                plan = _split_plan(plan, *lowest, n_blocks, aim, peak_of, segments, fits=False)
    return plan


def _lowest_split(reader: PlanReader, amp: int, n_blocks: int, top: int) -> Optional[tuple[dict[str, int], int]]:
    """The split with the lowest predicted peak, every block checkpointed (the fewest micro-batches at a tie), with
    that peak; ``None`` where the model cannot say. Read from the model alone: no block count in between, so no
    estimate is made."""
    found = []
    for micro in range(1, top + 1):
        for with_amp in range(amp + 1):
            levels = {"amp": with_amp, "checkpointing": n_blocks, "microbatch": micro}
            peak = reader.peak(levels)
            if peak is not None:
                found.append((peak, micro, -with_amp, levels))
    if not found:
        return None
    peak, _, _, levels = min(found, key=lambda t: t[:3])
    return levels, peak


def _split_plan(plan: Plan, levels: Mapping[str, int], split_peak: int, n_blocks: int, aim: float,
                peak_of: Callable[[Mapping[str, int]], Optional[int]], segments: ReservedSegments,
                fits: bool = True) -> Plan:
    """``plan`` turned into the split at ``levels`` (its reason extended with what it is predicted at)."""
    level = levels["microbatch"]
    split_peak = peak_of(levels) or split_peak  # the allocated peak (not the segments' reading of it)
    what = " + ".join((["AMP"] if levels["amp"] else []) + (
        [f"checkpointing {levels['checkpointing']}/{n_blocks} blocks"] if levels["checkpointing"] else [])
        + [f"{2**level} micro-batches"])
    held = segments.of(levels, split_peak)
    peak_text, aim_text = format_bytes_apart(split_peak, aim)
    said = f"with {what} a step is predicted at {peak_text}"
    if held is not None:
        said += f" (the caching allocator's segments at {format_bytes(held)})"
    if fits:
        said += f", which fits under {aim_text}"
        if aim > plan.limit_bytes:  # the two lines side by side in one reason read as a contradiction unless said
            said += (f" (a split may come nearer the capacity than the whole batch's {format_bytes(plan.limit_bytes)}"
                     ": micro-batching is the last rung)")
        if held is not None:
            said += f" and the {format_bytes(segments.cap)} cap"
    elif split_peak > aim:
        said += f", the lowest of any configuration estimated, over {format_bytes(aim)} too"
    else:
        said += (f": under {format_bytes(aim)}, but no split's segments are predicted under the "
                 f"{format_bytes(segments.cap)} cap")
    return replace(plan, amp=bool(levels["amp"]), checkpointed_blocks=levels["checkpointing"],
                   micro_batch_level=level, expected_peak_bytes=split_peak, fits=fits, reason=f"{plan.reason}; {said}")


def state_bytes(peaks: PeakModel, amp: bool = True) -> int:
    """Parameters, gradients, optimizer state and runtime: what persists across steps without the batch, which no
    activation remedy lowers (in the lower of the precisions ``peaks`` covers, AMP only with ``amp``)."""
    return min(peaks.by_amp[a].held_bytes - peaks.by_amp[a].batch_bytes for a in peaks.by_amp if a == 0 or amp)


def state_text(state: int, limit: int, limit_name: str = "capacity",
               sizes: Optional[Mapping[str, int]] = None) -> str:
    """What to say where ``state`` (:func:`state_bytes`) cannot fit ``limit``: no activation remedy helps, and what
    would (:func:`~lightning_memguard.base.advice.what_would_help`: for the parts of ``sizes``, the ``sizes`` of
    :class:`StepPredictions`, large enough to close the gap; every remedy where they are not given)."""
    helps = what_would_help(sizes, state - limit, foreach_helps=False)  # foreach=False lowers no state
    return (f"the training state cannot fit: parameters, gradients, optimizer state and runtime alone hold "
            f"{format_bytes(state)}, over the {format_bytes(limit)} {limit_name}; activation remedies (AMP, "
            f"checkpointing, micro-batching) cannot lower that. What would: {helps}.")


def _plan(amp: bool, checkpointed_blocks: int, n_blocks: int, peak: int, limit: int, tried, fits: bool = True,
          base: str = "fp32") -> Plan:
    # in configuration order (the estimates ran in the order the search needed them)
    tried_text = "; ".join(f"{'amp' if a else base}+{blocks} blocks: {format_bytes(p)}"
                           for a, blocks, p in sorted(tried, key=lambda t: (bool(t[0]), t[1])))
    if fits:
        what = "no change" if not amp and not checkpointed_blocks else " + ".join(
            (["AMP"] if amp else [])
            + ([f"checkpointing {checkpointed_blocks}/{n_blocks} blocks"] if checkpointed_blocks else []))
        reason = f"{what} is the cheapest configuration estimated under {format_bytes(limit)} ({tried_text})"
    else:
        reason = (f"no configuration of the whole batch estimated fits under {format_bytes(limit)}; the lowest peak "
                  f"is shown ({tried_text})")
    return Plan(amp=amp, checkpointed_blocks=checkpointed_blocks, n_blocks=n_blocks, expected_peak_bytes=peak,
                limit_bytes=limit, fits=fits, reason=reason)


def ladder_peak_model(model: nn.Module, example_batch: Any, blocks: BlockSpec = None, target: Optional[str] = None,
                      optimizer: OptimizerSpec = None, loss_fn: Optional[Callable] = None,
                      checkpointing: bool = True, amp: bool = False, precision: str = "32-true") -> PeakModel:
    """What the guard's rungs will do to a step's peak, from estimates — on the meta device for a CUDA target and
    for mixed precision (shapes only: no memory, no FLOPs; the target's autocast and kernels emulated; on CPU, with
    one warning, where the step reads values computed from the weights and the model is on CPU), on a copy of the
    model for a CPU target in full precision (a real step): the step as it is and, with ``checkpointing``, with one
    and with every block checkpointed (each block saves its share of the activations until what no block holds is
    the peak), in the order the checkpointing rung takes them; with ``amp``, both again in bf16 mixed precision.
    ``precision`` is the run's own: level 0 of the AMP rung. Micro-batching is predicted from the same numbers
    (:class:`~lightning_memguard.base.prediction.PeakModel`). ``optimizer`` and ``loss_fn`` are those of
    :func:`~lightning_memguard.estimate_memory`.

    Raises:
        ValueError: the model cannot be estimated this way (no repeated blocks, or it reads values computed from the
            weights and is not on CPU).
        RungPredictionError: the step ran, but not with a rung (checkpointing or AMP) applied.
    """
    return ladder_predictions(model, example_batch, blocks, target, optimizer, loss_fn, checkpointing, amp,
                              precision).model


@dataclass(frozen=True)
class StepPredictions:
    """What the estimate of a first batch predicts, kept together so that a plan made from it estimates nothing twice:
    ``model`` (the :class:`~lightning_memguard.base.prediction.PeakModel`), ``measure`` and ``measure_phases`` (the
    block counts the model draws a line between, estimated when asked: ``(amp, blocks) -> peak`` and ``-> (forward
    peak, backward peak)``; estimates made for the model are not made again), ``sizes``: the step's parameters,
    gradients and optimizer state in bytes (and DDP's buckets, ``ddp_buckets``, where the step is a DDP rank's), for
    what is said where they cannot fit, and ``measure_reserved``
    (``(amp, blocks) -> reserved bytes``, ``None`` where the estimate has none; see
    :class:`~lightning_memguard.estimate.result.MemoryEstimate`'s ``reserved_bytes``). Made with ``later``
    (:func:`ladder_predictions`), ``model``'s estimates past the step as it is are made when first read."""

    model: PeakModel
    measure: Callable[[bool, int], int]
    measure_phases: Callable[[bool, int], tuple[int, int]]
    sizes: dict
    measure_reserved: Optional[Callable[[bool, int], Optional[int]]] = None
    measure_part: Optional[Callable[[bool, int, int], Optional[tuple[int, int]]]] = None

    def split_reserved(self, amp: bool, blocks: int, level: int, split_peak: int) -> Optional[int]:
        """The reserved bytes predicted for a step split into ``2**level`` micro-batches with ``blocks`` checkpointed
        (in bf16 mixed precision with ``amp``) whose allocated peak is predicted at ``split_peak``: the segments the
        caching allocator is estimated to reserve for a step of one micro-batch (``measure_part``: ``(amp, blocks,
        level) -> (allocated peak, reserved bytes)`` of a step on the largest part, one estimate each, made when
        asked), with what the split step holds beyond that step's allocated peak on top (the whole batch, the
        gradients the earlier micro-batches left through each backward) taken as new segments. ``None`` where there
        is no such estimate (a CPU target, allocator options the model does not cover, an estimate that failed)."""
        part = self.measure_part(amp, blocks, level) if self.measure_part is not None else None
        if part is None:
            return None
        peak, reserved = part
        return max(reserved, split_peak + reserved - peak)


def ladder_predictions(model: nn.Module, example_batch: Any, blocks: BlockSpec = None, target: Optional[str] = None,
                       optimizer: OptimizerSpec = None, loss_fn: Optional[Callable] = None,
                       checkpointing: bool = True, amp: bool = False, precision: str = "32-true",
                       later: bool = False, data_parallel: Optional[tuple[str, int]] = None) -> StepPredictions:
    """:func:`ladder_peak_model` with the means to estimate more block counts later from the same estimates
    (:class:`StepPredictions`). Arguments and errors as :func:`ladder_peak_model`'s.

    ``later``: the step as it is in ``precision`` is estimated now, and where the rest can run on the meta device (a
    CUDA target whose step did not have to leave it) each other precision and block count the model holds is
    estimated the first time a question reads it (most runs fit as they are: one estimate), on a meta copy of the
    model as it is now, so that what training does to it since (weights, rungs applied) changes no number. Such a
    reading raises :class:`RungPredictionError` where a rung breaks the step. A CPU target's step in full precision is
    a real step on CPU, which would not be run mid-fit: every estimate is made now there.

    ``data_parallel``: ``(strategy, world_size)`` where the model trains through a wrapper the model itself does not
    show (``("ddp", ranks)``: DistributedDataParallel's gradient buckets are one rank's memory too;
    :func:`~lightning_memguard.base.sharding.data_parallel_of`); a model FSDP2 sharded shows its sharding itself."""
    estimates = _StepEstimates(model, example_batch, blocks, target, optimizer, loss_fn, data_parallel)
    sizes = _sizes(estimates.run(precision, 0), estimates.optimizer_spec)
    peaks = _peak_model(estimates, checkpointing, amp, precision, later=later and estimates.detach())
    return StepPredictions(peaks, estimates.peak_function(precision), estimates.phase_function(precision),
                           sizes, estimates.reserved_function(precision), estimates.part_function(precision))


def _sizes(estimate, optimizer: Any = None) -> dict:
    """What no rung lowers, by part: the ``sizes`` of :class:`StepPredictions` (one rank's under FSDP2, with the
    ranks it is sharded over as ``sharded_over``, and where ``optimizer`` is a ``ZeroRedundancyOptimizer`` the ranks
    it shards the state over as ``state_sharded_over``, for what is said to help)."""
    sharded = {"sharded_over": estimate.world_size} if estimate.strategy == "fsdp" else {}
    state_ranks = zero_redundancy_ranks(optimizer)
    if state_ranks:
        sharded["state_sharded_over"] = state_ranks
    buckets = {"ddp_buckets": estimate.ddp_bucket_bytes} if estimate.ddp_bucket_bytes else {}
    return {"parameters": estimate.parameters_bytes, "gradients": estimate.gradients_bytes,
            "optimizer_state": estimate.optimizer_state_bytes, "runtime": estimate.runtime_bytes, **sharded,
            **buckets}


def _peak_model(estimates: _StepEstimates, checkpointing: bool, amp: bool, precision: str,
                later: bool = False) -> PeakModel:
    """The peak model, every estimate made now in the order the rungs take them (a rung that breaks the step raises
    :class:`RungPredictionError`), or with ``later`` the step as it is in ``precision`` now and the rest when read."""
    n_blocks = len(find_blocks(estimates.work, estimates.blocks)) if checkpointing else 0

    def block_peaks(precision: str) -> tuple[list[int], list[int]]:
        # Each checkpointed block saves its share of the saved activations, until what no block holds (the head, the
        # loss, one block recomputed in backward) is the peak: a line from none to one block, floored at all blocks
        plain = estimates.run(precision, 0)
        try:
            one, full = estimates.run(precision, 1), estimates.run(precision, n_blocks)
        except Exception as err:
            raise RungPredictionError("checkpointing", err) from err
        forward, backward = [plain.phase_peaks["forward"]], [plain.phase_peaks["backward"]]
        shares = plain.blocks["activations_bytes"].tolist()
        saved = 0
        for share in shares[:-1]:
            saved += share / (shares[0] or 1)
            forward.append(_saving(plain, one, full, "forward", saved))
            backward.append(_saving(plain, one, full, "backward", saved))
        forward.append(full.phase_peaks["forward"])
        backward.append(full.phase_peaks["backward"])
        return forward, backward

    def phases(precision: str, blocks: Callable[[], tuple[list[int], list[int]]]) -> PhaseEstimate:
        plain = estimates.run(precision, 0)
        held = (plain.parameters_bytes + plain.gradients_bytes + plain.optimizer_state_bytes + plain.runtime_bytes
                + plain.batch_bytes + plain.ddp_bucket_bytes)
        forward, backward = LaterPeaks.pair(plain.phase_peaks["forward"], plain.phase_peaks["backward"],
                                            n_blocks + 1, blocks)
        return PhaseEstimate(forward, backward, plain.phase_peaks["optimizer_step"], held, plain.gradients_bytes,
                             plain.batch_bytes)

    base = phases(precision, lambda: block_peaks(precision))
    later_phases = {}
    if amp and precision == "32-true":

        def mixed_blocks() -> tuple[list[int], list[int]]:
            base.forward.make()  # full precision's blocks first: a rung that breaks the step there is checkpointing
            return _blamed("amp", lambda: block_peaks("bf16-mixed"))

        later_phases[1] = lambda: _blamed("amp", lambda: phases("bf16-mixed", mixed_blocks))
    model = PeakModel(LaterPhases({0: base}, later_phases), batch_size_of(estimates.batch))
    return model if later else model.made()


def _blamed(rung: str, make: Callable[[], Any]) -> Any:
    """``make()``, any error it raises said to be ``rung``'s (a :class:`RungPredictionError`)."""
    try:
        return make()
    except Exception as err:
        raise RungPredictionError(rung, err) from err


def step_peaks(model: nn.Module, example_batch: Any, blocks: BlockSpec = None, target: Optional[str] = None,
               optimizer: OptimizerSpec = None, loss_fn: Optional[Callable] = None,
               precision: str = "32-true") -> Callable[[bool, int], int]:
    """``(amp, checkpointed_blocks) -> estimated peak`` of a step of ``model`` on ``example_batch``, one estimate
    each: for the block counts a :class:`~lightning_memguard.base.prediction.PeakModel` only draws a line between.
    Arguments as :func:`ladder_peak_model` takes them; ``precision`` is the run's own (``amp``: bf16 mixed)."""
    return _StepEstimates(model, example_batch, blocks, target, optimizer, loss_fn).peak_function(precision)


class _StepEstimates:
    """Estimates of one model's step on one batch at any precision and checkpointed block count. A step that had to
    leave the meta device (it warned once) runs on CPU at once from then on."""

    def __init__(self, model: nn.Module, batch: Any, blocks: BlockSpec, target: Optional[str],
                 optimizer: OptimizerSpec, loss_fn: Optional[Callable],
                 data_parallel: Optional[tuple[str, int]] = None) -> None:
        # a model inside DistributedDataParallel is one rank's replica: its buckets are estimated with it
        self.data_parallel = data_parallel or data_parallel_of(model)
        self.model = unwrap_parallel(model)
        # the batch is given as it is: the estimate keeps its values (on CPU) for the model's questions about them
        if sharding_of(self.model) is not None:  # FSDP2: its unsharded structure, estimated as one rank
            self.work = own_copy(unsharded_meta_copy(self.model))
        elif resolve_target(target) == "cuda" and device_of(self.model).type not in ("cpu", "meta"):
            self.work = own_copy(meta_copy(self.model))  # a copy of a GPU model would take GPU memory
        else:  # on CPU the estimate copies the model itself, and can run it there where it must
            self.work = self.model
        if self.work is not self.model:
            # a step on the meta device reads the batch's values on the host (estimate/step.py): a copy there now,
            # not the device's batch held for the whole fit (later estimates, micro-batch parts) and copied each run
            batch = map_tensors(lambda t: t.to("cpu") if t.device.type not in ("cpu", "meta") and not t.requires_grad
                                else t, batch)
        self.batch, self.blocks, self.target, self.loss_fn = batch, blocks, target, loss_fn
        self.optimizer_spec, self.optimizer = optimizer, _on(optimizer, self.model, self.work)
        self.fallbacks = _Fallbacks(resolve_target(target))
        self._made: dict[tuple[str, int], Any] = {}
        self._parts: dict[tuple[str, int, int], Optional[tuple[int, int]]] = {}  # by precision, blocks, parts
        self._part_failed = False  # an estimate of a micro-batch failed (it warned once): none is made again

    def run(self, precision: str, checkpointed_blocks: int):
        """The estimate in ``precision`` with ``checkpointed_blocks`` checkpointed (each made once)."""
        key = (precision, checkpointed_blocks)
        if key not in self._made:
            self._made[key] = self._estimate(precision, checkpointed_blocks)
        return self._made[key]

    def detach(self) -> bool:
        """Whether the estimates still to be made may wait until a question needs them, mid-fit: where they run on the
        meta device (a CUDA target whose first estimate did not have to leave it: no memory, no real step), on a meta
        copy of the model as it is now (the model's own copy where it is on CPU: what training does to the model
        since changes no number). A step on CPU is made now (a CPU source would measure it; it runs the model)."""
        if self.fallbacks.target != "cuda" or self.fallbacks.on_cpu:
            return False
        if self.work is self.model and device_of(self.model).type != "meta":
            self.work = own_copy(meta_copy(self.model))
            self.optimizer = _on(self.optimizer_spec, self.model, self.work)
        return True

    def _estimate(self, precision: str, checkpointed_blocks: int, batch: Any = None):
        strategy, world_size = sharding_of(self.model) or self.data_parallel or (None, None)
        batch = self.batch if batch is None else batch
        estimate = estimate_memory(self.work, batch, optimizer=self.optimizer, precision=precision,
                                   strategy=strategy, world_size=world_size,
                                   loss_fn=self.loss_fn, blocks=self.blocks if checkpointed_blocks else None,
                                   checkpointed_blocks=checkpointed_blocks, target=self.target,
                                   path=self.fallbacks.path(precision))
        self.fallbacks.note(estimate)
        return estimate

    def peak_function(self, precision: str) -> Callable[[bool, int], int]:
        """``(amp, checkpointed_blocks) -> peak``, in bf16 mixed precision with ``amp``, else in ``precision``."""
        return lambda amp, blocks: self.run("bf16-mixed" if amp else precision, blocks).peak_bytes

    def reserved_function(self, precision: str) -> Callable[[bool, int], Optional[int]]:
        """``(amp, checkpointed_blocks) -> reserved bytes`` (``None`` where the estimate has none: a CPU target),
        precisions as :meth:`peak_function`."""
        return lambda amp, blocks: self.run("bf16-mixed" if amp else precision, blocks).reserved_bytes

    def part_function(self, precision: str) -> Callable[[bool, int, int], Optional[tuple[int, int]]]:
        """``(amp, checkpointed_blocks, micro-batch level) -> (allocated peak, reserved bytes)`` of a step on the
        largest of the ``2**level`` parts the micro-batch rung splits the batch into (precisions as
        :meth:`peak_function`), each estimated once when asked; ``None`` where the estimate has no reserved figure or
        failed: a failure warns once and no part is estimated again (the split is then checked by its allocated peak
        alone, never a reason for a run to fail)."""

        def part(amp: bool, blocks: int, level: int) -> Optional[tuple[int, int]]:
            key = ("bf16-mixed" if amp else precision, blocks, 2**level if level else 1)
            if key not in self._parts and not self._part_failed:
                try:
                    estimate = self._estimate(key[0], blocks, batch=micro_batches_of(self.model, self.batch, key[2])[0])
                    held = estimate.reserved_bytes
                    self._parts[key] = (estimate.peak_bytes, held) if held is not None else None
                except Exception as err:
                    self._part_failed = True
                    warnings.warn(f"lightning-memguard: the caching allocator's segments of a micro-batch's step could "
                                  f"not be estimated ({type(err).__name__}: {err}); a split is checked by its "
                                  "allocated peak alone.", stacklevel=2)
            return self._parts.get(key)

        return part

    def phase_function(self, precision: str) -> Callable[[bool, int], tuple[int, int]]:
        """``(amp, checkpointed_blocks) -> (forward peak, backward peak)``, precisions as :meth:`peak_function`."""

        def phases(amp: bool, blocks: int) -> tuple[int, int]:
            peaks = self.run("bf16-mixed" if amp else precision, blocks).phase_peaks
            return peaks["forward"], peaks["backward"]

        return phases


class _Fallbacks:
    """Which precisions' steps had to leave the meta device for the CPU (they warned once): those run on CPU at once
    from then on. Meta is tried first for a CUDA target, and for a CPU target in mixed precision."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.on_cpu: set[str] = set()

    def path(self, precision: str) -> Optional[str]:
        return "cpu" if precision in self.on_cpu else None

    def note(self, estimate) -> None:
        if estimate.path == "cpu" and (self.target == "cuda" or estimate.precision != "32-true"):
            # on a CUDA target the reason (a value read from the weights) holds in every precision
            self.on_cpu.update(PRECISIONS if self.target == "cuda" else {estimate.precision})


def _saving(plain, one, full, phase: str, blocks: float) -> int:
    """The phase peak with ``blocks`` first blocks' worth of activations checkpointed (in units of the first's)."""
    per_block = plain.phase_peaks[phase] - one.phase_peaks[phase]
    return int(max(plain.phase_peaks[phase] - per_block * blocks, full.phase_peaks[phase]))


def _on(optimizer: OptimizerSpec, original: nn.Module, work: nn.Module) -> OptimizerSpec:
    """An optimizer instance built on ``original`` becomes a like one on ``work``'s parameters (a class or a factory
    is built on whatever model it is given)."""
    if work is original or not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    return optimizer_like(optimizer, original, work)
