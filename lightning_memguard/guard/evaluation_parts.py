"""The parts of one evaluation batch, across its attempts: a part that ran is never run again.

An evaluation step may do what no savepoint can undo — append to a list (Lightning's own pattern since
``validation_epoch_end`` went: ``self.validation_step_outputs.append(...)``), add to a counter, write a file, call a
prediction writer. When the batch's second part runs out of memory after its first part ran, running the whole
batch again in more parts would do the first part's again: its rows counted twice. So the parts that ran keep their
outputs, and only what had not run yet runs again, each of its parts split in two (the loop's new number of parts).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..base.batches import batch_size_of

__all__ = ["EvaluationParts"]


class EvaluationParts:
    """One evaluation batch's parts: those that ran (their outputs, samples and shares) and those still to run.

    Args:
        split: ``(batch, k) -> [(part, share)]``: a batch as at most ``k`` parts, each with its share of what the mean
            is over (shares that add up to 1; a loss that adds up has shares of 1 a part).
    """

    def __init__(self, split: Callable[[Any, int], list]) -> None:
        self.split = split
        #: (outputs, samples, share) of each part that ran, in the batch's order
        self.done: list[tuple[Any, int, float]] = []
        #: (part, share, weight) of each part still to run, in order: ``weight`` is its share of the whole batch's
        #: logged values (the weights of all the parts add up to 1)
        self.pending: list[tuple[Any, float, float]] = []

    def start(self, batch: Any, parts: int) -> None:
        """The batch cut into ``parts`` parts, none run yet."""
        self.done, self.pending = [], self._weighed(self.split(batch, parts), 1.0, 1.0)

    def split_pending(self) -> None:
        """Each part not run yet (the one that ran out of memory first) cut in two; the parts that ran stay."""
        self.pending = [piece for part, share, weight in self.pending
                        for piece in self._weighed(self.split(part, 2), share, weight)]

    def run(self, call: Callable[[Any, float], Any], before_part: Optional[Callable[[], None]] = None) -> None:
        """Runs ``call(part, weight)`` on each part still to run, in order, keeping its outputs; ``before_part()``
        before each (it saves what a failed part's logging changes)."""
        while self.pending:
            part, share, weight = self.pending[0]
            if before_part is not None:
                before_part()
            outputs = call(part, weight)
            self.done.append((outputs, batch_size_of(part), share))
            self.pending.pop(0)

    @staticmethod
    def _weighed(pieces: list, share: float, weight: float) -> list[tuple[Any, float, float]]:
        """``pieces`` of a part of ``share`` and ``weight``: their shares of the whole batch (a part's share times its
        piece's: 1 a piece stays 1 where losses add up) and their weights, which add up to the part's."""
        total = sum(piece_share for _, piece_share in pieces) or 1.0
        return [(piece, share * piece_share, weight * piece_share / total) for piece, piece_share in pieces]
