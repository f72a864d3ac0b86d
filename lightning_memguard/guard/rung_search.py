"""Which of several rungs changed together broke the step. A plan or a rescue may change two or three rungs at once
(AMP, checkpointing and micro-batches, chosen together to fit); when the next attempt fails with an error that is not
an out-of-memory error, one of them most likely broke it. Turning all of them off for the run would also drop those
that work — and with them the memory the plan needed. Instead each is put back where it last ran in turn (the rung
changed last first), not turned off for the run, and the batch runs again:

- the attempt runs: the rung put back is the one that broke the step; it stays back, off for the run, and the others
  keep their new levels;
- the attempt fails the same way: that rung did not break it and goes up again; the next is tried;
- one suspect left: it is the culprit without a trial.

At most one attempt a rung changed. An out-of-memory error during the search ends it as a single break ends:
every rung changed together back where it last ran, off for the run. Framework-free; the ladder
(:mod:`~lightning_memguard.guard.ladder`) owns the levels and carries out what this says."""

from __future__ import annotations

from typing import Optional

__all__ = ["BrokenRungSearch"]


class BrokenRungSearch:
    """The search over ``changed`` (rung -> (the level it last ran at, its new level), in the order they changed)."""

    def __init__(self, changed: dict[str, tuple[int, int]]) -> None:
        self.changed = dict(changed)
        self._untested = list(reversed(self.changed))  # the rung changed last is the first suspect
        self.cleared: list[str] = []
        #: the rung put back for the attempt in progress (``None``: none yet)
        self.testing: Optional[str] = None

    def next_suspect(self) -> Optional[str]:
        """After a failed attempt: clears the rung that was put back for it (it did not break the step) and returns
        the next rung to put back, or ``None`` where one suspect is left (:attr:`culprit`)."""
        if self.testing is not None:
            self.cleared.append(self.testing)
            self.testing = None
        if len(self._untested) <= 1:
            return None
        self.testing = self._untested.pop(0)
        return self.testing

    @property
    def culprit(self) -> Optional[str]:
        """The one rung left when every other was cleared (``None`` while more are left)."""
        return self._untested[0] if self.testing is None and len(self._untested) == 1 else None

    def names(self) -> str:
        return ", ".join(f"{name} {old}->{new}" for name, (old, new) in self.changed.items())
