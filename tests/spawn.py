"""Spawning the ranks of a multi-process test with a deadline: a hang fails the test instead of the suite."""

from __future__ import annotations

import multiprocessing
import threading
import time
from contextlib import contextmanager
from typing import Callable

import torch.multiprocessing as mp


def spawn_ranks(worker: Callable, args: tuple, nprocs: int = 2, timeout_s: float = 300) -> None:
    """Runs ``worker(rank, *args)`` in ``nprocs`` spawned processes and waits for all of them; a rank's error is
    raised here, and ranks still running after ``timeout_s`` are killed and the test fails."""
    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise AssertionError(f"the {nprocs} ranks did not finish within {timeout_s} s")


@contextmanager
def ranks_killed_after(timeout_s: float = 300):
    """For a launcher that waits on its ranks itself (Lightning's ``ddp_spawn``): the ranks this process started that
    are still running after ``timeout_s`` are killed, so the launcher's wait ends in an error, not a hung suite."""
    expired = threading.Event()

    def kill_ranks() -> None:
        expired.set()
        for process in multiprocessing.active_children():
            process.kill()

    timer = threading.Timer(timeout_s, kill_ranks)
    timer.daemon = True
    timer.start()
    try:
        yield
    except BaseException:
        if expired.is_set():
            raise AssertionError(f"the ranks did not finish within {timeout_s} s")
        raise
    finally:
        timer.cancel()
