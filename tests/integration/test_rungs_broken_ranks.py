"""A rung that breaks the model under DistributedDataParallel or FSDP2: two CPU processes (gloo), the plain-loop
guard. A threshold crossing (no plan before the first step; DDP's buckets have settled by then) puts the checkpointing
rung on for the next step, and the model's blocks fail when they are recomputed — on both ranks (a rung breaks the
same code everywhere), or on rank 1 only. The rank that failed reduces what its backward had not (as after an
out-of-memory error), the ranks agree once, and every rank puts checkpointing back and runs the batch again: no rank
dies, no batch is skipped, the ladders stay alike and the parameters equal the unguarded run's. Before, the first
error ended the run on every rank."""

from __future__ import annotations

import os

import pandas as pd
import pytest
import torch
from torch import nn

from torch.utils.data import DataLoader

from lightning_memguard import MemGuard, MemGuardCallback
from tests.helpers import mse, train_plain
from tests.models import Block, Stack, lightning_class, pl, trainer_kwargs
from tests.ranks import assert_each_rank_close, gloo_group, rank_csvs, rank_doubled, rank_parameters, rank_texts, \
    save_full_parameters, wrap_for
from tests.spawn import ranks_killed_after, spawn_ranks

STEPS = 4
_TRAINED: list[nn.Module] = []  # the model a rank trains (the estimate's copies are never among them)


class RecomputeFails(Block):
    """A :class:`~tests.models.Block` of the trained model that raises when it is recomputed in a backward (under
    the checkpointing rung) on the ranks its model says."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        owner = _TRAINED[0] if _TRAINED else None
        if owner is not None and any(block is self for block in owner.blocks) \
                and torch._C._current_graph_task_id() != -1 and owner.breaks_here:
            raise RuntimeError("this block cannot be recomputed")
        return super().forward(x)


def _model(rank: int, breaks_on: tuple[int, ...]) -> nn.Module:
    model = Stack(block=RecomputeFails)  # seeded: the same parameters on both ranks
    model.breaks_here = rank in breaks_on
    _TRAINED[:] = [model]
    return model


class BreaksWhenRecomputed(pl.LightningModule):
    """The same model and data through the Trainer (``use_distributed_sampler=False``: each rank's batches are its
    own); its blocks break when recomputed on the ranks ``breaks_on`` names."""

    def __init__(self, breaks_on: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.breaks_on = breaks_on
        self.model = Stack(block=RecomputeFails)

    def on_fit_start(self) -> None:  # in the rank's own process: the module it trains (not the estimate's copy)
        self.model.breaks_here = self.global_rank in self.breaks_on
        _TRAINED[:] = [self.model]

    def training_step(self, batch, batch_idx):
        return mse(self.model, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(rank_doubled(self.global_rank, STEPS), batch_size=None)


def _worker(rank: int, root: str, settings, breaks_on: tuple[int, ...], strategy: str) -> None:
    with gloo_group(rank, root):
        model = wrap_for(_model(rank, breaks_on), strategy)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        data = rank_doubled(rank, STEPS)
        outcome = "finished"
        if settings is None:
            train_plain(model, optimizer, data)
        else:
            try:
                with MemGuard(model, optimizer, log_dir=root, tensorboard=False, explain=False, **settings) as guard:
                    for batch in data:
                        guard.step(batch, mse)
            except Exception as err:  # what ended the run, for the test to read
                # the first line, then the notes added to it (one line each)
                outcome = "\n".join([f"{type(err).__name__}: {str(err).splitlines()[0]}",
                                      *getattr(err, "__notes__", [])])
        with open(os.path.join(root, f"outcome.rank{rank}.txt"), "w") as out:
            out.write(outcome)
        save_full_parameters(model, root, rank)


def _train(root, strategy: str, settings=None, breaks_on=()) -> tuple[dict, dict]:
    os.makedirs(root, exist_ok=True)
    spawn_ranks(_worker, (str(root), settings, breaks_on, strategy), timeout_s=240)
    return rank_parameters(root), rank_texts(root, "outcome")


@pytest.mark.slow
@pytest.mark.parametrize("strategy, breaks_on", [("ddp", (0, 1)), ("ddp", (1,)), ("fsdp", (1,))],
                         ids=["ddp-both-ranks", "ddp-rank-1-only", "fsdp2-rank-1-only"])
def test_a_rung_that_breaks_the_model_is_put_back_on_every_rank_and_the_batch_runs_again(tmp_path, strategy,
                                                                                         breaks_on):
    reference, _ = _train(tmp_path / "plain", strategy)
    _train(tmp_path / "probe", strategy, dict(mitigations=(), cpu_sample_every=1))
    peak = max(int(frame["peak_bytes"].max())
               for frame in rank_csvs(tmp_path / "probe", "memguard_history.csv").values())
    settings = dict(budget=peak, plan_at_start=False, mitigations=("checkpointing", "microbatch"))
    guarded, outcomes = _train(tmp_path / "guarded", strategy, settings, breaks_on)

    assert outcomes == {0: "finished", 1: "finished"}
    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    decisions = {rank: frame[["step", "action", "rung", "level"]].reset_index(drop=True)
                 for rank, frame in events.items()}
    pd.testing.assert_frame_equal(decisions[0], decisions[1])  # the same decisions at the same steps on both ranks
    applied = events[0][(events[0]["action"] == "apply") & (events[0]["rung"] == "checkpointing")]
    reverted = events[0][(events[0]["action"] == "revert") & (events[0]["rung"] == "checkpointing")]
    assert len(applied) == 1 and len(reverted) == 1, events[0]
    assert reverted["level"].iloc[0] == 0
    for rank, frame in events.items():  # each rank says why: its own error, or that of the rank that failed
        why = frame[frame["action"] == "revert"]["reason"].iloc[0]
        assert ("cannot be recomputed" if rank in breaks_on else "PeerRungError: another rank's backward") in why
    histories = rank_csvs(tmp_path / "guarded", "memguard_history.csv")
    for rank, history in histories.items():  # every step ran to its optimizer step
        assert set(history[history["phase"] == "after_optimizer_step"]["step"]) == set(range(STEPS)), rank
    assert_each_rank_close(guarded, reference)
    for name, value in guarded[0].items():  # the ranks' parameters stayed one model
        torch.testing.assert_close(value, guarded[1][name], msg=name)


@pytest.mark.slow
def test_a_rung_the_plan_set_that_breaks_ddps_first_step_stops_both_ranks_with_what_happened(tmp_path):
    """The first batch's plan puts checkpointing on before step 0, and rank 1's blocks fail when recomputed in that
    step's backward, before DDP settled its gradient buckets: the batch cannot run again alike. Rank 1 stands in for
    the reductions it had not run, so rank 0's backward completes and both stop at once: rank 1 with its error, a note
    naming the rung and what to do; rank 0 with the report, which says another rank's error stopped it (not an out
    of memory). Before, rank 1 raised alone and rank 0 failed in gloo when its process ended."""
    _train(tmp_path / "probe", "ddp", dict(mitigations=(), cpu_sample_every=1))
    peak = max(int(frame["peak_bytes"].max())
               for frame in rank_csvs(tmp_path / "probe", "memguard_history.csv").values())
    settings = dict(budget=peak, mitigations=("checkpointing",))  # the plan at the first batch (the default)
    _, outcomes = _train(tmp_path / "guarded", "ddp", settings, (1,))

    first, *notes = outcomes[1].splitlines()
    assert first == "RuntimeError: this block cannot be recomputed", outcomes[1]
    assert len(notes) == 1 and notes[0].startswith("lightning-memguard: this error came in step 0, the first to run "
                                                   "with rungs the guard changed (checkpointing 0 -> "), notes
    assert "gradient buckets are not settled" in notes[0] and "leave it out of mitigations=" in notes[0]
    # rank 0's report says what stopped it: rank 1's error, not an out-of-memory error
    assert outcomes[0].startswith("MemGuardOutOfMemoryError: lightning-memguard could not rescue step 0: another "
                                  "rank's attempt of this batch failed with an error other than out of memory"), \
        outcomes[0]
    plans = {rank: frame[frame["action"] == "plan"] for rank, frame in
             rank_csvs(tmp_path / "guarded", "memguard_events.csv").items()}
    assert all(set(plan["step"]) == {0} and "checkpointing" in set(plan["rung"]) for plan in plans.values()), plans


@pytest.mark.slow
def test_a_rung_that_breaks_a_step_the_ranks_cannot_run_again_tells_the_other_rank_why_it_stopped(tmp_path):
    """Without the guard's recovery (``rescue_oom=False``) the ranks cannot put a rung back and run the batch again
    together: rank 1 ends with its error and the note, and rank 0, stopped by the collective rank 1 never joined
    (a closed connection, which says nothing of why), gets a note naming rank 1's error and what to do, not the
    conditional note of a rank whose own step may have broken. Before, rank 0 ended with the collective's error and
    that conditional note."""
    _train(tmp_path / "probe", "ddp", dict(mitigations=(), cpu_sample_every=1))
    peak = max(int(frame["peak_bytes"].max())
               for frame in rank_csvs(tmp_path / "probe", "memguard_history.csv").values())
    settings = dict(budget=peak, plan_at_start=False, mitigations=("checkpointing",), rescue_oom=False)
    _, outcomes = _train(tmp_path / "guarded", "ddp", settings, (1,))

    first, *notes = outcomes[1].splitlines()
    assert first == "RuntimeError: this block cannot be recomputed", outcomes[1]
    assert len(notes) == 1 and "the guard's recovery" in notes[0], notes
    first, *notes = outcomes[0].splitlines()
    assert first != "finished" and len(notes) == 1, outcomes[0]
    assert notes[0].startswith("lightning-memguard: rank 1 ended with an error other than out of memory in a step "
                               "run with rungs the guard had changed"), notes
    assert "RuntimeError: this block cannot be recomputed" in notes[0] and "leave it out of mitigations=" in notes[0]
    gave_up = rank_csvs(tmp_path / "guarded", "memguard_events.csv")[0]
    assert "rank 1 ended with an error other than out of memory" in " ".join(
        gave_up[gave_up["action"] == "gave_up"]["reason"]), gave_up


def _lightning_fit(root, callbacks, options: dict, breaks_on=()) -> BreaksWhenRecomputed:
    module = BreaksWhenRecomputed(breaks_on)
    os.environ.pop("MASTER_PORT", None)  # a port of its own for each launch
    strategy = lightning_class("strategies", "DDPStrategy")(start_method="spawn", **options)
    trainer = pl.Trainer(callbacks=callbacks, default_root_dir=str(root), logger=False, use_distributed_sampler=False,
                         **trainer_kwargs(strategy=strategy, devices=2, max_steps=STEPS))
    with ranks_killed_after(240):
        trainer.fit(module)  # ddp_spawn hands the rank 0 module's trained state back to this one
    return module


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_port")
@pytest.mark.parametrize("options", [{}, {"static_graph": True}], ids=["default", "static_graph"])
def test_under_lightning_ddp_a_rung_that_breaks_one_ranks_model_is_put_back_on_both(tmp_path, options):
    """With a static graph too: DDP starts it from one bucket of every parameter and rebuilds its buckets like the
    default's (the recovery took its first buckets as final and reduced stale ones: a collective size mismatch, both
    ranks aborted)."""
    reference = _lightning_fit(tmp_path / "plain", [], options)
    _lightning_fit(tmp_path / "probe", [MemGuardCallback(mitigations=(), cpu_sample_every=1)], options)
    peak = max(int(frame["peak_bytes"].max())
               for frame in rank_csvs(tmp_path / "probe", "memguard_history.csv").values())
    guard = MemGuardCallback(budget=peak, plan_at_start=False, mitigations=("checkpointing", "microbatch"))
    guarded = _lightning_fit(tmp_path / "guarded", [guard], options, breaks_on=(1,))

    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    decisions = {rank: frame[["step", "action", "rung", "level"]].reset_index(drop=True)
                 for rank, frame in events.items()}
    pd.testing.assert_frame_equal(decisions[0], decisions[1])
    reverted = {rank: frame[frame["action"] == "revert"] for rank, frame in events.items()}
    assert reverted[0]["rung"].tolist() == ["checkpointing"], events[0]
    assert "cannot be recomputed" in reverted[1]["reason"].iloc[0]
    assert "PeerRungError" in reverted[0]["reason"].iloc[0]
    for rank, history in rank_csvs(tmp_path / "guarded", "memguard_history.csv").items():
        assert set(history[history["phase"] == "after_optimizer_step"]["step"]) == set(range(STEPS)), rank
    for (name, p), (_, q) in zip(guarded.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=name)
