"""Evaluation, test and predict batches larger than the training batches, under a CPU hard limit that training fits
and an unsplit evaluation batch does not: through a real Trainer (fit with validation, test, predict), the plain loop
and Fabric, each batch is measured (a history row, a TensorBoard curve) and run in parts after its OOM, and what the
user gets — logged epoch metrics, a torchmetrics metric, predictions, outputs — equals an unguarded, unsplit run's.

Every hard limit lies between peaks probed from a monitor-only run of the same model and data (its evaluation rows
measure the unsplit batches), never copied from an earlier run's output."""

from __future__ import annotations

import os
import pickle
import warnings

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from lightning_memguard import FabricMemGuard, MemGuard, MemGuardCallback, MemGuardOutOfMemoryError
from tests.helpers import event_texts, fit_module, limit_between, make_optimizer, mse
from tests.models import (EvaluatedStack, Stack, lightning_class, pl, regression_batches, regression_dataset,
                          trainer_kwargs)

CSVLogger = lightning_class("loggers", "CSVLogger")
TensorBoardLogger = lightning_class("loggers", "TensorBoardLogger")

TRAIN, VAL, PREDICT = EvaluatedStack.TRAIN, EvaluatedStack.VAL, EvaluatedStack.PREDICT  # samples a batch


def trainer(root, callbacks=(), **extra):
    return pl.Trainer(**trainer_kwargs(**{"max_steps": -1, "max_epochs": 2, "callbacks": list(callbacks),
                                          "default_root_dir": str(root), **extra}))


def monitor_only():
    return MemGuardCallback(mitigations=(), cpu_sample_every=1, explain=False)


def rows(history: pd.DataFrame, phase: str) -> pd.DataFrame:
    return history[history["phase"] == phase]


def splits(events: pd.DataFrame, phase: str) -> pd.DataFrame:
    return events[(events["action"] == "eval_split") & (events["phase"] == phase)]


def assert_split_once_then_remembered(guard, phase: str, batches: int) -> None:
    """The loop's first batch ran out of memory and was split (2 or 4 parts); every later batch started split."""
    measured = rows(guard.history, phase)
    assert len(measured) == batches
    parts = int(measured["micro_batches"].iloc[0])
    assert parts in (2, 4) and (measured["micro_batches"] == parts).all()
    split = splits(guard.events, phase)
    assert list(split["level"]) == [2, 4][:parts // 2]  # all at the first batch: 1 -> 2 (-> 4)
    assert split["reason"].iloc[0].startswith(f"out of memory in {phase} batch of ")
    assert "gave_up" not in set(guard.events["action"])
    assert (measured["peak_bytes"] <= guard.cpu_hard_limit_bytes).all()  # the failed attempt's peak is not the row's


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """A monitor-only fit with validation, then test and predict, of the same model and data: their rows."""
    root = tmp_path_factory.mktemp("probe")
    module, guard = EvaluatedStack(), monitor_only()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitted = trainer(root, [guard], logger=False)
        fitted.fit(module)
        fit_history = guard.history
        fitted.test(module, verbose=False)
        test_history = guard.history
        fitted.predict(module)
        predict_history = guard.history
    assert guard.events.empty
    return {"fit": fit_history, "test": test_history, "predict": predict_history}


def test_validation_in_a_fit_is_measured_split_after_its_oom_and_logs_what_an_unsplit_run_logs(tmp_path, probed):
    history = probed["fit"]
    training = history[history["phase"].isin(["batch_start", "after_forward", "after_backward",
                                              "after_optimizer_step"])]
    validation = rows(history, "validation")
    assert len(validation) == 4 and (validation["micro_batches"] == 1).all()  # 2 epochs x 2 batches, sanity unmeasured
    limit = limit_between(int(validation["peak_bytes"].max()), int(training["peak_bytes"].max()))
    guard = MemGuardCallback(cpu_hard_limit=limit, mitigations=(), explain=False)
    module = EvaluatedStack()
    loggers = [CSVLogger(str(tmp_path), name="csv"), TensorBoardLogger(str(tmp_path), name="tb")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitted = trainer(tmp_path, [guard], logger=loggers)
        fitted.fit(module)
    assert fitted.global_step == 8 and fitted.current_epoch == 2
    assert_split_once_then_remembered(guard, "validation", 4)
    assert not {"apply", "rescue"} & set(guard.events["action"])  # training itself fitted
    assert rows(guard.history, "validation")["step"].tolist() == [3, 3, 7, 7]  # after the epoch's last step
    assert "validation_step" not in vars(module)  # unwrapped when the loop ended
    assert guard.state_dict()["evaluation"]["parts"]["validation"] >= 2

    reference = EvaluatedStack()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(tmp_path / "reference", logger=CSVLogger(str(tmp_path / "reference"), name="csv")).fit(reference)
    got, want = (pd.read_csv(os.path.join(logger_dir, "metrics.csv")).dropna(subset=["val_loss"])["val_loss"]
                 for logger_dir in (loggers[0].log_dir, os.path.join(tmp_path, "reference", "csv", "version_0")))
    assert len(got) == 2
    torch.testing.assert_close(torch.tensor(got.to_numpy()), torch.tensor(want.to_numpy()), rtol=1e-5, atol=0)

    events = [f for d, _, names in os.walk(loggers[1].log_dir) for f in (os.path.join(d, n) for n in names)
              if "tfevents" in f]
    accumulator = EventAccumulator(events[0]).Reload()
    peaks = accumulator.Scalars("memguard/validation/peak_GiB")
    assert [e.step for e in peaks] == [0, 1, 2, 3]  # one point per validation batch, on their own axis
    assert all(0 < e.value * 2**30 <= limit for e in peaks)
    assert "memguard/validation/allocated_GiB" in accumulator.Tags()["scalars"]
    assert any("eval_split - out of memory in validation batch of" in t for t in event_texts(loggers[1].log_dir))


def test_test_and_predict_on_their_own_are_split_and_give_an_unsplit_runs_results(tmp_path, probed):
    results, predictions = {}, {}
    for name, guarded in (("reference", False), ("guarded", True)):
        module = EvaluatedStack()
        callbacks = []
        if guarded:
            test_rows, predict_rows = rows(probed["test"], "test"), rows(probed["predict"], "predict")
            # the test batch's forward fits, its 8-fold augmented pass does not (after the metric was updated); in
            # two parts it peaks halfway between what stays allocated and the whole batch's peak: the limit is
            # placed clear of that, not on it (a few bytes more or less would decide between two and four parts)
            peak, stays = int(test_rows["peak_bytes"].max()), int(test_rows["allocated_bytes"].max())
            limit = stays + int(0.6 * (peak - stays))
            callbacks = [MemGuardCallback(cpu_hard_limit=limit, mitigations=(), explain=False)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tester = trainer(tmp_path / name, callbacks, logger=False)
            results[name] = tester.test(module, verbose=False)[0]
            if guarded:
                test_guard = callbacks[0]
                assert_split_once_then_remembered(test_guard, "test", 3)
                assert os.path.isfile(tmp_path / name / "memguard_test_history.csv")
                assert not os.path.exists(tmp_path / name / "memguard_history.csv")  # a fit's file: never written
                limit = limit_between(int(predict_rows["peak_bytes"].max()),
                                      int(predict_rows["allocated_bytes"].max()))
                callbacks = [MemGuardCallback(cpu_hard_limit=limit, mitigations=(), explain=False)]
            predictor = trainer(tmp_path / name, callbacks, logger=False)
            predictions[name] = torch.cat(predictor.predict(module))
        if guarded:
            assert_split_once_then_remembered(callbacks[0], "predict", 2)
            assert "predict_step" not in vars(module) and "test_step" not in vars(module)
    assert set(results["guarded"]) == {"test_mse", "test_loss", "test_tta_loss"}
    for key, value in results["reference"].items():
        assert results["guarded"][key] == pytest.approx(value, rel=1e-5), key
    assert predictions["guarded"].shape == (PREDICT + PREDICT // 2, 1)
    torch.testing.assert_close(predictions["guarded"], predictions["reference"], rtol=1e-5, atol=1e-6)


# --- the plain loop and Fabric ------------------------------------------------------------------------------------
def loop_guard(door: str, model, root, **settings):
    optimizer = make_optimizer("sgd", model.parameters(), 0.01)
    if door == "fabric":
        from lightning.fabric import Fabric
        from lightning.fabric.loggers import TensorBoardLogger as FabricTensorBoard

        fabric = Fabric(accelerator="cpu", devices=1, loggers=[FabricTensorBoard(str(root), name="fab")])
        model, optimizer = fabric.setup(model, optimizer)
        return FabricMemGuard(fabric, model, optimizer, **settings)
    return MemGuard(model, optimizer, log_dir=str(root), **settings)


def evaluate(model, batch):
    """An evaluation function without side effects: what to accumulate is in its outputs."""
    x, y = batch
    preds = model(x)
    return {"preds": preds, "loss": F.mse_loss(preds, y)}


def train_then_evaluate(door: str, root, val_batches, **settings):
    guard = loop_guard(door, Stack(), root, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        early = guard.evaluate(val_batches[0], evaluate)  # before the first step: measured on its own
        for batch in regression_batches(3, size=TRAIN):
            guard.step(batch, mse)
        outputs = [guard.evaluate(batch, evaluate) for batch in val_batches]
        guard.close()
    return guard, early, outputs


@pytest.mark.parametrize("door", ["loop", "fabric"])
def test_a_loop_evaluates_in_parts_after_an_oom_with_the_outputs_of_an_unsplit_run(door, tmp_path):
    val_batches = regression_batches(2, size=VAL)
    probe, _, _ = train_then_evaluate(door, tmp_path / "probe", val_batches, mitigations=(), cpu_sample_every=1,
                                      explain=False)
    history = probe.history
    assert list(rows(history, "validation")["micro_batches"]) == [1, 1] and probe.events.empty
    training = history[history["phase"] != "validation"]
    limit = limit_between(int(rows(history, "validation")["peak_bytes"].max()), int(training["peak_bytes"].max()))
    guard, early, outputs = train_then_evaluate(door, tmp_path / "guarded", val_batches, cpu_hard_limit=limit,
                                                mitigations=(), explain=False)
    assert_split_once_then_remembered(guard, "validation", 2)
    assert rows(guard.history, "validation")["step"].tolist() == [2, 2]  # after the last of three steps
    log_dir = guard.log_dir
    before = pd.read_csv(os.path.join(log_dir, "memguard_validation_history.csv"))  # the evaluation before training
    assert list(before["phase"]) == ["validation"]
    assert set(pd.read_csv(os.path.join(log_dir, "memguard_history.csv"))["phase"]) >= {"batch_start", "validation"}

    model = Stack()  # the same training, unguarded; evaluated whole
    optimizer = make_optimizer("sgd", model.parameters(), 0.01)
    with torch.no_grad():
        want_early = evaluate(model, val_batches[0])
    for batch in regression_batches(3, size=TRAIN):
        optimizer.zero_grad(set_to_none=True)
        mse(model, batch).backward()
        optimizer.step()
    with torch.no_grad():
        wanted = [evaluate(model, batch) for batch in val_batches]
    for got, want in [(early, want_early)] + list(zip(outputs, wanted)):
        torch.testing.assert_close(got["preds"], want["preds"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=0)

    tb_dir = guard.fabric.loggers[0].log_dir if door == "fabric" else log_dir
    event_files = [os.path.join(d, n) for d, _, names in os.walk(tb_dir) for n in names if "tfevents" in n]
    logged = set()
    for path in event_files:
        logged |= set(EventAccumulator(path).Reload().Tags()["scalars"])
    assert "memguard/validation/peak_GiB" in logged


def test_a_sample_too_big_alone_ends_with_the_report_naming_the_validation(tmp_path):
    model = Stack()
    guard = MemGuard(model, make_optimizer("sgd", model.parameters(), 0.01), log_dir=str(tmp_path),
                     cpu_hard_limit="4MiB", mitigations=(), explain=False)

    def wasteful(m, batch):  # memory that does not shrink with the batch
        return m(batch[0]).sum() + torch.ones(2**20).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(MemGuardOutOfMemoryError, match="could not rescue a validation batch of 2 samples") as err:
            guard.evaluate(regression_batches(1, size=2)[0], wasteful)
        guard.close()
    assert "out of memory in: validation" in str(err.value)
    assert list(guard.events["action"]) == ["eval_split", "gave_up"]
    assert (tmp_path / "memguard_validation_oom_report.txt").is_file()
    with pytest.raises(ValueError, match="phase='training'"):
        guard.evaluate(regression_batches(1, size=2)[0], evaluate, phase="training")


def test_a_guard_that_validated_on_its_own_then_fits_writes_both_runs_files(tmp_path):
    """trainer.validate, then a fit with the same callback: each run has its own files and the fit starts clean."""
    guard = monitor_only()
    module = EvaluatedStack()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tester = trainer(tmp_path, [guard], logger=False)
        tester.validate(module, verbose=False)
        assert set(guard.history["phase"]) == {"validation"}
        fit_module(module, guard, tmp_path, max_steps=2, limit_val_batches=0)
    assert "validation" not in set(guard.history["phase"]) and len(guard.history) == 8
    assert os.path.isfile(tmp_path / "memguard_validation_history.csv")
    assert os.path.isfile(tmp_path / "memguard_history.csv")


# ScriptedOom and UnevenParts stay here: they run out of memory on purpose, as these tests need
class ScriptedOom(EvaluatedStack):
    """A validation step that runs out of memory on more than 256 samples, as a CUDA OOM does with no budget set;
    ``fail`` makes it raise another error instead."""

    fail = False

    def validation_step(self, batch, batch_idx):
        if self.fail:
            raise ValueError("the model's own error")
        if batch[0].shape[0] > 256:
            raise torch.OutOfMemoryError("CUDA out of memory (scripted)")
        return super().validation_step(batch, batch_idx)


def test_without_a_budget_an_oom_in_the_sanity_check_is_split_and_the_fit_validates_in_parts(tmp_path):
    guard = MemGuardCallback(explain=False)  # monitor only: rescue_oom is the switch, not a capacity
    module = ScriptedOom()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitted = trainer(tmp_path, [guard], logger=False, num_sanity_val_steps=1, max_epochs=1)
        fitted.fit(module)
    split = splits(guard.events, "validation")
    assert list(split["level"]) == [2, 4] and (split["step"] == 0).all()  # in the sanity check, before any step
    validation = rows(guard.history, "validation")
    assert len(validation) == 2 and (validation["micro_batches"] == 4).all()  # the epoch's batches: measured, split
    assert "validation_step" not in vars(module)
    module.fail = True
    with warnings.catch_warnings(), pytest.raises(ValueError, match="the model's own error"):
        warnings.simplefilter("ignore")
        trainer(tmp_path, [guard], logger=False).validate(module, verbose=False)
    assert "validation_step" not in vars(module)  # unwrapped when the loop failed
    pickle.loads(pickle.dumps(module))


class UnevenParts(EvaluatedStack):
    """Validation batches of 6 samples that run out of memory on more than 2: they run in 4 parts of 2, 2, 1 and 1
    samples, so an epoch mean that weighed every part alike (not by its own size) would differ from an unsplit run's.
    ``guarded=False``: the reference, which never fails."""

    guarded = True

    def val_dataloader(self):
        return DataLoader(regression_dataset(12, 1), batch_size=6)

    def validation_step(self, batch, batch_idx):
        if self.guarded and batch[0].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (scripted)")
        return super().validation_step(batch, batch_idx)


def logged_unguarded_and_split(tmp_path, make_module, run, parts=(4, 4), **extra) -> dict[str, pd.DataFrame]:
    """What an :class:`UnevenParts` module (``make_module()``) logs to a CSV under ``run(trainer, module)``, as the
    unguarded reference and guarded (its validation batches in ``parts`` parts each), by name. ``extra``: Trainer
    arguments."""
    logged = {}
    for name, guarded in (("reference", False), ("guarded", True)):
        module = make_module()
        module.guarded = guarded
        guard = MemGuardCallback(explain=False)
        logger = CSVLogger(str(tmp_path / name), name="csv")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run(trainer(tmp_path / name, [guard], logger=logger, max_epochs=1, **extra), module)
        logged[name] = pd.read_csv(os.path.join(logger.log_dir, "metrics.csv"))
        if guarded:
            assert list(rows(guard.history, "validation")["micro_batches"]) == list(parts)
    return logged


def test_an_epoch_mean_weighs_parts_of_unequal_size_by_their_samples(tmp_path):
    logged = logged_unguarded_and_split(tmp_path, UnevenParts, lambda fitting, module: fitting.fit(module))
    got, want = (torch.tensor(logged[name]["val_loss"].dropna().to_numpy()) for name in ("guarded", "reference"))
    assert len(got) == 1
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


class MeteredUnevenParts(UnevenParts):
    """:class:`UnevenParts` that logs torchmetrics metrics as users do in ``validation_step``: what a collection
    returns (``log_dict``: a mean absolute error and an F1 of the sign, each step's and the epoch's mean of the steps'),
    an AUROC logged as itself for every step and the epoch, and a precision's value for the epoch only (the mean of
    the batches' values)."""

    def __init__(self) -> None:
        import torchmetrics

        super().__init__()
        self.val_metrics = torchmetrics.MetricCollection({"mae": torchmetrics.MeanAbsoluteError(),
                                                          "f1": torchmetrics.classification.BinaryF1Score()},
                                                         prefix="val_")
        self.val_auroc = torchmetrics.classification.BinaryAUROC()
        self.val_precision = torchmetrics.classification.BinaryPrecision()

    def validation_step(self, batch, batch_idx):
        if self.guarded and batch[0].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (scripted)")
        x, y = batch
        prediction, positive = self(x).flatten(), (y.flatten() > 0).long()
        self.log_dict(self.val_metrics(prediction.sigmoid(), positive), on_step=True, on_epoch=True)
        self.val_auroc(prediction.sigmoid(), positive)
        self.log("val_auroc", self.val_auroc, on_step=True, on_epoch=True)
        self.log("val_precision", self.val_precision(prediction.sigmoid(), positive))  # on_epoch only, a value


def test_metrics_a_split_validation_batch_logs_are_the_whole_batchs(tmp_path):
    """Each validation batch runs in parts of 2, 2, 1 and 1 samples: the step's AUROC is the batch's, and the epoch's
    means of the collection's values are the means of the batches' values (an F1 of a part is not the batch's)."""
    logged = logged_unguarded_and_split(tmp_path, MeteredUnevenParts,
                                        lambda validating, module: validating.validate(module, verbose=False))
    for key in ("val_mae_step", "val_mae_epoch", "val_f1_step", "val_f1_epoch", "val_auroc_step", "val_auroc_epoch",
                "val_precision"):
        got, want = (logged[name][key].dropna().to_numpy() for name in ("guarded", "reference"))
        assert len(got) == len(want) > 0, key
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=1e-7, msg=key)


class ConstantBatchSize(EvaluatedStack):
    """Validation batches of 2, 2 and 8 samples that log ``val_loss`` with a ``batch_size=`` of the user's, a constant
    (as ``batch_size=self.hparams.batch_size`` is): only the third runs out of memory (more than 2 samples), so it
    alone runs in 4 parts. Unsplit, each batch weighs 4 in the epoch's mean; the split one must too, not 4 a part."""

    guarded = True

    def val_dataloader(self):
        return DataLoader(regression_dataset(12, 1), batch_sampler=[[0, 1], [2, 3], list(range(4, 12))])

    def validation_step(self, batch, batch_idx):
        if self.guarded and batch[0].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (scripted)")
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), batch_size=4)
        self.log("val_loss_mean_of_steps", F.mse_loss(self(x), y), on_step=True, batch_size=4)


def test_an_epoch_mean_with_a_constant_batch_size_of_the_users_counts_a_split_batch_once(tmp_path):
    logged = logged_unguarded_and_split(tmp_path, ConstantBatchSize, lambda fitting, module: fitting.fit(module),
                                        parts=(1, 1, 4), num_sanity_val_steps=0)
    for key in ("val_loss", "val_loss_mean_of_steps_epoch"):
        got, want = (torch.tensor(logged[name][key].dropna().to_numpy()) for name in ("guarded", "reference"))
        assert len(got) == 1, key
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=key)
