"""Reading, from a real Trainer's fit loop, whether a training step logs a value reduced across the ranks at each log
call (``sync_dist=True`` with ``on_step``): what keeps every rank of a DDP run from running a batch, or a part of one,
alone (:class:`~lightning_memguard.adapters.logged_sync.LoggedSync`). One process under ``strategy="ddp"`` (Lightning
reduces a ``sync_dist`` value only under a distributed strategy), spawned: its process group stays out of the test
run's process."""

import json
import os

import pytest

from lightning_memguard.adapters.logged_sync import LoggedSync, synced_in_source
from tests.models import SizedStack, pl, trainer_kwargs
from tests.spawn import spawn_ranks


class LoggingStack(SizedStack):
    """:class:`SizedStack` that logs its loss from ``hook`` with the given ``self.log`` arguments."""

    def __init__(self, hook: str, **log_kwargs) -> None:
        super().__init__(batch_size=16, n_samples=64)
        self.hook, self.log_kwargs = hook, log_kwargs

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.hook == "training_step":
            self.log("train_loss", loss, **self.log_kwargs)
        self.last_loss = loss.detach()
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.hook == "on_train_batch_end":
            self.log("train_loss", self.last_loss, **self.log_kwargs)


class LogsOnlyIfAsked(LoggingStack):
    """Whose source logs with ``sync_dist=True``, under an ``if`` no batch takes."""

    asked = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.asked:
            self.log("train_loss", loss, sync_dist=True)
        return loss


class Watching(pl.Callback):
    """Asks a :class:`LoggedSync` after each training batch, as the guard's front door does; keeps what it said."""

    def __init__(self) -> None:
        self.watcher, self.said = None, []

    def on_fit_start(self, trainer, pl_module) -> None:
        self.watcher = LoggedSync(trainer)
        self.said.append((None, self.watcher.found))  # nothing logged yet: the source's answer

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.said.append((self.watcher.changed(), self.watcher.found))


def _worker(rank: int, root: str, hook: str, log_kwargs: dict) -> None:
    watching = Watching()
    trainer = pl.Trainer(default_root_dir=root, logger=False, callbacks=[watching],
                         **trainer_kwargs(strategy="ddp", max_steps=3))
    trainer.fit((LogsOnlyIfAsked if hook == "logs_only_if_asked" else LoggingStack)(hook, **log_kwargs))
    with open(os.path.join(root, "said.json"), "w") as file:
        json.dump(watching.said, file)


def _fit(tmp_path, hook: str, **log_kwargs) -> list:
    spawn_ranks(_worker, (str(tmp_path), hook, log_kwargs), nprocs=1, timeout_s=120)
    return [tuple(pair) for pair in json.loads((tmp_path / "said.json").read_text())]


def test_a_loss_logged_each_step_with_sync_dist_in_the_training_step_is_found_once(tmp_path):
    said = _fit(tmp_path, "training_step", on_step=True, on_epoch=False, sync_dist=True)
    # looked through after the first batch, whose keys are new; the same keys later: not again (the source's guess
    # before: yes, ``self.log`` is given ``**options`` in the training step)
    assert said == [(None, True), (True, True), (False, True), (False, True)]


@pytest.mark.parametrize("hook, log_kwargs", [
    ("training_step", dict(on_step=True, on_epoch=False)),  # no sync_dist
    ("training_step", dict(on_step=False, on_epoch=True, sync_dist=True)),  # reduced once, at the epoch's end
    ("training_step", dict(on_step=True, on_epoch=False, sync_dist=True, rank_zero_only=True)),  # never reduced
    ("on_train_batch_end", dict(on_step=True, on_epoch=False, sync_dist=True))])  # outside the batch that runs again
def test_a_loss_not_reduced_at_a_log_call_inside_the_batch_is_not(tmp_path, hook, log_kwargs):
    said = _fit(tmp_path, hook, **log_kwargs)
    # looked through after the first batch, and again once its key was logged (a module's on_train_batch_end runs
    # after the callbacks': after the second); the source's guess before (``self.log`` given ``**options`` in the
    # training step: yes) gives way to what the first batch logged
    looked = [True, True, False] if hook == "on_train_batch_end" else [True, False, False]
    assert said == [(None, True)] + [(changed, False) for changed in looked], said


def test_a_guess_from_the_source_gives_way_to_what_the_first_batch_logged(tmp_path):
    # the source calls self.log with sync_dist=True under an if that the batch did not take
    said = _fit(tmp_path, "logs_only_if_asked")
    assert said == [(None, True), (True, False), (False, False), (False, False)], said


def test_a_trainer_whose_results_read_otherwise_says_none(tmp_path):
    class NoResults:  # what another Lightning's Trainer might look like to the watcher
        fit_loop = None

    watcher = LoggedSync(NoResults())
    assert not watcher.changed() and not watcher.found


class _Logs(pl.LightningModule):
    sync = True

    def training_step(self, batch, batch_idx):
        return batch.sum()


class _TrueInStep(_Logs):
    def training_step(self, batch, batch_idx):
        loss = batch.sum()
        self.log("loss", loss, sync_dist=True)
        return loss


class _ChosenInStep(_Logs):
    def training_step(self, batch, batch_idx):
        self.log("loss", batch.sum(), prog_bar=True, sync_dist=self.sync)  # could be True: counts
        return batch.sum()


class _DictBeforeBackward(_Logs):
    def on_before_backward(self, loss):
        self.log_dict({"loss": loss}, sync_dist=True)


class _FalseInStep(_Logs):
    def training_step(self, batch, batch_idx):
        self.log("loss", batch.sum(), sync_dist=False)
        return batch.sum()


class _EpochOnly(_Logs):
    def training_step(self, batch, batch_idx):
        self.log("loss", batch.sum(), on_step=False, on_epoch=True, sync_dist=True)
        return batch.sum()


class _RankZeroOnly(_Logs):
    def training_step(self, batch, batch_idx):
        self.log("loss", batch.sum(), sync_dist=True, rank_zero_only=True)
        return batch.sum()


class _OptionsInStep(_Logs):
    options = {"sync_dist": True}

    def training_step(self, batch, batch_idx):
        self.log("loss", batch.sum(), **self.options)  # may pass sync_dist: counts
        return batch.sum()


class _OptionsToAnotherCall(_Logs):
    def training_step(self, batch, batch_idx):
        return batch.sum(**{})  # not a log call: its options say nothing


class _AfterTheBatch(_Logs):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("loss", outputs["loss"], sync_dist=True)


@pytest.mark.parametrize("module, synced", [
    (_TrueInStep, True), (_ChosenInStep, True), (_DictBeforeBackward, True), (_OptionsInStep, True),
    (_Logs, False), (_OptionsToAnotherCall, False), (_FalseInStep, False), (_EpochOnly, False), (_RankZeroOnly, False),
    (_AfterTheBatch, False)])
def test_before_anything_is_logged_the_hooks_source_says_whether_the_step_logs_with_sync_dist(module, synced):
    # the first batch's answer, where a rank running out of memory before its log call cannot know otherwise
    assert synced_in_source(module()) is synced
    assert synced_in_source(None) is False
