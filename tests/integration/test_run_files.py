"""A run's files are its own: a reused callback starts clean, a second run in the same directory never replaces the
first's files, a file that cannot be written never stops training, a run killed hard keeps its history up to the last
finished step, fast_dev_run writes nothing, and a resume that cannot apply the checkpoint's rungs says why."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import pandas as pd
import pytest
import torch

from lightning_memguard import MemGuard, MemGuardCallback
from lightning_memguard.commands.plot import load_run
from lightning_memguard.mitigations.checkpointing import ActivationCheckpointing
from tests.helpers import fit_module
from tests.models import BlockStack, pl, regression_batches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fit(guard, root, model=None, **trainer):
    return fit_module(model or BlockStack(width=32, depth=4, batch_size=64), guard, root, **trainer)


def test_a_reused_callback_starts_clean_at_each_fit(tmp_path):
    guard = MemGuardCallback(budget="2MiB", plan_at_start=True, cpu_sample_every=1)
    fit(guard, tmp_path / "first", max_steps=5)
    assert guard.history["step"].max() == 4 and (guard.events["action"] == "plan").sum() == 1
    fit(guard, tmp_path / "second", max_steps=3)
    history = pd.read_csv(tmp_path / "second" / "memguard_history.csv")
    assert sorted(history["step"].unique()) == [0, 1, 2]  # not the first fit's 0..4
    assert sorted(guard.history["step"].unique()) == [0, 1, 2]
    events = pd.read_csv(tmp_path / "second" / "memguard_events.csv")
    assert (events["action"] == "plan").sum() == 1  # planned again, and only this fit's events
    assert len(events) == len(guard.events)


def test_two_trainers_given_one_logger_keep_both_fits_files(tmp_path):
    """A second stage trained by a new Trainer with the first's logger (the same log_dir): the second fit's files
    replaced the first's, whose history was lost. Now they are versioned as Lightning versions a second checkpoint
    of the same name, and the report reads the latest, saying so."""
    logger = pl.loggers.CSVLogger(tmp_path)
    steps = (5, 3)
    guards = [MemGuardCallback(budget="2MiB", plan_at_start=True, cpu_sample_every=1) for _ in steps]
    trainers = [fit(guard, tmp_path, max_steps=n, logger=logger) for guard, n in zip(guards, steps)]
    log_dir = trainers[0].log_dir
    assert trainers[1].log_dir == log_dir
    first, second = (os.path.join(log_dir, name) for name in ("memguard_history.csv", "memguard_history-v1.csv"))
    assert (guards[0].history_csv, guards[1].history_csv) == (first, second)
    for guard, path, n in zip(guards, (first, second), steps):
        history = pd.read_csv(path)
        assert sorted(history["step"].unique()) == list(range(n)) and len(history) == len(guard.history)
        events = pd.read_csv(path.replace("_history", "_events"))
        assert (events["action"] == "plan").sum() == 1 and len(events) == len(guard.events)
    assert os.path.isfile(os.path.join(log_dir, "memguard_run-v1.json"))
    run = load_run(log_dir)
    assert sorted(run.history["step"].unique()) == [0, 1, 2] and run.settings["budget_bytes"] == 2 * 2**20
    assert [n for n in run.notes if "2 fits' files" in n and "memguard_history-v1.csv" in n]
    assert len(load_run(first).history) == len(guards[0].history)  # the first, read by its file


def test_a_loop_run_again_with_the_same_log_dir_keeps_the_earlier_runs_files(tmp_path):
    for run in range(3):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        with MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.01), log_dir=str(tmp_path),
                      tensorboard=False, cpu_sample_every=1) as guard:
            for batch in regression_batches(run + 1, size=8, features=16):
                guard.step(batch, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    names = ["memguard_history.csv", "memguard_history-v1.csv", "memguard_history-v2.csv"]
    assert guard.history_csv == str(tmp_path / names[-1])
    assert [pd.read_csv(tmp_path / name)["step"].nunique() for name in names] == [1, 2, 3]


def test_an_unwritable_log_directory_is_one_warning_and_training_goes_on(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    guard = MemGuardCallback(cpu_sample_every=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(guard, blocker / "logs", max_steps=3)
    assert trainer.global_step == 3
    cannot = [w for w in caught if "cannot write" in str(w.message)]
    assert cannot and all("training goes on" in str(w.message) for w in cannot)
    assert len(cannot) == len({str(w.message) for w in cannot}) <= 3  # one per file, not one per row
    assert sorted(guard.history["step"].unique()) == [0, 1, 2]  # kept in memory


KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from lightning_memguard import MemGuardCallback
    from tests.models import BlockStack, pl, trainer_kwargs

    class KilledAtStep6(BlockStack):
        def training_step(self, batch, batch_idx):
            if batch_idx == 6:
                os.kill(os.getpid(), signal.SIGKILL)  # what the Linux OOM killer does: no cleanup at all
            return super().training_step(batch, batch_idx)

    guard = MemGuardCallback(cpu_sample_every=1)  # default logging interval: every 50 steps
    pl.Trainer(callbacks=[guard], default_root_dir=sys.argv[1], logger=False,
               **trainer_kwargs(max_steps=20, log_every_n_steps=50)).fit(KilledAtStep6(width=32, depth=2))
""")


def test_a_run_killed_hard_keeps_every_finished_step(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED_RUN.format(root=ROOT))
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, timeout=300)
    assert result.returncode == -signal.SIGKILL
    history = pd.read_csv(tmp_path / "memguard_history.csv")
    finished = history[history["phase"] == "after_optimizer_step"]["step"].tolist()
    assert finished == [0, 1, 2, 3, 4, 5]  # only step 6, in progress when killed, is missing its end


def test_fast_dev_run_writes_no_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    guard = MemGuardCallback(budget="100KiB")  # crosses the threshold: would write explanations too
    pl.Trainer(callbacks=[guard], fast_dev_run=2, accelerator="cpu", enable_progress_bar=False,
               enable_model_summary=False).fit(BlockStack(width=32, depth=4, batch_size=64))
    assert len(guard.history) > 0 and len(guard.events) > 0  # measured and decided all the same
    assert os.listdir(tmp_path) == []


def test_without_a_logger_a_notice_says_where_the_files_go(tmp_path, caplog):
    """logger=False is the user's choice: said once, as a notice, not warned."""
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        fit(MemGuardCallback(), tmp_path, max_steps=1)
    assert not [w for w in caught if "logger" in str(w.message)]
    where = [r.getMessage() for r in caplog.records if "logging is off" in r.getMessage()]
    assert len(where) == 1 and str(tmp_path) in where[0]
    assert (tmp_path / "memguard_history.csv").exists()


def test_no_rung_warnings_when_there_is_nothing_to_guard(tmp_path):
    class NoBlocks(BlockStack):
        def __init__(self):
            super().__init__(width=32, depth=1)  # one block: nothing repeated

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(MemGuardCallback(), tmp_path, model=NoBlocks(), max_steps=1)
    assert not [str(w.message) for w in caught if "rung is off" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(MemGuardCallback(budget="1GiB"), tmp_path / "guarded", model=NoBlocks(), max_steps=1)
    assert len([w for w in caught if "checkpointing rung is off" in str(w.message)]) == 1


def test_resuming_with_fewer_blocks_than_the_checkpoint_says_what_to_do(tmp_path):
    model = BlockStack(width=32, depth=4, batch_size=64)
    ActivationCheckpointing(model).set_level(4)  # all four blocks: the callback takes the level over
    trainer = fit(MemGuardCallback(mitigations=("checkpointing",)), tmp_path / "first", model=model, max_steps=2)
    ckpt = str(tmp_path / "run.ckpt")
    trainer.save_checkpoint(ckpt)
    narrower = MemGuardCallback(mitigations=("checkpointing",), blocks=lambda name, m: name in ("blocks.0", "blocks.1"))
    with pytest.raises(ValueError, match=r"checkpoint being resumed saved MemGuard's checkpointing rung at level 4, "
                                         r"but this run allows levels 0-2.*blocks="):
        fit(narrower, tmp_path / "second", ckpt_path=ckpt, max_steps=4)
