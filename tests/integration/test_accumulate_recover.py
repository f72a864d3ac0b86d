"""One rank's out-of-memory error inside a gradient-accumulation window (Lightning's ``accumulate_grad_batches``),
two CPU processes (gloo), DDP and FSDP2 (``ModelParallelStrategy``): rank 1 alone runs out of memory once, in the
forward (or the backward) of one batch of a window (:mod:`tests.integration.accumulate_oom_run`).

Under DDP, where the failed attempt added no gradient and issued no collective (an OOM in a forward) and the ladder
has the micro-batch rung, rank 1 runs that batch again alone in more parts — before the window's last batch under
``no_sync``, at the last batch while rank 0 waits in the reduction rank 1 then joins — and the window's reduction
carries its flag: both ranks raise the same rung there, end at the same levels and train as a fit without a guard.
Under FSDP2 at a window's first batch (its reduce-scatters carry the mark and no earlier gradient is in the sum) both
run the batch again, one rung higher. Elsewhere both ranks stop with the same report: without the micro-batch rung
(no split alone), after a backward that added gradients to the window's sum, under FSDP2 at a later batch. Where the
training step logs with ``sync_dist=True`` each step (an all-reduce at the log call), under DDP and FSDP2 alike, no
rank runs a batch again alone: an OOM in the backward is run again on both ranks together, one after the log's
all-reduce stops both. So for a step that all-gathers (its loss, for a mean over the ranks) under DDP and FSDP2,
whether its source shows the call or a helper function makes it (the guard counts the collectives each step
issues). No rank hangs or dies of a closed connection."""

import json

import pandas as pd
import pytest
import torch

from tests.ranks import rank_csvs, rank_parameters, rank_texts
from tests.spawn import launch_rank_script

FAILING_STEP = 2  # accumulate_oom_run's


def _launch(root, strategy: str, which: int, ladder: str = "checkpointing", phase: str = "forward",
            accumulate: int = 2, sync: int = 0, failing_step: int = FAILING_STEP) -> dict[int, str]:
    """Both ranks of one ``accumulate_oom_run`` fit; returns each rank's outcome. A hang fails at the timeout."""
    root.mkdir(parents=True)
    result = launch_rank_script("tests.integration.accumulate_oom_run", strategy, root, which, ladder, phase,
                                accumulate, sync, failing_step, timeout_s=150)
    assert "Connection closed" not in result.stderr
    return rank_texts(root, "outcome")


WINDOW = "out of memory inside a gradient-accumulation window with several processes"
ADDED = "the backward failed in the middle of a gradient-accumulation window"
BOTH = "checkpointing,microbatch"


@pytest.mark.slow
@pytest.mark.parametrize("strategy, which, ladder, phase, accumulate, reason", [
    ("ddp", 0, "checkpointing", "forward", 2, WINDOW),  # no micro-batch rung: the batch cannot be split alone
    ("ddp", 1, "checkpointing", "forward", 2, WINDOW),
    ("ddp", 1, BOTH, "backward", 2, WINDOW),  # the last batch's reduction summed the window's earlier gradients
    ("ddp", 1, BOTH, "backward", 4, ADDED),  # under no_sync, but the backward added to the window's sum
    ("fsdp", 1, "checkpointing", "forward", 2, WINDOW)])
def test_an_oom_inside_an_accumulation_window_stops_every_rank_with_the_same_report(tmp_path, strategy, which, ladder,
                                                                                    phase, accumulate, reason):
    outcomes = _launch(tmp_path / "guarded", strategy, which, ladder, phase, accumulate)
    first_line = f"MemGuardOutOfMemoryError: lightning-memguard could not rescue step {FAILING_STEP}: {reason}"
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
    reference, guarded = rank_parameters(tmp_path / "plain"), rank_parameters(tmp_path / "guarded")
    for rank in (0, 1):
        for name, value in guarded[rank].items():  # checkpointing recomputes the same ops on the same inputs
            torch.testing.assert_close(value, reference[rank][name], atol=0.0, rtol=0.0, msg=name)


@pytest.fixture(scope="module")
def unguarded(tmp_path_factory):
    """The parameters each rank ends with in a fit without a guard (and without an OOM), per window length."""
    found = {}

    def parameters(accumulate: int) -> dict[int, dict]:
        if accumulate not in found:
            root = tmp_path_factory.mktemp("plain") / str(accumulate)
            assert _launch(root, "ddp", -1, accumulate=accumulate) == {0: "finished", 1: "finished"}
            found[accumulate] = rank_parameters(root)
        return found[accumulate]

    return parameters


@pytest.mark.slow
@pytest.mark.parametrize("which, accumulate", [(0, 2), (1, 2), (2, 4)])
def test_under_ddp_an_oom_in_a_windows_forward_is_run_again_alone_and_the_ranks_raise_the_same_rung(
        tmp_path, unguarded, which, accumulate):
    """``which`` < ``accumulate - 1``: a batch under ``no_sync``; else the window's last batch, whose reduction rank 0
    is waiting in while rank 1 runs it again."""
    root = tmp_path / "guarded"
    assert _launch(root, "ddp", which, BOTH, "forward", accumulate) == {0: "finished", 1: "finished"}
    events = rank_csvs(root, "memguard_events.csv")
    split = events[1][events[1]["action"] == "rescue_split"]  # rank 1 alone, this batch only, in two parts
    assert split[["step", "rung", "level"]].values.tolist() == [[FAILING_STEP, "microbatch", 1]], events[1]
    assert "this rank runs the batch again alone as 2 micro-batches" in split["reason"].iloc[0]
    assert "rescue_split" not in events[0]["action"].tolist()
    decisions = {rank: frame[frame["action"] != "rescue_split"][["step", "action", "rung", "level"]]
                 .reset_index(drop=True) for rank, frame in events.items()}
    pd.testing.assert_frame_equal(decisions[0], decisions[1])  # the same rung and level, at the same step
    rescues = decisions[0][decisions[0]["action"] == "rescue"]
    # the rungs the rescue takes at once (checkpointing, and micro-batches where it is predicted not to be enough
    # alone for a DDP rank after the ballast), all at the failing step
    assert len(rescues) >= 1 and set(rescues["step"]) == {FAILING_STEP}, decisions[0]
    assert "on another rank, inside a gradient-accumulation window" in \
        events[0][events[0]["action"] == "rescue"]["reason"].iloc[0]
    levels = [json.loads((root / f"levels.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert levels[0] == levels[1] and any(levels[0].values()), levels
    for rank, rows in rank_csvs(root, "memguard_history.csv").items():  # every step ran
        assert set(rows[rows["phase"] == "after_optimizer_step"]["step"]) == set(range(4)), rank
    reference = unguarded(accumulate)
    for rank in (0, 1):
        guarded = torch.load(root / f"parameters.rank{rank}.pt")
        for name, value in guarded.items():  # the parts' gradients are added in another order
            torch.testing.assert_close(value, reference[rank][name], atol=1e-6, rtol=0.0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1])
def test_a_step_that_logs_with_sync_dist_each_step_stops_every_rank_instead_of_running_a_batch_alone(tmp_path, which):
    """The training step all-reduces its logged loss at every log call: rank 1 running a batch of the window again alone
    would issue that all-reduce alone (``which`` 0: under ``no_sync``; 1: the window's last batch, whose forward rank 0
    has passed, logging, while rank 1 ran out of memory before its log). Both ranks stop with the same report, which
    says why; none hangs."""
    outcomes = _launch(tmp_path / "guarded", "ddp", which, BOTH, "forward", 2, sync=1)
    first_line = f"MemGuardOutOfMemoryError: lightning-memguard could not rescue step {FAILING_STEP}: {WINDOW}"
    assert outcomes[0].startswith(first_line) and outcomes[1] == outcomes[0], outcomes
    reports = [(tmp_path / "guarded" / name).read_text()
               for name in ("memguard_oom_report.txt", "memguard_oom_report.rank1.txt")]
    assert reports[0].splitlines()[0] == reports[1].splitlines()[0]
    assert "self.log(..., sync_dist=True) with on_step" in " ".join(reports[1].split()), reports[1]
    for rank, events in rank_csvs(tmp_path / "guarded", "memguard_events.csv").items():
        assert events["action"].tolist() == ["gave_up"] and events["step"].tolist() == [FAILING_STEP], rank


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_step_that_logs_with_sync_dist_each_step_is_run_again_together_after_an_oom_in_its_backward(tmp_path,
                                                                                                       strategy):
    """Without accumulation, rank 1 runs out of memory in its backward: both ranks have logged (the all-reduce in
    the training step) by then, so the ranks run the batch again together, one rung higher, as without the log, end
    at the same levels and train as a fit without a guard (under FSDP2, rank 1 first issues the rest of the
    backward's reduce-scatters for rank 0, as without the log)."""
    plain, root = tmp_path / "plain", tmp_path / "guarded"
    assert _launch(plain, strategy, -1, accumulate=1, sync=1) == {0: "finished", 1: "finished"}
    # checkpointing alone: it recomputes the same ops on the same inputs, so the parameters compare exactly
    assert _launch(root, strategy, 0, "checkpointing", "backward", 1, sync=1) == {0: "finished", 1: "finished"}
    events = rank_csvs(root, "memguard_events.csv")
    decisions = {rank: frame[["step", "action", "rung", "level"]] for rank, frame in events.items()}
    pd.testing.assert_frame_equal(decisions[0], decisions[1])  # the same rung and level, at the same step
    rescues = decisions[0][decisions[0]["action"] == "rescue"]
    assert rescues[["step", "rung"]].values.tolist() == [[FAILING_STEP, "checkpointing"]], decisions[0]
    levels = [json.loads((root / f"levels.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert levels[0] == levels[1] and levels[0]["checkpointing"] > 0, levels
    reference, guarded = rank_parameters(plain), rank_parameters(root)
    for rank in (0, 1):
        for name, value in guarded[rank].items():  # checkpointing recomputes the same ops on the same inputs
            torch.testing.assert_close(value, reference[rank][name], atol=0.0, rtol=0.0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, step", [("ddp", FAILING_STEP), ("fsdp", FAILING_STEP), ("ddp", 0)])
def test_a_step_that_logs_with_sync_dist_each_step_stops_every_rank_after_an_oom_in_its_forward(tmp_path, strategy,
                                                                                                step):
    """Without accumulation, rank 1 runs out of memory in its forward, before its log: rank 0 waits in the log's
    all-reduce, which rank 1 cannot stand in for. Both ranks stop with the same report, which says why; none hangs.
    At step 0 nothing is logged yet: the module's source says that its step logs so (it hung before)."""
    outcomes = _launch(tmp_path / "guarded", strategy, 0, BOTH, "forward", 1, sync=1, failing_step=step)
    first_line = (f"MemGuardOutOfMemoryError: lightning-memguard could not rescue step {step}: out of memory "
                  "with several processes whose training step reduces a value across the ranks as it logs it")
    assert outcomes[0].startswith(first_line) and outcomes[1] == outcomes[0], outcomes
    for rank, events in rank_csvs(tmp_path / "guarded", "memguard_events.csv").items():
        assert events["action"].tolist() == ["gave_up"] and events["step"].tolist() == [step], rank


OWN = "out of memory with several processes whose training step issues collectives of its own"


@pytest.mark.slow
@pytest.mark.parametrize("strategy, sync, step", [("ddp", 2, FAILING_STEP), ("fsdp", 2, FAILING_STEP), ("ddp", 3, 0),
                                                  ("ddp", 4, 0), ("fsdp", 4, 0), ("ddp", 2, 0), ("ddp", 5, 0)])
def test_a_step_that_all_gathers_stops_every_rank_after_an_oom_before_its_gather(tmp_path, strategy, sync, step):
    """Rank 1 runs out of memory in its forward, before the training step's all_gather: rank 0 waits in the gather,
    which rank 1 cannot stand in for (it hung there, rank 1 reducing zeros in place of DDP's gradients, or issuing
    FSDP2's gathers and reduce-scatters of zeros). Both ranks stop
    with the same report. At step 2 the guard counted the gather in the steps before (made by a helper function the
    source does not show); at step 0 no step ran yet: the training step's source shows ``self.all_gather`` (``sync``
    3), or the first batch's estimate, a copy of the step run on every rank, issued the helper's gather (``sync`` 4;
    ``sync`` 2: Lightning's ``self.all_gather``, which asks the Trainer the estimate's copy runs without, stood in for
    there and counted), or nothing is known (``sync`` 5: the step runs as its Trainer's module only, so no estimate
    runs it) and the rank that ran out stops rather than stand in for the others' reductions."""
    outcomes = _launch(tmp_path / "guarded", strategy, 0, BOTH, "forward", 1, sync=sync, failing_step=step)
    why = OWN if sync != 5 else "out of memory in the first step under DistributedDataParallel"
    first_line = f"MemGuardOutOfMemoryError: lightning-memguard could not rescue step {step}: {why}"
    assert outcomes[0].startswith(first_line) and outcomes[1] == outcomes[0], outcomes
    for rank, events in rank_csvs(tmp_path / "guarded", "memguard_events.csv").items():
        assert events["action"].tolist() == ["gave_up"] and events["step"].tolist() == [step], rank


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_step_that_all_gathers_is_run_again_together_after_an_oom_in_its_backward(tmp_path, strategy):
    """Rank 1 runs out of memory in its backward, after the step's all_gather ran on both ranks: only gradient
    reductions are left, which rank 1 stands in for, so both ranks run the batch again together one rung higher and
    train as a fit without a guard (checkpointing alone: the rank's predictions, once the estimate runs the gather,
    take micro-batches too, which sum the gradients in another order)."""
    plain, root = tmp_path / "plain", tmp_path / "guarded"
    assert _launch(plain, strategy, -1, accumulate=1, sync=2) == {0: "finished", 1: "finished"}
    assert _launch(root, strategy, 0, "checkpointing", "backward", 1, sync=2) == {0: "finished", 1: "finished"}
    events = rank_csvs(root, "memguard_events.csv")
    decisions = {rank: frame[["step", "action", "rung", "level"]] for rank, frame in events.items()}
    pd.testing.assert_frame_equal(decisions[0], decisions[1])
    rescues = decisions[0][decisions[0]["action"] == "rescue"]
    assert rescues[["step", "rung"]].values.tolist() == [[FAILING_STEP, "checkpointing"]], decisions[0]
    reference, guarded = rank_parameters(plain), rank_parameters(root)
    for rank in (0, 1):
        for name, value in guarded[rank].items():
            torch.testing.assert_close(value, reference[rank][name], atol=0.0, rtol=0.0, msg=name)


@pytest.mark.slow
def test_a_step_that_all_gathers_runs_no_batch_of_a_window_again_alone(tmp_path):
    """With accumulation, a forward OOM in a window's first batch would run again alone in more parts (as without the
    gather): each part would all-gather again, on rank 1 alone. The guard counted the step's gather: every rank stops
    with the window's report, which names the step's own collectives."""
    outcomes = _launch(tmp_path / "guarded", "ddp", 0, BOTH, "forward", 2, sync=2)
    first_line = f"MemGuardOutOfMemoryError: lightning-memguard could not rescue step {FAILING_STEP}: {WINDOW}"
    assert outcomes[0].startswith(first_line) and outcomes[1] == outcomes[0], outcomes
    assert "the training step issues collectives of its own" in outcomes[0]
