"""Lightning's batch-size search (``BatchSizeFinder``, ``Tuner.scale_batch_size``) under the guard's budget.

The finder runs its trials inside its own ``on_fit_start`` with every other callback taken off the Trainer, so the
guard sees none of them. The guard's ``setup`` therefore wraps the finder's ``scale_batch_size`` on the instance
(undone at ``teardown``), and during the search the budget is the device's limit: on CUDA the process's memory
fraction is the budget's share of the device; on CPU each trial batch's forward and backward are counted against it
(live tensor storage: the training state, the batch and what the step creates), as the guard counts a training step.
A trial that passes the budget fails with an out-of-memory error worded as the device's own, which the finder
recognises (Lightning's ``is_oom_error`` reads the message), so it settles on a batch that fits the budget without
the ladder. Under manual optimization the CPU trials run uncounted (there is no closure to count in).

The learning-rate search (``LearningRateFinder``, ``Tuner.lr_find``) runs its trial steps the same way, with every
other callback off the Trainer, from the finder's ``on_fit_start`` or, in a subclass, from a later hook in the middle
of a fit, and ends by restoring the checkpoint it saved at its start. Its ``lr_find`` is wrapped too, so that the
guard knows a search is running: the checkpoint's restore hands the guard its own state back (its levels, as they
were), which is not a resumed run; and the trials' memory is not the next training step's. The trials run through
the guard's closures at its levels (split where the micro-batch rung is on, an out-of-memory error rescued),
unmeasured; a search before the fit runs before the guard's ``on_fit_start`` (Lightning calls the tuner's callbacks
first), so the guard begins the fit at the search's start (``MemGuardCallback._begin_search``)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from ..base.batches import batch_tensors
from ..guard.settings import GuardSettings
from ..sources.cpu import CpuTensorAccountant
from ..sources.training_state import training_state_tensors

__all__ = ["BudgetedSearch", "LearningRateSearch", "budget_searches", "learning_rate_searches", "undo_searches"]


class _FinderSearch:
    """A finder callback's search method (``method``), replaced by this object as an instance attribute: deleting it
    puts the class's method back. ``search`` is the finder's own method."""

    method = ""

    def __init__(self, finder: Any) -> None:
        self.finder = finder
        self.search = getattr(finder, self.method)
        setattr(finder, self.method, self)

    def undo(self) -> None:
        if vars(self.finder).get(self.method) is self:
            delattr(self.finder, self.method)

    @classmethod
    def finders(cls, trainer: Any, finder_class: type) -> list:
        """The Trainer's ``finder_class`` callbacks whose search is not wrapped so yet."""
        return [callback for callback in trainer.callbacks
                if isinstance(callback, finder_class) and not isinstance(vars(callback).get(cls.method), cls)]


class BudgetedSearch(_FinderSearch):
    """The finder's ``scale_batch_size``, run under the budget (see the module docstring)."""

    method = "scale_batch_size"

    def __init__(self, finder: Any, limit_bytes: int) -> None:
        super().__init__(finder)
        self.limit_bytes = limit_bytes

    def __call__(self, trainer: Any, pl_module: Any) -> Any:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            under = _cuda_fraction(device, self.limit_bytes)
        elif device.type == "cpu":
            under = _counted_closures(trainer, pl_module, self.limit_bytes)
        else:
            under = contextlib.nullcontext()
        with _unguarded_closures(trainer), under:
            return self.search(trainer, pl_module)


@contextlib.contextmanager
def _unguarded_closures(trainer: Any) -> Iterator[None]:
    """The trials' closures as Lightning makes them: where a learning-rate search before this one began the fit, the
    guard's closure wrapper is on the loop, and a trial's out-of-memory error would be rescued in parts instead of
    reaching the finder, which would then take a batch that fits only with the ladder."""
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    guarded = vars(loop).pop("_make_closure", None)
    try:
        yield
    finally:
        if guarded is not None:
            object.__setattr__(loop, "_make_closure", guarded)


@contextlib.contextmanager
def _cuda_fraction(device: torch.device, limit_bytes: int) -> Iterator[None]:
    total = torch.cuda.get_device_properties(device).total_memory
    before = torch.cuda.get_per_process_memory_fraction(device)
    torch.cuda.set_per_process_memory_fraction(min(before, limit_bytes / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


@contextlib.contextmanager
def _counted_closures(trainer: Any, pl_module: Any, limit_bytes: int) -> Iterator[None]:
    """Each trial batch's closure (its forward and backward) runs counted, with ``limit_bytes`` as the limit."""
    accountant = CpuTensorAccountant(limit_bytes=limit_bytes)
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    make_closure = loop._make_closure

    def counted_closure(kwargs, optimizer, batch_idx):
        closure = make_closure(kwargs, optimizer, batch_idx)
        inner = closure.closure

        def counted(*args, **kw):
            accountant.track(training_state_tensors(pl_module, trainer.optimizers))
            accountant.track(batch_tensors(kwargs.get("batch")))
            accountant.start()
            try:
                return inner(*args, **kw)
            finally:
                accountant.stop()

        closure.closure = counted
        return closure

    loop._make_closure = counted_closure
    try:
        yield
    finally:
        if vars(loop).get("_make_closure") is counted_closure:
            del loop._make_closure


class LearningRateSearch(_FinderSearch):
    """The finder's ``lr_find``, with ``begin()`` before and ``end()`` after it (see the module docstring)."""

    method = "lr_find"

    def __init__(self, finder: Any, begin: Callable[[Any, Any], None], end: Callable[[], None]) -> None:
        super().__init__(finder)
        self.begin, self.end = begin, end

    def __call__(self, trainer: Any, pl_module: Any) -> Any:
        self.begin(trainer, pl_module)
        try:
            return self.search(trainer, pl_module)
        finally:
            self.end()


def learning_rate_searches(trainer: Any, finder_class: type, begin: Callable[[Any, Any], None],
                           end: Callable[[], None]) -> list[LearningRateSearch]:
    """Wraps every ``finder_class`` callback of the Trainer (Lightning's ``LearningRateFinder``)."""
    return [LearningRateSearch(callback, begin, end) for callback in LearningRateSearch.finders(trainer, finder_class)]


def budget_searches(trainer: Any, settings: GuardSettings, finder_class: type) -> list[BudgetedSearch]:
    """Wraps every ``finder_class`` callback of the Trainer when the settings name a budget or a CPU hard limit (the
    hard limit where both are given: it is what the fit enforces on CPU)."""
    limit = settings.cpu_hard_limit_bytes or settings.budget_bytes
    if limit is None:
        return []
    return [BudgetedSearch(callback, limit) for callback in BudgetedSearch.finders(trainer, finder_class)]


def undo_searches(searches: list) -> None:
    """Puts back the finders' own methods (:class:`BudgetedSearch`, :class:`LearningRateSearch`)."""
    for search in searches:
        search.undo()
