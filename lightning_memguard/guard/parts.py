"""BatchParts: the one owner of how many parts a batch runs in (framework-free).

A training batch runs as the micro-batch rung's level says (a lasting count, the ladder's to change), or for one batch
as more: a batch predicted, or found by an out-of-memory error, too large to run whole
(:mod:`~lightning_memguard.guard.long_batch`); a batch at least as large as one that needed more parts starts in
those. An evaluation loop's batches run in the parts that loop needed so far (kept per loop, apart from training: an
evaluation batch is often larger, and what one needs says nothing about the other). Everything that asks or changes a
count asks this object.
"""

from __future__ import annotations

from typing import Any, Optional

from ..base.snapshot import EVALUATION_PHASES

__all__ = ["BatchParts"]


class BatchParts:
    """How many parts each batch runs in. ``rung``: the micro-batch rung of the fit in progress (``None``: training
    batches always run whole)."""

    def __init__(self) -> None:
        #: per evaluation loop, the parts its batches run in (a loop not named runs them whole)
        self.evaluation: dict[str, int] = {}
        self.begin(None)

    def begin(self, rung: Any) -> None:
        """A fit starts with ``rung``: no one-off split, nothing learned."""
        self.rung = rung
        self._one_off = 1
        #: ``(elements, parts)``: a batch of that many elements ran out of memory in fewer parts and ran in these
        self._learned: list[tuple[int, int]] = []

    # --- training ---------------------------------------------------------------------------------------------------
    def training(self) -> int:
        """The micro-batches the training batch in progress runs as: the rung's count, or more for this batch."""
        return max(self.rung.micro_batches, self._one_off) if self.rung is not None else 1

    def split_once(self, parts: int) -> None:
        """Runs the batch in progress as at least ``parts`` micro-batches without changing a level; 1 puts the rung's
        own count back (the next batch). A rescue that raises the rung meanwhile runs the larger of the two."""
        self._one_off = max(1, int(parts)) if self.rung is not None else 1

    def split(self, batch: Any) -> list[tuple[Any, float]]:
        """The parts ``batch`` runs as now, each with its loss factor; ``[(batch, 1.0)]`` while it runs whole."""
        parts = self.training()
        return self.rung.split(batch, parts) if parts > 1 else [(batch, 1.0)]

    def learn(self, elements: int, parts: int) -> None:
        """A batch of ``elements`` ran out of memory in fewer parts and ran in ``parts``: as large a batch starts so."""
        self._learned.append((elements, parts))

    def learned_for(self, elements: int, samples: Optional[int]) -> int:
        """The parts a batch of ``elements`` starts in at least (at most one sample a part)."""
        if not samples or not self._learned:  # nothing learned: most fits
            return 1
        needed = max((parts for size, parts in self._learned if elements >= size), default=1)
        return min(needed, samples)

    # --- evaluation -------------------------------------------------------------------------------------------------
    def for_evaluation(self, phase: str, samples: Optional[int]) -> int:
        """The parts a batch of the loop ``phase`` with ``samples`` runs in now (at most one sample a part)."""
        return min(self.evaluation.get(phase, 1), samples) if samples else 1

    def state_dict(self) -> dict[str, Any]:
        """The evaluation loops' parts, for a checkpoint (training's count is the rung's level, saved by the
        ladder)."""
        return {"parts": dict(self.evaluation)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Puts back :meth:`state_dict` (an older checkpoint without it: every loop runs whole).

        Raises:
            ValueError: a number of parts that is not a positive int.
        """
        parts = dict((state or {}).get("parts") or {})
        for phase, count in parts.items():
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ValueError(f"the checkpoint's evaluation parts {phase}={count!r} must be a positive int")
        self.evaluation = {phase: count for phase, count in parts.items() if phase in EVALUATION_PHASES}
