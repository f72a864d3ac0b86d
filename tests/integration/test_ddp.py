"""Two CPU processes (gloo): both ranks must take the same rung at the same step."""

import os

import pandas as pd
import pytest
import torch

from lightning_memguard import MemGuardCallback
from tests.models import (
    BlockStack, ContrastiveStack, HeavierOnRankOne, SizedStack, TaskHeadsModule, WiderOnRankOne, lightning_class, pl,
    trainer_kwargs,
)
from tests.ranks import (
    OneOffBallast, applied_alike, assert_each_rank_close, assert_rescued_together, rank_csvs, rank_parameters,
    rank_texts,
)
from tests.spawn import launch_rank_script, ranks_killed_after

pytestmark = pytest.mark.usefixtures("fresh_port")


@pytest.mark.slow
def test_ranks_apply_the_same_rungs_at_the_same_step(tmp_path):
    model = HeavierOnRankOne(width=64, depth=8, batch_size=256, n_samples=4096, log_loss=False)
    # rank 0's plain peak is ~12 MiB, rank 1's ~20 MiB: a 16 MiB limit is crossed by rank 1 only
    guard = MemGuardCallback(budget=int(16 * 2**20 / 0.9), mitigations=("checkpointing", "amp"))
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
                         **trainer_kwargs(strategy="ddp_spawn", devices=2, max_steps=6))
    trainer.fit(model)

    events = rank_csvs(tmp_path, "memguard_events.csv")
    histories = rank_csvs(tmp_path, "memguard_history.csv")
    changes = {rank: frame[frame["action"].isin(["apply", "revert", "keep"])][["step", "action", "rung", "level"]]
               .reset_index(drop=True) for rank, frame in events.items()}
    assert len(changes[0]) >= 1
    pd.testing.assert_frame_equal(changes[0], changes[1])
    # rank 0 acted on rank 1's numbers: on its own it was under the limit at the step it applied the first rung
    first = int(changes[0]["step"].iloc[0])
    limit = 0.9 * guard.budget_bytes
    rank0_peak = histories[0][histories[0]["step"] == first]["peak_bytes"].max()
    rank1_peak = histories[1][histories[1]["step"] == first]["peak_bytes"].max()
    assert rank0_peak < limit <= rank1_peak


@pytest.mark.slow
def test_an_oom_on_one_rank_that_nothing_rescues_ends_every_rank_with_the_same_report(tmp_path):
    """Rank 1 runs out of memory at step 2 whatever the rungs (a scripted OOM): both ranks climb together, then both
    give up with the same report, and neither dies of a closed connection nor hangs."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    handoff_root = tmp_path / "tmp"  # where the launching process names its hand-off directory
    handoff_root.mkdir()
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TMPDIR": str(handoff_root)}
    result = subprocess.run([sys.executable, "-m", "tests.integration.ddp_oom_run", str(tmp_path)], cwd=root,
                            env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode != 0
    assert "MemGuardOutOfMemoryError" in result.stderr and "Connection closed" not in result.stderr
    # Lightning calls on_exception only in the launching process; the guard hands a spawned rank's error to its own
    # (adapters/rank_exceptions.py), as under ddp: each rank keeps its report, events and rows, every finished step
    # of both ranks is in their CSVs
    reports = [(tmp_path / name).read_text() for name in ("memguard_oom_report.txt", "memguard_oom_report.rank1.txt")]
    assert all(report.startswith("lightning-memguard could not rescue step 2: no rung of the ladder can be raised")
               and "checkpointing at 6/6: at its top level" in report for report in reports)
    assert reports[0].splitlines()[0] == reports[1].splitlines()[0]
    assert "another rank ran out of memory" in reports[0] and "simulated on rank 1" in reports[1]
    events = {rank: pd.read_csv(tmp_path / name)
              for rank, name in enumerate(("memguard_events.csv", "memguard_events.rank1.csv"))}
    climbed = {rank: frame[frame["action"] == "rescue"][["step", "rung", "level"]].reset_index(drop=True)
               for rank, frame in events.items()}
    assert len(climbed[0]) >= 2
    pd.testing.assert_frame_equal(climbed[0], climbed[1])  # the same rungs, at the same step, on both ranks
    assert events[0]["action"].tolist()[-1] == events[1]["action"].tolist()[-1] == "gave_up"
    rows = pd.read_csv(tmp_path / "memguard_history.rank1.csv")
    # the OOM's row, then the error's as it left the rank
    assert rows["phase"].tolist()[-2:] == ["oom", "exception"] and rows["step"].tolist()[-2:] == [2, 2]
    for name in ("memguard_history.csv", "memguard_history.rank1.csv"):
        rows = pd.read_csv(tmp_path / name)
        assert {0, 1} <= set(rows["step"])
    # the launching process's guard shows rank 0's rows and events although the ranks failed; its hand-off
    # directory is gone when it exits
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "launcher_history.csv"),
                                  pd.read_csv(tmp_path / "memguard_history.csv"))
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "launcher_events.csv"), events[0])
    assert list(handoff_root.glob("memguard*")) == []  # (torch leaves its rank error files there)


@pytest.mark.slow
def test_micro_batches_under_ddp_train_like_whole_batches(tmp_path):
    """Every rank splits the same way (the decision is taken on the worst rank's numbers) and gradients are
    all-reduced once per step, after the last micro-batch: the result equals plain DDP training."""
    torch.manual_seed(0)
    reference = BlockStack(width=64, depth=4, batch_size=256, n_samples=4096, log_loss=False)
    split = BlockStack(width=64, depth=4, batch_size=256, n_samples=4096, log_loss=False)
    split.load_state_dict(reference.state_dict())
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    pl.Trainer(default_root_dir=str(tmp_path / "whole"), logger=False,
               **trainer_kwargs(strategy="ddp_spawn", devices=2, max_steps=4)).fit(reference)
    os.environ.pop("MASTER_PORT", None)
    # parameters, gradients and momentum hold ~0.6 MB; a whole batch's step peaks at ~4 MB: only micro-batches fit
    # (the closed loop's decision, not the plan before the first step: the subject is the ranks' agreement)
    guard = MemGuardCallback(budget="2MB", mitigations=("microbatch",), min_gain=0.0, plan_at_start=False)
    pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path / "split"), logger=False,
               **trainer_kwargs(strategy="ddp_spawn", devices=2, max_steps=4)).fit(split)
    applied = applied_alike(rank_csvs(tmp_path / "split", "memguard_events.csv"))  # the same k on every rank
    assert len(applied) >= 1 and applied["rung"].eq("microbatch").all()
    assert not torch.equal(split.head.weight, initial["head.weight"])  # the spawned ranks' training came back
    for (name, p), (_, q) in zip(split.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"static_graph": True}, {"find_unused_parameters": True}],
                         ids=["default", "static_graph", "find_unused_parameters"])
def test_micro_batches_whose_last_part_misses_a_head_train_like_plain_ddp(tmp_path, options):
    """A multi-task model whose rank batches hold both tasks, one of them in rank 0's first quarter only: split in
    two, rank 0's last part never runs that task's head. Only the last part's backward all-reduces, and DDP (without
    find_unused_parameters) expects every parameter's gradient there: rank 0 failed at its next forward ("parameters
    that were not used in producing the loss"; where the ranks wait on each other in the reduction they hang). The
    last part's loss now reaches every parameter the step trains; training equals plain DDP's. With a static graph
    as well; with find_unused_parameters DDP itself reduces what a backward did not reach (the loss left as it is)."""
    def fit(callbacks, root):
        torch.manual_seed(0)
        os.environ.pop("MASTER_PORT", None)
        module = TaskHeadsModule()
        strategy = lightning_class("strategies", "DDPStrategy")(start_method="spawn", **options)
        trainer = pl.Trainer(callbacks=callbacks, default_root_dir=str(root), logger=False,
                             use_distributed_sampler=False,
                             **trainer_kwargs(strategy=strategy, devices=2, max_steps=4))
        with ranks_killed_after(240):
            trainer.fit(module)
        return module

    reference = fit([], tmp_path / "plain")
    # a whole batch peaks at ~7.8 MB (parameters, gradients, momentum ~2.2 MB): only parts fit
    guard = MemGuardCallback(budget="7MB", mitigations=("microbatch",), min_gain=0.0, plan_at_start=False)
    split = fit([guard], tmp_path / "split")
    applied = applied_alike(rank_csvs(tmp_path / "split", "memguard_events.csv"))
    assert len(applied) >= 1 and applied["rung"].eq("microbatch").all()
    for (name, p), (_, q) in zip(split.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_fsdp2_micro_batches_whose_parts_reach_different_heads_train_like_plain_fsdp2(tmp_path):
    """ModelParallelStrategy (FSDP2): every part reduce-scatters, each group the parameters that got a gradient. In
    their first part rank 0 reaches head 1 only, rank 1 head 0 only: the buffers did not line up and each head
    trained on the other's gradients, silently. Split steps reduce a zero for a parameter without a gradient now."""
    launch_rank_script("tests.integration.trainer_heads_fsdp_run", tmp_path)
    for name in ("plain", "guarded"):
        assert rank_texts(tmp_path / name, "outcome") == {0: "finished", 1: "finished"}, name
    applied = applied_alike(rank_csvs(tmp_path / "guarded", "memguard_events.csv"))
    assert len(applied) >= 1 and applied["rung"].eq("microbatch").all()
    assert_each_rank_close(rank_parameters(tmp_path / "guarded"), rank_parameters(tmp_path / "plain"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork", "bucket_view"])
def test_one_ranks_oom_under_lightning_ddp_is_recovered_on_both_ranks(tmp_path, strategy):
    """Rank 1 alone runs out of memory (the CPU hard limit): both ranks take the same rung at the same step, run the
    batch again and finish every step, and the model equals an unguarded run's; the launching process's guard shows
    rank 0's rescue. Under ``ddp_fork`` the ranks are copies of this process (nothing pickled, the guard handed back
    through its fork hook); ``bucket_view`` is ``ddp_spawn`` with ``gradient_as_bucket_view=True`` (the gradients are
    views of DDP's buckets; what the guard advises where the buckets do not fit)."""
    def fit(callbacks, root):
        torch.manual_seed(0)
        os.environ.pop("MASTER_PORT", None)
        model = WiderOnRankOne(width=64, depth=8, batch_size=256, n_samples=4096, log_loss=False)
        chosen = strategy if strategy != "bucket_view" else lightning_class("strategies", "DDPStrategy")(
            start_method="spawn", gradient_as_bucket_view=True)
        trainer = pl.Trainer(callbacks=callbacks, default_root_dir=str(root), logger=False,
                             **trainer_kwargs(strategy=chosen, devices=2, max_steps=4))
        with ranks_killed_after(240):
            trainer.fit(model)
        return trainer, model

    _, reference = fit([], tmp_path / "plain")
    # an OOM first: no plan, no threshold crossing before it
    guard = MemGuardCallback(cpu_hard_limit="14MiB", threshold=1.0, plan_at_start=False, mitigations=("microbatch",))
    _, guarded = fit([guard], tmp_path / "guarded")
    for rank, rows in rank_csvs(tmp_path / "guarded", "memguard_history.csv").items():
        assert set(rows[rows["phase"] == "after_optimizer_step"]["step"]) == {0, 1, 2, 3}, rank  # no batch skipped
    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    rescues = {rank: frame[frame["action"] == "rescue"][["step", "rung", "level"]].reset_index(drop=True)
               for rank, frame in events.items()}
    assert len(rescues[1]) >= 1
    pd.testing.assert_frame_equal(rescues[0], rescues[1])
    assert "another rank ran out of memory" in " ".join(events[0]["reason"])
    shown = guard.events[guard.events["action"] == "rescue"][["step", "rung", "level"]].reset_index(drop=True)
    pd.testing.assert_frame_equal(shown, rescues[0], check_dtype=False)
    for name, value in guarded.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], atol=2e-5, rtol=1e-4, msg=name)


class OneOomOnRankOne(BlockStack):
    """:class:`BlockStack` whose rank 1 runs out of memory once, in a block's ``phase`` at step ``at`` (a tensor past
    the CPU hard limit ``limit``); the batch run again does not."""

    def __init__(self, at: int, phase: str, limit: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.at, self.phase, self.limit, self.ballast = at, phase, limit, None

    def on_fit_start(self) -> None:  # in the rank's own process, on the module it trains
        if self.global_rank == 1:
            self.ballast = OneOffBallast(self.blocks[1], self.phase, self.limit)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self.ballast is not None and self.global_step == self.at:
            self.ballast.armed = True


@pytest.mark.slow
@pytest.mark.parametrize("at, phase", [(1, "forward"), (2, "backward")])
def test_one_ranks_oom_under_a_static_graph_stops_both_before_its_buckets_are_rebuilt_and_is_recovered_after(
        tmp_path, at, phase):
    """DDP starts a static graph from one bucket of every parameter and rebuilds its buckets early, as by default
    (at step 1's end here). The recovery had taken the first buckets as final: at step 1 it reduced stale ones in
    place of the failed rank's and both ranks aborted on a collective size mismatch. Now both stop there with the
    same report, and an OOM once the buckets are rebuilt (step 2) is run again on both."""
    limit = 32 * 2 ** 20

    def fit(callbacks, root):
        torch.manual_seed(0)
        os.environ.pop("MASTER_PORT", None)
        model = OneOomOnRankOne(at=at, phase=phase, limit=limit, log_loss=False)
        strategy = lightning_class("strategies", "DDPStrategy")(start_method="spawn", static_graph=True)
        trainer = pl.Trainer(callbacks=callbacks, default_root_dir=str(root), logger=False,
                             **trainer_kwargs(strategy=strategy, devices=2, max_steps=4))
        with ranks_killed_after(240):
            trainer.fit(model)
        return model

    guard = MemGuardCallback(cpu_hard_limit=limit, threshold=1.0, plan_at_start=False, mitigations=("microbatch",))
    if at == 1:
        with pytest.raises(Exception, match="could not rescue step 1"):  # Lightning re-raises rank 0's error
            fit([guard], tmp_path / "guarded")
        reports = [(tmp_path / "guarded" / name).read_text()
                   for name in ("memguard_oom_report.txt", "memguard_oom_report.rank1.txt")]
        assert "another rank cannot run this batch again" in reports[0].splitlines()[0]
        assert "before its gradient buckets were settled" in reports[1].splitlines()[0]
        return
    reference = fit([], tmp_path / "plain")
    guarded = fit([guard], tmp_path / "guarded")
    assert_rescued_together(rank_csvs(tmp_path / "guarded", "memguard_events.csv"), at, "microbatch", phase)
    for rank, rows in rank_csvs(tmp_path / "guarded", "memguard_history.csv").items():
        assert set(rows[rows["phase"] == "after_optimizer_step"]["step"]) == {0, 1, 2, 3}, rank  # no batch skipped
    for name, value in guarded.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_the_plan_under_ddp_counts_its_gradient_buckets(tmp_path):
    """DistributedDataParallel holds its gradient buckets (one more copy of the gradients) all step long on every
    rank. A step one process would fit in (5.4 MiB predicted) does not fit a rank (6.4 MiB) under a 6 MiB budget: the
    plan before the first step must see the rank's step, not the module's alone, or the first rung comes only after a
    step ran over (on a GPU, an OOM)."""
    assert_planned_at_step_0_as_each_rank_measures(tmp_path, SizedStack(batch_size=64, n_samples=64 * 2 * 3))


def assert_planned_at_step_0_as_each_rank_measures(root, model) -> None:
    """Two ranks fit ``model`` for three steps under a 6 MiB budget with the checkpointing rung: on each, the plan
    acts at step 0, and from the second step on (once the optimizer's state exists) the forward's peak is what it
    predicted, also in the second step's, which starts with DDP's rebuild of its buckets."""
    guard = MemGuardCallback(budget="6MiB", mitigations=("checkpointing",))
    with ranks_killed_after(240):
        pl.Trainer(callbacks=[guard], default_root_dir=str(root), logger=False,
                   **trainer_kwargs(strategy="ddp_spawn", devices=2, max_steps=3)).fit(model)
    events, histories = rank_csvs(root, "memguard_events.csv"), rank_csvs(root, "memguard_history.csv")
    for rank in (0, 1):
        plan = events[rank][events[rank]["action"] == "plan"]
        assert plan[["step", "rung"]].values.tolist() == [[0, "checkpointing"]], events[rank]
        forward = histories[rank][histories[rank]["phase"] == "after_forward"].set_index("step")["peak_bytes"]
        assert forward[1:].tolist() == pytest.approx([plan["peak_before_bytes"].iloc[0]] * 2, rel=0.02)


@pytest.mark.slow
def test_a_step_that_gathers_its_negatives_from_every_rank_is_planned_before_its_first_step(tmp_path):
    """A contrastive step gathering every rank's embeddings with Lightning's ``self.all_gather``: the estimates run
    the step on a copy of the module without its Trainer, so they failed, and the first steps ran unplanned. The copy's
    gather is stood in for (each rank's embeddings repeated once per rank, what the gather holds): the plan acts at
    step 0 and predicts the forward each rank then measures."""
    assert_planned_at_step_0_as_each_rank_measures(tmp_path, ContrastiveStack(batch_size=64, n_samples=64 * 2 * 3))


@pytest.mark.slow
def test_a_ranks_count_holds_ddps_buckets_from_its_first_step_and_does_not_grow_at_their_rebuild(tmp_path):
    """DDP makes its gradient buckets when it wraps the module, before the guard counts anything on CPU, and makes them
    again at the second step's forward: a rank's count lacked them in the first step and then grew by a gradient copy
    at that step, from which the guard predicted a next step over the budget and took a rung for nothing (seen: a
    contrastive model split into micro-batches, its loss changed). Now they are counted from the start."""
    model = SizedStack(batch_size=64, n_samples=64 * 2 * 4)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    guard = MemGuardCallback(cpu_sample_every=1, mitigations=())
    with ranks_killed_after(240):
        pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
                   **trainer_kwargs(strategy="ddp_spawn", devices=2, max_steps=4)).fit(model)
    for rank, history in rank_csvs(tmp_path, "memguard_history.csv").items():
        held = history[history["phase"] == "batch_start"].set_index("step")["allocated_bytes"]
        # parameters, gradients, Adam's state, the buckets and the batch (give or take a scalar of the step's)
        assert max(held[1:]) - min(held[1:]) < 0.01 * params, (rank, held.tolist())
        assert held[0] >= 2 * params, (rank, held.tolist())  # the parameters and the buckets, before any gradient
        # nor does the guard's own news between ranks add a copy of a rebuilt bucket to the second step's backward
        # (its carrier was chosen from the buckets before the rebuild: here the index of the largest after it)
        for phase in ("after_forward", "after_backward"):
            peaks = history[history["phase"] == phase].set_index("step")["peak_bytes"]
            assert max(peaks[1:]) - min(peaks[1:]) < 0.01 * params, (rank, phase, peaks.tolist())
