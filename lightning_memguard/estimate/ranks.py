"""One rank's share of a data-parallel step, from the single-process estimate of the unsharded model (no process
group needed): DDP keeps a full replica plus its gradient buckets; FSDP2 shards parameters, gradients and optimizer
state and gathers one unit at a time.

The FSDP2 layout is the recipe torchtitan and Lightning's ``ModelParallelStrategy`` use: ``fully_shard`` on every
block of the model's block list, then on the root, with ``reshard_after_forward``'s default (blocks free their
gathered parameters after their forward; the root keeps its own through forward and backward). Measured on two gloo
ranks with the live-storage count (torch 2.13):

* forward: the shards, plus the unit being gathered twice over (the all-gather's flat output and the parameters
  copied out of it), plus the root's own parameters whole;
* backward: as forward, plus a third of a unit (the prefetched unit's gathered parameters and the current unit's
  unsharded gradients, less what reduce-scatter hands back) — modelled as ``2 + 1/N`` units; the single-process
  backward peak comes early in backward, when few gradients exist, so gradients are not taken off it;
* optimizer step: everything but the batch divided by the ranks (the step runs on shards only).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from torch import nn

from ..base.checks import check_int
from ..mitigations.checkpointing import BlockSpec, find_blocks
from .result import MemoryEstimate

__all__ = ["STRATEGIES", "check_strategy", "per_rank"]

STRATEGIES = ("ddp", "fsdp")


def check_strategy(strategy: Optional[str], world_size: Optional[int]) -> tuple[Optional[str], int]:
    """``(strategy, world_size)`` checked: ``strategy`` one of :data:`STRATEGIES` or ``None`` (one process), and
    ``world_size`` the number of ranks (at least 1; required with a strategy, 1 or ``None`` without)."""
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}; allowed: {STRATEGIES} (or None: one process)")
    if strategy is None:
        if world_size not in (None, 1):
            raise ValueError(f"world_size={world_size!r} needs strategy='ddp' or 'fsdp' (how the ranks share the "
                             "model)")
        return None, 1
    if world_size is None:
        raise ValueError(f"strategy={strategy!r} needs world_size= (the number of ranks)")
    return strategy, check_int("world_size", world_size, minimum=1)


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters at their full (unsharded) shapes: a DTensor's ``numel`` is global."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def per_rank(estimate: MemoryEstimate, model: nn.Module, blocks: BlockSpec, strategy: Optional[str],
             world_size: int) -> MemoryEstimate:
    """``estimate`` (one process, the whole per-rank batch) turned into one rank's under ``strategy``."""
    if strategy is None:
        return estimate
    # the buckets DDP all-reduces through: one more copy of the gradients, all step long (with
    # gradient_as_bucket_view=True the gradients are views of them: then an upper bound, by up to that copy after the
    # forward)
    if strategy == "ddp":
        buckets = estimate.gradients_bytes
        # the allocator's segments are one process's, not a rank's under a strategy: no reserved figure
        return replace(estimate, strategy=strategy, world_size=world_size, strategy_bytes=buckets,
                       phase_peaks={phase: peak + buckets for phase, peak in estimate.phase_peaks.items()},
                       reserved_bytes=None)
    n = world_size
    params = parameter_bytes(model)
    # every block is a unit, also one the model checkpoints itself (torch's checkpoint_wrapper, transformers' flag)
    units = [parameter_bytes(block) for _, block in find_blocks(model, blocks, self_checkpointed=True)]
    unit = max(units, default=0)
    root = params - sum(units)  # the root's own parameters: gathered once, kept through forward and backward
    buffers = max(estimate.parameters_bytes - params, 0)  # buffers are not sharded
    state, grads = params + estimate.optimizer_state_bytes, estimate.gradients_bytes
    kept_whole = root * (1 - 1 / n)
    forward_in_flight = 2 * unit + kept_whole
    backward_in_flight = (2 + 1 / n) * unit + kept_whole
    peaks = estimate.phase_peaks
    phase_peaks = {
        "forward": peaks["forward"] - (state + grads) * (1 - 1 / n) + forward_in_flight,
        "backward": peaks["backward"] - state * (1 - 1 / n) + backward_in_flight,
        "optimizer_step": (peaks["optimizer_step"] - estimate.batch_bytes) / n + estimate.batch_bytes,
    }
    return replace(
        estimate, strategy=strategy, world_size=n, strategy_bytes=int(backward_in_flight),
        parameters_bytes=int(params / n) + buffers, gradients_bytes=int(grads / n),
        optimizer_state_bytes=int(estimate.optimizer_state_bytes / n),
        phase_peaks={phase: int(peak) for phase, peak in phase_peaks.items()}, reserved_bytes=None)
