"""Which memory source a run reads — the CUDA caching allocator plus NVML on a CUDA device, else the CPU tensor
accountant, with one warning saying what is counted and why — and which steps it counts."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from ..base.batches import batch_tensors
from ..base.compiled import compiled_code
from ..sources import CpuTensorAccountant, CudaAllocatorSource, NvmlSampler
from ..sources.base import MemorySource
from ..sources.cpu import compiled_code_warning, dense_tensors, storage_bytes
from ..sources.kept import model_kept_tensors
from ..sources.training_state import training_state_tensors

__all__ = ["open_source", "measures_step", "resume_counting", "held_beside_step"]


def open_source(device: torch.device, called: Optional[nn.Module], warn: Callable[[str], None], guarding: bool, *,
                given: Optional[MemorySource] = None, budget_bytes: Optional[int] = None,
                cpu_hard_limit_bytes: Optional[int] = None,
                nvml_interval_s: float = 0.2) -> tuple[MemorySource, Optional[NvmlSampler], bool]:
    """Opens the source for a run on ``device``: ``(source, NVML sampler or None, whether the run calls compiled
    code)``. ``called`` is the module the front door calls (searched for compiled code); ``guarding``: a capacity is
    guarded (the CPU warning says so). ``given``: a source to use as it is (a scripted one in tests)."""
    # compiled kernels allocate where live CPU tensor counting cannot see, and run no module hooks inside graphs
    compiled = compiled_code(called) if called is not None else []
    if given is not None:
        if not isinstance(given, CpuTensorAccountant):  # the accountant starts per measured step
            given.start()
        return given, None, bool(compiled)
    if device.type == "cuda":
        source = CudaAllocatorSource(device, budget_bytes=budget_bytes)
        source.start()
        nvml = NvmlSampler(str(torch.cuda.get_device_properties(device).uuid), nvml_interval_s)
        nvml.start()
        return source, nvml, bool(compiled)
    if compiled:  # no count at all rather than a short one; one warning instead of the notes below
        warn(compiled_code_warning(compiled))
    elif device.type != "cpu" or torch.cuda.is_available():
        warn(f"lightning-memguard: the device {device} is not CUDA, so live CPU tensor memory is counted instead.")
    else:
        warn("lightning-memguard: there is no CUDA device, so live CPU tensor memory is counted"
             + (" against the budget." if guarding else
                "; give budget= to guard it (until then it is only monitored)."))
    # started per measured step (MemoryMonitor.batch_start)
    accountant = CpuTensorAccountant(budget_bytes=budget_bytes, limit_bytes=cpu_hard_limit_bytes)
    if compiled:
        accountant.switch_off()
    return accountant, None, bool(compiled)


def measures_step(source: Optional[MemorySource], step: int, every: int, module: Optional[nn.Module],
                  optimizers: Callable[[], list], batch: Any, elsewhere: Callable[[], list] = list) -> bool:
    """Whether optimizer step ``step`` is measured. The CPU accountant counts every ``every``-th step only (counting
    costs time per op): it is started here for such a step, after it learns the tensors created while it was off (the
    state that persists across steps, and this batch), and stopped for the others. Other sources measure every
    step."""
    if not isinstance(source, CpuTensorAccountant):
        return source is not None
    measured = step % every == 0
    if measured and not source.started:
        resume_counting(source, module, optimizers, batch, elsewhere)
        source.read(reset_peak=True)
    elif not measured and source.started:
        source.stop()
    return measured


def resume_counting(source: CpuTensorAccountant, module: Optional[nn.Module], optimizers: Callable[[], list],
                    batch: Any, elsewhere: Callable[[], list] = list) -> None:
    """Starts the CPU accountant after it learns the tensors born while it was off that are still alive: the state
    that persists across steps, this batch, what the run holds ``elsewhere`` (a callback's averaged model: the host's
    ``held_elsewhere``) and what the model keeps besides (a list of outputs, a metric's states, a loss kept with its
    graph and the tensors the graph saved: :func:`~lightning_memguard.sources.kept.model_kept_tensors`). Without the
    last, what steps that were not counted keep was never counted, and memory that grows every step rose by a
    ``cpu_sample_every``-th of its size."""
    if module is not None:
        source.track(training_state_tensors(module, optimizers()))
    source.track(batch_tensors(batch))
    source.track(_held_elsewhere(elsewhere))
    if module is not None:
        source.track(model_kept_tensors(module, source.knows))
    source.start()


def held_beside_step(source: Optional[MemorySource], module: Optional[nn.Module], optimizers: Callable[[], list],
                     batch: Any, elsewhere: Callable[[], list] = list) -> int:
    """Bytes the source holds now, or counts from this batch's start, beside the model's training state (parameters,
    buffers, gradients, optimizer state) and ``batch``: what an estimate of the step does not hold. On CUDA, what the
    allocator has handed out beyond those (another model, averaged weights, cached data on the device, and the CUDA
    runtime's workspaces where a step already ran); on CPU, the tensors the model keeps in its attributes (a dataset,
    a list of outputs) and those held ``elsewhere`` (a callback's averaged model), which the accountant counts with
    the step. 0 for another source, or where it cannot be read."""
    if source is None or module is None:
        return 0
    try:
        state = [*training_state_tensors(module, optimizers()), *batch_tensors(batch)]
        if isinstance(source, CpuTensorAccountant):
            mine = {dense.untyped_storage()._cdata for tensor in state for dense in dense_tensors(tensor)}

            def known(tensor: torch.Tensor) -> bool:
                return not source.counts(tensor) or all(dense.untyped_storage()._cdata in mine
                                                        for dense in dense_tensors(tensor))

            held = [t for t in _held_elsewhere(elsewhere) if not known(t)]
            return storage_bytes(model_kept_tensors(module, known) + held)
        if isinstance(source, CudaAllocatorSource):
            device = torch.device(source.device)
            held = source.read(reset_peak=False).allocated_bytes
            return max(0, held - storage_bytes(t for t in state if isinstance(t, torch.Tensor) and t.device == device))
    except Exception:  # a reading that fails must not stop the plan: it is then made as before
        return 0
    return 0


def _held_elsewhere(elsewhere: Callable[[], list]) -> list:
    """``elsewhere()``, or nothing where it fails: what a front door reads off its framework must not stop a count."""
    try:
        return [t for t in elsewhere() if isinstance(t, torch.Tensor)]
    except Exception:
        return []
