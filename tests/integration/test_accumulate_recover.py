"""One rank's out-of-memory error inside a gradient-accumulation window (Lightning's ``accumulate_grad_batches=2``),
two CPU processes (gloo), DDP and FSDP2 (``ModelParallelStrategy``): rank 1 alone runs out of memory once, in the
forward of the first or of the second batch of a window (:mod:`tests.integration.accumulate_oom_run`).

Where the ranks can run the batch again alike (FSDP2, the window's first batch: its reduce-scatters carry the mark
and no earlier gradient is in the sum) both do, one rung higher, and train as a fit without a guard. Elsewhere both
ranks stop with the same report: under DDP the window's first batch runs under ``no_sync`` (no reduction to carry
the other rank through; Lightning's next collective is a broadcast of its own), and at a window's later batch the
reduction already summed the earlier batches' gradients. No rank hangs or dies of a closed connection."""

import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

from tests.helpers import rank_csvs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAILING_STEP = 2  # accumulate_oom_run's


def _launch(root, strategy: str, which: int) -> dict[int, str]:
    """Both ranks of one ``accumulate_oom_run`` fit; returns each rank's outcome. A hang fails at the timeout."""
    root.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MASTER_PORT", None)
    result = subprocess.run([sys.executable, "-m", "tests.integration.accumulate_oom_run", strategy, str(root),
                             str(which)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Connection closed" not in result.stderr
    return {rank: (root / f"outcome.rank{rank}.txt").read_text() for rank in (0, 1)}


@pytest.mark.slow
@pytest.mark.parametrize("strategy, which", [("ddp", 0), ("ddp", 1), ("fsdp", 1)])
def test_an_oom_inside_an_accumulation_window_stops_every_rank_with_the_same_report(tmp_path, strategy, which):
    outcomes = _launch(tmp_path / "guarded", strategy, which)
    first_line = (f"MemGuardOutOfMemoryError: lightning-memguard could not rescue step {FAILING_STEP}: out of memory "
                  "inside a gradient-accumulation window with several processes")
    assert outcomes[0].startswith(first_line) and outcomes[1] == outcomes[0], outcomes
    reports = [(tmp_path / "guarded" / name).read_text()
               for name in ("memguard_oom_report.txt", "memguard_oom_report.rank1.txt")]
    assert reports[0].splitlines()[0] == reports[1].splitlines()[0]
    assert reports[0].startswith(first_line.split(": ", 1)[1])
    for rank, events in rank_csvs(tmp_path / "guarded", "memguard_events.csv").items():
        assert events["action"].tolist() == ["gave_up"] and events["step"].tolist() == [FAILING_STEP], rank
    for rank, rows in rank_csvs(tmp_path / "guarded", "memguard_history.csv").items():
        assert set(rows[rows["phase"] == "after_optimizer_step"]["step"]) == {0, 1}, rank  # stopped at step 2


@pytest.mark.slow
def test_under_fsdp2_an_oom_in_a_windows_first_batch_is_run_again_on_both_ranks(tmp_path):
    assert _launch(tmp_path / "plain", "fsdp", -1) == {0: "finished", 1: "finished"}
    assert _launch(tmp_path / "guarded", "fsdp", 0) == {0: "finished", 1: "finished"}
    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    decisions = {rank: frame[["step", "action", "rung", "level"]] for rank, frame in events.items()}
    pd.testing.assert_frame_equal(decisions[0], decisions[1])  # the same rung and level, at the same step
    rescues = decisions[0][decisions[0]["action"] == "rescue"]
    assert rescues["step"].tolist() == [FAILING_STEP] and rescues["rung"].tolist() == ["checkpointing"]
    assert "another rank ran out of memory" in " ".join(events[0]["reason"])
    for rank in (0, 1):
        reference = torch.load(tmp_path / "plain" / f"parameters.rank{rank}.pt")
        guarded = torch.load(tmp_path / "guarded" / f"parameters.rank{rank}.pt")
        for name, value in guarded.items():  # checkpointing recomputes the same ops on the same inputs
            torch.testing.assert_close(value, reference[name], atol=0.0, rtol=0.0, msg=name)
