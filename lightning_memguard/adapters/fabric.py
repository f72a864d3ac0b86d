"""FabricMemGuard: the loop guard with a Fabric backend, where Lightning Fabric does what Fabric does — precision (the
AMP rung swaps Fabric's precision plugin), ``fabric.backward``, gradient sync (``no_backward_sync`` between
micro-batches, but for FSDP2), the optimizer step through Fabric's wrapped optimizer, and logging to
``fabric.loggers``."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from lightning.fabric.plugins.precision import MixedPrecision, Precision
from lightning.fabric.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.fabric.utilities import rank_zero_info, rank_zero_warn
from lightning.fabric.wrappers import _FabricModule
from torch import nn

from ..base.checks import MemGuardWarning, install_warning_format
from ..base.host import Host
from ..guard.settings import GuardSettings
from ..mitigations.amp import mixed_precision_name
from .fsdp_recovery import holds_fsdp2
from .loop import MemGuard, check_model_and_optimizer
from .own_collectives import uncounted
from .signature import takes_guard_settings
from .tensorboard import TensorBoardText
from .worker_release import numbers_for_collective

__all__ = ["FabricMemGuard", "FabricBackend"]


class FabricPrecision:
    """The AMP rung's switch for Fabric: swap the strategy's precision plugin. Fabric reads it at every forward of a
    set-up module (autocast), in ``fabric.backward`` (scaling) and in the wrapped optimizer's step (unscaling)."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.device = fabric.device
        self.base_precision = mixed_precision_name(fabric.strategy.precision, MixedPrecision)
        self._previous: Optional[Precision] = None

    def fixed_reason(self) -> Optional[str]:
        strategy = self.fabric.strategy
        if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy)):
            return f"{type(strategy).__name__} fixes precision when it wraps the model"
        if type(strategy.precision) is not Precision:
            return f"Fabric already runs {type(strategy.precision).__name__}"
        return None

    def enable(self, precision: str) -> None:
        self._previous = self.fabric.strategy.precision
        self._set(MixedPrecision(precision, device=self.device.type))

    def disable(self) -> None:
        self._set(self._previous if self._previous is not None else Precision())
        self._previous = None

    def fit_ended(self) -> None:
        """The guard closed (the rung keeps its level): Fabric's own plugin back, so that what the user runs after it
        (an evaluation through the set-up module) runs in the precision they set up, and a guard that steps again
        finds Fabric as it was (it would read the mixed plugin as the user's and leave its AMP rung off)."""
        if self._previous is not None:
            self._set(self._previous)

    def _set(self, plugin: Precision) -> None:
        self.fabric.strategy.precision = plugin
        self.fabric._precision = plugin  # what fabric.autocast() enters


class FabricBackend:
    """How a Fabric loop runs one step's parts (see :class:`~lightning_memguard.adapters.loop.LoopBackend`): Fabric's
    precision plugin, ``fabric.backward``, ``no_backward_sync`` and ``fabric.loggers``.

    Args:
        fabric: the launched Fabric.
        model: the module ``fabric.setup`` returned (or a module Fabric did not set up).
        optimizer: the optimizer ``fabric.setup`` returned.
    """

    name = "Fabric"

    def __init__(self, fabric: Fabric, model: nn.Module, optimizer: Any) -> None:
        self.fabric = fabric
        self.model = self.called_module = model
        self.optimizer = optimizer
        self.module = model.module if isinstance(model, _FabricModule) else model
        # the DistributedDataParallel module Fabric's DDP strategy wrapped (Fabric keeps it as the module it calls)
        self.data_parallel = model._forward_module if isinstance(model, _FabricModule) else model
        self.estimate_optimizer = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper holds the user's
        self._fsdp2: Optional[bool] = None  # whether the module is sharded with FSDP2 (see no_sync)

    @property
    def device(self) -> torch.device:
        return self.fabric.device

    def precision_switch(self) -> FabricPrecision:
        return FabricPrecision(self.fabric)

    def forward_context(self) -> ContextManager:
        return contextlib.nullcontext()  # the set-up module enters the precision plugin's autocast itself

    def backward(self, loss: torch.Tensor) -> None:
        self.fabric.backward(loss, model=self.model if isinstance(self.model, _FabricModule) else None)

    def unscale_gradients(self) -> None:
        # not here: fabric.clip_gradients unscales through the precision plugin, and a second unscale_ raises
        return None

    def optimizer_step(self) -> None:
        self.optimizer.step()  # Fabric's optimizer: the precision plugin unscales and skips inf steps

    def no_sync(self, last: bool) -> ContextManager:
        """Gradients synchronised once, with the last part, as Fabric's ``no_backward_sync`` does under DDP — not
        under FSDP2, where each part reduce-scatters its gradients: held unsharded until the last part they would
        cost a whole model's gradients on every rank, and each part's collectives stay the same, so that a rank may
        run its batch in more parts than the others (see
        :attr:`~lightning_memguard.adapters.fsdp_recovery.FSDPRecovery.splits_alone`)."""
        # the last part syncs as every backward does by default: no context at all (Fabric's FSDP2 context entered
        # with enabled=False turns gradient sync off when it exits, Lightning 2.6)
        if last or not isinstance(self.model, _FabricModule) or self._sharded():
            return contextlib.nullcontext()
        return self.fabric.no_backward_sync(self.model, enabled=True)

    def _sharded(self) -> bool:
        if self._fsdp2 is None:  # asked at the first part: the module is sharded by then
            self._fsdp2 = holds_fsdp2(self.data_parallel)
        return self._fsdp2

    def host(self) -> Host:
        fabric = self.fabric
        for logger in fabric.loggers:
            # each logger's experiment made before the guard writes its files into the first one's directory: a
            # CSVLogger finding them there warned that "previous log files" would be deleted (a dummy off rank zero)
            logger.experiment
        tensorboards = [logger for logger in fabric.loggers if isinstance(logger, TensorBoardLogger)]
        text = TensorBoardText(lambda: [logger.experiment for logger in tensorboards])

        def reduce_max(values: list[int]) -> list[int]:
            tensor = numbers_for_collective(values, fabric.device)
            with uncounted():  # the guard's own collective, not the step's
                return [int(v) for v in fabric.all_reduce(tensor, reduce_op="max").tolist()]

        return Host(log_metrics=lambda metrics, step: fabric.log_dict(metrics, step=step),
                    log_text=text.log_text, add_layout=text.add_layout, warn=_warn,
                    info=rank_zero_info, reduce_max=reduce_max, rank=fabric.global_rank,
                    world_size=fabric.world_size, has_logger=bool(fabric.loggers))

    def flush(self) -> None:
        # written now, not at the writer's next timed flush (TensorBoard) or every 100th step (CSVLogger, which before
        # wrote nothing of a shorter run); left open. Each logger's save() runs on global rank zero only
        for logger in self.fabric.loggers:
            logger.save()


class FabricMemGuard(MemGuard):
    r"""Guards a Lightning Fabric training loop: :class:`~lightning_memguard.MemGuard` with a
    :class:`FabricBackend`, so Fabric's precision, backward, gradient sync and loggers.

    Example::

        fabric = Fabric(accelerator="cuda", loggers=TensorBoardLogger("runs"))
        model, optimizer = fabric.setup(model, optimizer)
        guard = FabricMemGuard(fabric, model, optimizer)
        for batch in fabric.setup_dataloaders(loader):
            loss = guard.step(batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        guard.close()

    The model and optimizer are the ones ``fabric.setup`` returned (the AMP rung acts through the wrapped model's
    forward; a loss computed outside it runs in full precision, as with Fabric's own mixed precision). The run's
    files go to ``log_dir``, else to the first logger's directory.

    Args:
        fabric: the launched Fabric.
        model: the module ``fabric.setup`` returned.
        optimizer: the optimizer ``fabric.setup`` returned.
        log_dir: where the run's files go; ``None``: the first logger's ``log_dir`` (no files without a logger).
        scheduler: an LR scheduler stepped after every optimizer step (optional).
        settings: the guard's settings as one :class:`~lightning_memguard.guard.settings.GuardSettings`, instead
            of by keyword (not both). The settings by keyword (``threshold``, ``budget``, ``mitigations``, ...) are
            the constructor's keyword arguments, typed and documented there, the same for every front door.

    Raises:
        ValueError: on a bad argument or an unknown setting, naming it and what is allowed.
    """

    @takes_guard_settings
    def __init__(self, fabric: Fabric, model: nn.Module, optimizer: Any, *, log_dir: Optional[str] = None,
                 scheduler: Any = None, settings: Optional[GuardSettings] = None, **keywords: Any) -> None:
        if not isinstance(fabric, Fabric):
            raise ValueError(f"fabric={type(fabric).__name__} must be a lightning.fabric.Fabric")
        check_model_and_optimizer(model, optimizer)
        self.fabric = fabric
        if log_dir is None and fabric.loggers:
            log_dir = getattr(fabric.loggers[0], "log_dir", None)
        self._compose(FabricBackend(fabric, model, optimizer), model, optimizer, log_dir, scheduler,
                      GuardSettings.from_keywords(settings, **keywords))


def _warn(message: str) -> None:
    install_warning_format()
    rank_zero_warn(message, category=MemGuardWarning)
