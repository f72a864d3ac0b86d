"""What the guard handed a process group's worker threads, waited for at interpreter exit.

A collective's worker thread lets go of the Python objects it was given (a tensor made in Python, a future's Python
callback) by taking the GIL, after the thread that waited for the collective went on. A worker that takes it only
once the interpreter has begun to finalize is ended inside a C++ destructor, and the process aborts ("terminate
called without an active exception"): a rank of a run that finished dies at exit, its launcher reports a failure. A
loaded machine delays a worker that long now and then, and Lightning's launchers leave a gloo group to the interpreter.

So each such object of the guard is registered here as it is handed over, and at exit, before the interpreter
finalizes, the guard waits until the workers let go of every one (a few seconds at most; nothing to wait for, as a
rule). Objects the guard keeps itself (a bucket's buffer, which DDP owns) are not registered.
"""

from __future__ import annotations

import atexit
import time
import weakref
from typing import TypeVar

import torch

__all__ = ["handed_to_workers", "numbers_for_collective", "registered", "still_held", "wait_for_workers"]

T = TypeVar("T")

#: how long the wait at exit lasts at most: a worker stuck longer is left to the interpreter
WAIT_AT_EXIT_S = 5.0

#: a weak reference to each object handed over and not yet let go of, by the reference's id
_held: dict[int, weakref.ref] = {}
_registered = 0  # how many so far
_waiting_at_exit = False


def _let_go(reference: weakref.ref) -> None:
    # run in whichever thread lets go last (a worker holds the GIL then)
    _held.pop(id(reference), None)


def handed_to_workers(obj: T) -> T:
    """Registers ``obj``, about to be given to a collective (its tensor or its future's callback), as held until the
    last reference to it goes; returns it. Well under a microsecond: DDP's hook calls it for every bucket."""
    global _waiting_at_exit, _registered
    reference = weakref.ref(obj, _let_go)
    _held[id(reference)] = reference  # one step under the GIL: the autograd engine's threads call in too
    _registered += 1
    if not _waiting_at_exit:
        _waiting_at_exit = True
        atexit.register(wait_for_workers)
    return obj


def numbers_for_collective(numbers: list[int], device) -> torch.Tensor:
    """``numbers`` as the float64 tensor on ``device`` that an agreement between ranks reduces, registered as handed
    to the workers (every agreement of the guard's, whatever the front door, makes it here)."""
    return handed_to_workers(torch.tensor(numbers, dtype=torch.float64, device=device))


def registered() -> int:
    """How many objects were registered in this process."""
    return _registered


def still_held() -> int:
    """How many registered objects are not let go of yet."""
    return len(_held)


def wait_for_workers(at_most_s: float = WAIT_AT_EXIT_S) -> bool:
    """Waits, the GIL released, until every registered object is let go of, at most ``at_most_s``; whether all were."""
    deadline = time.monotonic() + at_most_s
    while _held:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True
