"""What is said when memory runs out: the out-of-memory report of a batch that could not be rescued, and the texts of
an optimizer step that ran out (numbers in, text out; framework-free)."""

from __future__ import annotations

from typing import Optional

import pandas as pd

from ..base.advice import what_would_help
from ..base.snapshot import format_bytes
from .fragmentation import Fragmentation

__all__ = ["oom_report", "optimizer_oom_texts"]


def oom_report(step: int, phase: str, peak_bytes: Optional[int], capacity_bytes: Optional[int],
               levels: dict[str, int], events: pd.DataFrame, why: str, error: str,
               fragmentation: Optional[Fragmentation] = None, subject: Optional[str] = None) -> dict:
    """What a user needs when a batch could not be rescued: where, how much, against what, what was tried and,
    when the cache held enough free memory for the failed request, that this is fragmentation and what helps.
    ``subject``: what could not be rescued, where it is not step ``step`` (``"a validation batch of 32 samples"``)."""
    tried_actions = ["apply", "keep", "revert", "rescue", "rescue_split", "predicted_split", "eval_split",
                     "speed_trial"]
    tried = events[events["action"].isin(tried_actions)] if not events.empty else events
    tried_lines = [f"  step {row.step}: {row.action} {row.rung} (level {row.level}) - {row.reason}"
                   for row in tried.itertuples()] or ["  nothing"]
    text = "\n".join([
        f"lightning-memguard could not rescue {subject or f'step {step}'}: {why}.",
        f"  out of memory in: {phase} ({error})",
        f"  peak at failure: {format_bytes(peak_bytes)}; capacity: {format_bytes(capacity_bytes)}",
        *([f"  {fragmentation.text}"] if fragmentation is not None else []),
        "  rungs now: " + (", ".join(f"{name}={level}" for name, level in levels.items()) or "none configured"),
        "what was tried:",
        *tried_lines,
    ])
    return {"step": step, "phase": phase, "peak_bytes": peak_bytes, "capacity_bytes": capacity_bytes,
            "levels": dict(levels), "why": why, "error": error, "tried": tried_lines, "text": text,
            "fragmentation": fragmentation.numbers() if fragmentation is not None else None}


def optimizer_oom_texts(step: int, error: str, sizes: dict[str, int], capacity: Optional[int],
                        foreach_helps: bool = True) -> tuple[str, str]:
    """What to say when ``optimizer.step`` ran out of memory: ``(the reason of a retry with foreach=False, why the
    run ends otherwise)``, both with the training state's sizes. ``sizes``: as
    :func:`~lightning_memguard.sources.training_state.training_state_bytes` returns them. ``foreach_helps``: some
    group runs group-wide kernels, whose temporaries ``foreach=False`` would lower (else it is not named)."""
    numbers = (f"parameters {format_bytes(sizes['parameters'])}, gradients {format_bytes(sizes['gradients'])}, "
               f"optimizer state {format_bytes(sizes['optimizer_state'])}, capacity {format_bytes(capacity)}")
    retry = (f"out of memory in the optimizer step of step {step} ({error}) before any parameter or state was "
             f"updated; {numbers}; retrying the step with foreach=False (one parameter's temporaries at a time)")
    # the state may have been half created when it ran out: the gap is known only where what exists is already over
    held = sizes["parameters"] + sizes["gradients"] + sizes["optimizer_state"]
    excess = held - capacity if capacity is not None else 0
    helps = what_would_help(sizes if excess > 0 else None, excess, sizes.get("sharded_over"), foreach_helps,
                            sizes.get("state_sharded_over"))
    why = (f"the optimizer step ran out of memory ({numbers}). Activation remedies (AMP, checkpointing, "
           f"micro-batching) cannot lower it. What helps: {helps}")
    return retry, why
