"""The processes of a run and what they must agree on (framework-free): every rank decides on the worst rank's
numbers, and a failed batch is run again only in a run of one process."""

from __future__ import annotations

from typing import Callable, Optional

from ..base.host import Host
from ..base.snapshot import PHASES

__all__ = ["Ranks"]


class Ranks:
    """This process among the run's processes, as the front door's :class:`~lightning_memguard.base.host.Host` says.

    Several processes must change their rungs together (DDP's collectives must match on every rank), so each
    decision is taken on the worst rank's numbers. They cannot run a batch again together: every rank would have to
    repeat the same forward and backward, with a collective after each. An out-of-memory error there ends the run
    with the report of the rank that ran out.

    Args:
        rank: this process's rank.
        world_size: the number of processes.
        reduce_max: the element-wise maximum over ranks of a list of ints (needed when ``world_size > 1``).
    """

    #: why an out-of-memory error is not retried with several processes (in its report)
    NO_RETRY = ("the run has several processes, which cannot retry a batch together (every rank would have to "
                "repeat the same forward and backward)")
    #: said once at the start of a fit that would rescue OOMs in one process
    NO_RETRY_WARNING = ("lightning-memguard: with several processes an OOM cannot be retried; it fails the run with "
                        "the memory report of the rank that ran out. Threshold mitigation stays on.")

    def __init__(self, rank: int = 0, world_size: int = 1,
                 reduce_max: Optional[Callable[[list[int]], list[int]]] = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self._reduce_max = reduce_max

    @classmethod
    def of(cls, host: Host) -> "Ranks":
        return cls(host.rank, host.world_size, host.reduce_max)

    @property
    def can_retry(self) -> bool:
        """Whether a batch that failed may run again: only in one process."""
        return self.world_size == 1

    @property
    def reduce_max(self) -> Optional[Callable[[list[int]], list[int]]]:
        """The element-wise maximum over ranks when the run has several processes, else ``None`` (nothing to
        agree on)."""
        return self._reduce_max if self.world_size > 1 else None

    def worst_step(self, peaks: dict[str, int], *values: Optional[int]) -> tuple:
        """A step's peaks per phase and its other numbers (``None``: not measured), each the maximum over ranks, in
        one collective; unchanged in one process."""
        reduce_max = self.reduce_max
        if reduce_max is None:
            return (peaks, *values)
        phases = [p for p in PHASES if p in peaks]
        reduced = [int(v) for v in reduce_max([peaks[p] for p in phases] + [-1 if v is None else v for v in values])]
        others = [None if v < 0 else v for v in reduced[len(phases):]]  # -1 stands for "no value"
        return (dict(zip(phases, reduced[:len(phases)])), *others)
