"""Pre-flight estimate: what one training step of a model will need, by category, phase and module — measured by
running a step under tensor accounting on CPU, or on the ``meta`` device for models larger than this machine.
Framework-free: a LightningModule is used through ``training_step`` / ``configure_optimizers`` by duck typing.

The numbers are what autograd saves (``saved_tensors_hooks``) and what the step really allocates (live storages
counted by a dispatch mode), not a sum of module output sizes: residuals, attention, in-place ops and what autograd
does not keep come out as they are. This module checks the arguments, chooses where the step runs (meta, or CPU
where it must) and adds the remedies' variants; the step itself is :mod:`lightning_memguard.estimate.step`.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Callable, Optional

import pandas as pd
import torch
from torch import nn

from ..base.checks import caller_stacklevel, check_bool, check_int
from ..base.collection import collection_paused
from ..base.sharding import data_parallel_of
from ..base.snapshot import MiB
from ..mitigations.checkpointing import BlockSpec, find_blocks, validate_block_spec
from ..sources.cuda import ALLOC_CONF_VARIABLES, configured_allocator_options
from .caching_allocator import unmodelled_options
from .copies import OptimizerSpec, device_of, estimation_device, unsharded, unwrap_parallel
from .gathers import TrainingStep
from .mixed import NeedsValues
from .ranks import check_strategy, per_rank
from .result import MemoryEstimate
from .step import StepSpec, run_step

__all__ = ["EstimateFallbackWarning", "MemoryEstimate", "estimate_memory"]

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
TARGETS = ("cuda", "cpu")
PATHS = ("meta", "cpu")
ESTIMATE_PHASES = ("forward", "backward", "optimizer_step")


class EstimateFallbackWarning(UserWarning):
    """The step read a value computed from the weights, or failed on the meta device alone, so the estimate ran it on
    CPU instead."""


# a burst of short-lived objects: a full collection in its middle would walk the whole process (base/collection.py)
@collection_paused()
def estimate_memory(
    model: nn.Module,
    example_batch: Any,
    optimizer: OptimizerSpec = None,
    precision: str = "32-true",
    loss_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
    blocks: BlockSpec = None,
    checkpointed_blocks: int = 0,
    variants: bool = False,
    target: Optional[str] = None,
    path: Optional[str] = None,
    strategy: Optional[str] = None,
    world_size: Optional[int] = None,
) -> MemoryEstimate:
    """Estimates one training step of ``model`` on ``example_batch`` by running it under tensor accounting.

    The step runs on a copy (the model is not changed). The order is Lightning's: forward while the previous step's
    gradients are alive, ``zero_grad(set_to_none=True)``, backward, optimizer step — after one warm-up step that
    creates gradients and optimizer state.

    For ``target="cuda"`` the step runs on the ``meta`` device (shapes only, no FLOPs, no memory: seconds for a
    GPT-2-sized model on a laptop). The batch and what is computed from it alone (masks, positions, lengths) keep
    their values on CPU, so a model's questions about its inputs (transformers' mask helpers) are answered; where
    they meet the weights they become shapes (:class:`~lightning_memguard.estimate.mixed.MixedExecution`). What the
    CUDA kernels keep and allocate is put in (:class:`~lightning_memguard.estimate.cuda_kernels.CudaKernelMode`: the
    attention kernel CUDA picks, autocast's casts), the caching allocator's blocks (each storage counted as the
    block a model of its policy hands out,
    :class:`~lightning_memguard.estimate.caching_allocator.CachingAllocatorModel`: 512-byte rounding, blocks whose
    rest is too small to split handed out whole), foreach optimizer steps (torch's default on CUDA), the cuBLAS and
    cuBLASLt workspaces of the threads that run matmuls (``runtime_bytes``) and a bounded cuDNN workspace in the
    backward of fp32 convolutions. Mixture-of-experts layers that run their experts in one ``torch._grouped_mm``
    stay on meta (their routing is offsets, not a value read), and so does counting the experts a router picked with
    ``torch.bincount(..., minlength=num_experts)`` (their load-balancing loss, transformers before 5.2x). A model
    that reads a value computed from the weights (routing that loops over the experts it hit, a branch on an
    activation) runs on CPU instead, with one :class:`EstimateFallbackWarning` naming the op; the CUDA kernel model
    applies there too, so the two paths agree (the CPU's fused attention stands in for CUDA's). ``path`` says which
    ran. Not covered: the CUDA context and other processes (outside ``memory_allocated``), the exact workspaces of
    kernels chosen at run time. The allocator's cache (``memory_reserved``) is its model's segments,
    ``reserved_bytes``: ``None``, with a note in ``notes``, where the allocator's options
    (``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF`` in the environment when the estimate is made, or this
    process's settings) change the policy the model replays (``expandable_segments:True``, ``max_split_size_mb``,
    ``roundup_power2_divisions``, ``garbage_collection_threshold``, ...; the allocated bytes stay the default
    policy's blocks).

    For ``target="cpu"`` the step runs on CPU (or on meta for a model built there), counted as live tensor storage:
    exactly what :class:`~lightning_memguard.sources.CpuTensorAccountant` measures in training. In mixed precision
    it runs on meta (falling back to CPU where it must, as above) with CPU autocast's casts and the CPU's attention
    kernel emulated (:class:`~lightning_memguard.estimate.cpu_kernels.CpuKernelMode`): a real bf16 step is hundreds
    of times slower than an fp32 one on a CPU without native bf16.

    Args:
        model: an ``nn.Module`` or LightningModule (on CPU or meta).
        example_batch: one batch as the training step receives it (tensors are moved to the model's device).
        optimizer: an optimizer built on ``model.parameters()`` (``torch.optim.AdamW(model.parameters(), lr=3e-4)``:
            the copy gets the same class and per-group hyperparameters; yours is neither stepped nor changed), an
            optimizer class (``torch.optim.AdamW``) or ``params -> optimizer``; ``None`` uses the LightningModule's
            ``configure_optimizers`` if there is one, else no optimizer state (plain SGD).
        precision: ``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"`` (autocast; emulated on meta by the target's
            casting rules).
        loss_fn: ``(model, batch) -> loss``; default: ``training_step(batch, 0)`` of a LightningModule (one that
            optimizes manually runs its step whole, its optimizers, ``manual_backward``, toggling, schedulers and
            ``clip_gradients`` stood in for: :mod:`~lightning_memguard.estimate.manual_step`), else the
            forward's loss (:func:`~lightning_memguard.estimate.losses.default_loss`: a dict batch passed as keyword
            arguments, a tuple as positional ones; ``ModelOutput.loss``, a ``"loss"`` key, or the sum of its tensors).
        blocks: which blocks may be checkpointed (see :func:`~lightning_memguard.mitigations.find_blocks`).
        checkpointed_blocks: estimate with this many blocks checkpointed.
        variants: also estimate AMP and checkpointing a quarter, half, three quarters and all of the blocks.
        target: ``"cuda"`` or ``"cpu"``; default ``"cuda"`` where CUDA is available, else ``"cpu"``.
        path: where the step runs: ``"meta"`` or ``"cpu"`` (see above), no fallback; default: meta for a CUDA target,
            a mixed precision or a model on meta (falling back to CPU where it must), else CPU.
        strategy: ``"ddp"`` or ``"fsdp"``: estimate one rank of a data-parallel run of ``world_size`` ranks, each
            training on ``example_batch`` (the per-rank batch), from the unsharded model — no process group needed.
            DDP: a full replica plus its gradient buckets (one more copy of the gradients). FSDP (FSDP2's
            ``fully_shard`` on every block of the block list and the root, ``reshard_after_forward`` left at its
            default): parameters, gradients and optimizer state divided by the ranks, plus the units gathered in
            flight (:mod:`~lightning_memguard.estimate.ranks`). ``None``: one process.
        world_size: the number of ranks (with ``strategy``). A model already sharded by FSDP2 (DTensor
            parameters) is estimated from its unsharded structure on meta — never copied as it is — and, without
            ``strategy``, as one rank of ``"fsdp"`` over its mesh; a DistributedDataParallel module, without
            ``strategy``, as one rank of ``"ddp"`` over its process group.

    Raises:
        ValueError: a bad argument (naming it), a model on another device, a batch the model's forward rejects (the
            message carries the model's own error), a training step that returns no loss for the batch, or a step
            that reads a value computed from the weights where it cannot run on CPU (``path="meta"``, a model not on
            CPU).
    """
    check_estimate_arguments(model, example_batch, optimizer, precision, loss_fn, blocks)
    strategy, world_size = check_strategy(strategy, world_size)
    # a replica inside DistributedDataParallel is one rank's, its buckets with it
    layout = data_parallel_of(model)
    # a sharded model is estimated from its unsharded structure (on meta), as one rank of its sharding
    model, optimizer, sharding = unsharded(unwrap_parallel(model), optimizer)
    if strategy is None and (sharding or layout) is not None:
        strategy, world_size = sharding or layout
    check_int("checkpointed_blocks", checkpointed_blocks, minimum=0)
    check_bool("variants", variants)
    target = resolve_target(target)
    if path not in (None, *PATHS):
        raise ValueError(f"path={path!r}; allowed: {PATHS} (or None: meta where it can, else CPU)")
    device = estimation_device(model) if target == "cpu" else device_of(model)
    if path == "cpu" and device.type == "meta":
        raise ValueError("path='cpu' needs a model with its weights: this one is on the meta device")
    # mixed precision for a CPU target runs on meta too, CPU autocast emulated: a real half-precision step on a CPU
    # without native bf16 is hundreds of times slower than an fp32 one
    on_meta = path == "meta" or (path is None and (target == "cuda" or device.type == "meta"
                                                    or precision != "32-true"))
    if loss_fn is None and strategy is not None:  # a step's self.all_gather, stood in for, spans the ranks
        loss_fn = TrainingStep(world_size)
    spec = StepSpec(model=model, batch=example_batch, optimizer=optimizer, precision=precision, loss_fn=loss_fn,
                    blocks=blocks, checkpointed_blocks=checkpointed_blocks,
                    device=torch.device("meta" if on_meta else "cpu"), target=target)

    def rank(one_process: MemoryEstimate) -> MemoryEstimate:
        return per_rank(one_process, model, blocks, strategy, world_size)

    estimate = rank(run_with_fallback(spec, fallback=path is None))
    if estimate.reserved_bytes is not None:
        estimate = _without_unmodelled_reserved(estimate)
    if variants:
        estimate.variants = _variants(spec, estimate, rank)
    return estimate


def resolve_target(target: Optional[str]) -> str:
    """``None`` -> ``"cuda"`` where CUDA is available, else ``"cpu"``; anything else must be one of :data:`TARGETS`."""
    if target is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if target not in TARGETS:
        raise ValueError(f"target={target!r}; allowed: {TARGETS} (or None: cuda where it is available)")
    return target


def run_with_fallback(spec: StepSpec, fallback: bool) -> MemoryEstimate:
    """Runs the step as ``spec`` says; on meta, a model that reads a value computed from the weights runs on CPU
    instead (one :class:`EstimateFallbackWarning`) where ``fallback`` allows it and the model is on CPU, else that
    is a ValueError saying what to do. Any other error on meta runs the step on CPU the same way (one warning), where
    its own error, if any, is raised."""
    if spec.on_meta:
        try:
            return run_step(spec)
        except NeedsValues as need:
            name, model_device = type(spec.model).__name__, device_of(spec.model)
            if not fallback or model_device.type != "cpu":
                remedy = ("estimate with path='cpu'" if model_device.type == "cpu" else "give a copy of the model on "
                          "CPU to estimate it there")
                raise ValueError(f"{name}'s training step reads a value computed from the weights, which the meta "
                                 f"device does not have: {need.operation}; {remedy}") from None
            warnings.warn(f"{name}'s training step reads a value computed from the weights: {need.operation}. The "
                          "meta device has none, so the estimate ran the step on CPU (real FLOPs and memory"
                          + (", CUDA's kernels modelled" if spec.target == "cuda" else "") + ").",
                          EstimateFallbackWarning, stacklevel=caller_stacklevel())
        except Exception as err:
            # What fails on meta alone is the meta run's, not the step's: a loss function that reaches a real module
            # outside the copied one (a GAN's other network), or torch.utils.checkpoint in the model's own forward,
            # whose recomputation in backward runs outside the emulated autocast (other dtypes: CheckpointError).
            # The step on CPU says whether the step itself fails; blamed on meta, a rung would be turned off.
            if not fallback or device_of(spec.model).type != "cpu":
                raise
            warnings.warn(f"{type(spec.model).__name__}'s training step failed on the meta device "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:200]}), so the estimate ran it on CPU "
                          "(real FLOPs and memory" + (", CUDA's kernels modelled" if spec.target == "cuda" else "")
                          + ").", EstimateFallbackWarning, stacklevel=caller_stacklevel())
    return run_step(spec.on("cpu"))


def _without_unmodelled_reserved(estimate: MemoryEstimate) -> MemoryEstimate:
    """``estimate`` with no reserved figure (and a note why) where the caching allocator is set up, in this process
    or in the environment now, with options its model does not replay: no number rather than a wrong one (a plan
    then keeps the allocated peaks under the capacity only)."""
    unmodelled: dict[str, str] = {}
    for options in configured_allocator_options():
        unmodelled.update(unmodelled_options(options))
    if not unmodelled:
        return estimate
    said = ",".join(f"{name}:{value}" for name, value in unmodelled.items())
    note = (f"no reserved bytes: the caching allocator runs with {said} ({' or '.join(ALLOC_CONF_VARIABLES)}), "
            "whose segments the allocator model does not replay; the allocated bytes are its default policy's blocks")
    return replace(estimate, reserved_bytes=None, notes=(*estimate.notes, note))


def check_estimate_arguments(model, example_batch, optimizer, precision, loss_fn, blocks) -> None:
    """The checks :func:`estimate_memory` and :func:`~lightning_memguard.estimate.plan.plan_configuration` share."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={model!r} must be an nn.Module (or a LightningModule)")
    if example_batch is None:
        raise ValueError("example_batch=None: give one batch as the training step receives it")
    if not (optimizer is None or isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
        raise ValueError(f"optimizer={optimizer!r} must be None, an optimizer (torch.optim.AdamW(model.parameters()"
                         "), an optimizer class, or a params -> optimizer callable")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; allowed: {PRECISIONS}")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn={loss_fn!r} must be None or a (model, batch) -> loss callable")
    validate_block_spec(blocks)


def _variants(spec: StepSpec, base: MemoryEstimate,
              rank: Callable[[MemoryEstimate], MemoryEstimate] = lambda e: e) -> pd.DataFrame:
    """The step as given, then with AMP (a run in full precision) and with a quarter, half, three quarters and all of
    the blocks checkpointed, each on the path the given step ran on (each one rank's, by ``rank``)."""
    amp_used = spec.precision != "32-true"
    rows = [("as given", amp_used, base.checkpointed_blocks, base.peak_bytes, base.peak_phase)]
    rerun = spec.on(base.path)
    if not amp_used:  # autocast runs on CPU, or is emulated on meta (CUDA's rules or the CPU's)
        amp_spec = replace(rerun, precision="bf16-mixed", checkpointed_blocks=base.checkpointed_blocks)
        if base.target == "cpu":  # on meta, as a CPU target's mixed precision is estimated (CPU where it must)
            amp = rank(run_with_fallback(amp_spec.on("meta"), fallback=True))
        else:
            amp = rank(run_step(amp_spec))
        rows.append(("amp (bf16-mixed)", True, base.checkpointed_blocks, amp.peak_bytes, amp.peak_phase))
    # counted in place: a copy of a GPU model would take GPU memory
    n_blocks = len(find_blocks(spec.model, spec.blocks))
    for blocks in sorted({max(1, round(f * n_blocks)) for f in (0.25, 0.5, 0.75, 1.0)} if n_blocks else ()):
        est = rank(run_step(replace(rerun, checkpointed_blocks=blocks)))
        rows.append((f"checkpoint {blocks}/{n_blocks} blocks", amp_used, blocks, est.peak_bytes, est.peak_phase))
    frame = pd.DataFrame(rows, columns=["config", "amp", "checkpointed_blocks", "peak_bytes", "peak_phase"])
    frame["peak_MiB"] = frame["peak_bytes"] / MiB
    return frame
