"""Facts read from, and things done through, a Lightning Trainer — in whichever namespace it was imported from.

``lightning.pytorch`` and the standalone ``pytorch_lightning`` package hold the same code as *different* classes: a
``pytorch_lightning`` Trainer's precision plugin is not an instance of ``lightning.pytorch``'s ``Precision``. So
every class the adapter checks against or builds is taken from the trainer's own namespace.
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from ..base.checks import MemGuardWarning, install_warning_format
from ..mitigations.amp import mixed_precision_name
from .own_collectives import uncounted
from .worker_release import numbers_for_collective


@functools.cache
def lightning_namespace(name: str = "lightning.pytorch") -> SimpleNamespace:
    """The Lightning classes and functions the adapter uses, from package ``name``."""
    def load(module: str, *attrs: str) -> list[Any]:
        loaded = importlib.import_module(f"{name}.{module}")
        return [getattr(loaded, attr) for attr in attrs]

    precision, mixed = load("plugins.precision", "Precision", "MixedPrecision")
    sharded = tuple(load("strategies", "DeepSpeedStrategy", "FSDPStrategy", "ModelParallelStrategy"))
    (tensorboard,) = load("loggers", "TensorBoardLogger")
    warn, info = load("utilities", "rank_zero_warn", "rank_zero_info")
    (closure_result,) = load("loops.optimization.automatic", "ClosureResult")
    (block_sync,) = load("loops.utilities", "_block_parallel_sync_behavior")
    batch_size_finder, learning_rate_finder = load("callbacks", "BatchSizeFinder", "LearningRateFinder")
    return SimpleNamespace(name=name, Precision=precision, MixedPrecision=mixed, sharded_strategies=sharded,
                           TensorBoardLogger=tensorboard, rank_zero_warn=warn, rank_zero_info=info,
                           ClosureResult=closure_result, block_parallel_sync_behavior=block_sync,
                           BatchSizeFinder=batch_size_finder, LearningRateFinder=learning_rate_finder)


def namespace_of(trainer: Any) -> SimpleNamespace:
    """The namespace ``trainer`` comes from (``pytorch_lightning`` or ``lightning.pytorch``)."""
    return lightning_namespace(_namespace_name(trainer))


def _namespace_name(trainer: Any) -> str:
    root = type(trainer).__module__.split(".")[0]
    return "pytorch_lightning" if root == "pytorch_lightning" else "lightning.pytorch"


def memguard_warn(message: str, trainer: Any) -> None:
    """One warning on rank zero, printed as the sentence alone (a ``MemGuardWarning``)."""
    _warn_in(_namespace_name(trainer), message)


def warner_of(trainer: Any) -> Callable[[str], None]:
    """:func:`memguard_warn` for ``trainer``, holding its namespace's name only: the guard keeps its way of warning
    after a fit, and a closure over the Trainer kept the Trainer alive and made the callback unpicklable — a callback
    fitted once, then handed to a Trainer that spawns its ranks (``ddp_spawn``), failed to start them."""
    return functools.partial(_warn_in, _namespace_name(trainer))


def _warn_in(namespace: str, message: str) -> None:
    install_warning_format()
    lightning_namespace(namespace).rank_zero_warn(message, category=MemGuardWarning)


def callbacks_held_tensors(trainer: Any, guard: Any) -> list:
    """The tensors the Trainer's other callbacks hold in their attributes: a model's parameters and buffers (the
    averaged copy WeightAveraging and StochasticWeightAveraging make in their ``setup``, before the guard counts),
    a tensor, or tensors in a list, tuple or dict. The module's own are among them where a callback keeps the
    module: an accountant counts each storage once."""
    found: list = []
    for callback in trainer.callbacks:
        if callback is guard:
            continue
        for value in vars(callback).values():
            for item in value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                    else (value,):
                if isinstance(item, torch.nn.Module):
                    found.extend(item.parameters())
                    found.extend(item.buffers())
                elif isinstance(item, torch.Tensor):
                    found.append(item)
    return found


def optimizer_step_index(trainer: Any) -> int:
    """The step on the axis of the module's own ``self.log`` metrics. Lightning logs at this counter and increments
    it only after ``on_train_batch_end``, so all four boundaries of a step share it (``global_step`` is already +1
    inside ``on_train_batch_end``)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def run_dir(trainer: Any) -> str:
    """Where a run's files go: the first logger's directory, else the Trainer's root directory."""
    return trainer.log_dir or trainer.default_root_dir


#: on a precision plugin the AMP rung installed: the plugin it replaced (the Trainer's own)
REPLACED = "_memguard_replaced"


class LightningPrecision:
    """The AMP rung's switch for a Trainer: swap the strategy's precision plugin.

    Lightning reads ``trainer.strategy.precision_plugin`` at every training step (autocast context, backward scaling,
    optimizer step), so a new plugin takes effect on the next batch. The switch is not saved in Lightning's
    checkpoint: the callback keeps it in its own state and re-applies it on resume, before Lightning restores the
    scaler state. A plugin the rung installed carries the one it replaced: a later fit on the same Trainer starts
    from the Trainer's own precision (the ladder then puts the rung back at its level), not from MemGuard's."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.ns = namespace_of(trainer)
        self.device = trainer.strategy.root_device
        strategy = trainer.strategy
        replaced = getattr(strategy.precision_plugin, REPLACED, None)
        if replaced is not None:  # left on by an earlier fit's AMP rung
            strategy.precision_plugin = replaced
        self.base_precision = mixed_precision_name(strategy.precision_plugin, self.ns.MixedPrecision)

    def fixed_reason(self) -> Optional[str]:
        strategy = self.trainer.strategy
        if isinstance(strategy, self.ns.sharded_strategies):
            return f"{type(strategy).__name__} fixes precision when it wraps the model"
        if type(strategy.precision_plugin) is not self.ns.Precision:  # mixed, half, double or custom: leave it
            return f"the trainer already runs precision={self.trainer.precision!r}"
        return None

    def enable(self, precision: str) -> None:
        strategy = self.trainer.strategy
        current = strategy.precision_plugin
        plugin = self.ns.MixedPrecision(precision, device=self.device.type)
        setattr(plugin, REPLACED, getattr(current, REPLACED, current))
        strategy.precision_plugin = plugin

    def disable(self) -> None:
        strategy = self.trainer.strategy
        replaced = getattr(strategy.precision_plugin, REPLACED, None)
        strategy.precision_plugin = replaced if replaced is not None else self.ns.Precision()

    def fit_ended(self) -> None:
        """The Trainer's own plugin back after the fit (the rung keeps its level): ``trainer.validate``, ``test``
        and ``predict`` after ``fit`` ran in the fit's mixed precision, bf16 predictions from an fp32 Trainer."""
        strategy = self.trainer.strategy
        replaced = getattr(strategy.precision_plugin, REPLACED, None)
        if replaced is not None:
            strategy.precision_plugin = replaced


def reduce_max(trainer: Any, values: list[int]) -> list[int]:
    """The element-wise maximum over ranks, in one collective (the guard's own: not counted as the step's)."""
    tensor = numbers_for_collective(values, trainer.strategy.root_device)
    with uncounted():
        return [int(v) for v in trainer.strategy.reduce(tensor, reduce_op="max").tolist()]
