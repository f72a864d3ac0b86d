"""The processes of a run and what they must agree on (framework-free): every rank decides on the worst rank's
numbers, and where the front door hands in a recovery (DistributedDataParallel's,
:class:`~lightning_memguard.adapters.ddp_recovery.DDPRecovery`, or FSDP2's,
:class:`~lightning_memguard.adapters.fsdp_recovery.FSDPRecovery`) the ranks run a batch that ran out of memory on any
of them again, together."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..base.host import Host
from ..base.posts import post, read_post, withdraw
from ..base.snapshot import PHASES

__all__ = ["Ranks", "PeerOutOfMemoryError", "PeerRungError"]


class Ranks:
    """This process among the run's processes, as the front door's :class:`~lightning_memguard.base.host.Host` says.

    Several processes must change their rungs together (DDP's collectives must match on every rank), so each
    decision is taken on the worst rank's numbers. They run a batch again together only through a ``recovery``
    (:class:`~lightning_memguard.adapters.ddp_recovery.DDPRecovery`: ``begin_attempt()`` before each attempt,
    ``shadow()`` on a rank that ran out of memory, ``peer_failed()`` after a backward, ``agree(numbers)`` for the
    element-wise maximum over the ranks, ``reset()`` on a rank whose peer failed, ``settled`` whether a batch may run
    again, where it carries news between steps ``say(news)`` and ``heard``: see :meth:`step_numbers`, and where a rank
    may run more parts than the others ``say_more(more)``, ``more`` and ``shadow_part()``: see :meth:`part_ran`);
    elsewhere an out-of-memory error ends the run with the report.

    Args:
        rank: this process's rank.
        world_size: the number of processes.
        reduce_max: the element-wise maximum over ranks of a list of ints (needed when ``world_size > 1``).
    """

    #: why an out-of-memory error is not retried with several processes (in its report)
    NO_RETRY = ("the run has several processes, which can retry a batch together only under DistributedDataParallel "
                "with no communication hook of its own or FSDP2 with its own collectives (every rank must repeat the "
                "same forward and backward)")
    #: why an evaluation batch that ran out of memory is not split with several processes (in its report). Not
    #: :data:`NO_RETRY`: that names DistributedDataParallel as able to retry. Where the front door handed in an
    #: :attr:`evaluation`, that says why not instead (adapters/ddp_evaluation.py)
    NO_EVALUATION_SPLIT = (
        "the run has several processes, and an evaluation batch is split on one rank alone only on a module under "
        "DistributedDataParallel or not sharded at all: elsewhere its parts would issue collectives the other ranks "
        "do not (under FSDP2 each part gathers the parameters again). Give the evaluation loop smaller batches (its "
        "DataLoader's batch_size)")
    #: said once at the start of a fit that would rescue OOMs in one process
    #: (the other ranks are inside the same collectives: they stop when the rank that ran out ends)
    NO_RETRY_WARNING = ("lightning-memguard: with several processes outside DistributedDataParallel and FSDP2 an OOM "
                        "cannot be retried; the rank that runs out stops with the memory report, the others with the "
                        "error of their next collective once its process ends, that report added to it. Threshold "
                        "mitigation stays on.")

    #: whether the run's training step reduces a value across the ranks as it logs it, each step (Lightning's
    #: ``self.log(..., sync_dist=True)`` on_step), as the front door finds it (set on an instance): from the logged
    #: results after a batch, from the hooks' source before the first
    logged_collectives = False
    #: whether the module's source calls a collective in its training step, or it holds SyncBatchNorm layers (set on
    #: an instance by the front door): what the recovery takes as the step's own collectives until it has counted them
    source_collectives = False

    def __init__(self, rank: int = 0, world_size: int = 1,
                 reduce_max: Optional[Callable[[list[int]], list[int]]] = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self._reduce_max = reduce_max
        self.recovery: Optional[Any] = None
        #: with several processes, what says whether an evaluation batch that ran out of memory may run again in more
        #: parts on this rank alone (:class:`~lightning_memguard.adapters.ddp_evaluation.EvaluationAlone`), as the
        #: front door hands it in for a fit or an evaluation of its own; ``None``: it may not
        self.evaluation: Optional[Any] = None
        self._pending: Optional[tuple[list[str], list[int]]] = None  # this rank's numbers not yet agreed on
        self._parts_left = 0  # of the training batch in progress on this rank, not yet run (see part_ran)
        self.parts = 1  # the parts this rank's training batch runs in, this attempt

    @property
    def step_collectives(self) -> bool:
        """Whether the run's training step issues collectives of its own: as the front door finds it
        (:attr:`logged_collectives`), or as the recovery counted them (``own_collectives_seen``: an ``all_gather``,
        SyncBatchNorm's statistics). A rank that ran a batch, or a part of one, alone would issue them alone: then
        every rank runs the same parts, and a batch runs again only together, after the step's own collectives ran
        on every rank (see :meth:`~lightning_memguard.guard.attempts.Attempts.on_oom`)."""
        return self.logged_collectives or getattr(self.recovery, "own_collectives_seen", False)

    @classmethod
    def of(cls, host: Host) -> "Ranks":
        """The ranks of a run that starts: a report an earlier run's rank gave up with is withdrawn (no rank of
        this run can give up before every rank has started: its first step meets the others in a collective)."""
        if host.world_size > 1:
            withdraw(_GAVE_UP_KEY)
            withdraw(_RUNG_ERROR_KEY)
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

    @property
    def hears_news(self) -> bool:
        """Whether the ranks learn of each other's news without a collective of their own (the recovery carries it
        inside the gradients' reduction): they then agree only on steps that have news (see :attr:`splits_alone` for
        a batch of a rank's own)."""
        return self.world_size > 1 and self.recovery is not None and hasattr(self.recovery, "say")

    @property
    def splits_alone(self) -> bool:
        """Whether a rank may run a batch of its own in more parts than the others, with no collective to agree on
        the count: where it hears their news and either the gradients are reduced once a step, after the last part,
        whatever the count (DistributedDataParallel), or the recovery says so (FSDP2, whose every part gathers and
        reduces: once a step has shown its collectives, a rank whose parts have run meets the others' further ones
        with shadow parts, see :meth:`part_ran`) — and the training step has no collectives of its own
        (:attr:`step_collectives`: each part would issue them again on this rank alone)."""
        return self.hears_news and getattr(self.recovery, "splits_alone", True) and not self.step_collectives

    def begin_parts(self, parts: int) -> None:
        """This rank's training batch runs in ``parts`` parts, this attempt (the front door runs them)."""
        self._parts_left = self.parts = parts
        say_more = getattr(self.recovery, "say_more", None)
        if say_more is not None and self.world_size > 1:
            say_more(parts > 1)

    def part_ran(self) -> bool:
        """After the backward of a part of the training batch (or of a shadow part), where no rank ran out of memory:
        whether this rank now runs a shadow part (the recovery's ``shadow_part``) — its own parts have all run and
        the backward told every rank that another's has parts left (the recovery's ``more``). The same question on
        every rank after every backward, so they issue as many forwards' and backwards' collectives."""
        recovery = self.recovery
        if recovery is None or not hasattr(recovery, "shadow_part"):  # DDP: no collective in a part but the last
            return False
        self._parts_left -= 1
        recovery.say_more(self._parts_left > 1)
        return self._parts_left <= 0 and bool(recovery.more)

    def step_numbers(self, peaks: dict[str, int], *values: Optional[int], news: bool = True,
                     due: bool = False) -> Optional[tuple]:
        """A step's peaks per phase and its other numbers (``None``: not measured) as every rank decides on them, each
        the maximum over the ranks in one collective — or ``None`` where the ranks skip this step's decision alike.
        Unchanged in one process.

        Where the ranks hear each other's news (:attr:`hears_news`) they agree only when the step is ``due`` (the same
        on every rank: a rung on trial is judged) or when this step's backward told them that some rank had ``news``
        after an earlier one (a peak over the line, the allocator retrying); the numbers agreed are then the worst of
        every step since the last agreement, so a step of news is decided one step late, on every rank alike (a
        forward's crossing is said in the same step's backward: that step is decided at its end, see
        :meth:`~lightning_memguard.guard.engine.MemGuardEngine.boundary`).
        Elsewhere every step is agreed on."""
        reduce_max = self.reduce_max
        if reduce_max is None:
            return (peaks, *values)
        phases = [p for p in PHASES if p in peaks]
        mine = [peaks[p] for p in phases] + [-1 if v is None else v for v in values]  # -1 stands for "no value"
        if self.hears_news:
            pending = self._pending
            if pending is not None and pending[0] == phases:
                mine = [max(a, b) for a, b in zip(pending[1], mine)]
            heard = self.recovery.heard
            if not due and heard is False:  # nobody had news: nothing to decide; this rank's is said next step
                self._pending = (phases, mine) if news or pending is not None else None
                self.recovery.say(self._pending is not None)
                return None
            self._pending = None
            self.recovery.say(False)
        reduced = [int(v) for v in reduce_max(mine)]
        others = [None if v < 0 else v for v in reduced[len(phases):]]
        return (dict(zip(phases, reduced[:len(phases)])), *others)

    def say_gave_up(self, report: str) -> None:
        """Leaves this rank's report where the other ranks' :meth:`peer_report` finds it: they stop at their next
        collective with its closed connection, which says nothing of why."""
        if self.world_size > 1:
            post(_GAVE_UP_KEY, f"rank {self.rank}: {report}")

    def peer_report(self) -> Optional[str]:
        """The report a rank that gave up left (``"rank N: ..."``), else ``None``."""
        return read_post(_GAVE_UP_KEY) if self.world_size > 1 else None

    def say_rung_error(self, error: str) -> None:
        """Leaves the error this rank ends with where a rung the guard changed may have broken its step and the ranks
        could not put it back together (:meth:`peer_rung_error` finds it): the others stop at their next collective,
        which says nothing of why."""
        if self.world_size > 1:
            post(_RUNG_ERROR_KEY, f"rank {self.rank}: {error}")

    def peer_rung_error(self) -> Optional[str]:
        """What :meth:`say_rung_error` left (``"rank N: ..."``), else ``None``."""
        return read_post(_RUNG_ERROR_KEY) if self.world_size > 1 else None


_GAVE_UP_KEY = "lightning_memguard/gave_up"
_RUNG_ERROR_KEY = "lightning_memguard/rung_error"


class PeerOutOfMemoryError(torch.OutOfMemoryError):
    """Raised on a rank whose own attempt ran, when another rank's ran out of memory: every rank then runs the batch
    again, one rung higher, together."""


class PeerRungError(PeerOutOfMemoryError):
    """Raised on a rank whose own attempt ran, when the rungs changed since the last step that ran broke another
    rank's attempt: every rank puts them back and runs the batch again, together. It leaves the attempt the way a
    peer's out-of-memory error does."""
