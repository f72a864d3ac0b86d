"""How Lightning calls a step, read from its signature (framework-free): with the batch's index after the batch or
without it, and with a batch or with the iterator of its batches (a step that fetches its own,
:mod:`~lightning_memguard.base.fetched_batches`)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

__all__ = ["ITERATOR_PARAMETER", "fetches_own_batches", "takes_batch_index"]

#: the name of the step's parameter that makes Lightning hand it the iterator
ITERATOR_PARAMETER = "dataloader_iter"


def fetches_own_batches(step: Optional[Callable]) -> bool:
    """Whether ``step`` (a bound ``training_step``, ``validation_step``...) takes the iterator of its batches
    rather than a batch: a parameter named ``dataloader_iter``, as Lightning decides it."""
    if not callable(step):
        return False
    try:
        return ITERATOR_PARAMETER in inspect.signature(step).parameters
    except (TypeError, ValueError):  # no signature to read: a step of the usual kind
        return False


def takes_batch_index(step: Any) -> bool:
    """Whether a step is called with the batch's index after the batch, as Lightning decides it: a parameter named
    ``batch_idx``, ``*args``, or two positional parameters or more (``training_step(self, batch)`` takes none)."""
    try:
        parameters = list(inspect.signature(step).parameters.values())
    except (TypeError, ValueError):  # no signature to read: the usual step, (batch, batch_idx)
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (any(p.name == "batch_idx" or p.kind is p.VAR_POSITIONAL for p in parameters) or len(positional) >= 2)
