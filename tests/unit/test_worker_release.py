"""worker_release: what the guard hands a process group's worker threads is waited for at exit, so that a worker
letting go late cannot abort a finished rank. The process-level tests run a one-rank gloo group in a subprocess whose
collective's callback sleeps (the GIL released) past the end of the script: a worker that loaded a machine delays."""

import os
import subprocess
import sys
import textwrap
import time

import torch

from lightning_memguard.adapters.worker_release import handed_to_workers, still_held, wait_for_workers
from tests.spawn import ROOT

_LATE_WORKER = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed as dist
    from lightning_memguard.adapters.worker_release import handed_to_workers
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)

    def late(future):
        time.sleep(0.5)  # the worker still holds this callback when the script ends
        return future.value()

    register = handed_to_workers if sys.argv[2] == "registered" else (lambda obj: obj)
    dist.all_reduce(register(torch.ones(4)), async_op=True).get_future().then(register(late))
""")


def _exit_code(tmp_path, how: str, attempt: int = 0) -> int:
    rendezvous = tmp_path / f"rendezvous.{how}.{attempt}"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", _LATE_WORKER, str(rendezvous), how], env=env, cwd=ROOT,
                          capture_output=True, timeout=120).returncode


def test_a_process_waits_at_exit_for_a_worker_to_let_go_of_what_it_was_handed(tmp_path):
    # unregistered, the worker takes the GIL after the interpreter began finalizing: this torch and Python abort
    # (a timing: on a loaded machine the callback may not have begun by the end, so up to three tries)
    assert any(_exit_code(tmp_path, "unregistered", attempt) == -6 for attempt in range(3))  # SIGABRT
    assert _exit_code(tmp_path, "registered") == 0


def test_the_wait_ends_when_the_last_reference_goes_and_gives_up_after_its_limit():
    held = handed_to_workers(torch.ones(3))
    before = still_held()
    assert before >= 1
    started = time.monotonic()
    assert not wait_for_workers(at_most_s=0.05)  # still referenced here
    assert time.monotonic() - started < 1.0
    del held
    assert still_held() == before - 1
