"""The measured step of an estimate, derived from the record of the step before it instead of run again.

An estimate runs its step twice: the first creates gradients and optimizer state (and leaves the allocator model's
cache as a run's first step does), the second is measured. The second's forward and backward dispatch the very ops
of the first, so they make and free the same storages in the same order; only the optimizer step differs (its state
exists by then). So the first step's forward and backward are recorded — each storage the counting saw made,
resized or freed, in order (:class:`StepRecorder`) — and the measured step replays that record through the same
counting (the same peaks, the same caching-allocator blocks: :class:`Replay`), with the first step's gradients
freed where ``zero_grad`` frees them and handed the blocks their replayed twins hold at the end; its optimizer step
runs. That halves the ops an estimate dispatches.

Where the first step changed what the second would do, the record is not used and the second step runs
(:meth:`StepRecorder.refusal`): a storage made in the forward or backward that outlives them other than a gradient
(a tensor a module keeps for its next call), a storage from before the step freed or resized, a gradient that
``zero_grad`` would not clear.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Hashable, Iterable, Iterator, Optional

__all__ = ["StepRecorder", "Replay", "replay_enabled", "replay_is_enabled"]

_enabled = [True]


@contextlib.contextmanager
def replay_enabled(enabled: bool = True) -> Iterator[None]:
    """Within it, estimates replay their measured step (``True``, the default) or run it again (``False``: as they
    did before the replay, to compare the two)."""
    before = _enabled[0]
    _enabled[0] = enabled
    try:
        yield
    finally:
        _enabled[0] = before


def replay_is_enabled() -> bool:
    """Whether estimates made now replay their measured step (see :func:`replay_enabled`)."""
    return _enabled[0]


class StepRecorder:
    """The storages a step's counting saw made, resized and freed, in order, as ``(key, bytes)`` (made or resized)
    and ``(key, None)`` (freed); keys are the storages' while they live (an address used again later is another
    storage). The counting tells it what it sees (:meth:`seen`, :meth:`freed`); the step marks where the forward ends
    and where the backward ends (:attr:`forward_end`, :attr:`backward_end`)."""

    def __init__(self) -> None:
        self.events: list[tuple[Hashable, Optional[int]]] = []
        #: the recorded storages alive now, by key: their bytes
        self.alive: dict[Hashable, int] = {}
        self.forward_end = 0
        self.backward_end = 0
        self._refused: Optional[str] = None
        self._workspaces = 0

    def seen(self, key: Hashable, nbytes: int, known: bool, changed: Callable[[], bool]) -> None:
        """The counting saw storage ``key`` of ``nbytes``: ``known`` if it counts it already, and for a storage from
        before the record ``changed()`` says whether its size is another now."""
        size = self.alive.get(key)
        if size is not None:
            if size != nbytes:  # resized in place (an out= op, resize_)
                self.alive[key] = nbytes
                self.events.append((key, nbytes))
        elif not known:
            self.alive[key] = nbytes
            self.events.append((key, nbytes))
        elif changed():
            self.refuse("a storage from before the step was resized in it")

    def freed(self, key: Hashable) -> None:
        """The counting stopped counting storage ``key`` (it died)."""
        if self.alive.pop(key, None) is None:
            self.refuse("a storage from before the step was freed in it")
        else:
            self.events.append((key, None))

    def workspace(self, nbytes: int) -> Hashable:
        """Records a workspace of ``nbytes`` made without being allocated (the measured step allocates it, the step
        before did not); :meth:`freed` with the key returned ends it."""
        self._workspaces += 1
        key = ("workspace", self._workspaces)
        self.alive[key] = nbytes
        self.events.append((key, nbytes))
        return key

    def refuse(self, why: str) -> None:
        """The record cannot stand for the next step (the first reason is kept)."""
        if self._refused is None:
            self._refused = why

    def refusal(self, gradients: Iterable[Hashable], cleared: bool) -> Optional[str]:
        """Why the record cannot be replayed as the next step, or ``None``. ``gradients``: the keys of the gradients'
        storages after the recorded step (what alone may outlive its forward and backward); ``cleared``: whether the
        step's ``zero_grad`` sets every one of them to ``None`` (a parameter the optimizer does not hold keeps its
        gradient, and the next backward adds into it instead of making it)."""
        if self._refused is not None:
            return self._refused
        if not cleared:
            return "a gradient that zero_grad does not clear"
        if set(self.alive) != set(gradients):
            return "a storage made in the forward or backward outlived them, not a gradient"
        return None


class Replay:
    """Replays a :class:`StepRecorder`'s events through a counting's ``count(key, bytes)`` and ``free(key)``, each
    recorded storage under a key of its own (negative integers: a storage's own key is its address), so that a
    replayed storage never meets one alive now. :attr:`keys` maps a recorded key alive in the replay to its own."""

    def __init__(self, count: Callable[[Hashable, int], None], free: Callable[[Hashable], None]) -> None:
        self._count = count
        self._free = free
        self._last = 0
        self.keys: dict[Hashable, int] = {}

    def run(self, events: list[tuple[Hashable, Optional[int]]]) -> None:
        keys, count, free = self.keys, self._count, self._free
        for key, nbytes in events:
            if nbytes is None:
                free(keys.pop(key))
                continue
            replayed = keys.get(key)
            if replayed is None:
                self._last -= 1
                replayed = keys[key] = self._last
            count(replayed, nbytes)
