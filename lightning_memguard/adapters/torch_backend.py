"""The plain-PyTorch backend of the loop guard: ``torch.autocast`` and a ``GradScaler`` for the AMP rung, DDP's
``no_sync`` between micro-batches, ranks from ``torch.distributed`` and logging to a TensorBoard ``SummaryWriter``.
Imports no Lightning."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import torch
from torch import nn

from ..base.host import Host
from .own_collectives import uncounted
from .tensorboard import TensorBoardText
from .worker_release import numbers_for_collective

__all__ = ["AutocastSwitch", "TorchBackend"]

#: entered around every forward and backward of most steps: one shared context that does nothing (reentrant)
_NO_CONTEXT = contextlib.nullcontext()


class AutocastSwitch:
    """The AMP rung's switch for a loop MemGuard runs itself: ``torch.autocast`` around the loss function and, for
    fp16, a ``torch.amp.GradScaler`` for backward and the optimizer step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base_precision = "32-true"  # the loop's autocast is the rung's alone
        self.dtype: Optional[torch.dtype] = None
        self.scaler: Optional[torch.amp.GradScaler] = None

    def fixed_reason(self) -> Optional[str]:
        return None

    def enable(self, precision: str) -> None:
        self.dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
        self.scaler = torch.amp.GradScaler(self.device.type) if self.dtype == torch.float16 else None

    def disable(self) -> None:
        self.dtype, self.scaler = None, None

    def forward_context(self) -> ContextManager:
        if self.dtype is None:
            return _NO_CONTEXT
        return torch.autocast(self.device.type, dtype=self.dtype)


class TorchBackend:
    """How a plain PyTorch loop runs one step's parts (see :class:`~lightning_memguard.adapters.loop.LoopBackend`).

    Args:
        model: the module being trained (a ``DistributedDataParallel`` one synchronises gradients once a batch).
        optimizer: its optimizer.
        log_dir: where a ``SummaryWriter`` is opened when ``writer`` is not given; ``None``: none is.
        writer: a ``SummaryWriter`` to log to (flushed, never closed: it is the caller's).
        tensorboard: open a ``SummaryWriter`` in ``log_dir`` when no ``writer`` is given.
    """

    name = "the loop"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, log_dir: Optional[str] = None,
                 writer: Any = None, tensorboard: bool = True) -> None:
        self.model = self.module = self.called_module = self.data_parallel = model
        self.optimizer = self.estimate_optimizer = optimizer
        self.log_dir = log_dir
        self._writer, self._own_writer = writer, False
        self._tensorboard = tensorboard
        self._switch: Optional[AutocastSwitch] = None

    @property
    def device(self) -> torch.device:
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def precision_switch(self) -> AutocastSwitch:
        self._switch = AutocastSwitch(self.device)
        return self._switch

    def forward_context(self) -> ContextManager:
        return self._switch.forward_context() if self._switch is not None else _NO_CONTEXT

    def backward(self, loss: torch.Tensor) -> None:
        scaler = self._switch.scaler if self._switch is not None else None
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def unscale_gradients(self) -> None:
        scaler = self._switch.scaler if self._switch is not None else None
        if scaler is not None:
            scaler.unscale_(self.optimizer)  # scaler.step() below sees it done and does not unscale again

    def optimizer_step(self) -> None:
        scaler = self._switch.scaler if self._switch is not None else None
        if scaler is None:
            self.optimizer.step()
        else:
            scaler.step(self.optimizer)
            scaler.update()

    def no_sync(self, last: bool) -> ContextManager:
        if not last and isinstance(self.model, nn.parallel.DistributedDataParallel):
            return self.model.no_sync()  # gradients are all-reduced once, with the last micro-batch
        return _NO_CONTEXT

    def host(self) -> Host:
        writer = self._writer
        if writer is None and self.log_dir is not None and self._tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            writer = self._writer = SummaryWriter(self.log_dir)
            self._own_writer = True
        world_size = dist_world_size()
        several = world_size > 1
        rank = torch.distributed.get_rank() if several else 0
        processes = dict(rank=rank, world_size=world_size, reduce_max=dist_reduce_max if several else None)
        if rank != 0:  # what every rank would say alike is said once
            processes.update(warn=_silent, info=_silent)
        if writer is None:  # tensorboard=False with a log_dir: the user's choice
            return Host(has_logger=False, logger_off_by_choice=self.log_dir is not None and not self._tensorboard,
                        **processes)

        def log_metrics(metrics: dict, step: int) -> None:
            for key, value in metrics.items():
                writer.add_scalar(key, value, global_step=step)

        text = TensorBoardText(lambda: [writer])
        return Host(log_metrics=log_metrics, log_text=text.log_text, add_layout=text.add_layout, **processes)

    def flush(self) -> None:
        if self._writer is None:
            return
        if self._own_writer:
            self._writer.close()
        else:
            self._writer.flush()  # the user's writer stays open


def dist_world_size() -> int:
    """The processes of the ``torch.distributed`` group, 1 without one."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def dist_reduce_max(values: list[int]) -> list[int]:
    """Every rank decides on the worst rank's numbers (the ladder must change the same way everywhere)."""
    backend = torch.distributed.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    tensor = numbers_for_collective(values, device)
    with uncounted():  # the guard's own collective, not the step's
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def _silent(message: str) -> None:
    return None
