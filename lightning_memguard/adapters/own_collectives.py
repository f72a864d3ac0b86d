"""Counts the collectives a training step issues of its own through ``torch.distributed``: an ``all_gather`` of
embeddings for in-batch negatives across ranks (Lightning's ``self.all_gather``), SyncBatchNorm's statistics, a value
logged with ``sync_dist=True`` each step, a torchmetrics metric synced on each step.

A rank that ran out of memory stands in for the gradient reductions the others wait in
(:class:`~lightning_memguard.adapters.ddp_recovery.DDPRecovery`); it cannot stand in for a collective of the model's
own, whose arguments only the model knows. Where the others wait in one, a stand-in reduction would meet their
``all_gather`` and both would wait for ever. So the recovery has to know whether the step issues such collectives,
and whether the failed attempt had issued all of them: it counts the calls made while an attempt runs.

torch has no hook for a collective issued from Python, so the functions below are replaced, once, in the
``torch.distributed`` namespace (where torch's own callers — ``torch.distributed.nn``, SyncBatchNorm — Lightning and
torchmetrics look them up at each call) by wrappers that count the call while an attempt is watched and otherwise only
call through. A function bound by name before the replacement (``from torch.distributed import all_gather``) is not
seen. What the recoveries issue themselves, and FSDP2's collectives (through the recovery's hooks), run
:func:`uncounted`."""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch.distributed as dist

__all__ = ["CollectiveCount", "CollectiveRefused", "CountsOwnCollectives", "count_stand_in", "uncounted"]

#: what a training step may call through ``torch.distributed`` (collectives and point-to-point), as torch names them
_NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
          "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast",
          "broadcast_object_list", "all_to_all", "all_to_all_single", "reduce", "gather", "gather_object", "scatter",
          "scatter_object_list", "barrier", "monitored_barrier", "all_reduce_coalesced", "all_gather_coalesced",
          "batch_isend_irecv", "send", "recv", "isend", "irecv")
_LOCK = threading.Lock()
_installed = False
#: the count of the attempt being watched (one a process: one module trains at a time)
_watched: Optional["CollectiveCount"] = None
_quiet = 0  # how deep in :func:`uncounted` the process is


@contextmanager
def uncounted() -> Iterator[None]:
    """Collectives issued inside are not the training step's own: a recovery's reductions, FSDP2's gathers."""
    global _quiet
    _quiet += 1
    try:
        yield
    finally:
        _quiet -= 1


def count_stand_in() -> None:
    """Counts one collective of the step's own that an estimate's copy of the step stood in for without issuing it
    (Lightning's ``self.all_gather`` on a copy of the module without its Trainer: lightning_step_copy.py), as the
    real one is counted."""
    count = _watched
    if count is not None and not _quiet:
        count.issued += 1


def _install() -> None:
    global _installed
    with _LOCK:
        if _installed:
            return
        for name in _NAMES:
            function = getattr(dist, name, None)
            if callable(function):
                setattr(dist, name, _counting(function))
        _installed = True


class CollectiveRefused(RuntimeError):
    """A collective the watched attempt tried to issue where its count refuses them (``CollectiveCount.refusing``:
    a batch run on this rank alone before the step is known to issue none): raised instead of issuing it, which the
    other ranks would never meet."""


def _counting(function: Callable) -> Callable:
    @functools.wraps(function)
    def counted(*args, **kwargs):
        count = _watched
        if count is not None and not _quiet:
            if count.refusing:
                raise CollectiveRefused(f"torch.distributed.{function.__name__} in a batch run on this rank alone")
            count.issued += 1
        return function(*args, **kwargs)

    return counted


class CollectiveCount:
    """The collectives an attempt issues of its own, and what complete attempts issued: the most any complete attempt
    of the same kind issued (``kind``: the number of parts a batch runs in, each part issuing the step's collectives
    again), so a step whose collectives come and go (a value logged every 10 steps) is judged by its fullest step."""

    def __init__(self) -> None:
        _install()
        self.issued = 0  # by the attempt being watched, so far
        #: the watched attempt must issue none: each one it tries raises :class:`CollectiveRefused`, unissued
        self.refusing = False
        self._most: dict[int, int] = {}  # the most a complete attempt of each kind issued
        #: what the first batch's estimates issued (a copy of the step, run on every rank alike before it trains);
        #: ``None`` where no estimate ran the step through and issued none: then, before an attempt has completed,
        #: whether the step issues collectives of its own is not known
        self.estimated: Optional[int] = None

    @contextmanager
    def estimating(self, ran: Callable[[], bool]) -> Iterator[None]:
        """The first batch's estimates run inside (the step itself, on a copy of the model, on every rank): the
        collectives they issue are the step's own, known before any attempt has completed — also those of a helper
        function the module's source does not show. ``ran`` says afterwards whether an estimate ran the step through
        (where none did and none was issued, nothing is known)."""
        global _watched
        self.issued, _watched = 0, self
        try:
            yield
        finally:
            _watched = None
            issued, self.issued = self.issued, 0
            if issued or ran():
                self.estimated = max(self.estimated or 0, issued)

    @property
    def known(self) -> bool:
        """Whether this run knows if its training step issues collectives of its own: an attempt completed, or the
        first batch's estimates ran the step."""
        return bool(self._most) or self.estimated is not None

    @property
    def seen(self) -> bool:
        """Whether a training step issued a collective of its own in this run (so far; before any attempt
        completed, in the first batch's estimates too)."""
        return self.issued > 0 or any(self._most.values()) or (not self._most and bool(self.estimated))

    def watch(self) -> None:
        """An attempt begins: its collectives are counted from zero."""
        global _watched
        self.issued = 0
        _watched = self

    def complete(self, kind: int) -> None:
        """The watched attempt ran to its end (its backward, every part): what it issued is what one of ``kind``
        issues, at most. Counting stops (collectives after the step, an evaluation's, are not the step's)."""
        global _watched
        if _watched is self:
            _watched = None
        self._most[kind] = max(self._most.get(kind, 0), self.issued)

    def stop(self) -> None:
        """The watched attempt failed: counting stops, and what it issued (:attr:`issued`) is not what a complete one
        issues."""
        global _watched
        if _watched is self:
            _watched = None

    def pending(self, kind: int, guessed: bool = False) -> bool:
        """After an OOM in the watched attempt: whether the others may be waiting in a collective of the step's own
        that it had not issued yet — it issued fewer than a complete attempt of ``kind`` did, or any where no attempt
        of ``kind`` completed yet. Before any attempt completed, ``guessed`` (the module's source calls one) counts as
        one, as does one the first batch's estimates issued (:meth:`estimating`), and so does not knowing
        (:attr:`known`): a stand-in reduction meeting another rank's gather would wait for ever. ``False`` where no
        step issued any (so far)."""
        if not self._most:
            return self.issued > 0 or guessed or self.estimated != 0
        if not self.seen:
            return False
        most = self._most.get(kind)
        return most is None or self.issued < most


class CountsOwnCollectives:
    """What a recovery (DDP's, FSDP2's) answers about the training step's own collectives, from its ``own`` count
    (made in its ``__init__``, watched from each ``begin_attempt``)."""

    own: CollectiveCount

    @property
    def own_collectives_seen(self) -> bool:
        """Whether a training step issued collectives of its own in this run (so far)."""
        return self.own.seen

    def own_collectives_pending(self, parts: int, guessed: bool = False) -> bool:
        """After an OOM in this rank's attempt (of a batch in ``parts`` parts): whether the others may wait in a
        collective of the step's own that this attempt had not issued yet (then this rank cannot stand in for what
        they wait in). ``guessed``: the front door finds one in the module's source, which counts until an attempt
        has completed."""
        return self.own.pending(parts, guessed)

    @property
    def own_collectives_known(self) -> bool:
        """Whether this run knows if its training step issues collectives of its own (:attr:`CollectiveCount.known`).
        """
        return self.own.known

    def estimates_counted(self, ran: Callable[[], bool]):
        """A context the first batch's estimates run in: the collectives the step issues there count as its own
        before any attempt has completed; ``ran``: whether an estimate ran the step through
        (:meth:`CollectiveCount.estimating`)."""
        return self.own.estimating(ran)

    def attempt_complete(self, parts: int) -> None:
        """This rank's attempt (of a batch in ``parts`` parts) ran to its end: what it issued is what such a step
        issues."""
        self.own.complete(parts)
