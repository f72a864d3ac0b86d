"""Pre-flight estimate: what one training step of a model will need, by category, phase and module — measured by
running a step under tensor accounting on CPU, or on the ``meta`` device for models larger than this machine.
Framework-free: a LightningModule is used through ``training_step`` / ``configure_optimizers`` by duck typing.

The seeds' estimator summed every module's output size in ``model.modules()`` order and doubled it: wrong for
residuals, attention, in-place ops and anything autograd does not keep. Here the numbers are what autograd saves
(``saved_tensors_hooks``) and what the step really allocates (live storages counted by a dispatch mode).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional, Union

import pandas as pd
import torch
from torch import nn

from ..base.batches import batch_tensors, map_tensors
from ..base.checks import check_bool, check_int
from ..base.module_stack import ForwardModuleStack
from ..base.snapshot import MiB, format_bytes
from ..mitigations.checkpointing import ActivationCheckpointing, BlockSpec, find_blocks, validate_block_spec
from ..sources.cpu import (
    CpuTensorAccountant,
    compiled_code_runs_eagerly,
    optimizer_state_tensors,
    storage_bytes,
    unbind_from_original,
)
from .cpu_kernels import CpuKernelMode
from .cuda_kernels import CUDA_ALLOCATION_GRANULARITY, BlasWorkspaces, CudaKernelMode
from .mixed import MixedExecution, NeedsValues, error_location, reads_values

__all__ = ["EstimateFallbackWarning", "MemoryEstimate", "estimate_memory"]

OptimizerSpec = Union[None, type, torch.optim.Optimizer, Callable[[Any], torch.optim.Optimizer]]
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
TARGETS = ("cuda", "cpu")
PATHS = ("meta", "cpu")
ESTIMATE_PHASES = ("forward", "backward", "optimizer_step")


class EstimateFallbackWarning(UserWarning):
    """The step read a value computed from the weights, so the estimate ran it on CPU instead of the meta device."""


@dataclass
class MemoryEstimate:
    """One training step's memory (a step after the first: gradients and optimizer state exist).

    Attributes:
        parameters_bytes / gradients_bytes / optimizer_state_bytes / batch_bytes: held across the step.
        activations_bytes: what autograd saves for backward (excluding parameters and the batch), and the inputs
            that checkpointed blocks keep for their recomputation.
        temporaries_bytes: the most a phase allocated and freed again within itself (workspaces, casts).
        runtime_bytes: fixed allocations of the CUDA runtime held across steps, on target cuda: the cuBLAS and
            cuBLASLt workspaces of the training thread's and autograd's backward thread's handles, for the threads
            that run such matmuls (sizes by torch's settings:
            :func:`~lightning_memguard.estimate.cuda_kernels.workspace_sizes`).
        target: the device the estimate is for (``"cuda"`` or ``"cpu"``).
        path: how the step was run: ``"meta"`` (the weights and all they touch are shapes only, no FLOPs; the batch
            and what is computed from it alone keep their values) or ``"cpu"`` (real execution on CPU, for models
            that read values computed from the weights).
        phase_peaks: phase -> peak bytes (``forward``, ``backward``, ``optimizer_step``).
        peak_bytes: the overall peak.
        modules: activation bytes saved by each module's own ops (DataFrame: module, activations_bytes).
        blocks: the same summed per repeated block (DataFrame: block, activations_bytes): which blocks hold the
            memory, and what checkpointing each would save.
        variants: the same step under each remedy (DataFrame: config, amp, checkpointed_blocks, peak_bytes, ...).
    """

    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    temporaries_bytes: int
    batch_bytes: int
    phase_peaks: dict[str, int]
    precision: str
    device: str
    target: str = "cpu"
    path: str = "cpu"
    runtime_bytes: int = 0
    checkpointed_blocks: int = 0
    n_blocks: int = 0
    modules: pd.DataFrame = field(default_factory=pd.DataFrame)
    blocks: pd.DataFrame = field(default_factory=pd.DataFrame)
    variants: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def peak_bytes(self) -> int:
        return max(self.phase_peaks.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phase_peaks, key=self.phase_peaks.get)

    def to_dataframe(self) -> pd.DataFrame:
        """Rows ``(kind, name, bytes)``: the categories, then the phase peaks, then the overall peak."""
        rows = [("category", name, getattr(self, f"{name}_bytes")) for name in
                ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "batch", "runtime")]
        rows += [("phase_peak", phase, peak) for phase, peak in self.phase_peaks.items()]
        rows.append(("peak", "overall", self.peak_bytes))
        return pd.DataFrame(rows, columns=["kind", "name", "bytes"])

    def __str__(self) -> str:
        lines = [f"Memory estimate for one training step on {self.target} ({self.precision}, run on {self.path}"
                 + (f", {self.checkpointed_blocks}/{self.n_blocks} blocks checkpointed" if self.checkpointed_blocks
                    else "") + ")"]
        for kind, name, nbytes in self.to_dataframe().itertuples(index=False):
            label = {"category": name, "phase_peak": f"peak in {name}", "peak": "PEAK"}[kind]
            lines.append(f"  {label:<26}{format_bytes(int(nbytes)):>12}")
        if not self.blocks.empty:
            lines.append(f"  activations per block: {len(self.blocks)} blocks, "
                         f"{format_bytes(int(self.blocks['activations_bytes'].max()))} in the largest")
        if not self.modules.empty:
            lines.append("  activations by module (largest first):")
            for module, nbytes in self.modules.head(8).itertuples(index=False):
                lines.append(f"    {module or '(top level)':<36}{format_bytes(int(nbytes)):>12}")
        if not self.variants.empty:
            lines.append("  remedies:")
            for row in self.variants.itertuples(index=False):
                lines.append(f"    {row.config:<28}{format_bytes(int(row.peak_bytes)):>12}  "
                             f"x{row.peak_bytes / self.peak_bytes:.2f}")
        return "\n".join(lines)


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
) -> MemoryEstimate:
    """Estimates one training step of ``model`` on ``example_batch`` by running it under tensor accounting.

    The step runs on a copy (the model is not changed). The order is Lightning's: forward while the previous step's
    gradients are alive, ``zero_grad(set_to_none=True)``, backward, optimizer step — after one warm-up step that
    creates gradients and optimizer state.

    For ``target="cuda"`` the step runs on the ``meta`` device (shapes only, no FLOPs, no memory: seconds for a
    GPT-2-sized model on a laptop). The batch and what is computed from it alone (masks, positions, lengths) keep
    their values on CPU, so a model's questions about its inputs (transformers' mask helpers) are answered; where
    they meet the weights they become shapes (:class:`~lightning_memguard.estimate.mixed.MixedExecution`). What the
    CUDA kernels keep and allocate is put in
    (:class:`~lightning_memguard.cuda_kernels.CudaKernelMode`: fused attention, autocast's casts), the caching
    allocator's 512-byte rounding, foreach optimizer steps (torch's default on CUDA) and the cuBLAS and cuBLASLt
    workspaces of the threads that run matmuls (``runtime_bytes``). A model that reads a value computed from the
    weights (expert routing, a branch on an activation) runs on CPU instead, with one
    :class:`EstimateFallbackWarning` naming the op; the CUDA kernel model applies there too, so the two paths agree
    (the CPU's fused attention stands in for CUDA's). ``path`` says which ran. Not covered: the CUDA context and
    other processes (outside ``memory_allocated``), the allocator's cache and fragmentation (``memory_reserved``
    minus allocated), workspaces of kernels chosen at run time.

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
        loss_fn: ``(model, batch) -> loss``; default: ``training_step(batch, 0)`` of a LightningModule, else
            the sum of ``model(batch)``.
        blocks: which blocks may be checkpointed (see :func:`~lightning_memguard.mitigations.find_blocks`).
        checkpointed_blocks: estimate with this many blocks checkpointed.
        variants: also estimate AMP and checkpointing a quarter, half, three quarters and all of the blocks.
        target: ``"cuda"`` or ``"cpu"``; default ``"cuda"`` where CUDA is available, else ``"cpu"``.
        path: where the step runs: ``"meta"`` or ``"cpu"`` (see above), no fallback; default: meta for a CUDA target,
            a mixed precision or a model on meta (falling back to CPU where it must), else CPU.

    Raises:
        ValueError: a bad argument (naming it), a model on another device, a batch the model's forward rejects (the
            message carries the model's own error), a training step that returns no loss for the batch, or a step
            that reads a value computed from the weights where it cannot run on CPU (``path="meta"``, a model not on
            CPU).
    """
    check_estimate_arguments(model, example_batch, optimizer, precision, loss_fn, blocks)
    model = unwrap_parallel(model)
    check_int("checkpointed_blocks", checkpointed_blocks, minimum=0)
    check_bool("variants", variants)
    target = resolve_target(target)
    if path not in (None, *PATHS):
        raise ValueError(f"path={path!r}; allowed: {PATHS} (or None: meta where it can, else CPU)")
    device = estimation_device(model) if target == "cpu" else _device_of(model)
    if path == "cpu" and device.type == "meta":
        raise ValueError("path='cpu' needs a model with its weights: this one is on the meta device")
    # mixed precision for a CPU target runs on meta too, CPU autocast emulated: a real half-precision step on a CPU
    # without native bf16 is hundreds of times slower than an fp32 one
    on_meta = path == "meta" or (path is None and (target == "cuda" or device.type == "meta"
                                                    or precision != "32-true"))
    estimate = _run_for(target, model, example_batch, optimizer, precision, loss_fn, blocks, checkpointed_blocks,
                        device, on_meta, fallback=path is None)
    if variants:
        estimate.variants = _variants(model, example_batch, optimizer, precision, loss_fn, blocks, estimate)
    return estimate


def resolve_target(target: Optional[str]) -> str:
    """``None`` -> ``"cuda"`` where CUDA is available, else ``"cpu"``; anything else must be one of :data:`TARGETS`."""
    if target is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if target not in TARGETS:
        raise ValueError(f"target={target!r}; allowed: {TARGETS} (or None: cuda where it is available)")
    return target


def _run_for(target, model, batch, optimizer, precision, loss_fn, blocks, k, device, on_meta,
             fallback) -> MemoryEstimate:
    """Runs the step on meta, falling back to CPU (one warning) for a model that reads a value computed from the
    weights where ``fallback`` allows it, or on CPU."""
    if on_meta:
        try:
            return _run(model, batch, optimizer, precision, loss_fn, blocks, k, torch.device("meta"), target)
        except NeedsValues as need:
            if not fallback or device.type != "cpu":
                remedy = ("estimate with path='cpu'" if device.type == "cpu" else "give a copy of the model on CPU to "
                          "estimate it there")
                raise ValueError(f"{type(model).__name__}'s training step reads a value computed from the weights, "
                                 f"which the meta device does not have: {need.operation}; {remedy}") from None
            warnings.warn(f"{type(model).__name__}'s training step reads a value computed from the weights: "
                          f"{need.operation}. The meta device has none, so the estimate ran the step on CPU (real "
                          "FLOPs and memory" + (", CUDA's kernels modelled" if target == "cuda" else "") + ").",
                          EstimateFallbackWarning, stacklevel=3)
    return _run(model, batch, optimizer, precision, loss_fn, blocks, k, torch.device("cpu"), target)


def check_estimate_arguments(model, example_batch, optimizer, precision, loss_fn, blocks) -> None:
    """The checks :func:`estimate_memory` and :func:`~lightning_memguard.plan.plan_configuration` share."""
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


def _device_of(model: nn.Module) -> torch.device:
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def estimation_device(model: nn.Module) -> torch.device:
    """Where a CPU-target estimate runs: the model's device, which must be CPU or meta."""
    device = _device_of(model)
    if device.type not in ("cpu", "meta"):
        raise ValueError(f"the model is on {device}; estimate a copy on CPU or one built on the meta device "
                         "(with torch.device('meta'): model = ...)")
    return device


def unwrap_parallel(model: nn.Module) -> nn.Module:
    """The module inside torch's data-parallel wrappers: a copy of a ``DistributedDataParallel`` would run its
    collectives (buffer broadcasts, gradient all-reduces) in the estimate, on one rank only."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def copy_without_trainer(model: nn.Module) -> nn.Module:
    # A LightningModule attached to a Trainer would drag the whole Trainer into the copy
    memo = {id(getattr(model, "_trainer")): None} if getattr(model, "_trainer", None) is not None else {}
    return copy.deepcopy(model, memo)


def _make_optimizer(model: nn.Module, optimizer: OptimizerSpec,
                    original: nn.Module) -> Optional[torch.optim.Optimizer]:
    if optimizer is None:
        configure = getattr(model, "configure_optimizers", None)
        if configure is None:
            return None
        configured = configure()
        while not isinstance(configured, torch.optim.Optimizer):  # dict, list or tuple forms
            if isinstance(configured, dict):
                configured = configured["optimizer"]
            elif isinstance(configured, (list, tuple)) and configured:
                configured = configured[0]
            else:
                raise ValueError(f"cannot find an optimizer in configure_optimizers() -> {configured!r}")
        return configured
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer_like(optimizer, original, model)
    return optimizer(model.parameters())


def optimizer_like(optimizer: torch.optim.Optimizer, original: nn.Module, copy_: nn.Module) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class and per-group hyperparameters as ``optimizer`` (built on ``original``'s
    parameters), on the matching parameters of ``copy_``. The given optimizer and its state are not touched."""
    counterpart = {id(p): q for p, q in zip(original.parameters(), copy_.parameters())}
    groups = []
    for group in optimizer.param_groups:
        if any(id(p) not in counterpart for p in group["params"]):
            raise ValueError(f"optimizer={type(optimizer).__name__}(...) holds parameters that are not the model's; "
                             "build it on model.parameters(), or pass its class")
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [counterpart[id(p)] for p in group["params"]]})
    # the groups carry every hyperparameter; the defaults go only where the constructor takes them (AdamW keeps a
    # default its constructor does not accept)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


def _default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    if hasattr(model, "training_step"):
        out = model.training_step(batch, 0)
        return out.get("loss") if isinstance(out, dict) else out
    out = model(*batch) if isinstance(batch, (tuple, list)) else model(batch)
    tensors = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    return sum(t.float().sum() for t in tensors)


def _run(model, batch, optimizer_spec, precision, loss_fn, blocks, k, device, target) -> MemoryEstimate:
    on_meta = device.type == "meta"
    work = meta_copy(model) if on_meta and _device_of(model).type != "meta" else copy_without_trainer(model)
    unbind_from_original(work)  # a compiled LightningModule's methods would run the original
    work.train()
    for name in ("log", "log_dict"):  # a LightningModule's logging needs a Trainer (and .item(), not on meta)
        if hasattr(work, name):
            setattr(work, name, lambda *args, **kwargs: None)
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    # CUDA's kernels for a CUDA target, on meta and on CPU alike; for a CPU target on meta the CPU's (its attention
    # kernel, its autocast's casts, the answers to value questions such as nn.Transformer's causal mask check)
    if target == "cuda":
        kernels = CudaKernelMode(half)
    else:
        kernels = CpuKernelMode(half) if on_meta else None
    n_blocks = 0
    checkpointed: list[tuple[str, nn.Module]] = []
    if k or blocks is not None:
        # a checkpointed block recomputes in backward, outside the forward's kernel model: give it the model there
        rung = ActivationCheckpointing(work, blocks, context=kernels.outside_only if kernels else None)
        n_blocks = rung.max_level
        rung.set_level(min(k, n_blocks))
        checkpointed = rung.blocks[:rung.level]
    optimizer = _make_optimizer(work, optimizer_spec, model)
    if optimizer is not None and target == "cuda":
        for group in optimizer.param_groups:  # torch's default on CUDA: whole-group kernels, whole-group temporaries
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True
    # on meta the batch stays real (on CPU): its values answer the model's questions about its inputs
    batch_device = torch.device("cpu") if on_meta else device
    batch = map_tensors(lambda t: t.to(batch_device), batch)
    loss_fn = loss_fn or _default_loss
    if kernels is not None:
        autocast = kernels
    elif half is not None:  # as Lightning's MixedPrecision plugin does: no cache of casted weights
        autocast = torch.autocast("cpu", dtype=half, cache_enabled=False)
    else:
        autocast = contextlib.nullcontext()
    params = list(work.parameters())
    param_storages = {p.untyped_storage()._cdata for p in params}
    batch_leaves = _leaves(batch)
    batch_storages = {t.untyped_storage()._cdata for t in batch_leaves}

    granularity = CUDA_ALLOCATION_GRANULARITY if target == "cuda" else 1
    mixed = MixedExecution() if on_meta else None
    if mixed is not None:  # the batch and the buffers with values are on the device
        mixed.place([*batch_leaves, *work.buffers()])
    accountant = _StepAccountant(device.type, granularity, mixed, count_host=target == "cpu")
    accountant.track([*params, *work.buffers(), *batch_leaves])
    saved: dict[int, tuple[int, str]] = {}
    phase_peaks: dict[str, int] = {}
    temporaries = 0
    # the mixed execution goes under the accounting modes: its shape-only copies are not the step's allocations
    with warnings.catch_warnings(), mixed or contextlib.nullcontext():
        warnings.simplefilter("ignore")  # self.log without a Trainer, and the like
        for step in range(2):  # step 0 creates gradients and optimizer state; step 1 is measured
            measure = step == 1
            tracker = ForwardModuleStack(work) if measure else contextlib.nullcontext()
            pack = _saver(saved, param_storages | batch_storages, tracker, accountant.counts)
            hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if measure
                     else contextlib.nullcontext())
            # a checkpointed block saves nothing through the hooks, but keeps its inputs for the recomputation
            handles = [block.register_forward_pre_hook(_input_keeper(pack)) for _, block in checkpointed] \
                if measure else []
            blas = BlasWorkspaces()  # which phases run matmuls: the CUDA workspaces they hold
            # compiled code runs uncompiled: counted exactly, and the modes leave dynamo's caches untouched
            with accountant, blas, compiled_code_runs_eagerly():
                start = accountant.read(reset_peak=True)
                try:
                    with tracker, hooks, autocast:
                        loss = loss_fn(work, batch)
                except NeedsValues:
                    raise
                except Exception as err:
                    if on_meta and reads_values(err):  # a meta value read outside the dispatcher (tolist())
                        raise NeedsValues(f"{type(err).__name__}: {err}{error_location(err)}") from err
                    raise ValueError(f"the example batch does not fit {type(model).__name__}'s training step: "
                                     f"{type(err).__name__}: {err}") from err
                if not isinstance(loss, torch.Tensor):
                    raise ValueError(f"{type(model).__name__}'s training step returned {type(loss).__name__} for the "
                                     "example batch (a skipped batch?), not a loss: give a batch it trains on, or "
                                     "loss_fn=(model, batch) -> loss")
                # Lightning zeroes gradients after the forward and before on_before_backward: same boundary here
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
                else:
                    work.zero_grad(set_to_none=True)
                fwd = accountant.read(reset_peak=True)
                for handle in handles:
                    handle.remove()
                blas.phase = "backward"
                loss.backward()
                del loss
                bwd = accountant.read(reset_peak=True)
                blas.phase = "optimizer_step"
                if optimizer is not None:
                    optimizer.step()
                opt = accountant.read(reset_peak=True)
            if target == "cuda" and not on_meta:
                accountant.forget(_host_step_counters(optimizer))
            if measure:
                phase_peaks = {"forward": fwd.peak_bytes, "backward": bwd.peak_bytes, "optimizer_step": opt.peak_bytes}
                # what a phase allocated and freed within itself: its peak above both ends of the phase
                ends = ((start, fwd), (fwd, bwd), (bwd, opt))
                temporaries = max(end.peak_bytes - max(begin.allocated_bytes, end.allocated_bytes)
                                  for begin, end in ends)
    state = list(optimizer_state_tensors([optimizer] if optimizer is not None else []))
    modules = (pd.DataFrame([(m, n) for n, m in saved.values()], columns=["module", "activations_bytes"])
               .groupby("module", as_index=False)["activations_bytes"].sum()
               .sort_values("activations_bytes", ascending=False, ignore_index=True))
    block_names = [name for name, _ in find_blocks(work, blocks)]
    by_block = pd.DataFrame(
        [(name, int(modules[(modules["module"] == name) | modules["module"].str.startswith(name + ".")]
                    ["activations_bytes"].sum())) for name in block_names],
        columns=["block", "activations_bytes"])
    runtime = blas.held_bytes() if target == "cuda" else 0
    phase_peaks = {phase: peak + runtime for phase, peak in phase_peaks.items()}
    return MemoryEstimate(
        parameters_bytes=storage_bytes([*params, *work.buffers()]),
        gradients_bytes=storage_bytes(p.grad for p in params if p.grad is not None),
        optimizer_state_bytes=storage_bytes(state),
        activations_bytes=sum(n for n, _ in saved.values()),
        temporaries_bytes=temporaries,
        batch_bytes=storage_bytes(batch_leaves),
        phase_peaks=phase_peaks,
        precision=precision,
        device=device.type,
        target=target,
        path=device.type,
        runtime_bytes=runtime,
        checkpointed_blocks=len(checkpointed),
        n_blocks=n_blocks,
        modules=modules,
        blocks=by_block,
    )


class _StepAccountant(CpuTensorAccountant):
    """Counts what the step holds on the device being estimated. On a mixed step (``mixed``): the meta storages and
    the real ones the mixed execution says are device-side (the batch, the masks computed from it), and with
    ``count_host`` every real one (a CPU target). Storages it is told to :meth:`forget` are host memory."""

    def __init__(self, device_type: str, granularity: int, mixed: Optional[MixedExecution] = None,
                 count_host: bool = True) -> None:
        super().__init__(device_type="meta" if mixed is not None else device_type, granularity=granularity)
        self._mixed = mixed
        self._count_host = count_host
        self._host: set[int] = set()

    def counts(self, tensor: torch.Tensor) -> bool:
        if self._mixed is None:
            counted = super().counts(tensor)
        else:
            counted = not tensor.is_sparse and (tensor.is_meta or (
                tensor.device.type == "cpu" and (self._count_host or self._mixed.on_device(tensor))))
        return counted and not (self._host and tensor.untyped_storage()._cdata in self._host)

    def forget(self, tensors) -> None:
        """Stops counting these tensors' storages, now and later: host memory in the run being estimated."""
        for tensor in tensors:
            key = tensor.untyped_storage()._cdata
            self._host.add(key)
            self._free(key)


def _host_step_counters(optimizer: Optional[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The step counters torch keeps on the CPU for CUDA parameters (optimizers neither capturable nor fused)."""
    if optimizer is None:
        return []
    counters = []
    for group in optimizer.param_groups:
        if group.get("capturable") or group.get("fused"):
            continue
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, torch.Tensor) and step.dim() == 0:
                counters.append(step)
    return counters


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy whose parameters and floating-point buffers live on the meta device: no memory, no copy of the
    weights, and not the Trainer a LightningModule is attached to. Integer and boolean buffers (position ids, causal
    masks, BatchNorm's batch counter) are copied to the CPU with their values, which a model may read."""
    memo: dict = {}
    if getattr(module, "_trainer", None) is not None:
        memo[id(module._trainer)] = None
    for param in module.parameters():
        memo[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
    for buffer in module.buffers():
        real = not (buffer.is_floating_point() or buffer.is_complex() or buffer.is_meta)
        memo[id(buffer)] = buffer.to("cpu", copy=True) if real else torch.empty_like(buffer, device="meta")
    return copy.deepcopy(module, memo)


def _leaves(batch) -> list[torch.Tensor]:
    return batch_tensors(batch)


def _input_keeper(pack: Callable) -> Callable:
    def keep_inputs(module, args):
        for tensor in _leaves(args):
            if tensor.requires_grad or tensor.grad_fn is not None:
                pack(tensor)

    return keep_inputs


def _saver(saved: dict, exclude: set, tracker, counts: Callable[[torch.Tensor], bool]) -> Callable:
    """A pack hook that records each saved storage the accounting counts once, with the module whose forward saved
    it."""

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in exclude and key not in saved and counts(tensor):
            saved[key] = (storage.nbytes(), tracker.innermost)
        return tensor

    return pack


def _variants(model, batch, optimizer, precision, loss_fn, blocks, base: MemoryEstimate) -> pd.DataFrame:
    rows = [("as given", precision != "32-true", base.checkpointed_blocks, base.peak_bytes, base.peak_phase)]
    device = torch.device(base.path)
    rerun = partial(_run, model, batch, optimizer, loss_fn=loss_fn, blocks=blocks, device=device, target=base.target)
    if precision == "32-true":  # autocast runs on CPU, or is emulated on meta (CUDA's rules or the CPU's)
        if base.target == "cpu":  # on meta, as a CPU target's mixed precision is estimated (CPU where it must)
            amp = _run_for("cpu", model, batch, optimizer, "bf16-mixed", loss_fn, blocks, base.checkpointed_blocks,
                           estimation_device(model), on_meta=True, fallback=True)
        else:
            amp = rerun("bf16-mixed", k=base.checkpointed_blocks)
        rows.append(("amp (bf16-mixed)", True, base.checkpointed_blocks, amp.peak_bytes, amp.peak_phase))
    n_blocks = len(find_blocks(model, blocks))  # counted in place: a copy of a GPU model would take GPU memory
    for k in sorted({max(1, round(f * n_blocks)) for f in (0.25, 0.5, 0.75, 1.0)} if n_blocks else ()):
        est = rerun(precision, k=k)
        rows.append((f"checkpoint {k}/{n_blocks} blocks", precision != "32-true", k, est.peak_bytes, est.peak_phase))
    frame = pd.DataFrame(rows, columns=["config", "amp", "checkpointed_blocks", "peak_bytes", "peak_phase"])
    frame["peak_MiB"] = frame["peak_bytes"] / MiB
    return frame
