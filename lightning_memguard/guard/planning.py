"""``plan_at_start``: before the first step, the cheapest rung levels the first batch's peak model says fit, set on
the ladder."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from ..base.prediction import PeakModel
from .ladder import Ladder
from .policy import Decision

__all__ = ["plan_at_start"]


def plan_at_start(ladder: Ladder, module: nn.Module, batch: Any, capacity: Optional[int], threshold: float, step: int,
                  *, cuda: bool, optimizer: Any = None, loss_fn: Optional[Callable] = None,
                  precision: str = "32-true", reduce_max: Optional[Callable[[list[int]], list[int]]] = None,
                  warn: Callable[[str], None]) -> Optional[Decision]:
    """Applies the cheapest levels predicted to fit under ``threshold × capacity`` (smaller micro-batches where
    nothing else fits), chosen from the peak model of ``batch``: the ladder's, built at this batch, or where the
    ladder has none (or several processes each plan for their own batch) one built the same way. Returns the
    ``plan`` decision to record, or ``None`` when nothing was planned. ``reduce_max`` (several processes) makes every
    rank apply the highest levels any rank planned. Never raises: a plan is a head start."""
    if capacity is None or ladder.policy is None:
        warn("lightning-memguard: plan_at_start needs a capacity (a budget on CPU), so no plan was made.")
        return None
    levels: dict[str, int] = {}
    reason, expected = "", None
    limit = int(threshold * capacity)
    amp, checkpointing = ladder.usable("amp"), ladder.usable("checkpointing")
    target = "cuda" if cuda else "cpu"
    # loaded here, not with the guard: a run that does not plan or predict never loads the estimator
    from ..estimate.plan import choose_levels, ladder_peak_model, step_peaks

    try:
        # on CUDA the estimate runs a meta copy through the CUDA kernel model: no GPU memory, no FLOPs
        peaks = (_ladder_model(ladder) if reduce_max is None else None) or ladder_peak_model(
            module, batch, ladder.blocks, target, optimizer, loss_fn, checkpointing=checkpointing,
            amp=amp and precision == "32-true", precision=precision)
        # the model draws a line between no block and all checkpointed: the counts between are estimated where the
        # choice looks at them
        measure = step_peaks(module, batch, ladder.blocks, target, optimizer, loss_fn, precision)
        top = ladder.policy.max_levels["microbatch"] if "microbatch" in ladder.rungs else 0
        # a split aims where the policy aims a micro-batch level: 5 % under the limit, or under the capacity where
        # micro-batching is the last resort
        aim = ladder.policy.aim("microbatch", capacity)
        plan = choose_levels(peaks, limit, amp=amp, checkpointing=checkpointing, precision=precision,
                             micro_batch_levels=top, micro_batch_aim=aim, measure=measure)
    except Exception as err:  # a plan is a head start, never the reason a fit dies
        warn(f"lightning-memguard: plan_at_start could not estimate the step ({_error_text(err)}); the closed loop "
             "will act on measurements instead.")
    else:
        levels = {"amp": int(plan.amp), "checkpointing": plan.checkpointed_blocks}
        if plan.micro_batch_level:
            levels["microbatch"] = plan.micro_batch_level
        reason, expected = plan.reason, plan.expected_peak_bytes
        if not plan.fits:
            warn(f"lightning-memguard: plan_at_start: {reason}")
    if reduce_max is not None:
        # each rank planned for its own batch; all must run the same micro-batches: the highest levels win
        names = sorted(ladder.rungs)
        agreed = {n: int(v) for n, v in zip(names, reduce_max([levels.get(n, 0) for n in names]))}
        if any(agreed[n] != levels.get(n, 0) for n in names):
            reason = (reason + "; " if reason else "") + "levels raised to the highest any rank planned"
        levels = agreed
    if not reason and not any(levels.values()):
        return None
    ladder.apply_plan(levels)
    return Decision(step=step, action="plan", reason=reason, peak_before_bytes=expected)


def _ladder_model(ladder: Ladder) -> Optional[PeakModel]:
    """The peak model the ladder built at this batch, if it could (one process: with several the ladder's is the
    worst rank's, and each rank plans for its own batch)."""
    return ladder.policy.peak_model


def _error_text(err: BaseException) -> str:
    """What the plan's estimate said: for a rung that broke it, the step's own error."""
    from ..estimate.plan import RungPredictionError

    return str(err.error if isinstance(err, RungPredictionError) else err)
