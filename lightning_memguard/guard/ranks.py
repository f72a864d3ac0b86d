"""The processes of a run and what they must agree on (framework-free): every rank decides on the worst rank's
numbers, and where the front door hands in a recovery (DistributedDataParallel's,
:class:`~lightning_memguard.adapters.ddp_recovery.DDPRecovery`) the ranks run a batch that ran out of memory on any
of them again, together."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..base.host import Host
from ..base.posts import post, read_post, withdraw
from ..base.snapshot import PHASES

__all__ = ["Ranks", "PeerOutOfMemoryError"]


class Ranks:
    """This process among the run's processes, as the front door's :class:`~lightning_memguard.base.host.Host` says.

    Several processes must change their rungs together (DDP's collectives must match on every rank), so each
    decision is taken on the worst rank's numbers. They run a batch again together only through a ``recovery``
    (:class:`~lightning_memguard.adapters.ddp_recovery.DDPRecovery`: ``begin_attempt()`` before each attempt,
    ``shadow()`` on a rank that ran out of memory, ``peer_failed()`` after a backward, ``agree(numbers)`` for the
    element-wise maximum over the ranks, ``reset()`` on a rank whose peer failed, ``settled`` whether a batch may run
    again); elsewhere an out-of-memory error ends the run with the report.

    Args:
        rank: this process's rank.
        world_size: the number of processes.
        reduce_max: the element-wise maximum over ranks of a list of ints (needed when ``world_size > 1``).
    """

    #: why an out-of-memory error is not retried with several processes (in its report)
    NO_RETRY = ("the run has several processes, which can retry a batch together only under DistributedDataParallel "
                "with no communication hook of its own (every rank must repeat the same forward and backward)")
    #: said once at the start of a fit that would rescue OOMs in one process
    #: (under FSDP2 the other ranks are inside the same all-gathers: they stop when the rank that ran out ends)
    NO_RETRY_WARNING = ("lightning-memguard: with several processes outside DistributedDataParallel an OOM cannot be "
                        "retried; the rank that runs out stops with the memory report, the others with the error of "
                        "their next collective once its process ends, that report added to it. Threshold mitigation "
                        "stays on.")

    def __init__(self, rank: int = 0, world_size: int = 1,
                 reduce_max: Optional[Callable[[list[int]], list[int]]] = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self._reduce_max = reduce_max
        self.recovery: Optional[Any] = None

    @classmethod
    def of(cls, host: Host) -> "Ranks":
        """The ranks of a run that starts: a report an earlier run's rank gave up with is withdrawn (no rank of
        this run can give up before every rank has started: its first step meets the others in a collective)."""
        if host.world_size > 1:
            withdraw(_GAVE_UP_KEY)
        return cls(host.rank, host.world_size, host.reduce_max)

    @property
    def can_retry(self) -> bool:
        """Whether a training batch that failed may run again: in one process, or together (``recovery``)."""
        return self.world_size == 1 or self.recovery is not None

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

    def say_gave_up(self, report: str) -> None:
        """Leaves this rank's report where the other ranks' :meth:`peer_report` finds it: they stop at their next
        collective with its closed connection, which says nothing of why."""
        if self.world_size > 1:
            post(_GAVE_UP_KEY, f"rank {self.rank}: {report}")

    def peer_report(self) -> Optional[str]:
        """The report a rank that gave up left (``"rank N: ..."``), else ``None``."""
        return read_post(_GAVE_UP_KEY) if self.world_size > 1 else None


_GAVE_UP_KEY = "lightning_memguard/gave_up"


class PeerOutOfMemoryError(torch.OutOfMemoryError):
    """Raised on a rank whose own attempt ran, when another rank's ran out of memory: every rank then runs the batch
    again, one rung higher, together."""
