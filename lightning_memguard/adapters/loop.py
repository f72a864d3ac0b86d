"""MemGuard for a plain PyTorch loop: one call per optimizer step runs forward, backward and the optimizer step of a
batch under the guard — measured at every boundary, in mixed precision when the AMP rung is on, split into
micro-batches when the micro-batch rung is on, and run again one rung higher when it runs out of memory. Imports no
Lightning. :class:`~lightning_memguard.adapters.fabric.FabricMemGuard` is the same with Fabric doing the precision,
the backward and the logging."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn

from ..base.host import Host
from ..guard.engine import MemGuardEngine
from ..guard.oom import BatchState, retry_on_oom, step_optimizer
from ..guard.settings import GuardSettings
from .results import GuardResults
from .tensorboard import TensorBoardText

__all__ = ["MemGuard", "AutocastSwitch"]

#: ``(model, batch) -> loss``: the model is passed in, so the pre-flight estimate can run the same step on a copy
LossFn = Callable[[nn.Module, Any], torch.Tensor]


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
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


class MemGuard(GuardResults):
    r"""Guards a plain PyTorch training loop: the same measuring, logging, ladder and OOM rescue as
    :class:`~lightning_memguard.MemGuardCallback`, in a loop you write.

    Example::

        guard = MemGuard(model, optimizer, budget="2GiB", log_dir="runs/exp1")
        for inputs, target in loader:
            loss = guard.step((inputs, target), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        guard.close()

    Each :meth:`step` is one optimizer step: it zeroes the gradients, runs ``loss_fn(model, batch)`` (forward, inside
    autocast when the AMP rung is on), backward and ``optimizer.step()``, reading memory at the four boundaries. When
    the micro-batch rung is on, ``loss_fn`` is called on each part of the batch (every tensor with the batch's leading
    size is split, in any nesting of mappings, ``BatchEncoding``, dataclasses and sequences), and each loss is weighted
    by its share of what the loss averages over (labels not -100 when the batch has ``labels``, else samples, or
    ``microbatch_weight=``). When forward or backward runs out of memory, the failed
    attempt is freed, the next rung applied and the same batch run again; :class:`~lightning_memguard.
    MemGuardOutOfMemoryError` says why when nothing is left to try.

    Logged with ``torch.utils.tensorboard`` to ``log_dir`` (or to ``writer``), the history and events also as CSV
    there; :attr:`history` and :attr:`events` are pandas DataFrames.

    Args:
        model: the module being trained (the checkpointing rung finds its repeated blocks).
        optimizer: its optimizer.
        log_dir: where the run's files and TensorBoard events go; ``None``: nothing is written.
        writer: a ``SummaryWriter`` to log to instead of one opened in ``log_dir``.
        tensorboard: open a ``SummaryWriter`` in ``log_dir`` when no ``writer`` is given.
        scheduler: an LR scheduler stepped after every optimizer step (optional).
        **settings: the guard's settings (``threshold``, ``budget``, ``mitigations``, ...), the same for every
            front door: see :class:`~lightning_memguard.guard.settings.GuardSettings`.

    Raises:
        ValueError: on a bad argument, naming it and what is allowed.
    """

    _name = "the loop"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, log_dir: Optional[str] = None,
                 writer: Any = None, tensorboard: bool = True, scheduler: Any = None, **settings: Any) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model={type(model).__name__} must be a torch.nn.Module")
        if not isinstance(getattr(optimizer, "param_groups", None), list):
            raise ValueError(f"optimizer={type(optimizer).__name__} must be a torch.optim.Optimizer")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.log_dir = log_dir
        self._writer, self._own_writer = writer, False
        self._tensorboard = tensorboard
        self._engine = MemGuardEngine(_settings(settings), name=self._name)
        self._state = BatchState()
        self._switch: Optional[AutocastSwitch] = None
        self._started = False
        self.global_step = 0  # optimizer steps done (restored on resume)
        self._steps_done = 0  # optimizer steps done in this process: the first creates the optimizer state

    # --- the loop's calls -------------------------------------------------------------------------------------------
    def step(self, batch: Any, loss_fn: LossFn) -> torch.Tensor:
        """Runs one optimizer step on ``batch``: returns the loss (detached; with micro-batches, their weighted sum).

        Raises:
            MemGuardOutOfMemoryError: the batch cannot fit whatever the ladder does; its message is the report.
            ValueError: ``loss_fn`` returned something other than a scalar tensor.
        """
        if not self._started:
            self._start()
        engine = self._engine
        try:
            # zeroed before the batch-start read: memory held across steps is then parameters and optimizer state
            # only, in every step (gradients exist from the first backward on), as the policy compares steps
            self.optimizer.zero_grad(set_to_none=True)
            engine.batch_start(self.global_step, batch, loss_fn)
            loss = retry_on_oom(lambda: self._forward_backward(batch, loss_fn), self._state, first_micro_batch=True,
                                max_retries=engine.settings.max_retries,
                                release=lambda: self.optimizer.zero_grad(set_to_none=True),
                                on_failure=engine.on_oom, on_error=engine.on_rung_error,
                                rescue=engine.settings.rescue_oom)
            step_optimizer(self.optimizer, lambda retry: self._optimizer_step(), self._steps_done == 0,
                           engine.on_optimizer_oom)
            self._steps_done += 1
            if self.scheduler is not None:
                self.scheduler.step()
            engine.step_end()
        except BaseException:
            engine.on_exception()  # the rows of this step and the memory now; the files stay open
            raise
        self.global_step += 1
        return loss

    def close(self) -> None:
        """Flushes and closes the files and sources; the results stay readable. Idempotent."""
        self._engine.stop()
        self._flush_loggers()
        self._started = False

    def _flush_loggers(self) -> None:
        if self._writer is None:
            return
        if self._own_writer:
            self._writer.close()
        else:
            self._writer.flush()  # the user's writer stays open

    def __enter__(self) -> "MemGuard":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """The ladder's levels and the step counter, to save with a checkpoint."""
        return {**self._engine.state_dict(), "global_step": self.global_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` before the first :meth:`step` of a resumed run."""
        self.global_step = int(state.get("global_step", 0))
        self._engine.load_state_dict(state)

    # --- what a framework may do differently ------------------------------------------------------------------------
    @property
    def _module(self) -> nn.Module:
        """The model the rungs change (a framework's wrapper unwrapped)."""
        return self.model

    @property
    def _estimate_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the estimate builds a like one of."""
        return self.optimizer

    def _device(self) -> torch.device:
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _world_size(self) -> int:
        # under torch.distributed an OOM on one rank cannot be retried alone (the others would wait in backward)
        return _dist_world_size()

    def _precision_switch(self, device: torch.device):
        self._switch = AutocastSwitch(device)
        return self._switch

    def _forward_context(self) -> ContextManager:
        return self._switch.forward_context() if self._switch is not None else contextlib.nullcontext()

    def _backward(self, loss: torch.Tensor) -> None:
        scaler = self._switch.scaler if self._switch is not None else None
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def _optimizer_step(self) -> None:
        scaler = self._switch.scaler if self._switch is not None else None
        if scaler is None:
            self.optimizer.step()
        else:
            scaler.step(self.optimizer)
            scaler.update()

    def _no_sync(self, last: bool) -> ContextManager:
        if not last and isinstance(self.model, nn.parallel.DistributedDataParallel):
            return self.model.no_sync()  # gradients are all-reduced once, with the last micro-batch
        return contextlib.nullcontext()

    def _host(self) -> Host:
        writer = self._writer
        if writer is None and self.log_dir is not None and self._tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            writer = self._writer = SummaryWriter(self.log_dir)
            self._own_writer = True
        world_size = _dist_world_size()
        several = world_size > 1
        processes = dict(rank=torch.distributed.get_rank() if several else 0, world_size=world_size,
                         reduce_max=_dist_reduce_max if several else None)
        if writer is None:
            return Host(has_logger=False, **processes)

        def log_metrics(metrics: dict, step: int) -> None:
            for key, value in metrics.items():
                writer.add_scalar(key, value, global_step=step)

        text = TensorBoardText(lambda: [writer])
        return Host(log_metrics=log_metrics, log_text=text.log_text, add_layout=text.add_layout, **processes)

    # --- the work ---------------------------------------------------------------------------------------------------
    def _start(self) -> None:
        device = self._device()
        self._engine.begin_fit(self._module, device, self._precision_switch(device), self._host(),
                               estimate_optimizer=self._estimate_optimizer, called_module=self.model,
                               first_step=self.global_step)
        self._engine.start(lambda: [self.optimizer], self.log_dir)
        self._state = BatchState(self._engine.running_buffers())
        self._started = True

    def _forward_backward(self, batch: Any, loss_fn: LossFn) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)  # a retry starts from no gradients
        chunks = self._engine.split_batch(batch)  # [(batch, 1.0)] unless the micro-batch rung is on
        total = None
        for i, (chunk, weight) in enumerate(chunks):
            self._state.in_backward = False
            with self._forward_context():
                loss = loss_fn(self.model, chunk)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"loss_fn returned {type(loss).__name__}"
                                 f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; it must return "
                                 "the batch's loss as a scalar tensor")
            self._engine.boundary("after_forward")
            self._state.in_backward = True
            with self._no_sync(last=i == len(chunks) - 1):  # gradients synchronised once, with the last part
                self._backward(loss * weight if len(chunks) > 1 else loss)
            self._state.partial_gradients = True
            self._engine.boundary("after_backward")
            part = loss.detach() * weight
            total = part if total is None else total + part
            del loss
        return total


def _dist_world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _dist_reduce_max(values: list[int]) -> list[int]:
    """Every rank decides on the worst rank's numbers (the ladder must change the same way everywhere)."""
    backend = torch.distributed.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def _settings(settings: dict[str, Any]) -> GuardSettings:
    names = [f.name for f in dataclasses.fields(GuardSettings)]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; allowed: {names}")
    return GuardSettings(**settings)
