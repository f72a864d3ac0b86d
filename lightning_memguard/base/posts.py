"""Messages between the processes of a run that need no collective: a key in the default process group's store
(``torch.distributed``'s rendezvous). For what must reach ranks that may be stuck in a collective with a process that
is ending. Best effort: a store hosted by a process that ended is gone, and nothing here ever raises."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

__all__ = ["post", "read_post", "withdraw"]


def post(key: str, text: str) -> None:
    """Leaves ``text`` under ``key`` for every process of the run (the last post under a key wins)."""
    store = _store()
    try:
        if store is not None:
            store.set(key, text)
    except Exception:  # telling the others is a courtesy, never the reason a rank fails differently
        pass


def withdraw(key: str) -> None:
    """Removes what was posted under ``key`` (a run that starts: an earlier run's post is not its news)."""
    store = _store()
    try:
        if store is not None:
            store.delete_key(key)
    except Exception:  # a store without deletion: a stale post can only add a note to a later error
        pass


def read_post(key: str) -> Optional[str]:
    """What was posted under ``key``, else ``None``; waits a few seconds at most (the run is ending: not the
    process group's timeout)."""
    store = _store()
    try:
        if store is not None:
            store.set_timeout(timedelta(seconds=5))
            if store.check([key]):
                return store.get(key).decode()
    except Exception:  # the store went with the process that hosted it
        pass
    return None


def _store() -> Optional[Any]:
    try:
        from torch.distributed import distributed_c10d, is_available, is_initialized

        return distributed_c10d._get_default_store() if is_available() and is_initialized() else None
    except Exception:  # a torch without the store's getter: nothing to post through
        return None
