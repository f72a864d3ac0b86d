"""What would help where what no rung of the ladder lowers — parameters, gradients, optimizer state — does not fit:
the remedies for the parts of it large enough to close the gap (framework-free)."""

from __future__ import annotations

from typing import Mapping, Optional

__all__ = ["what_would_help"]


def what_would_help(sizes: Optional[Mapping[str, int]], excess: int, sharded_over: Optional[int] = None,
                    foreach_helps: bool = True, state_sharded_over: Optional[int] = None) -> str:
    """The remedies worth naming where what no rung lowers is ``excess`` bytes over the capacity, for the parts of
    it that are at least that large (``sizes``: ``parameters``, ``gradients``, ``optimizer_state`` in bytes): less
    optimizer state where the state is; fewer trainable parameters where their gradients and state are; lighter or
    sharded weights where the parameters are (a LoRA's frozen base: its adapters' state is small, and freezing is
    done); all of them where only together they are, or where ``sizes`` is ``None`` (not known); and a larger
    capacity always. ``sharded_over``: the ranks FSDP2 already shards the model over (default: ``sizes``'
    ``sharded_over``, where it has one): more ranks (always, as they divide every part) and CPU offloading are
    named instead of sharding. ``state_sharded_over`` (default: ``sizes``' ``state_sharded_over``): the ranks a
    ``ZeroRedundancyOptimizer`` already shards the optimizer state over: more ranks and offloading are named
    instead of sharding the state, and FSDP for sharding the parameters and gradients too.
    ``foreach_helps=False``: the optimizers run one parameter at a time or fused already, so ``foreach=False`` is
    not named. ``sizes``' ``ddp_buckets`` (DistributedDataParallel's gradient buckets, a copy of the gradients):
    letting the gradients live in the buckets is named first where they are enough."""
    if sharded_over is None and sizes is not None:
        sharded_over = sizes.get("sharded_over")
    if state_sharded_over is None and sizes is not None:
        state_sharded_over = sizes.get("state_sharded_over")
    if sharded_over:
        state_remedies, weights_remedies = [_FSDP2_OFFLOADING], []
    elif state_sharded_over:  # torch's ZeroRedundancyOptimizer beside DDP
        state_remedies = [f"more ranks (ZeroRedundancyOptimizer shards the optimizer state over {state_sharded_over} "
                          f"now: each keeps about 1/{state_sharded_over} of it)",
                          "offloading the optimizer state to the CPU (DeepSpeed ZeRO-Offload)"]
        weights_remedies = ["sharding the parameters and gradients too (FSDP in place of DDP and "
                            "ZeroRedundancyOptimizer)"]
    else:
        state_remedies = ["sharding or offloading the optimizer state (FSDP, torch's ZeroRedundancyOptimizer beside "
                          "DDP, DeepSpeed ZeRO)"]
        weights_remedies = ["sharding the parameters (FSDP)"]
    optimizer = [_LESS_STATE, _FOREACH, *state_remedies]
    weights = [_LIGHTER_WEIGHTS, *weights_remedies, "a smaller model"]
    if not foreach_helps:
        optimizer.remove(_FOREACH)
    trainable = ["fewer trainable parameters (freezing layers, LoRA)"]
    remedies: list[str] = []
    if sizes is not None:
        params, grads, state = sizes["parameters"], sizes["gradients"], sizes["optimizer_state"]
        remedies = (optimizer if state >= excess else []) + (trainable if grads + state >= excess else []) \
            + (weights if params >= excess else [])
    if not remedies:  # no part alone is enough: lowering several together is
        remedies = optimizer + trainable + weights
    buckets = sizes.get("ddp_buckets", 0) if sizes is not None else 0
    if buckets and buckets >= excess:
        remedies.insert(0, _BUCKET_VIEW)
    if sharded_over:  # more ranks divide every part at once
        remedies.append(f"more ranks to shard over (now {sharded_over}: each holds 1/{sharded_over} of the "
                        "parameters, gradients and optimizer state)")
    return ", ".join(remedies) + ", or a larger capacity"


#: the remedies for the optimizer state and the weights that every layout names
_LESS_STATE = "an optimizer with less state (SGD, 8-bit or factored Adam)"
_FOREACH = "foreach=False in the optimizer for smaller temporaries"
_LIGHTER_WEIGHTS = "lighter weights (bf16, or 8-/4-bit quantized as for a LoRA's frozen base)"
_FSDP2_OFFLOADING = "FSDP2's CPU offloading (fully_shard(..., offload_policy=CPUOffloadPolicy()))"

#: what lets DistributedDataParallel's gradient buckets hold the gradients themselves (no second copy)
_BUCKET_VIEW = ("gradient_as_bucket_view=True for DistributedDataParallel where it is not on already (Lightning: "
                "DDPStrategy(gradient_as_bucket_view=True); the gradients then live in its buckets, one copy fewer)")
