"""``plan_at_start``: before the first step, the levels the first batch's estimate says fit, set on the ladder."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from ..base.snapshot import format_bytes
from ..estimate.plan import plan_configuration
from .ladder import Ladder
from .policy import Decision

__all__ = ["plan_at_start"]


def plan_at_start(ladder: Ladder, module: nn.Module, batch: Any, capacity: Optional[int], threshold: float, step: int,
                  *, cuda: bool, optimizer: Any = None, loss_fn: Optional[Callable] = None,
                  precision: str = "32-true", reduce_max: Optional[Callable[[list[int]], list[int]]] = None,
                  warn: Callable[[str], None]) -> Optional[Decision]:
    """Estimates the step from ``batch`` and applies the cheapest levels that fit under ``threshold × capacity``.
    Returns the ``plan`` decision to record, or ``None`` when nothing was planned. ``reduce_max`` (several processes)
    makes every rank apply the highest levels any rank planned. Never raises: a plan is a head start."""
    if capacity is None or ladder.policy is None:
        warn("lightning-memguard: plan_at_start needs a capacity (a budget on CPU), so no plan was made.")
        return None
    levels: dict[str, int] = {}
    reason, expected, fits = "", None, False
    try:
        # on CUDA the estimate runs a meta copy through the CUDA kernel model: no GPU memory, no FLOPs
        plan = plan_configuration(module, batch, capacity, threshold, optimizer=optimizer, loss_fn=loss_fn,
                                  blocks=ladder.blocks, allow_amp=ladder.usable("amp"),
                                  target="cuda" if cuda else "cpu",
                                  allow_checkpointing=ladder.usable("checkpointing"), precision=precision)
    except Exception as err:  # a plan is a head start, never the reason a fit dies
        warn(f"lightning-memguard: plan_at_start could not estimate the step ({err}); the closed loop will act on "
             "measurements instead.")
    else:
        levels = {"amp": int(plan.amp), "checkpointing": plan.checkpointed_blocks}
        reason, expected, fits = plan.reason, plan.expected_peak_bytes, plan.fits
        split = ladder.policy.planned_level("microbatch", levels, capacity) \
            if not plan.fits and "microbatch" in ladder.rungs else None
        if split is not None:  # only smaller micro-batches fit: split from the first step, not after an OOM
            (levels["microbatch"], expected), fits = split, True
            reason += (f"; with {ladder.rungs['microbatch'].micro_batches_at(split[0])} micro-batches a step is "
                       f"predicted at {format_bytes(expected)}, which fits")
        if not fits:
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
