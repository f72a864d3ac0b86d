"""What an estimated step holds on the device being estimated (framework-free): the CPU accountant's counting of
storages, with what a step adds — a CUDA target's caching-allocator blocks, the mixed execution's host and device
storages, cuDNN's workspaces, and the hand-over between a replayed warm-up and the measured step
(:mod:`~lightning_memguard.estimate.step_replay`)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..sources.cpu import CpuTensorAccountant, NewTensorMode, dispatch_new_tensors, new_tensors
from .caching_allocator import CachingAllocatorModel
from .cuda_kernels import BlasWorkspaces, cudnn_workspace_bytes
from .mixed import MixedExecution
from .step_replay import StepRecorder

__all__ = ["StepAccountant"]


class StepAccountant(CpuTensorAccountant):
    """Counts what the step holds on the device being estimated. On a mixed step (``mixed``): the meta storages and
    the real ones the mixed execution says are device-side (the batch, the masks computed from it), and with
    ``count_host`` every real one (a CPU target); its mode runs the mixed execution's ops beneath the counting. Storages
    it is told to :meth:`forget` are host memory."""

    def __init__(self, device_type: str, granularity: int, mixed: Optional[MixedExecution] = None,
                 count_host: bool = True, allocator: Optional[CachingAllocatorModel] = None) -> None:
        super().__init__(device_type="meta" if mixed is not None else device_type, granularity=granularity)
        self._mixed = mixed
        self._count_host = count_host
        self._host: set[int] = set()
        #: a CUDA target's caching allocator: each storage is counted as the block it would be handed
        self.allocator = allocator
        #: what notes the step's matmuls and holds cuDNN's workspaces, where the step is watched for them (set before
        #: the counting starts)
        self.blas: Optional[BlasWorkspaces] = None
        #: what records the storages counted and freed, while a step is recorded
        #: (:func:`~lightning_memguard.estimate.step.run_phases`)
        self.recorder: Optional[StepRecorder] = None

    def _count_storage(self, storage: torch.UntypedStorage, check_limit: bool) -> None:
        if self.recorder is not None:
            key, nbytes = storage._cdata, storage.nbytes()
            entry = self._live.get(key)
            self.recorder.seen(key, nbytes, entry is not None, lambda: self._requested_bytes(key, entry) != nbytes)
        super()._count_storage(storage, check_limit)

    def _requested_bytes(self, key: int, entry: tuple) -> int:
        """What a counted storage's allocation asked for (its count is the allocator's block)."""
        return self.allocator.requested_bytes(key) if self.allocator is not None else entry[0]

    def count_replayed(self, key: int, nbytes: int) -> None:
        """Counts a replayed storage (:class:`~lightning_memguard.estimate.step_replay.Replay`): alive in the
        counting only, until it is freed."""
        self._count(key, nbytes, None, check_limit=False)

    def adopt(self, replayed: int, storage: torch.UntypedStorage) -> None:
        """``storage`` (not counted now) takes over what the replayed storage ``replayed`` holds: its count and its
        allocator block; its death frees them."""
        nbytes, _ = self._live.pop(replayed)
        key = storage._cdata
        self._live[key] = (nbytes, self._death_watch(key, storage))
        if self.allocator is not None:
            self.allocator.rename(replayed, key)

    def _counted_bytes(self, key: int, nbytes: int) -> int:
        if self.allocator is None:
            return super()._counted_bytes(key, nbytes)
        return self.allocator.hold(key, nbytes)  # a new storage, a known one, or one resized

    def _free(self, key: int) -> None:
        if self.recorder is not None and key in self._live:
            self.recorder.freed(key)
        super()._free(key)
        if self.allocator is not None:
            self.allocator.free(key)

    def _new_tensor_mode(self) -> NewTensorMode:
        # on a mixed step the mixed execution runs every op beneath the counting, and the workspaces are watched, in
        # the same dispatch layer: a mode of its own for each cost one more Python dispatch on every op of the step
        run = self._mixed.run if self._mixed is not None else None
        if self.blas is not None:
            run = self._watching_workspaces(run or _call)
        return _EstimateTensorMode(self._add, run=run)

    def _watching_workspaces(self, run: Callable) -> Callable:
        """``run`` with :attr:`blas` watching each op, as its mode did when it ran just above the counting."""
        blas = self.blas

        def watched(func, args: tuple, kwargs: dict):
            if not blas.needs_workspace(func, args):
                blas.note(func, args, kwargs)
                return run(func, args, kwargs)
            recorder = self.recorder
            if recorder is not None:  # recorded where the measured step makes it (see step.run_phases)
                key = recorder.workspace(cudnn_workspace_bytes(args))
                out = run(func, args, kwargs)
                for tensor in new_tensors(func, out):
                    self._add(tensor)
                recorder.freed(key)
                return out
            # the workspace is made under the counting, as above it, and freed once the op's outputs are counted
            with self._mode:
                workspace = torch.empty(cudnn_workspace_bytes(args), dtype=torch.uint8, device=args[0].device)
            out = run(func, args, kwargs)
            for tensor in new_tensors(func, out):
                self._add(tensor)
            del workspace
            return out

        return watched

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


def _call(func, args: tuple, kwargs: dict):
    return func(*args, **kwargs)


class _EstimateTensorMode(NewTensorMode):
    """The estimate's counting mode, without torch's per-op wrapper that keeps dynamo out of a mode's dispatch: the
    estimate runs compiled code uncompiled (``compiled_code_runs_eagerly``), so dynamo has nothing to do in it, and the
    wrapper cost a few microseconds on every op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    __torch_dispatch__ = dispatch_new_tensors
