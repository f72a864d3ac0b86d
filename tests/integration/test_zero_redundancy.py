"""torch's ZeroRedundancyOptimizer beside DistributedDataParallel, on two gloo ranks (plain loop): each rank keeps the
optimizer state of its partition of the parameters only, in the wrapper's local optimizer (``optim``; the wrapper's
own ``state`` stays empty). The estimate builds a like local optimizer on this rank's partition, so the plan before the
first step works (it raised TypeError: the wrapper's constructor takes ``optimizer_class``, and the guard fell back to
measuring) and counts this rank's state, not every parameter's; from a LightningModule's ``configure_optimizers``, the
estimate steps the local optimizer alone (the wrapper's step broadcast every shard from inside the estimate, counted
as collectives of the training step's own); the guarded run trains as plain ZeRO does."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from lightning_memguard import MemGuard, estimate_memory
from lightning_memguard.sources.training_state import training_state_bytes
from tests.helpers import mse, train_plain
from tests.models import RecordedBlockStack, Stack, regression_batches
from tests.ranks import assert_each_rank_close, gloo_group, rank_csvs, rank_parameters, save_full_parameters, wrap_for
from tests.spawn import spawn_ranks

WIDTH, DEPTH, SIZES, STEPS = 128, 8, (128, 192), 3  # rank r trains on batches of SIZES[r] samples


def _zero(model: torch.nn.Module, **adam):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3, **adam)


def _state_bytes(optimizer) -> int:
    return sum(t.nbytes for state in optimizer.optim.state.values() for t in state.values()
               if isinstance(t, torch.Tensor))


class ZeroStack(RecordedBlockStack):
    """A LightningModule whose ``configure_optimizers`` returns a ZeroRedundancyOptimizer, as a user's does under
    ``strategy="ddp"``."""

    def configure_optimizers(self):
        return _zero(self)


def _broadcasts_of_an_estimate(batch) -> int:
    """The broadcasts ``estimate_memory`` issues estimating :class:`ZeroStack` from its ``configure_optimizers``:
    the wrapper's step broadcasts every rank's updated shard to the others, from inside the estimate."""
    calls, broadcast = [], dist.broadcast
    dist.broadcast = lambda *args, **kwargs: calls.append(1) or broadcast(*args, **kwargs)
    try:
        estimate_memory(ZeroStack(n_samples=SIZES[1]), batch, target="cpu")
    finally:
        dist.broadcast = broadcast
    return len(calls)


def _worker(rank: int, root: str, mode: str, budget: int = 0) -> None:
    import warnings

    with gloo_group(rank, root), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        model = wrap_for(Stack(width=WIDTH, depth=DEPTH), "ddp")
        optimizer = _zero(model)
        batches = regression_batches(STEPS, size=SIZES[rank])
        if mode == "plain":
            train_plain(model, optimizer, batches, loss=mse)
        else:
            estimate = estimate_memory(model, batches[0], optimizer=optimizer, loss_fn=mse, target="cpu") \
                if mode == "measure" else None
            settings = dict(mitigations=(), cpu_sample_every=1) if mode == "measure" else dict(
                budget=budget, mitigations=("checkpointing", "microbatch"))
            with MemGuard(model, optimizer, log_dir=root, tensorboard=False, explain=False, **settings) as guard:
                for batch in batches:
                    guard.step(batch, mse)
            broadcasts = _broadcasts_of_an_estimate(batches[0]) if mode == "measure" else None
            with open(os.path.join(root, f"rank{rank}.json"), "w") as file:
                json.dump({"estimate": estimate.phase_peaks if estimate else None, "state": _state_bytes(optimizer),
                           "broadcasts": broadcasts,
                           "counted": training_state_bytes(model, [optimizer])["optimizer_state"],
                           "said": [str(w.message) for w in said if "lightning-memguard" in str(w.message)]}, file)
        save_full_parameters(model, root, rank)


def _run(root, mode: str, budget: int = 0) -> dict:
    os.makedirs(root, exist_ok=True)
    spawn_ranks(_worker, (str(root), mode, budget), timeout_s=240)
    return {rank: json.loads((root / f"rank{rank}.json").read_text()) for rank in (0, 1)} if mode != "plain" else {}


@pytest.mark.slow
def test_zero_redundancy_is_estimated_per_rank_and_trains_guarded_as_plain(tmp_path):
    measured = _run(tmp_path / "measure", "measure")
    histories = rank_csvs(tmp_path / "measure", "memguard_history.csv")
    for rank, found in measured.items():
        history = histories[rank][histories[rank]["step"] >= 1]
        # the loop zeroes the gradients before the forward, the estimate after it, as Lightning does: the phases both
        # orders share
        for phase, row_phase in (("backward", "after_backward"), ("optimizer_step", "after_optimizer_step")):
            measured_peak = history[history["phase"] == row_phase]["peak_bytes"].max()
            assert found["estimate"][phase] == pytest.approx(measured_peak, rel=0.05), (rank, phase)
        optimizer_step = history[history["phase"] == "after_optimizer_step"]["peak_bytes"].max()
        # the other rank's half of Adam's state, which an estimate of every parameter's would add, is more than
        # twice the tolerance
        assert found["state"] > 0.1 * optimizer_step, rank
        # what the reports count as held across steps is that state (the wrapper's own ``state`` is empty)
        assert found["counted"] == found["state"], rank
        # from configure_optimizers (Lightning's way): the local optimizer's step alone, no collective
        assert found["broadcasts"] == 0, rank

    # a budget where the whole batch does not fit on rank 1: the plan before the first step acts, on both ranks alike
    history = histories[1][histories[1]["step"] >= 1]
    held = history[history["phase"] == "batch_start"]["allocated_bytes"].max()
    budget = int(held + 0.6 * (history["peak_bytes"].max() - held))
    guarded = _run(tmp_path / "guarded", "guarded", budget)
    _run(tmp_path / "plain", "plain")
    for rank, found in guarded.items():
        assert not [text for text in found["said"] if "cannot be predicted" in text], found["said"]
    plans = {rank: frame[frame["action"] == "plan"] for rank, frame in
             rank_csvs(tmp_path / "guarded", "memguard_events.csv").items()}
    assert all(set(plan["step"]) == {0} for plan in plans.values()) and not plans[1].empty, plans
    # Adam's first steps move a parameter by about lr whatever its gradient's size: a gradient near zero summed over
    # micro-batches in another order moves it by a little more or less (1 of 65,536 by 2.7e-5 at lr 1e-3)
    assert_each_rank_close(rank_parameters(tmp_path / "guarded"), rank_parameters(tmp_path / "plain"), atol=1e-4)


# --- what a report advises under ZeroRedundancyOptimizer ------------------------------------------------------------
HARD_LIMIT = 64 * 2 ** 20  # far above a step of the stack; the ballast alone passes it


def _advised_worker(rank: int, root: str, mode: str) -> None:
    """Rank 1's optimizer step runs out of memory at step 2 (a ballast in the local optimizer's step, before the
    wrapper's broadcasts), or once at step 0 (``mode="first_step"``, Adam's group-wide kernels on: the guard retries
    it one parameter at a time), or (``mode="state"``) every rank's budget is under what its training state holds."""
    from lightning_memguard import MemGuardOutOfMemoryError

    with gloo_group(rank, root):
        torch.manual_seed(0)
        model = wrap_for(Stack(width=WIDTH, depth=DEPTH), "ddp")
        optimizer = _zero(model, **({"foreach": True} if mode == "first_step" else {}))
        step, ballast, fired = [0], [], []

        def ballast_in_the_step(local, args, kwargs):
            if rank == 1 and not fired and (mode, step[0]) in (("optimizer", 2), ("first_step", 0)):
                fired.append(step[0])
                ballast.append(torch.empty(HARD_LIMIT, dtype=torch.uint8))

        optimizer.optim.register_step_pre_hook(ballast_in_the_step)
        settings = dict(cpu_hard_limit=HARD_LIMIT, budget=HARD_LIMIT) if mode != "state" else dict(budget=2 ** 20)
        ended = "finished"
        try:
            with MemGuard(model, optimizer, log_dir=root, tensorboard=False, explain=False, **settings) as guard:
                for step[0], batch in enumerate(regression_batches(STEPS, size=SIZES[rank])):
                    guard.step(batch, mse)
                    ballast.clear()
        except MemGuardOutOfMemoryError as err:
            ended = str(err)
        except RuntimeError as err:  # gloo's, where the other rank's process ended in a collective
            ended = f"RuntimeError: {err}"
        with open(os.path.join(root, f"rank{rank}.json"), "w") as file:
            json.dump({"ended": ended}, file)
        if ended == "finished":
            save_full_parameters(model, root, rank)


@pytest.mark.slow
def test_a_ranks_optimizer_step_oom_under_zero_redundancy_advises_more_ranks_and_stops_both(tmp_path):
    """Not retried (not the first step): rank 1's report names what would help a state already sharded over the
    two ranks, not sharding it; rank 0, waiting in the wrapper's broadcast, stops with rank 1's report as its own
    ``gave_up`` event."""
    spawn_ranks(_advised_worker, (str(tmp_path), "optimizer"), timeout_s=240)
    ended = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text())["ended"] for rank in (0, 1)}
    assert "the optimizer step ran out of memory" in ended[1], ended
    assert "more ranks (ZeroRedundancyOptimizer shards the optimizer state over 2 now" in ended[1]
    assert "torch's ZeroRedundancyOptimizer beside DDP" not in ended[1]
    assert ended[0] != "finished", ended
    gave_up = rank_csvs(tmp_path, "memguard_events.csv")[0].query("action == 'gave_up'")
    assert len(gave_up) == 1 and "rank 1 ran out of memory" in gave_up["reason"].iloc[0], gave_up


@pytest.mark.slow
def test_a_state_over_the_budget_under_zero_redundancy_is_told_at_step_0_what_would_help(tmp_path):
    spawn_ranks(_advised_worker, (str(tmp_path), "state"), timeout_s=240)
    for rank, events in rank_csvs(tmp_path, "memguard_events.csv").items():
        told = events[(events["step"] == 0) & (events["action"] == "cannot_help")]["reason"].tolist()
        assert len(told) == 1 and "more ranks (ZeroRedundancyOptimizer shards the optimizer state over 2" in told[0]
        assert "torch's ZeroRedundancyOptimizer beside DDP" not in told[0], told


@pytest.mark.slow
def test_a_ranks_first_optimizer_step_oom_under_zero_redundancy_is_retried_there_and_both_train_on(tmp_path):
    """Nothing was updated yet: rank 1 runs its local step again one parameter at a time while rank 0 waits in the
    wrapper's broadcast of the shards, which rank 1's second try then joins; the ranks end as plain ZeRO does."""
    (tmp_path / "guarded").mkdir()
    spawn_ranks(_advised_worker, (str(tmp_path / "guarded"), "first_step"), timeout_s=240)
    ended = {rank: json.loads((tmp_path / "guarded" / f"rank{rank}.json").read_text())["ended"] for rank in (0, 1)}
    assert ended == {0: "finished", 1: "finished"}, ended
    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    assert events[0].empty, events[0]
    assert events[1][["step", "action", "rung"]].values.tolist() == [[0, "rescue", "optimizer"]], events[1]
    _run(tmp_path / "plain", "plain")
    assert_each_rank_close(rank_parameters(tmp_path / "guarded"), rank_parameters(tmp_path / "plain"), atol=1e-6)
