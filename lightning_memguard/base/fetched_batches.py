"""A training step that fetches its own batches: ``training_step(self, dataloader_iter)`` calls
``next(dataloader_iter)`` for ``(batch, batch_idx, dataloader_idx)`` itself, so the loop that runs it never holds the
batch (Lightning's loop hands such a step an iterator instead of a batch). Framework-free.

Such a step can run again after a failed attempt only if it meets the same batches again: the fetches are kept for
the length of the step and handed out once more, in order, to the next attempt (:class:`ReplayedFetches`), so a
rescued batch is the batch that failed and none is skipped. Nothing can split a batch the step has not fetched yet, so
micro-batching is off for such a step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

__all__ = ["ReplayedFetches", "iterator_over"]


def iterator_over(batch: Any) -> Iterator[tuple[Any, int, int]]:
    """What a step that fetches its own batches is handed to run on ``batch`` (the estimate's step): ``(batch, 0,
    0)`` at every ``next``, so a step that fetches two batches a step is run on two like it."""
    return itertools.repeat((batch, 0, 0))


class ReplayedFetches(Iterator):
    """The iterator one batch's attempts fetch from: the first attempt's fetches come from ``source`` and are kept;
    after :meth:`rewind` the next attempt is handed the same items, in the same order, before anything new is
    fetched. Other attributes (Lightning's ``done``, ``fetched``, ``length``) are the source's."""

    def __init__(self, source: Iterator) -> None:
        self.source = source
        self.fetched: list[Any] = []
        self._position = 0

    def rewind(self) -> None:
        """The next ``next`` hands out the first item fetched again."""
        self._position = 0

    def __next__(self) -> Any:
        if self._position < len(self.fetched):
            item = self.fetched[self._position]
        else:
            item = next(self.source)
            self.fetched.append(item)
        self._position += 1
        return item

    def __getattr__(self, name: str) -> Any:
        if name == "source":  # not set yet (a copy being built): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.source, name)
