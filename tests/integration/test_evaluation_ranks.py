"""An evaluation batch that runs out of memory on one rank of two (gloo, a DistributedDataParallel model in a plain
loop, under Fabric and under Lightning's ddp_spawn, in a fit or in ``trainer.validate``). Once a batch of the loop has
completed without a collective of the step's own, that rank runs the batch again in more parts alone: the other rank
is unaware, and both go on training as one model; before one has, the parts run alone refusing any collective. Where
the step issues a collective, the run ends with a report that says why."""

import os
from pathlib import Path
from typing import Optional

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torchmetrics
from torch.utils.data import DataLoader

from lightning_memguard import MemGuard, MemGuardCallback
from tests.helpers import mse, predictions, train_plain
from tests.models import ShiftedStack, Stack, lightning_class, pl, trainer_kwargs
from tests.ranks import OneOffBallast, gloo_group, rank_csvs, rank_half, rank_parameters, rank_texts, \
    save_full_parameters, wrap_for
from tests.spawn import launch_rank_script, ranks_killed_after, spawn_ranks

LIMIT = 32 * 2 ** 20  # far above a step of the stack; the ballast alone passes it


def reduced_predictions(model, batch) -> torch.Tensor:
    """The predictions, and their sum reduced over the ranks: a collective of the evaluation step's own."""
    output = model(batch[0])
    dist.all_reduce(output.sum())
    return output


def _first_evaluation_worker(rank: int, root: str, step_fn: str) -> None:
    """Trains 2 steps, then evaluates a batch whose forward runs out of memory on rank 1 alone: the loop's first, so
    whether the step issues collectives of its own is not known yet. Writes each rank's outcome and, where it
    finished, its predictions beside the unguarded model's."""
    evaluate_fn = {"predictions": predictions, "reduced": reduced_predictions}[step_fn]
    with gloo_group(rank, root):
        model = wrap_for(Stack(), "ddp")  # seeded: the same parameters on both ranks
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        ballast = OneOffBallast(model.module.blocks[0], "forward", LIMIT)
        data = rank_half(rank, 2)
        outcome = "finished"
        with MemGuard(model, optimizer, log_dir=root, cpu_hard_limit=LIMIT, budget=LIMIT, tensorboard=False,
                      plan_at_start=False) as guard:
            for batch in data:
                guard.step(batch, mse)
            ballast.armed = rank == 1  # rank 1's first evaluation batch alone runs out of memory
            try:
                got = guard.evaluate(data[0], evaluate_fn)
            except Exception as error:  # rank 1's report; rank 0's collective that rank 1 never joined
                outcome = str(error)
        Path(root, f"outcome.rank{rank}.txt").write_text(outcome)
        if outcome == "finished":
            with torch.no_grad():
                torch.save((got, model.module(data[0][0])), os.path.join(root, f"outputs.rank{rank}.pt"))
        if step_fn == "reduced" and rank == 1:
            return  # rank 0 waits in the step's collective: it ends when this process does


@pytest.mark.slow
def test_one_ranks_oom_in_the_first_evaluation_batch_runs_it_again_in_parts_on_that_rank_alone(tmp_path):
    """No batch of the loop has completed yet (``trainer.test``'s first, a validation with no sanity check): rank 1
    runs its batch in parts alone all the same, refusing any collective its parts would try, and tries none: both
    ranks finish, rank 1's predictions those of the whole batch. Before, the run ended with a report."""
    os.makedirs(tmp_path, exist_ok=True)
    spawn_ranks(_first_evaluation_worker, (str(tmp_path), "predictions"), timeout_s=240)
    assert rank_texts(tmp_path, "outcome") == {0: "finished", 1: "finished"}
    for rank in (0, 1):
        got, want = torch.load(tmp_path / f"outputs.rank{rank}.pt")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
    splits = {rank: frame[frame["action"] == "eval_split"]
              for rank, frame in rank_csvs(tmp_path, "memguard_events.csv").items()}
    assert splits[0].empty and splits[1]["level"].tolist() == [2], splits


@pytest.mark.slow
def test_a_first_evaluation_batch_whose_step_issues_a_collective_ends_with_the_report_not_issuing_it(tmp_path):
    """The step reduces a value over the ranks after its forward: rank 1's first part reaches that all-reduce, which
    is refused, not issued (rank 0 would have summed it with its own batch's and gone on with a wrong value), and rank
    1 ends with the report, which names the collective and what to do; rank 0 ends when rank 1's process does."""
    os.makedirs(tmp_path, exist_ok=True)
    spawn_ranks(_first_evaluation_worker, (str(tmp_path), "reduced"), timeout_s=240)
    outcomes = rank_texts(tmp_path, "outcome")
    assert outcomes[1].startswith("lightning-memguard could not rescue a validation batch of 128 samples: the run has "
                                  "several processes, and the validation step issues collectives of its own"), \
        outcomes[1]
    assert "log the value on_epoch only" in outcomes[1]
    assert outcomes[0] != "finished"  # its all-reduce never met one of rank 1's


def _split_alone_worker(rank: int, root: str, step_fn: str) -> None:
    """Trains 2 steps, evaluates a batch, trains a step, evaluates a batch that runs out of memory on rank 1 (inside
    the module's forward, after DDP's broadcast of the buffer), trains a last step — with the guard under ``root``/
    guarded, and without it under ``root``/plain; each run's predictions and parameters saved."""
    evaluate_fn = {"predictions": predictions, "reduced": reduced_predictions}[step_fn]
    with gloo_group(rank, root):
        data = rank_half(rank, 4)
        for run in ("plain", "guarded"):
            folder = os.path.join(root, run)
            os.makedirs(folder, exist_ok=True)
            model = wrap_for(ShiftedStack(), "ddp")
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            outputs, outcome = [], "finished"
            if run == "plain":
                def train(batches):
                    train_plain(model, optimizer, batches)

                def evaluate(batch):
                    with torch.no_grad():
                        return evaluate_fn(model, batch)
            else:
                guard = MemGuard(model, optimizer, log_dir=folder, cpu_hard_limit=LIMIT, budget=LIMIT,
                                 tensorboard=False, plan_at_start=False)
                ballast = OneOffBallast(model.module.blocks[0], "forward", LIMIT)

                def train(batches):
                    for batch in batches:
                        guard.step(batch, mse)

                def evaluate(batch):
                    return guard.evaluate(batch, evaluate_fn)
            try:
                train(data[:2])
                outputs.append(evaluate(data[0]))
                train(data[2:3])
                if run == "guarded":
                    ballast.armed = rank == 1
                outputs.append(evaluate(data[1]))
                train(data[3:])
            except Exception as error:  # rank 1's report; rank 0's collective that rank 1 left
                outcome = str(error)
            finally:
                if run == "guarded":
                    guard.close()
            Path(folder, f"outcome.rank{rank}.txt").write_text(outcome)
            if outcome == "finished":
                torch.save(outputs, os.path.join(folder, f"outputs.rank{rank}.pt"))
                save_full_parameters(model.module, folder, rank)
            else:
                return  # rank 0 waits in the step's collective: it ends when this process does


@pytest.mark.slow
@pytest.mark.parametrize("door", ["loop", "fabric"])
def test_one_ranks_evaluation_oom_runs_that_batch_again_in_parts_on_that_rank_alone(tmp_path, door):
    """Rank 1's evaluation batch after a training step runs out of memory inside its forward, after DDP broadcast
    the module's buffer: rank 1 runs it again in 2 parts, issuing that broadcast no second time (it would meet rank
    0's next gradient reduction), and both ranks predict and train exactly as without the guard. In a plain loop and
    under Fabric's ddp_spawn (tests/integration/fabric_evaluation_run.py)."""
    os.makedirs(tmp_path, exist_ok=True)
    if door == "loop":
        spawn_ranks(_split_alone_worker, (str(tmp_path), "predictions"), timeout_s=240)
        assert rank_texts(tmp_path / "guarded", "outcome") == {0: "finished", 1: "finished"}
    else:
        launch_rank_script("tests.integration.fabric_evaluation_run", tmp_path)
    for rank in (0, 1):
        got = torch.load(tmp_path / "guarded" / f"outputs.rank{rank}.pt")
        want = torch.load(tmp_path / "plain" / f"outputs.rank{rank}.pt")
        for index, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, evaluation {index}")
    guarded, plain = rank_parameters(tmp_path / "guarded"), rank_parameters(tmp_path / "plain")
    for rank in (0, 1):
        for name, value in plain[rank].items():
            torch.testing.assert_close(guarded[rank][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    splits = {rank: frame[frame["action"] == "eval_split"] for rank, frame in events.items()}
    assert splits[0].empty, events[0]
    assert splits[1]["level"].tolist() == [2], events[1]
    assert "out of memory in validation batch of 128 samples" in splits[1]["reason"].iloc[0]
    histories = rank_csvs(tmp_path / "guarded", "memguard_history.csv")
    for rank, history in histories.items():  # every training step ran to its optimizer step, on both ranks
        assert sorted(history[history["phase"] == "after_optimizer_step"]["step"]) == [0, 1, 2, 3], rank
    rows = histories[1][histories[1]["phase"] == "validation"]
    assert rows["micro_batches"].tolist() == [1, 2]


@pytest.mark.slow
def test_an_evaluation_step_with_a_collective_of_its_own_is_not_split_on_one_rank(tmp_path):
    """The step reduces a value over the ranks: its parts on rank 1 alone would reduce it again where rank 0 does
    not, so rank 1 ends with the report, which names the collective and what to do."""
    os.makedirs(tmp_path, exist_ok=True)
    spawn_ranks(_split_alone_worker, (str(tmp_path), "reduced"), timeout_s=240)
    outcome = rank_texts(tmp_path / "guarded", "outcome")[1]
    assert outcome.startswith("lightning-memguard could not rescue a validation batch of 128 samples: the run has "
                              "several processes, and the validation step issues collectives of its own"), outcome
    assert "log the value on_epoch only" in outcome


# --- the same under Lightning's ddp_spawn -----------------------------------------------------------------------------
EPOCHS, TRAIN_BATCHES, VALIDATION_BATCHES = 2, 3, 3


class ValidatedStack(pl.LightningModule):
    """:class:`ShiftedStack` trained on each rank's half of the batches and validated on 3 batches a rank, the loss
    logged with ``sync_dist=True`` (reduced over the ranks at the epoch's end), and two torchmetrics metrics (synced at
    the epoch's end). ``oom_on_rank``: that rank's validation batch ``oom_at`` of the first epoch (not the sanity
    check's) runs out of memory once, under ``LIMIT``."""

    def __init__(self, oom_on_rank: Optional[int] = None, oom_at: int = 0, manual: bool = False) -> None:
        super().__init__()
        self.model = ShiftedStack()
        self.oom_on_rank, self.oom_at = oom_on_rank, oom_at
        self.automatic_optimization = not manual
        # synced at the epoch's end: a state of sums and one of lists (each part appends its own)
        self.val_mae, self.val_spearman = torchmetrics.MeanAbsoluteError(), torchmetrics.SpearmanCorrCoef()
        self.ballast: Optional[OneOffBallast] = None

    def on_fit_start(self) -> None:  # in the rank's own process
        self.ballast = OneOffBallast(self.model.blocks[0], "forward", LIMIT)

    def on_validation_batch_start(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.ballast is None:  # trainer.validate: no fit started
            self.ballast = OneOffBallast(self.model.blocks[0], "forward", LIMIT)
        if not self.trainer.sanity_checking and self.current_epoch == 0 and self.global_rank == self.oom_on_rank \
                and batch_idx == self.oom_at:
            self.ballast.armed = True

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return mse(self.model, batch)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(mse(self.model, batch))
        optimizer.step()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", mse(self.model, batch), sync_dist=True)
        predicted, target = self.model(batch[0]).squeeze(-1), batch[1].squeeze(-1)
        self.val_mae(predicted, target)
        self.val_spearman(predicted, target)
        self.log_dict({"val_mae": self.val_mae, "val_spearman": self.val_spearman})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(rank_half(self.global_rank, TRAIN_BATCHES), batch_size=None)

    def val_dataloader(self):
        return DataLoader(rank_half(self.global_rank, VALIDATION_BATCHES + 5)[5:], batch_size=None)


def _fit(root, callbacks: list, oom_on_rank: Optional[int] = None, validate: bool = False,
         manual: bool = False, oom_at: int = 0) -> ValidatedStack:
    """A fit of :class:`ValidatedStack` under ``ddp_spawn``, where rank ``oom_on_rank``'s validation batch ``oom_at``
    after the sanity check runs out of memory (or, ``validate``, ``trainer.validate``'s alone)."""
    module = ValidatedStack(oom_on_rank, oom_at=oom_at, manual=manual)
    os.environ.pop("MASTER_PORT", None)  # a port of its own for each launch
    trainer = pl.Trainer(callbacks=callbacks, default_root_dir=str(root), use_distributed_sampler=False,
                         logger=lightning_class("loggers", "CSVLogger")(str(root), name="", version=""),
                         **trainer_kwargs(strategy="ddp_spawn", devices=2, max_steps=-1, max_epochs=EPOCHS))
    with ranks_killed_after(240):
        if validate:
            trainer.validate(module)
        else:
            trainer.fit(module)  # ddp_spawn hands the rank 0 module's trained state back to this one
    return module


def validation_metrics(root) -> dict[str, list[float]]:
    metrics = pd.read_csv(Path(root, "metrics.csv"))
    return {key: metrics[key].dropna().tolist() for key in ("val_loss", "val_mae", "val_spearman")}


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_port")
@pytest.mark.parametrize("optimization", ["automatic", "manual"])
def test_under_lightning_ddp_one_ranks_validation_oom_is_split_on_that_rank_alone(tmp_path, optimization):
    """The sanity check's validation batches show the step issues no collective; rank 1's first validation batch
    after training then runs out of memory and runs again in 2 parts there alone. Both ranks train on; the validation
    loss reduced over the ranks and the trained parameters are the unguarded run's. Under manual optimization too (no
    training batch runs again there, but an evaluation batch has no gradients)."""
    manual = optimization == "manual"
    plain = _fit(tmp_path / "plain", [], manual=manual)
    guard = MemGuardCallback(cpu_hard_limit=LIMIT, budget=LIMIT, plan_at_start=False)
    guarded = _fit(tmp_path / "guarded", [guard], oom_on_rank=1, manual=manual)

    want = validation_metrics(tmp_path / "plain")
    assert all(len(values) == EPOCHS for values in want.values()), want
    got = validation_metrics(tmp_path / "guarded")
    for key, values in want.items():
        assert got[key] == pytest.approx(values, rel=1e-5), key
    for (name, p), (_, q) in zip(guarded.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    assert events[0][events[0]["action"] == "eval_split"].empty, events[0]
    splits = events[1][events[1]["action"] == "eval_split"]
    assert splits["level"].tolist() == [2], events[1]
    for rank, history in rank_csvs(tmp_path / "guarded", "memguard_history.csv").items():
        trained = history[history["phase"] == "after_optimizer_step"]["step"]
        assert sorted(trained) == list(range(EPOCHS * TRAIN_BATCHES)), rank
        validated = history[history["phase"] == "validation"]["micro_batches"].tolist()
        assert validated == ([2] * 6 if rank == 1 else [1] * 6), (rank, validated)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_port")
@pytest.mark.parametrize("oom_at", [0, 1], ids=["first batch", "second batch"])
def test_under_lightning_ddp_trainer_validate_splits_one_ranks_batch_alone(tmp_path, oom_at):
    """``trainer.validate`` runs the module unwrapped (no DDP, no sanity check): rank 1's batch ``oom_at``, out of
    memory, runs in 2 parts there alone — after a first batch that showed the step issues no collective, or as the
    first, its parts refusing any (before, that ended the run with a report); the metrics are the unguarded run's."""
    _fit(tmp_path / "plain", [], validate=True)
    guard = MemGuardCallback(cpu_hard_limit=LIMIT, budget=LIMIT, plan_at_start=False)
    _fit(tmp_path / "guarded", [guard], oom_on_rank=1, validate=True, oom_at=oom_at)

    want, got = validation_metrics(tmp_path / "plain"), validation_metrics(tmp_path / "guarded")
    assert all(len(values) == 1 for values in want.values()), want
    for key, values in want.items():
        assert got[key] == pytest.approx(values, rel=1e-5), key
    events = rank_csvs(tmp_path / "guarded", "memguard_validation_events.csv")
    assert events[0][events[0]["action"] == "eval_split"].empty, events[0]
    assert events[1][events[1]["action"] == "eval_split"]["level"].tolist() == [2], events[1]
