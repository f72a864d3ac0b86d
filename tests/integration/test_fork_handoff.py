"""Under ``ddp_fork`` and ``ddp_notebook`` (Lightning's fork start: nothing is pickled) the fit runs in forked ranks:
the launching process's guard shows rank 0's history, events and the levels the fit ended at, read back from its
files, as after ``ddp_spawn``. Forks that are not Lightning starting a Trainer's ranks (DataLoader workers, a user's
own ``os.fork``), and launches of another guard's Trainer, leave a guard's results as they were."""

import os
import warnings

import pandas as pd
import pytest
from torch.utils.data import DataLoader

from lightning_memguard import MemGuardCallback
from lightning_memguard.adapters.spawned_results import SpawnedResults
from tests.models import BlockStack, HeavierOnRankOne, pl, regression_dataset, trainer_kwargs
from tests.ranks import rank_csvs, shows_rank_zeros_results, stepped
from tests.spawn import ranks_killed_after

pytestmark = pytest.mark.usefixtures("fresh_port")


def laddered_guard() -> MemGuardCallback:
    """A guard whose budget the two-rank fit crosses: the ladder acts in the ranks."""
    return MemGuardCallback(budget=int(16 * 2**20 / 0.9), mitigations=("checkpointing", "amp"))


def fork_fit(guard, root, steps: int, strategy: str = "ddp_fork"):
    os.environ.pop("MASTER_PORT", None)
    model = HeavierOnRankOne(width=64, depth=8, batch_size=256, n_samples=4096, log_loss=False)
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(root), logger=False,
                         **trainer_kwargs(strategy=strategy, devices=2, max_steps=steps))
    with ranks_killed_after(180):
        trainer.fit(model)
    assert trainer.state.finished
    return trainer


def handoffs(root) -> list:
    """The hand-off directories named under ``root`` (torch's launch names one of its own there too)."""
    return list(root.glob("memguard-spawn-*"))


def forked_loader(n_samples: int) -> DataLoader:
    """Two worker processes started by fork; a worker that hangs fails the test after a minute."""
    return DataLoader(regression_dataset(n_samples, seed=0), batch_size=16, num_workers=2,
                      multiprocessing_context="fork", timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_notebook"])
def test_after_a_forked_fit_the_guard_shows_rank_zeros_rows_events_and_levels(tmp_path, handoff_root, strategy):
    guard = laddered_guard()
    trainer = fork_fit(guard, tmp_path / "run", steps=5, strategy=strategy)

    shows_rank_zeros_results(guard, tmp_path / "run", steps=5)
    assert guard.engine.history.empty
    # one launch, one hand-off directory, still there after the ranks (copies of this process) exited
    assert len(handoffs(handoff_root)) == 1
    assert trainer.state.finished


@pytest.mark.slow
def test_forks_other_than_a_launch_of_its_ranks_leave_a_guards_results(tmp_path, handoff_root):
    """Two guards, each fitted under ddp_fork by its own Trainer, then a DataLoader's forked workers and a plain
    ``os.fork``: each guard keeps its own fit's rank 0 rows and its hand-off directory."""
    first, second = laddered_guard(), laddered_guard()
    fork_fit(first, tmp_path / "first", steps=3)
    fork_fit(second, tmp_path / "second", steps=2)  # forks this process again: only the second guard's launch

    assert sum(len(x) for x, _ in forked_loader(64)) == 64
    child = os.fork()
    if child == 0:
        os._exit(0)
    assert os.waitpid(child, 0)[1] == 0

    for guard, run, steps in ((first, "first", 3), (second, "second", 2)):
        assert stepped(guard.history) == list(range(steps))
        pd.testing.assert_frame_equal(guard.history, rank_csvs(tmp_path / run, "memguard_history.csv")[0])
        pd.testing.assert_frame_equal(guard.events, rank_csvs(tmp_path / run, "memguard_events.csv")[0])
    assert len(handoffs(handoff_root)) == 2


def test_a_plain_fit_with_forked_dataloader_workers_keeps_its_own_history(tmp_path, handoff_root):
    guard = MemGuardCallback(budget="1GiB")  # guarded: a row every step (monitored only, CPU steps are sampled)
    model = BlockStack(width=32, depth=2, batch_size=16, n_samples=128, log_loss=False)
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path / "run"), logger=False,
                         **trainer_kwargs(max_steps=3))
    trainer.fit(model, train_dataloaders=forked_loader(128))

    assert stepped(guard.history) == [0, 1, 2]
    assert guard.history["time"].equals(guard.engine.history["time"])  # this process's rows, not a file's
    assert guard.state_dict() == guard.engine.state_dict()
    assert handoffs(handoff_root) == []  # the workers' forks named no hand-off


@pytest.mark.slow
def test_a_hand_off_that_cannot_be_prepared_is_one_warning_and_the_forked_fit_trains_on(tmp_path, handoff_root,
                                                                                       monkeypatch):
    """The fork hook runs inside Lightning's launch, where an error would only be printed: one warning instead, the
    ranks train to the end, and the launching process's guard shows its own (empty) rows, not a file's."""
    def cannot_prepare(self):
        raise OSError("no space left on device (as a test makes it)")

    monkeypatch.setattr(SpawnedResults, "_prepare_launch", cannot_prepare)
    guard = laddered_guard()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fork_fit(guard, tmp_path / "run", steps=3)
    said = [str(w.message) for w in caught if "hand-off" in str(w.message)]
    assert len(said) == 1 and "no space left on device" in said[0], said
    assert trainer.state.finished and guard.history.empty and handoffs(handoff_root) == []
    assert stepped(rank_csvs(tmp_path / "run", "memguard_history.csv")[0]) == [0, 1, 2]  # rank 0 wrote its own files
