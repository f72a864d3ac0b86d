"""Under ``ddp_spawn`` the fit runs in spawned ranks: the launching process's guard shows rank 0's history, events and
the levels the fit ended at, read back from its files, and a later run replaces them."""

import copy
import os
import pickle
import warnings

import pandas as pd
import pytest
import torch

from lightning_memguard import MemGuardCallback, MemGuardWarning
from tests.models import BlockStack, HeavierOnRankOne, pl, trainer_kwargs
from tests.ranks import rank_csvs, shows_rank_zeros_results, stepped
from tests.spawn import ranks_killed_after

pytestmark = pytest.mark.usefixtures("fresh_port")


def spawn_fit(guard, root, steps, **overrides):
    os.environ.pop("MASTER_PORT", None)
    model = HeavierOnRankOne(width=64, depth=8, batch_size=256, n_samples=4096, log_loss=False)
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(root), logger=False,
                         **trainer_kwargs(strategy="ddp_spawn", devices=2, max_steps=steps, **overrides))
    with ranks_killed_after(240):
        trainer.fit(model)
    return trainer


@pytest.mark.slow
def test_after_a_ddp_spawn_fit_the_guard_shows_rank_zeros_rows_and_events(tmp_path, handoff_root):
    guard = MemGuardCallback(budget=int(16 * 2**20 / 0.9), mitigations=("checkpointing", "amp"))
    trainer = spawn_fit(guard, tmp_path / "run", steps=6)
    assert trainer.state.finished

    shows_rank_zeros_results(guard, tmp_path / "run", steps=6)  # and levels, state_dict: where the fit ended
    trainer.save_checkpoint(tmp_path / "saved.ckpt")
    saved = torch.load(tmp_path / "saved.ckpt", weights_only=False)["callbacks"]
    assert [state["ladder"]["levels"] for state in saved.values()] == [guard.levels]

    # copies show the same, and pickling after the fit works
    pd.testing.assert_frame_equal(copy.deepcopy(guard).events, guard.events)
    pd.testing.assert_frame_equal(pickle.loads(pickle.dumps(guard)).history, guard.history)

    # a file gone: one warning, then this process's own (empty) rows; the fit is not touched
    os.remove(tmp_path / "run" / "memguard_history.csv")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert guard.history.empty and guard.events.empty
    said = [str(w.message) for w in caught if issubclass(w.category, MemGuardWarning)]
    assert len(said) == 1 and "cannot read back" in said[0], said

@pytest.mark.slow
def test_a_later_fit_replaces_what_a_ddp_spawn_fit_handed_back(tmp_path, handoff_root):
    """A second spawned fit shows its own steps (never the first fit's), leaving one hand-off directory; a fit run in
    this process afterwards shows its own rows and leaves none."""
    guard = MemGuardCallback(budget=int(16 * 2**20 / 0.9), mitigations=("checkpointing", "amp"))
    spawn_fit(guard, tmp_path / "first", steps=5)
    assert stepped(guard.history) == list(range(5))
    first_handoff = list(handoff_root.iterdir())
    assert len(first_handoff) == 1

    spawn_fit(guard, tmp_path / "second", steps=3)
    assert stepped(guard.history) == [0, 1, 2]
    pd.testing.assert_frame_equal(guard.history, rank_csvs(tmp_path / "second", "memguard_history.csv")[0])
    pd.testing.assert_frame_equal(guard.events, rank_csvs(tmp_path / "second", "memguard_events.csv")[0])
    assert len(list(handoff_root.iterdir())) == 1 and not first_handoff[0].exists()

    model = BlockStack(width=64, depth=4, batch_size=64, n_samples=512, log_loss=False)
    pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path / "here"), logger=False,
               **trainer_kwargs(max_steps=2)).fit(model)
    assert stepped(guard.history) == [0, 1]
    assert guard.history["time"].equals(guard.engine.history["time"])  # this process's rows, not a file's
    assert list(handoff_root.iterdir()) == []


@pytest.mark.slow
def test_a_guard_fitted_in_this_process_starts_the_ranks_of_a_ddp_spawn_fit(tmp_path, handoff_root):
    """Pickled for the spawned ranks after a fit in this process, the guard held that fit's sources and closures
    over its Trainer, which cannot be pickled: the ranks never started. They get the guard as made now (and this
    process keeps no Trainer through it)."""
    guard = MemGuardCallback(budget=int(16 * 2**20 / 0.9), mitigations=("checkpointing", "amp"))
    model = BlockStack(width=64, depth=4, batch_size=64, n_samples=512, log_loss=False)
    pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path / "here"), logger=False,
               **trainer_kwargs(max_steps=2)).fit(model)
    assert stepped(guard.history) == [0, 1]
    spawn_fit(guard, tmp_path / "spawned", steps=3)
    assert stepped(guard.history) == [0, 1, 2]
    pd.testing.assert_frame_equal(guard.history, rank_csvs(tmp_path / "spawned", "memguard_history.csv")[0])

