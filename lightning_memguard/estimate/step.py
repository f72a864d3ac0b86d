"""One training step run under tensor accounting, as :func:`~lightning_memguard.estimate.estimate_memory` measures
it: a working copy is prepared (:func:`prepare_step`), stepped once to create gradients and optimizer state, then
stepped again with each phase read (forward, backward, optimizer step) and what autograd saves recorded by module;
:func:`collect_estimate` turns that into a :class:`~lightning_memguard.estimate.result.MemoryEstimate`."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import pandas as pd
import torch
from torch import nn

from ..base.batches import batch_tensors, map_tensors
from ..base.module_stack import ForwardModuleStack
from ..base.optimizer_step import step_needs_closure
from ..base.randomness import random_state_kept
from ..mitigations.checkpointing import ActivationCheckpointing, BlockSpec, find_blocks, uncheckpoint_module
from ..sources.base import AllocatorReading
from ..sources.cpu import (
    compiled_code_runs_eagerly,
    dense_tensors,
    counting_paused,
    optimizer_state_tensors,
    storage_bytes,
    unbind_from_original,
)
from .copies import OptimizerSpec, copy_without_trainer, device_of, is_own_copy, make_optimizer, meta_copy
from .cpu_kernels import CpuKernelMode
from .caching_allocator import CachingAllocatorModel
from .cuda_kernels import CUDA_ALLOCATION_GRANULARITY, BlasWorkspaces, CudaKernelMode
from .gathers import TrainingStep, step_loss_with_gathers_stood_in
from .manual_step import SelfOptimizingStep, configured_optimizers, optimizes_itself
from .mixed import MixedExecution, NeedsValues, error_location, reads_values
from .own_checkpoints import recomputed_under
from .result import MemoryEstimate
from .step_accountant import StepAccountant
from .step_replay import Replay, StepRecorder, replay_is_enabled

__all__ = ["StepSpec", "run_step", "prepare_step", "collect_estimate"]

HALF_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass(frozen=True)
class StepSpec:
    """What one estimated step runs: ``model`` (the user's, never changed) on ``batch`` with ``optimizer`` (as
    :func:`~lightning_memguard.estimate.estimate_memory` takes it) in ``precision``, the loss from ``loss_fn``
    (``None``: the training step's), ``checkpointed_blocks`` of the ``blocks`` checkpointed; run on ``device``
    (``meta`` or ``cpu``) for the ``target`` device (``cuda`` or ``cpu``: whose kernels and rounding count)."""

    model: nn.Module
    batch: Any
    optimizer: OptimizerSpec
    precision: str
    loss_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]]
    blocks: BlockSpec
    checkpointed_blocks: int
    device: torch.device
    target: str

    @property
    def on_meta(self) -> bool:
        return self.device.type == "meta"

    def on(self, device: str) -> StepSpec:
        """The same step run on ``device``."""
        return replace(self, device=torch.device(device))


@dataclass
class PreparedStep:
    """The working copy a :class:`StepSpec` steps, and what counts its memory."""

    work: nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    batch: Any
    batch_leaves: list[torch.Tensor]
    params: list[nn.Parameter]
    autocast: Any  # the kernel model, or torch's autocast, or nothing
    checkpointed: list[tuple[str, nn.Module]]
    n_blocks: int
    mixed: Optional[MixedExecution]
    accountant: StepAccountant
    #: a step that runs its optimizers itself (manual_step.py): all of them (``optimizer`` is the first)
    manual: Optional[list[torch.optim.Optimizer]] = None
    schedulers: list[Any] = field(default_factory=list)  # and the learning-rate schedulers it made

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer the step steps: a self-optimizing step's all, else its one (none without)."""
        return _stepped(self.manual, self.optimizer)


@dataclass
class StepPhases:
    """The measured step: each phase's peak, the most a phase allocated and freed within itself, what autograd
    saved (one entry a storage: (bytes, module)), and which threads ran matmuls (their CUDA workspaces; a CUDA
    target's)."""

    phase_peaks: dict[str, int]
    temporaries_bytes: int
    saved: dict[int, tuple[int, str]]
    blas: Optional[BlasWorkspaces]


def run_step(spec: StepSpec) -> MemoryEstimate:
    """Prepares the step, runs it twice (step 0 creates gradients and optimizer state; step 1 is measured) and
    returns its estimate. Step 1's forward and backward are step 0's replayed where step 0 changed nothing they
    would do (:mod:`~lightning_memguard.estimate.step_replay`): the same counting, half the ops dispatched. The
    random number generators are left as they were.

    Raises:
        NeedsValues: on meta, the step read a value computed from the weights.
        ValueError: the batch does not fit the training step, or the step returned no loss.
    """
    # what the step draws (dropout on CPU, a diffusion model's noise drawn from the real batch) is not the training's:
    # the generators are put back after it, so the run draws what an unguarded one with the same seed draws
    # (base/randomness.py); no guard's CPU accountant counts the estimate's tensors (sources/cpu.py); and anomaly
    # detection (Trainer(detect_anomaly=True)) is off: its check of every gradient for NaN reads their values, which
    # the meta device has not, so the whole estimate fell back to running on CPU — for memory it changes nothing
    with random_state_kept(), counting_paused(), torch.autograd.set_detect_anomaly(False):
        return _run_step(spec)


def _run_step(spec: StepSpec) -> MemoryEstimate:
    step = prepare_step(spec)
    # the mixed execution runs under the accounting (the accountant's mode runs its ops: its shape-only copies are not
    # the step's allocations)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer, and the like
        # an optimizer that runs the forward again in its step (LBFGS) needs the step's loss: the step runs whole
        replay = replay_is_enabled() and not step_needs_closure(step.optimizer) and step.manual is None
        recorder = StepRecorder() if replay else None
        first = run_phases(spec, step, measure=recorder is not None, recorder=recorder)
        if step.manual is not None:
            _state_made(step)
        phases = _replayed(spec, step, first, recorder) if recorder is not None else None
        if phases is None:
            phases = run_phases(spec, step, measure=True)
    return collect_estimate(spec, step, phases)


def _state_made(step: PreparedStep) -> None:
    """After the warm-up of a step that optimizes itself: where no optimizer stepped (the step accumulates by hand and
    steps on a later batch, as ``(batch_idx + 1) % n == 0`` does), each steps once on the gradients the warm-up left,
    so the measured step holds the optimizer state the run's later batches hold."""
    if any(optimizer.state for optimizer in step.manual):
        return
    with step.accountant, compiled_code_runs_eagerly():
        for optimizer in step.manual:
            if any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
                optimizer.step()


def prepare_step(spec: StepSpec) -> PreparedStep:
    """The working copy (on meta, or a copy on CPU) with its optimizer, blocks checkpointed, kernel model and
    autocast, the batch on the step's device, and an accountant already counting the weights and the batch."""
    if spec.on_meta and is_own_copy(spec.model):
        # the estimator's own copy (a plan's): stepped itself, from no gradients, as a fresh copy starts
        work = spec.model
        for param in work.parameters():
            param.grad = None
    elif spec.on_meta and device_of(spec.model).type != "meta":
        work = meta_copy(spec.model)
    else:
        work = copy_without_trainer(spec.model)
    unbind_from_original(work)  # a compiled LightningModule's methods would run the original
    # The estimate sets the checkpointed blocks itself: blocks the run has checkpointed (a rung restored from a
    # checkpoint, or left on by an earlier fit) are put back in the copy. A copied one would also recompute in backward
    # outside the estimate's kernel model, under which its forward ran (autocast emulated on meta): other dtypes than
    # the forward's, and torch's CheckpointError.
    for module in work.modules():
        uncheckpoint_module(module)
    work.train()
    for name in ("log", "log_dict"):  # a LightningModule's logging needs a Trainer (and .item(), not on meta)
        if hasattr(work, name):
            setattr(work, name, lambda *args, **kwargs: None)
    half = HALF_DTYPES.get(spec.precision)
    # CUDA's kernels for a CUDA target, on meta and on CPU alike; for a CPU target on meta the CPU's (its attention
    # kernel, its autocast's casts, the answers to value questions such as nn.Transformer's causal mask check)
    if spec.target == "cuda":
        kernels = CudaKernelMode(half)
    else:
        kernels = CpuKernelMode(half) if spec.on_meta else None
    checkpointed, n_blocks = _checkpoint_blocks(work, spec, kernels)
    manual, schedulers = None, []
    if optimizes_itself(work) and (spec.loss_fn is None or isinstance(spec.loss_fn, TrainingStep)):
        # its own step, which asks for its optimizers: all of them
        manual, schedulers = configured_optimizers(work)
        if spec.optimizer is not None:  # the one given stands for them
            manual = [make_optimizer(work, spec.optimizer, spec.model)]
    optimizer = manual[0] if manual else make_optimizer(work, spec.optimizer, spec.model)
    optimizers = _stepped(manual, optimizer)
    for stepped in optimizers:
        if spec.target == "cuda":
            for group in stepped.param_groups:  # torch's default on CUDA: whole-group kernels and temporaries
                if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                    group["foreach"] = True
    # on meta the batch stays real (on CPU): its values answer the model's questions about its inputs
    batch_device = torch.device("cpu") if spec.on_meta else spec.device
    # a PackedSequence moves as one (its .to keeps its batch sizes on the CPU, where the RNN kernels read them)
    batch = map_tensors(lambda t: t.to(batch_device), spec.batch, packed=lambda ps: ps.to(batch_device))
    if kernels is not None:
        autocast = kernels
    elif half is not None:  # as Lightning's MixedPrecision plugin does: no cache of casted weights
        autocast = torch.autocast("cpu", dtype=half, cache_enabled=False)
    else:
        autocast = contextlib.nullcontext()
    params = list(work.parameters())
    batch_leaves = batch_tensors(batch)
    granularity = CUDA_ALLOCATION_GRANULARITY if spec.target == "cuda" else 1
    mixed = MixedExecution() if spec.on_meta else None
    if mixed is not None:  # the batch and the buffers with values are on the device
        mixed.place([*batch_leaves, *work.buffers()])
    # a CUDA target's storages are counted as the caching allocator's blocks, from the weights on: the measured step
    # finds the cache the warm-up step left, as a run's later steps do
    allocator = CachingAllocatorModel() if spec.target == "cuda" else None
    accountant = StepAccountant(spec.device.type, granularity, mixed, count_host=spec.target == "cpu",
                                 allocator=allocator)
    # Adagrad makes its state when it is built, not at its first step: held from the start, as in the run
    made = list(optimizer_state_tensors(optimizers))
    accountant.track([*params, *work.buffers(), *batch_leaves, *made])
    return PreparedStep(work, optimizer, batch, batch_leaves, params, autocast, checkpointed, n_blocks, mixed,
                        accountant, manual, schedulers)


def _stepped(manual: Optional[list[torch.optim.Optimizer]],
             optimizer: Optional[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    return manual or ([optimizer] if optimizer is not None else [])


def _checkpoint_blocks(work: nn.Module, spec: StepSpec, kernels) -> tuple[list[tuple[str, nn.Module]], int]:
    """Checkpoints the first ``spec.checkpointed_blocks`` blocks of ``work``; returns them and how many blocks
    there are (none counted where no blocks are named and none are checkpointed)."""
    if not spec.checkpointed_blocks and spec.blocks is None:
        return [], 0
    # a checkpointed block recomputes in backward, outside the forward's kernel model: give it the model there
    rung = ActivationCheckpointing(work, spec.blocks, context=kernels.outside_only if kernels else None)
    rung.set_level(min(spec.checkpointed_blocks, rung.max_level))
    return rung.blocks[:rung.level], rung.max_level


def run_phases(spec: StepSpec, step: PreparedStep, measure: bool,
               recorder: Optional[StepRecorder] = None) -> Optional[StepPhases]:
    """One step in Lightning's order: forward (the previous step's gradients alive), ``zero_grad(set_to_none=True)``,
    backward, optimizer step. With ``measure`` each phase is read and what autograd saves is recorded; a
    ``recorder`` records what the forward and backward make and free, for :func:`replay_phases` (cuDNN's
    workspaces recorded, not allocated: the cache this step leaves is the one a step without them leaves)."""
    accountant = step.accountant
    saved: dict[int, tuple[int, str]] = {}
    tracker = ForwardModuleStack(step.work) if measure else contextlib.nullcontext()
    params = {p.untyped_storage()._cdata for p in step.params}
    batch = {t.untyped_storage()._cdata for t in step.batch_leaves}
    pack = _saver(saved, params | batch, tracker, accountant.counts)
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if measure else contextlib.nullcontext()
    # a checkpointed block saves nothing through the hooks, but keeps its inputs for the recomputation
    handles = [block.register_forward_pre_hook(_input_keeper(pack), with_kwargs=True)
               for _, block in step.checkpointed] if measure else []
    # which phases run matmuls: the CUDA workspaces they hold; cuDNN's too, counted by the accountant. A CUDA
    # target's measured step alone: a CPU target holds no workspaces, and the warm-up step's reading is dropped
    # (cuDNN's workspace lives for one op): one dispatch layer fewer on every op there
    blas = BlasWorkspaces(cudnn=True) if measure and spec.target == "cuda" else None
    accountant.blas = blas  # watched in the accountant's own dispatch layer
    # compiled code runs uncompiled: counted exactly, and the modes leave dynamo's caches untouched
    accountant.recorder = recorder
    if step.manual is not None:
        readings = _self_optimizing_phases(spec, step, tracker, hooks, handles, blas)
        if spec.target == "cuda" and not spec.on_meta:
            accountant.forget([c for optimizer in step.optimizers for c in _host_step_counters(optimizer)])
        return _step_phases(readings, saved, blas) if measure else None
    with accountant, compiled_code_runs_eagerly():
        start = accountant.read(reset_peak=True)
        try:
            loss = run_forward(spec, step, tracker, hooks)
        finally:  # a forward that failed leaves no hook behind (the estimator's own copy is stepped again)
            for handle in handles:
                handle.remove()
        marked = len(recorder.events) if recorder is not None else 0
        zero_gradients(step)
        if recorder is not None:
            recorder.forward_end = marked
            if len(recorder.events) != marked:  # it freed what the forward made: not the next step's zero_grad
                recorder.refuse("zero_grad freed a storage the forward made")
        forward = accountant.read(reset_peak=True)
        if blas is not None:
            blas.phase = "backward"
        loss.backward()
        # LBFGS calls its closure in its step, first for the loss just computed, then to run forward and backward
        # again: the estimate's step does as Lightning's does (zero_grad, training step, backward)
        closure = Reevaluation(spec, step, loss.detach()) if step_needs_closure(step.optimizer) else None
        del loss  # freed before the backward's end is read
        accountant.recorder = None
        if recorder is not None:
            recorder.backward_end = len(recorder.events)
        backward = accountant.read(reset_peak=True)
        if blas is not None:
            blas.phase = "optimizer_step"
        run_optimizer_step(step, closure)
        optimizer_step = accountant.read(reset_peak=True)
    if closure is not None:  # its forwards and backwards peak in their phases, as the guard measures them
        start, forward, backward, optimizer_step = closure.phases(start, forward, backward, optimizer_step)
    if spec.target == "cuda" and not spec.on_meta:
        accountant.forget(_host_step_counters(step.optimizer))
    if not measure:
        return None
    return _step_phases((start, forward, backward, optimizer_step), saved, blas)


def _self_optimizing_phases(spec: StepSpec, step: PreparedStep, tracker: Any, hooks: Any, handles: list,
                            blas: Optional[BlasWorkspaces]) -> tuple[AllocatorReading, ...]:
    """A step that runs its optimizers itself, read where the guard reads it under manual optimization: each forward
    ends where a backward begins, each backward where it returns, and what follows the last backward (its optimizer's
    step, logging) to the step's end is the optimizer step's phase. A phase passed twice (two optimizers' backwards)
    keeps its higher peak; what runs between a backward and the next (the first optimizer's step, the second
    forward) is the next forward's, as the guard measures it."""
    accountant = step.accountant
    ends: dict[str, AllocatorReading] = {}

    def phase_ends(phase: str, next_phase: str) -> None:
        reading = accountant.read(reset_peak=True)
        last = ends.get(phase)
        ends[phase] = reading if last is None or last.peak_bytes <= reading.peak_bytes else \
            reading._replace(peak_bytes=last.peak_bytes)
        if blas is not None:
            blas.phase = next_phase

    with accountant, compiled_code_runs_eagerly():
        start = accountant.read(reset_peak=True)
        stand_ins = SelfOptimizingStep(step.work, step.manual, step.schedulers,
                                       lambda: phase_ends("forward", "backward"),
                                       lambda: phase_ends("backward", "optimizer_step"))
        try:
            with stand_ins:
                run_forward(spec, step, tracker, hooks, loss_needed=False)
        finally:
            for handle in handles:
                handle.remove()
        phase_ends("optimizer_step", "optimizer_step")
    # a step that ran no backward (one that skipped its batch): its whole step is its forward
    end = ends["optimizer_step"]
    forward, backward = ends.get("forward", end), ends.get("backward", end)
    return start, forward, backward, end


def _replayed(spec: StepSpec, step: PreparedStep, first: StepPhases, recorder: StepRecorder) -> Optional[StepPhases]:
    """The measured step replayed from ``recorder`` (:func:`replay_phases`), or ``None`` where it refuses (the step
    then runs again: the gradients' storages are not held here past this call, so that its ``zero_grad`` frees
    them)."""
    gradients, cleared = _gradients(step)
    if recorder.refusal([key for key, _ in gradients], cleared) is not None:
        return None
    return replay_phases(spec, step, first, recorder, gradients)


def replay_phases(spec: StepSpec, step: PreparedStep, first: StepPhases, recorder: StepRecorder,
                  gradients: list[tuple[int, torch.UntypedStorage]]) -> StepPhases:
    """The measured step from the step before it, as :func:`run_phases` would measure it: ``recorder``'s forward
    replayed, the ``gradients`` (their storages by key, from :func:`_gradients`) freed (``zero_grad``), its backward
    replayed and the gradients given the blocks their replayed twins hold, then the optimizer step run. What autograd
    saved and the matmuls' threads are ``first``'s (the same ops)."""
    accountant = step.accountant
    replay = Replay(accountant.count_replayed, accountant._free)
    start = accountant.read(reset_peak=True)
    replay.run(recorder.events[:recorder.forward_end])
    for key, _ in gradients:  # the counting's only: the gradients themselves live on as step 1's
        accountant._free(key)
    forward = accountant.read(reset_peak=True)
    replay.run(recorder.events[recorder.forward_end:recorder.backward_end])
    for key, storage in gradients:
        accountant.adopt(replay.keys.pop(key), storage)
    backward = accountant.read(reset_peak=True)
    with accountant, compiled_code_runs_eagerly():
        run_optimizer_step(step)
        optimizer_step = accountant.read(reset_peak=True)
    if spec.target == "cuda" and not spec.on_meta:
        accountant.forget(_host_step_counters(step.optimizer))
    return _step_phases((start, forward, backward, optimizer_step), first.saved, first.blas)


def _step_phases(readings: tuple, saved: dict[int, tuple[int, str]], blas: Optional[BlasWorkspaces]) -> StepPhases:
    """The measured step from the readings at its start and at the end of each phase."""
    start, forward, backward, optimizer_step = readings
    # what a phase allocated and freed within itself: its peak above both ends of the phase
    ends = ((start, forward), (forward, backward), (backward, optimizer_step))
    temporaries = max(end.peak_bytes - max(begin.allocated_bytes, end.allocated_bytes) for begin, end in ends)
    peaks = {"forward": forward.peak_bytes, "backward": backward.peak_bytes,
             "optimizer_step": optimizer_step.peak_bytes}
    return StepPhases(peaks, temporaries, saved, blas)


def _gradients(step: PreparedStep) -> tuple[list[tuple[int, torch.UntypedStorage]], bool]:
    """The storages of the gradients :func:`zero_gradients` clears (the optimizer's parameters', else the module's),
    each once by key, in the order it frees them; and whether it clears every gradient of the step's parameters."""
    zeroed = step.params if step.optimizer is None else [
        param for group in step.optimizer.param_groups for param in group["params"]]
    storages: dict[int, torch.UntypedStorage] = {}
    for param in zeroed:
        if param.grad is not None:
            for dense in dense_tensors(param.grad):  # a sparse gradient's indices and values
                storage = dense.untyped_storage()
                storages.setdefault(storage._cdata, storage)
    ids = {id(param) for param in zeroed}
    return list(storages.items()), all(id(param) in ids for param in step.params if param.grad is not None)


def run_forward(spec: StepSpec, step: PreparedStep, tracker: Any, hooks: Any, loss_needed: bool = True) -> Any:
    """The loss of the training step on the batch, under the step's autocast and, when measured, the ``tracker`` of
    the module running and the ``hooks`` that record what autograd saves.

    Raises:
        NeedsValues: on meta, the step read a value computed from the weights.
        ValueError: the batch does not fit the training step, or it returned no loss.
    """
    name = type(spec.model).__name__
    kernels = step.autocast
    # blocks the model checkpoints itself recompute in the backward under the kernel model too (own_checkpoints.py)
    own = recomputed_under(kernels.outside_only) if isinstance(kernels, CudaKernelMode) else contextlib.nullcontext()
    try:
        with tracker, hooks, own, kernels:
            loss = (spec.loss_fn or step_loss_with_gathers_stood_in)(step.work, step.batch)
    except NeedsValues:
        raise
    except Exception as err:
        if spec.on_meta and reads_values(err):  # a meta value read outside the dispatcher (tolist())
            raise NeedsValues(f"{type(err).__name__}: {err}{error_location(err)}") from err
        if "not attached to a `Trainer`" in str(err):  # Lightning's words: the step asks its Trainer for something
            raise ValueError(f"{name}'s training step uses its Trainer (self.trainer, self.optimizers(), ...), which "
                             f"the estimate's copy of the module runs without: {type(err).__name__}: {err}") from err
        raise ValueError(f"the example batch does not fit {name}'s training step: "
                         f"{type(err).__name__}: {err}") from err
    if loss_needed and not isinstance(loss, torch.Tensor):
        raise ValueError(f"{name}'s training step returned {type(loss).__name__} for the example batch (a skipped "
                         "batch?), not a loss: give a batch it trains on, or loss_fn=(model, batch) -> loss")
    return loss


def zero_gradients(step: PreparedStep) -> None:
    """Lightning zeroes gradients after the forward and before on_before_backward: the same boundary here."""
    if step.optimizer is not None:
        step.optimizer.zero_grad(set_to_none=True)
    else:
        step.work.zero_grad(set_to_none=True)


def run_optimizer_step(step: PreparedStep, closure: Optional[Reevaluation] = None) -> None:
    if step.optimizer is not None:
        step.optimizer.step(closure) if closure is not None else step.optimizer.step()


class Reevaluation:
    """The closure of an optimizer that re-evaluates the loss in its step (LBFGS): its first call returns ``loss``
    (the step's forward and backward ran already), the later ones run them again, as Lightning's closure does. The
    peaks of those forwards and backwards are their phases' (what the rungs lower: the guard measures them at the
    same hooks), what the optimizer does between them its step's."""

    def __init__(self, spec: StepSpec, step: PreparedStep, loss: torch.Tensor) -> None:
        self.spec, self.step, self.first = spec, step, [loss]
        self.peaks = {"forward": 0, "backward": 0, "optimizer_step": 0}

    def __call__(self) -> torch.Tensor:
        if self.first:
            return self.first.pop()
        accountant, peaks, step = self.step.accountant, self.peaks, self.step
        peaks["optimizer_step"] = max(peaks["optimizer_step"], accountant.read(reset_peak=True).peak_bytes)
        with torch.enable_grad():
            zero_gradients(step)
            loss = run_forward(self.spec, step, contextlib.nullcontext(), contextlib.nullcontext())
            peaks["forward"] = max(peaks["forward"], accountant.read(reset_peak=True).peak_bytes)
            loss.backward()
        peaks["backward"] = max(peaks["backward"], accountant.read(reset_peak=True).peak_bytes)
        return loss.detach()

    def phases(self, *readings: AllocatorReading) -> tuple[AllocatorReading, ...]:
        """The step's readings (start, forward, backward, optimizer step) with these peaks in their phases."""
        start, *ends = readings
        return (start, *(end._replace(peak_bytes=max(end.peak_bytes, self.peaks[phase]))
                         for end, phase in zip(ends, ("forward", "backward", "optimizer_step"))))


def collect_estimate(spec: StepSpec, step: PreparedStep, phases: StepPhases) -> MemoryEstimate:
    """The estimate of the measured step: categories from the working copy's tensors, activations by module and by
    block, and the runtime's workspaces on each phase's peak (target cuda)."""
    work, params = step.work, step.params
    state = list(optimizer_state_tensors(step.optimizers))
    # summed in Python, framed once: pandas' group-by and a string match per block were a tenth of a small estimate
    by_module: dict[str, int] = {}
    for nbytes, module in phases.saved.values():
        by_module[module] = by_module.get(module, 0) + nbytes
    modules = (pd.DataFrame(sorted(by_module.items()), columns=["module", "activations_bytes"])
               .sort_values("activations_bytes", ascending=False, ignore_index=True))
    block_names = [name for name, _ in find_blocks(work, spec.blocks)]
    by_block = pd.DataFrame([(name, _bytes_within(by_module, name)) for name in block_names],
                            columns=["block", "activations_bytes"])
    # the workspaces come on top of the allocator model's peaks: a cuBLAS workspace is a segment of its own (32 MiB,
    # exactly a multiple of 2 MiB) and cuBLASLt's 1 MiB comes from the small pool, which splits to 512 bytes: neither
    # is handed a larger block, nor changes the blocks the step's tensors get beyond the small pool
    runtime = phases.blas.held_bytes() if spec.target == "cuda" else 0
    allocator = step.accountant.allocator
    return MemoryEstimate(
        parameters_bytes=storage_bytes([*params, *work.buffers()]),
        gradients_bytes=storage_bytes(p.grad for p in params if p.grad is not None),
        optimizer_state_bytes=storage_bytes(state),
        activations_bytes=sum(n for n, _ in phases.saved.values()),
        temporaries_bytes=phases.temporaries_bytes,
        batch_bytes=storage_bytes(step.batch_leaves),
        phase_peaks={phase: peak + runtime for phase, peak in phases.phase_peaks.items()},
        precision=spec.precision,
        device=spec.device.type,
        target=spec.target,
        path=spec.device.type,
        runtime_bytes=runtime,
        checkpointed_blocks=len(step.checkpointed),
        n_blocks=step.n_blocks,
        modules=modules,
        blocks=by_block,
        reserved_bytes=allocator.peak_reserved_bytes + runtime if allocator is not None else None,
    )


def _bytes_within(by_module: dict[str, int], name: str) -> int:
    """The bytes of module ``name`` and the modules inside it."""
    inside = name + "."
    return sum(nbytes for module, nbytes in by_module.items() if module == name or module.startswith(inside))


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


def _input_keeper(pack: Callable) -> Callable:
    """A forward pre-hook (with keyword arguments) that records the tensors a checkpointed block keeps for its
    recomputation: every tensor argument, also those that need no gradient. torch's checkpoint saves the positional
    ones (through the saved-tensor hooks too); the keyword ones — transformers' attention mask, rotary tables and
    position ids, T5's position bias — stay referenced by the call it recomputes, which no hook sees. Only where the
    block's output will have a graph (a trainable parameter in it, or an input that needs a gradient): else nothing
    is kept."""

    def keep_inputs(module, args, kwargs):
        tensors = batch_tensors((args, kwargs))
        if any(t.requires_grad or t.grad_fn is not None for t in tensors) or \
                any(p.requires_grad for p in module.parameters()):
            for tensor in tensors:
                pack(tensor)

    return keep_inputs


def _saver(saved: dict, exclude: set, tracker, counts: Callable[[torch.Tensor], bool]) -> Callable:
    """A pack hook that records each saved storage the accounting counts once, with the module whose forward saved
    it. A storage is known by its address while it lives: one saved after another was freed at the same address is
    another storage (freed by the garbage collector, say), and counts again."""
    recorded: dict[int, weakref.ref] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata
        known = recorded.get(key)
        if (known is None or known() is None) and key not in exclude and counts(tensor):
            recorded[key] = weakref.ref(storage)
            saved[len(saved)] = (storage.nbytes(), tracker.innermost)
        return tensor

    return pack
