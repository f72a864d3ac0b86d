"""The plan before the first step: the cheapest rung levels the first batch's estimate says fit, set on the ladder
before the step runs — always with ``plan_at_start=True``; by default (``None``) where the estimate the ladder made of
the first batch predicts the step at its present levels over the capacity, so that a step the estimate already knows
cannot fit never runs out of memory first. Where what no rung lowers (parameters, gradients, optimizer state) is over
the capacity, it says so once, with what would help, and no rung is ever raised."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from ..base.advice import what_would_help
from ..base.prediction import RungPredictionError, floor_over
from ..base.snapshot import format_bytes
from .ladder import Ladder
from .policy import AIM_SHARE, Decision

__all__ = ["plan_at_start", "needs_plan"]


def needs_plan(ladder: Ladder, capacity: Optional[int], capped: bool = False, beside_bytes: int = 0) -> bool:
    """Whether the estimate the ladder made of the first batch predicts the step at the ladder's present levels over
    95 % of the capacity (the aim of the costliest rung: an estimate a few per cent short must not cost an OOM) less
    ``beside_bytes``, what the run holds beside the step, or what no rung lowers over ``capacity`` (the capacity less
    those), or — ``capped``: the capacity caps what the CUDA caching allocator reserves — the allocator's predicted
    segments over it. Costs the estimate of the present levels only (where the ladder left it for later), and of
    mixed precision where what no rung lowers is over the capacity in full precision; the segments are read at levels
    already estimated only."""
    predictions, policy, predictor = ladder.predictor.predictions, ladder.policy, ladder.predictor
    if capacity is None or predictions is None or policy is None:
        return False
    levels = ladder.levels
    # None: levels the estimate does not cover (say, blocks a first fit left checkpointed), or whose estimate found
    # that a rung breaks the step (the rung is off, no prediction is left): the closed loop decides
    predicted = predictor.peak(levels)
    if predicted is None:
        return False
    amp_levels = (0, 1) if ladder.usable("amp") else (0,)
    over = predicted > AIM_SHARE * (capacity + beside_bytes) - beside_bytes or predictor.ask(
        lambda model: floor_over(model, capacity, amp_levels), None) is not None
    return predictor.model is not None and (over or (capped and _segments(predictions, levels) > capacity))


def _segments(predictions: Any, levels: dict[str, int]) -> int:
    """The reserved bytes predicted at ``levels`` where an estimate was made at them (no micro-batches, no block or
    every block checkpointed, the precision the model covers), else 0."""
    blocks, amp = levels.get("checkpointing", 0), levels.get("amp", 0)
    n_blocks = predictions.model.n_blocks
    if predictions.measure_reserved is None or levels.get("microbatch", 0) or blocks not in (0, n_blocks) \
            or (amp and not predictions.model.covers("amp")):
        return 0
    return predictions.measure_reserved(bool(amp), blocks) or 0


def plan_at_start(ladder: Ladder, module: nn.Module, batch: Any, capacity: Optional[int], step: int,
                  *, cuda: bool, optimizer: Any = None, loss_fn: Optional[Callable] = None,
                  precision: str = "32-true", reduce_max: Optional[Callable[[list[int]], list[int]]] = None,
                  warn: Callable[[str], None], asked: bool = True, capped: bool = False,
                  beside_bytes: int = 0, data_parallel: Optional[tuple[str, int]] = None) -> list[Decision]:
    """Applies the cheapest levels predicted to fit under the policy's line, ``threshold × capacity`` (the fewest
    micro-batches, then blocks, with or without AMP, under 95 % of the capacity where only smaller micro-batches
    fit), chosen from the estimate of ``batch``: the ladder's (``ladder.predictor``), or where the ladder has none
    (or several processes each plan for their own batch) one made the same way. ``reduce_max`` (several processes)
    makes every rank apply the highest levels any rank planned. Where what no rung lowers is over the capacity, no
    level is set, the policy stops climbing and a ``cannot_help`` decision says what would help. ``asked``: the user
    asked for the plan (``plan_at_start=True``: a plan that does not fit is a warning too; else the plan is the
    default's, made because the step is predicted not to fit); ``capped``: the capacity caps what the CUDA caching
    allocator reserves (the card, a memory fraction; not a ``budget=``), so a configuration must keep its predicted
    reserved bytes under it too — a split's estimated at its micro-batch's size, only where a split is the plan
    (:func:`~lightning_memguard.estimate.plan.choose_levels`); ``beside_bytes``: what the run holds beside the step,
    already taken off ``capacity`` (said in the reasons); ``data_parallel``: how the module trains over the ranks
    where it does not show it itself (``("ddp", ranks)``, as
    :func:`~lightning_memguard.estimate.plan.ladder_predictions` takes it). Returns the decisions to record (``plan``,
    ``cannot_help``). Never raises: a plan is a head start."""
    if capacity is None or ladder.policy is None:
        if asked:
            warn("lightning-memguard: plan_at_start needs a capacity (a budget on CPU), so no plan was made.")
        return []
    levels: dict[str, int] = {}
    reason, expected = "", None
    decisions: list[Decision] = []
    name = "plan_at_start" if asked else "the plan before the first step"
    # loaded here, not with the guard: a run that does not plan or predict never loads the estimator
    from ..estimate.plan import ladder_predictions

    def estimated() -> Any:
        # on CUDA the estimate runs a meta copy through the CUDA kernel model: no GPU memory, no FLOPs
        return ladder_predictions(module, batch, ladder.blocks, "cuda" if cuda else "cpu", optimizer, loss_fn,
                                  checkpointing=ladder.usable("checkpointing"),
                                  amp=ladder.usable("amp") and precision == "32-true", precision=precision,
                                  data_parallel=data_parallel)

    def planned(predictions: Any) -> tuple[dict[str, int], str, Optional[int], list[Decision]]:
        return _chosen(ladder, predictions, capacity, step, cuda=cuda, precision=precision, asked=asked,
                       capped=capped, name=name, warn=warn, beside_bytes=beside_bytes,
                       base=_configuration_base(precision, module))

    # with several processes each rank plans for its own batch where asked (the ladder's model is the worst rank's)
    ladders = ladder.predictor.predictions if reduce_max is None or not asked else None
    try:
        try:
            levels, reason, expected, decisions = planned(ladders or estimated())
        except RungPredictionError as err:
            if ladders is None:
                raise
            # an estimate the ladder left for later found that a rung breaks the step: the rung is turned off, as at
            # the first batch, and the plan is made as where the ladder has no estimate
            ladder.predictor.rung_failed(err)
            levels, reason, expected, decisions = planned(estimated())
    except Exception as err:  # a plan is a head start, never the reason a fit dies
        warn(f"lightning-memguard: {name} could not estimate the step ({_error_text(err)}); the closed loop will "
             "act on measurements instead.")
    if reduce_max is not None:
        # each rank planned for its own batch; all must run the same micro-batches: the highest levels win
        names = sorted(ladder.rungs)
        agreed = {n: int(v) for n, v in zip(names, reduce_max([levels.get(n, 0) for n in names]))}
        if any(agreed[n] != levels.get(n, 0) for n in names):
            reason = (reason + "; " if reason else "") + "levels raised to the highest any rank planned"
        levels = agreed
    if not reason and not any(levels.values()):
        return decisions
    # a plan only raises: a level already set (a resumed checkpoint's, a first fit's) was measured, not estimated
    ladder.apply_plan({name: max(level, ladder.levels.get(name, 0)) for name, level in levels.items()})
    return decisions + _plan_decisions(ladder, levels, step, reason, expected)


def _configuration_base(precision: str, module: nn.Module) -> str:
    from ..estimate.plan import configuration_base

    return configuration_base(precision, module)


def _plan_decisions(ladder: Ladder, planned: dict[str, int], step: int, reason: str,
                    expected: Optional[int]) -> list[Decision]:
    """The plan as events: one a rung it puts on (in the ladder's order, with the rung's level after the plan), each
    with the plan's one reason, as any decision that moves several rungs at once; one naming no rung where the plan
    keeps the step as it is."""
    levels = ladder.levels
    engaged = [name for name in ladder.rungs if planned.get(name, 0) and levels.get(name, 0)]
    return [Decision(step=step, action="plan", reason=reason, rung=name, level=levels[name],
                     peak_before_bytes=expected) for name in engaged] or [
        Decision(step=step, action="plan", reason=reason, peak_before_bytes=expected)]


def _chosen(ladder: Ladder, predictions: Any, capacity: int, step: int, *, cuda: bool, precision: str, asked: bool,
            capped: bool, name: str, warn: Callable[[str], None], beside_bytes: int = 0, base: Optional[str] = None
            ) -> tuple[dict[str, int], str, Optional[int], list[Decision]]:
    """The levels :func:`plan_at_start` applies from ``predictions``, the plan's reason and expected peak, and the
    decision where what no rung lowers cannot fit."""
    from ..estimate.plan import choose_levels

    levels: dict[str, int] = {}
    amp, checkpointing = ladder.usable("amp"), ladder.usable("checkpointing")
    peaks = predictions.model
    floor = floor_over(peaks, capacity, (0, 1) if amp else (0,))
    if floor is not None:
        held = min(peaks.by_amp[a].held_bytes for a in peaks.by_amp if amp or a == 0)
        # foreach=False lowers the optimizer step's temporaries only: named where what persists fits without them
        text = _cannot_fit_text(predictions, floor, capacity, beside_bytes, foreach_helps=held < capacity)
        ladder.policy.stop_climbing(text)
        return levels, "", None, [Decision(step=step, action="cannot_help", reason=text, peak_before_bytes=floor)]
    top = ladder.policy.max_levels["microbatch"] if ladder.usable("microbatch") else 0
    # the policy's lines are shares of the whole capacity, which the run's peak (the step's and what is held beside
    # it) must stay under: the step's room under each is the line less what is held beside (``capacity`` is the room
    # under the capacity itself). A share of the room alone left the step above the threshold's line, so the closed
    # loop climbed at once
    policy, whole = ladder.policy, capacity + beside_bytes
    # a split aims where the policy aims a micro-batch level: 5 % under the limit, or under the capacity where
    # micro-batching is the last resort
    aim = policy.aim("microbatch", whole) - beside_bytes
    # and the blocks and AMP of a split where the policy aims them, under the threshold's limit: a step left between
    # the two lines would have the loop raise them at once
    cheap = policy.aim("checkpointing", whole) - beside_bytes
    # under a cap on reserved memory a split's segments are estimated too, at its micro-batch's size: only where a
    # split is what the allocated peaks choose
    plan = choose_levels(peaks, policy.limit_bytes(whole) - beside_bytes, amp=amp, checkpointing=checkpointing,
                         precision=precision, micro_batch_levels=top, micro_batch_aim=aim, cheap_rungs_aim=cheap,
                         measure=predictions.measure, measure_phases=predictions.measure_phases,
                         sizes=predictions.sizes, reserved=predictions.measure_reserved if capped and cuda else None,
                         reserved_limit=capacity,
                         split_reserved=predictions.split_reserved if capped and cuda else None, base=base)
    levels = {"amp": int(plan.amp), "checkpointing": plan.checkpointed_blocks}
    if plan.micro_batch_level:
        levels["microbatch"] = plan.micro_batch_level
    reason = plan.reason
    if not asked:
        reason = (f"the estimate of the first batch puts a step at the present levels over {AIM_SHARE:.0%} of the "
                  f"capacity {_capacity_text(capacity, beside_bytes)}, where it would run out of memory: {reason}")
    elif beside_bytes:
        reason = f"planned for the capacity {_capacity_text(capacity, beside_bytes)}: {reason}"
    if not plan.fits:
        warn(f"lightning-memguard: {name}: {reason}")
    return levels, reason, plan.expected_peak_bytes, []


def _capacity_text(room: int, beside_bytes: int) -> str:
    """The capacity in words, less what the run holds beside the step where that was taken off it (``room``)."""
    if not beside_bytes:
        return format_bytes(room)
    return (f"{format_bytes(room + beside_bytes)} less the {format_bytes(beside_bytes)} the run holds beside the step "
            "(data the model keeps, other tensors on the device), which the step's estimate does not count")


def _cannot_fit_text(predictions, floor: int, capacity: int, beside_bytes: int = 0,
                     foreach_helps: bool = True) -> str:
    """What the estimate says where what no rung lowers is over the capacity, with what would help."""
    sizes = predictions.sizes
    return ("the training state cannot fit: the estimate of the first batch puts what no rung lowers at "
            f"{format_bytes(floor)} (parameters "
            f"{format_bytes(sizes['parameters'])}, gradients {format_bytes(sizes['gradients'])}, optimizer state "
            f"{format_bytes(sizes['optimizer_state'])}{_buckets_text(sizes)}, with the runtime's workspaces and the "
            f"batch, or the optimizer step's peak), over the capacity {_capacity_text(capacity, beside_bytes)}. "
            "Activation remedies (AMP, checkpointing, micro-batching) cannot lower that, so none is applied. "
            "What would: "
            f"{what_would_help(sizes, floor - capacity, foreach_helps=foreach_helps)}")


def _buckets_text(sizes) -> str:
    buckets = sizes.get("ddp_buckets")
    return f", DistributedDataParallel's gradient buckets {format_bytes(buckets)}" if buckets else ""


def _error_text(err: BaseException) -> str:
    """What the plan's estimate said: for a rung that broke it, the step's own error."""
    return str(err.error if isinstance(err, RungPredictionError) else err)
