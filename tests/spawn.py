"""Spawning the ranks of a multi-process test with a deadline, or launching a runner module that Lightning or Fabric
starts its ranks from: a hang fails the test instead of the suite."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable

import torch.multiprocessing as mp

#: the repository's root: where a rank script runs, and what it imports ``tests`` from
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: what a launcher (Lightning, Fabric) left in this process's environment for its ranks: a port or rank of an earlier
#: launch must not reach the ranks of a new one
LAUNCH_VARIABLES = ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK")


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


def launch_rank_script(module: str, *args, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """Runs ``python -m <module> <args>`` from the repository's root, for a runner that Lightning or Fabric launches
    its ranks from (it starts the other ranks by running the module again); fails the test where it does not exit
    with 0 (its stderr's end shown) and, as a hang, after ``timeout_s``. Returns the finished process."""
    env = {name: value for name, value in os.environ.items() if name not in LAUNCH_VARIABLES}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-m", module, *(str(arg) for arg in args)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, result.stderr[-3000:]
    return result
