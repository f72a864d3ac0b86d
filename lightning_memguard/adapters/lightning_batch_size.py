"""LargestBatchSize: Lightning's ``BatchSizeFinder`` by estimate instead of trial fits, so it also works under DDP and
FSDP2 (``ModelParallelStrategy``), where the finder refuses to run.

At fit start it takes the first batch of the train dataloader, asks :func:`~lightning_memguard.largest_batch` for the
largest per-rank batch under the budget (with the Trainer's precision, strategy and ranks), and sets it where the
finder does — ``model.batch_size``, ``model.hparams``, ``datamodule.batch_size`` or its ``hparams``, through
Lightning's own ``lightning_setattr`` — then rebuilds the dataloaders. The estimate runs from the unsharded structure
of a model ``configure_model`` already sharded, and every rank takes the smallest size any rank found (each rank
estimates from its own first batch, whose shapes may differ), so the ranks train on equal batches."""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback

from ..base.checks import check_int, check_number, check_size
from ..base.snapshot import format_bytes
from ._lightning_trainer import memguard_warn, namespace_of, reduce_max
from .lightning_callback import MemGuardCallback

__all__ = ["LargestBatchSize"]

#: the Trainer precisions the estimate models
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


class LargestBatchSize(Callback):
    """Sets the batch size to the largest per-rank batch the estimate says fits, before the fit's first batch.

    The size goes where Lightning's ``BatchSizeFinder`` puts it: ``batch_arg_name`` on the model, in
    ``model.hparams``, on the datamodule or in its ``hparams`` (every one that has it); the train and validation
    dataloaders are then rebuilt, so the dataloader methods must read it. The search trains nothing and takes no
    trial out-of-memory error: a few estimates of one training step on the meta device
    (:func:`~lightning_memguard.largest_batch`), at the Trainer's precision (``32-true``, ``bf16-mixed`` or
    ``16-mixed``), as one rank of its strategy: one device, DDP (``ddp``, ``ddp_spawn``, ...) or
    ``ModelParallelStrategy`` with FSDP2 over the data-parallel ranks (no tensor parallelism). The size is per rank,
    what each rank's ``DataLoader(batch_size=...)`` takes, capped at the samples one rank sees in an epoch. (Under
    ``ddp_spawn`` the ranks are other processes: the size is set on their copies of the model and the datamodule.)

    With a :class:`~lightning_memguard.MemGuardCallback` on the same Trainer the size is chosen under the guard's
    budget and threshold (where none is given here), so the guard starts with nothing to do. On CPU the batch
    Lightning's fetcher holds ahead is memory of the step too: the size leaves room for it. An estimate that fails (a
    step it cannot run, a budget not even one sample fits) leaves the batch size as it was, with one warning: the
    guard still guards.

    Args:
        budget: the memory of one device, in bytes or as a size string (``"40GiB"``); ``None``: the
            ``MemGuardCallback``'s budget, else the device's memory (CUDA: its total times the process's memory
            fraction). On CPU there is no device memory to take: give a budget here or to the guard.
        batch_arg_name: the attribute that holds the batch size, as ``BatchSizeFinder`` takes it.
        threshold: the share of the budget a step may reach; ``None``: the guard's threshold, else 0.9.
        max_size: the largest size looked at; ``None``: no cap but the samples one rank sees in an epoch.

    Attributes:
        batch_size: the size set at the latest fit start (``None`` before, or when the estimate failed).

    Raises:
        ValueError: at construction, a bad argument (naming it); at setup, a Trainer it cannot serve: no attribute
            ``batch_arg_name`` where Lightning looks, dataloaders passed to ``fit`` directly (they cannot be
            rebuilt), another strategy or precision, no budget on CPU.

    Example::

        model.batch_size = 32  # the train_dataloader reads self.batch_size
        trainer = Trainer(strategy="ddp", devices=8, callbacks=[LargestBatchSize(), MemGuardCallback()])
        trainer.fit(model)  # model.batch_size is the largest per-rank batch that fits
    """

    def __init__(self, budget: Optional[int | str] = None, batch_arg_name: str = "batch_size",
                 threshold: Optional[float] = None, max_size: Optional[int] = None) -> None:
        self.budget_bytes = check_size("budget", budget, none_means="the MemGuardCallback's budget, else the "
                                                                    "device's memory")
        if not isinstance(batch_arg_name, str) or not batch_arg_name.isidentifier():
            raise ValueError(f"batch_arg_name={batch_arg_name!r} must be an attribute name, like 'batch_size'")
        self.batch_arg_name = batch_arg_name
        self.threshold = None if threshold is None else check_number("threshold", threshold, 0, 1, low_open=True)
        self.max_size = check_int("max_size", max_size, none_means="the samples one rank sees in an epoch")
        self.batch_size: Optional[int] = None
        self._run: Optional[dict[str, Any]] = None  # what setup found out for on_fit_start

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        _check_holder(trainer, pl_module, self.batch_arg_name)
        if not trainer.fit_loop._data_source.is_module():
            raise ValueError("LargestBatchSize cannot change dataloaders passed to trainer.fit() directly: return "
                             "them from the LightningModule's or a LightningDataModule's train_dataloader, built "
                             f"with its {self.batch_arg_name}")
        precision = str(trainer.precision)
        if precision not in PRECISIONS:
            raise ValueError(f"LargestBatchSize: the Trainer's precision={precision!r} is not one the estimate "
                             f"models; allowed: {PRECISIONS}")
        device = trainer.strategy.root_device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"LargestBatchSize estimates CUDA and CPU steps; this Trainer runs on {device}")
        strategy, world_size = _data_parallel(trainer)
        guard = next((c for c in trainer.callbacks if isinstance(c, MemGuardCallback)), None)
        guarded = guard.settings.budget_bytes or guard.settings.cpu_hard_limit_bytes if guard is not None else None
        budget = self.budget_bytes or guarded or _device_memory(device)
        if budget is None:
            raise ValueError("LargestBatchSize on CPU needs a budget: LargestBatchSize(budget='8GiB') or "
                             "MemGuardCallback(budget='8GiB') on the same Trainer")
        threshold = self.threshold or (guard.settings.threshold if guard is not None else 0.9)
        self._run = dict(budget=budget, precision=precision, target=device.type, strategy=strategy,
                         world_size=world_size, threshold=threshold)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self._run is None:  # setup did not run for this fit
            return
        run, self._run = self._run, None
        size, self.batch_size = None, None
        current = _lightning_parsing(trainer).lightning_getattr(pl_module, self.batch_arg_name)
        kept = f"LargestBatchSize kept {self.batch_arg_name}={current}"
        try:
            size = self._estimate(trainer, pl_module, run)
        except Exception as error:  # noqa: BLE001 - an estimate that cannot answer must not end the fit
            memguard_warn(f"{kept}: {error}", trainer)
        # every rank the same size: the smallest any rank found (a rank that found none makes every rank keep its)
        failed, negative = reduce_max(trainer, [int(size is None), -(size or 0)])
        if failed and size is not None:  # said on rank zero, which warns
            memguard_warn(f"{kept}: another rank's estimate could not answer", trainer)
        if not failed:
            self.batch_size = -negative
            _lightning_parsing(trainer).lightning_setattr(pl_module, self.batch_arg_name, self.batch_size)
        _reset_dataloaders(trainer)  # at the new size, or the one it had (the example batch was taken from a loader)
        if failed:
            return
        namespace_of(trainer).rank_zero_info(
            f"LargestBatchSize: {self.batch_arg_name}={self.batch_size} a rank ({run['strategy'] or 'one device'}, "
            f"{run['precision']}, {run['threshold']:g} of {format_bytes(run['budget'])})")

    def _estimate(self, trainer, pl_module, run: dict[str, Any]) -> int:
        from ..estimate.batch_size import largest_batch  # the estimator loads on first use

        batch, samples = _first_batch(trainer, pl_module)
        caps = [cap for cap in (self.max_size, samples) if cap]
        # on CPU the batch Lightning's fetcher holds ahead is memory of the step too (on CUDA it waits on the host)
        return largest_batch(pl_module, batch, budget=run["budget"], precision=run["precision"], target=run["target"],
                             strategy=run["strategy"], world_size=run["world_size"], threshold=run["threshold"],
                             batches_ahead=int(run["target"] == "cpu"), **({"max_size": min(caps)} if caps else {}))


def _lightning_parsing(trainer) -> Any:
    return importlib.import_module(f"{namespace_of(trainer).name}.utilities.parsing")


def _check_holder(trainer, pl_module, name: str) -> None:
    if not _lightning_parsing(trainer).lightning_hasattr(pl_module, name):
        raise ValueError(f"LargestBatchSize found no {name!r} to set: it looks where BatchSizeFinder does, in "
                         f"model.{name}, model.hparams.{name}, datamodule.{name} and datamodule.hparams.{name}; give "
                         "the model or the datamodule that attribute and build the train_dataloader with it (or name "
                         "another with batch_arg_name=)")


def _data_parallel(trainer) -> tuple[Optional[str], Optional[int]]:
    """The estimate's ``(strategy, world_size)`` for the Trainer's strategy; a ValueError for one it does not model."""
    name = namespace_of(trainer).name
    strategies = importlib.import_module(f"{name}.strategies")
    strategy = trainer.strategy
    if isinstance(strategy, strategies.DDPStrategy):
        return "ddp", trainer.world_size
    if isinstance(strategy, strategies.ModelParallelStrategy):
        mesh = strategy.device_mesh
        if mesh["tensor_parallel"].size() > 1:
            raise ValueError(f"LargestBatchSize models FSDP2 over the data-parallel ranks, not tensor parallelism: "
                             f"this ModelParallelStrategy has tensor_parallel_size={mesh['tensor_parallel'].size()}; "
                             "give ModelParallelStrategy(data_parallel_size=<ranks>, tensor_parallel_size=1)")
        return "fsdp", mesh["data_parallel"].size()
    if isinstance(strategy, strategies.SingleDeviceStrategy):
        return None, None
    raise ValueError(f"LargestBatchSize estimates one device, DDP and ModelParallelStrategy (FSDP2); not "
                     f"{type(strategy).__name__} (for FSDP use ModelParallelStrategy with fully_shard)")


def _device_memory(device: torch.device) -> Optional[int]:
    """What a CUDA process may allocate: the device's total times its memory fraction; ``None`` on CPU."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * torch.cuda.get_per_process_memory_fraction(device))


def _first_batch(trainer, pl_module) -> tuple[Any, Optional[int]]:
    """The train dataloader's first batch as the training step receives it, kept on CPU (a size search repeats its
    samples many times over), and the samples one rank sees in an epoch (``None`` when unknown)."""
    loop = trainer.fit_loop
    loop.setup_data()
    combined = loop._combined_loader
    if combined is None:
        raise ValueError("the Trainer has no train dataloader to take an example batch from")
    try:
        batch, _, _ = next(iter(combined))
    except StopIteration:
        raise ValueError("the train dataloader is empty: there is no example batch") from None
    finally:
        combined.reset()
    batch = pl_module._on_before_batch_transfer(batch, dataloader_idx=0)
    batch = pl_module._apply_batch_transfer_handler(batch, device=torch.device("cpu"), dataloader_idx=0)
    samples = []
    for loader in combined.flattened:
        try:
            samples.append(len(loader.sampler))
        except (AttributeError, TypeError):  # an iterable dataset: no length
            return batch, None
    return batch, max(samples)


def _reset_dataloaders(trainer) -> None:
    """The train and validation dataloaders built again at the new size, as BatchSizeFinder rebuilds them."""
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.setup_data()
    loop.epoch_loop.val_loop._combined_loader = None
    loop.epoch_loop.val_loop.setup_data()
