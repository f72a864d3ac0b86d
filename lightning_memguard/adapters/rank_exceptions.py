"""A rank that Lightning's multiprocessing launcher spawned or forked (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``)
runs the Trainer's stage function directly: Lightning calls ``on_exception`` (and tears down) only in the launching
process, around the launch, so in the ranks no callback hears an error. The guard's ``on_exception`` is where a rank
that stopped in a collective learns that another rank gave up (its report, a ``gave_up`` event) and where the
rank's files get their ``exception`` row and are closed. So, in such a rank only, the Trainer's ``_run_stage`` is
wrapped on its instance (that rank's copy: the launching process's Trainer is untouched) to hand an error to the
guard before it goes on up. Under ``ddp`` Lightning calls ``on_exception`` in every rank itself."""

from __future__ import annotations

from typing import Any, Callable

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
            on_exception(error)
            raise

    setattr(run_stage_handing_errors, _WRAPPED, True)
    trainer._run_stage = run_stage_handing_errors
