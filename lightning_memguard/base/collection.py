"""Python's cyclic garbage collector held off during a burst of short-lived objects (an estimate, the first batch's
plan).

An estimate makes hundreds of thousands of objects (a copy of the model, its tensors, autograd's graph, the memo of
the meta kernels). Nearly all of them die by reference counting at its end, but those alive when a young collection
runs are moved to the oldest generation and count towards a full collection, which walks every object of the
process: about 0.3 s with torch, Lightning and transformers loaded. With the collector on, the plan before the first
step ran into one every few estimates (a third of a small model's plan). Held off, the young generation keeps them
until they die; reference counting frees everything acyclic as before, and cycles made in between are collected by
the first collection after.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["collection_paused"]


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Holds automatic cyclic collection off inside the block, where it was on; nested blocks and a caller's own
    ``gc.disable()`` are left as they are (only the block that turned it off turns it back on)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
