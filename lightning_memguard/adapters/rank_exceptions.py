"""A rank that Lightning's multiprocessing launcher spawned or forked (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``)
runs the Trainer's stage function directly: Lightning calls ``on_exception`` (and tears down) only in the launching
process, around the launch, so in the ranks no callback hears an error. The guard's ``on_exception`` is where a rank
that stopped in a collective learns that another rank gave up (its report, a ``gave_up`` event) and where the
rank's files get their ``exception`` row and are closed. So, in such a rank only, the Trainer's ``_run_stage`` is
wrapped on its instance (that rank's copy: the launching process's Trainer is untouched) to hand an error to the
guard before it goes on up. Under ``ddp`` Lightning calls ``on_exception`` in every rank itself."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Any, Callable, Iterator

__all__ = ["hand_errors_to"]

_WRAPPED = "_memguard_hands_errors"


def hand_errors_to(trainer: Any, on_exception: Callable[[BaseException], None]) -> None:
    """Wraps ``trainer._run_stage`` (once) so that an error it raises is given to ``on_exception`` and then raised
    on. A Lightning without ``_run_stage`` is left as it is (the guard then hears no error in a spawned rank, as
    before)."""
    run_stage = getattr(trainer, "_run_stage", None)
    if run_stage is None or getattr(run_stage, _WRAPPED, False):
        return

    def run_stage_handing_errors(*args: Any, **kwargs: Any) -> Any:
        try:
            return run_stage(*args, **kwargs)
        except BaseException as error:  # raised on unchanged; the guard only records it
            with _termination_deferred():
                on_exception(error)
            raise

    setattr(run_stage_handing_errors, _WRAPPED, True)
    trainer._run_stage = run_stage_handing_errors


@contextmanager
def _termination_deferred() -> Iterator[None]:
    """SIGTERM held back until the block ends, then raised again for the handler that was there. Once one rank has
    failed, the launching process sends the others SIGTERM at once, and Lightning's handler broadcasts in the process
    group, which raises (the peer is gone) in whatever the rank runs then: in three two-rank runs of eight here, the
    guard's reading of the peer's report from the store, which took the error for a store that is gone (no
    ``gave_up`` event). Left as it is off the main thread (no handler can be set there) or where the handler
    was not set from Python."""
    pending: list[int] = []
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None:
            raise ValueError("a handler set outside Python cannot be put back")
        signal.signal(signal.SIGTERM, lambda signum, frame: pending.append(signum))
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if pending:
            signal.raise_signal(signal.SIGTERM)
