"""MemGuardCallback as a first-class Lightning callback: configured from a LightningCLI YAML file like Lightning's own
callbacks, resumed at the levels it had, reused for a second fit, run as two instances, logged at the logger's
cadence, quiet about a logger the user chose not to have."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys

import warnings

import pandas as pd
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_memguard import FabricMemGuard, GuardSettings, MemGuard, MemGuardCallback
from lightning_memguard.base.snapshot import MiB
from lightning_memguard.mitigations.checkpointing import is_checkpointed
from tests.models import NAMESPACE, BlockStack, lightning_class, pl, trainer_kwargs

SETTING_NAMES = [field.name for field in dataclasses.fields(GuardSettings)]

# MemGuardCallback subclasses lightning.pytorch's Callback: pytorch_lightning's CLI checks the class path against its
# own Callback class and refuses it (the Trainer itself takes it)
only_lightning_cli = pytest.mark.xfail(NAMESPACE == "pytorch_lightning", strict=True,
                                       reason="pytorch_lightning's CLI wants a pytorch_lightning Callback subclass")


def write_config(tmp_path, **init_args) -> str:
    config = {
        "model": {"width": 32, "depth": 4, "batch_size": 64, "n_samples": 256},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 3, "enable_progress_bar": False,
                    "enable_model_summary": False, "enable_checkpointing": False, "log_every_n_steps": 1,
                    "default_root_dir": str(tmp_path / "runs"),
                    "callbacks": [{"class_path": "lightning_memguard.MemGuardCallback", "init_args": init_args}]},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture(autouse=True)
def _no_command_line_of_pytest(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])  # LightningCLI warns when given args beside a command line


def lightning_cli(*args: str):
    cli_class = lightning_class("cli", "LightningCLI")
    return cli_class(BlockStack, args=list(args), save_config_kwargs={"overwrite": True})


@only_lightning_cli
def test_a_yaml_file_configures_the_callback_and_the_fit_runs_under_it(tmp_path):
    path = write_config(tmp_path, budget="8MiB", threshold=0.5, mitigations=["checkpointing", "microbatch"],
                        cpu_sample_every=1)
    cli = lightning_cli("fit", "--config", path)
    (guard,) = [c for c in cli.trainer.callbacks if isinstance(c, MemGuardCallback)]
    assert guard.budget_bytes == 8 * MiB and guard.threshold == 0.5
    assert guard.mitigations == ("checkpointing", "microbatch")
    assert sorted(guard.history["step"].unique()) == [0, 1, 2]  # the guard measured the fit the CLI ran
    assert guard.history["capacity_bytes"].eq(8 * MiB).all()


@only_lightning_cli
def test_print_config_shows_every_setting_with_its_default(tmp_path, capsys):
    path = write_config(tmp_path, budget="8MiB")
    with pytest.raises(SystemExit) as exit_info:
        lightning_cli("fit", "--config", path, "--print_config")
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    (callback,) = printed["trainer"]["callbacks"]
    init_args = callback["init_args"]
    assert sorted(init_args) == sorted(["progress_bar", *SETTING_NAMES])
    assert init_args["budget"] == "8MiB" and init_args["threshold"] == 0.9 and init_args["mitigations"] is None


@only_lightning_cli
def test_the_help_of_the_callback_documents_each_setting(tmp_path, capsys):
    with pytest.raises(SystemExit):
        lightning_cli("fit", "--trainer.callbacks.help", "lightning_memguard.MemGuardCallback")
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for name in SETTING_NAMES:
        assert f"--trainer.callbacks.{name} " in text
    assert "act when a phase peak reaches" in text and "count tensors during every N-th optimizer step" in text


@only_lightning_cli
def test_a_misspelled_setting_is_refused_by_name(tmp_path, capsys):
    path = write_config(tmp_path, treshold=0.5)
    with pytest.raises(SystemExit):
        lightning_cli("fit", "--config", path)
    assert "Option 'treshold' is not accepted" in capsys.readouterr().err


@only_lightning_cli
@pytest.mark.parametrize(("init_args", "message"), [
    ({"threshold": 1.5}, "threshold=1.5 must be a number in (0, 1]"),
    ({"budget": "8 potatoes"}, "budget='8 potatoes'"),
    ({"mitigations": ["checkpointing", "amp", "checkpointing"]}, "twice"),
])
def test_a_bad_value_gets_the_guards_own_error(tmp_path, init_args, message):
    path = write_config(tmp_path, **init_args)
    with pytest.raises(ValueError) as info:
        lightning_cli("fit", "--config", path)
    assert message in str(info.value)


@pytest.mark.parametrize("door", [MemGuard, FabricMemGuard, MemGuardCallback])
def test_every_front_door_declares_every_setting_typed_and_documented(door):
    parameters = inspect.signature(door).parameters
    hints = GuardSettings.__dataclass_fields__
    for name in SETTING_NAMES:
        parameter = parameters[name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
        assert parameter.default == hints[name].default and parameter.annotation is not inspect.Parameter.empty
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    documented = {line.split(":")[0].strip() for line in door.__init__.__doc__.splitlines() if line.startswith("    ")}
    assert set(SETTING_NAMES) <= documented


def test_jsonargparse_builds_the_settings_of_a_loop_guard_from_a_file(tmp_path):
    """A plain-loop script configured with jsonargparse: the guard's settings are read from its signature."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(MemGuard, "guard", skip={"model", "optimizer", "writer", "scheduler"})
    path = tmp_path / "loop.yaml"
    path.write_text(yaml.safe_dump({"guard": {"budget": "3MiB", "mitigations": ["microbatch"], "log_dir": None}}))
    config = parser.parse_object(yaml.safe_load(path.read_text()))
    model = torch.nn.Linear(4, 1)
    guard = MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), **vars(config.guard))
    assert guard.budget_bytes == 3 * MiB and guard.mitigations == ("microbatch",)
    with pytest.raises(Exception, match="treshold"):
        parser.parse_object({"guard": {"treshold": 0.5}})


# --- resume and a further fit: the run goes on at the levels it had ---------------------------------------------------

LEVELS = {"amp": 1, "checkpointing": 2}


def guard_at(levels: dict, **settings) -> MemGuardCallback:
    """A guard whose first fit starts at ``levels`` (as a checkpoint's state would put it); a budget far above the
    model's needs, so the run is guarded (the first batch is estimated) and nothing changes the levels."""
    guard = MemGuardCallback(budget="1GiB", mitigations=("amp", "checkpointing"), explain=False, **settings)
    guard.load_state_dict({"ladder": {"levels": levels}})
    return guard


class ForwardDtypes:
    """The dtype the model's first block really computes in, at every training forward of the model itself (the
    estimate's copies carry the hook too, and are left out)."""

    def __init__(self, model) -> None:
        self.layer = model.blocks[0].up
        self.seen: list = []
        self.layer.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        if module is self.layer and torch.is_grad_enabled() and module.training:
            self.seen.append(output.dtype)


def make_trainer(root, guard, steps: int, **overrides):
    logger = lightning_class("loggers", "TensorBoardLogger")(str(root), name="tb")
    return pl.Trainer(**trainer_kwargs(max_steps=steps, callbacks=[guard], logger=logger, default_root_dir=str(root),
                                       **overrides))


def stack(seed: int = 0) -> BlockStack:
    torch.manual_seed(seed)
    return BlockStack(width=32, depth=4, batch_size=64, n_samples=512)


def test_a_resumed_run_goes_on_in_mixed_precision_with_the_blocks_checkpointed(tmp_path):
    """The estimate of the resumed run's first batch used to run the checkpointed blocks' recomputation outside its
    autocast (torch's CheckpointError), turn AMP off and run the resumed steps in float32."""
    model = stack()
    first = make_trainer(tmp_path / "first", guard_at(LEVELS), steps=2)
    first.fit(model)
    path = str(tmp_path / "first.ckpt")
    first.save_checkpoint(path)
    assert first.callbacks[0].levels == LEVELS and first.callbacks[0].state_dict()["ladder"]["levels"] == LEVELS

    resumed = stack(seed=1)
    dtypes = ForwardDtypes(resumed)
    guard = MemGuardCallback(budget="1GiB", mitigations=("amp", "checkpointing"), explain=False)
    trainer = make_trainer(tmp_path / "second", guard, steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(resumed, ckpt_path=path)
    assert guard.levels == LEVELS and trainer.precision == "32-true"  # the Trainer's own, back after the fit
    assert dtypes.seen and set(dtypes.seen) == {torch.bfloat16}  # forwards and recomputations, steps 2 and 3
    assert [sum(is_checkpointed(b) for b in resumed.blocks)] == [2]
    events = guard.events
    assert events["action"].tolist() == ["resume"] and events["step"].tolist() == [2]
    assert "resumed from a saved state: the run goes on at amp 1, checkpointing 2" in events["reason"].iloc[0]
    assert not [w for w in caught if "rung is off" in str(w.message) or "CheckpointError" in str(w.message)]
    assert guard.state_dict()["ladder"]["levels"] == LEVELS


@pytest.mark.parametrize("same_trainer", [True, False], ids=["same Trainer", "new Trainer"])
def test_a_further_fit_goes_on_at_the_callbacks_levels_and_saves_what_runs(tmp_path, same_trainer):
    model = stack()
    guard = guard_at(LEVELS)
    trainer = make_trainer(tmp_path / "first", guard, steps=2)
    trainer.fit(model)
    dtypes = ForwardDtypes(model)
    if same_trainer:
        trainer.fit_loop.epoch_loop.max_steps = 4  # two more steps on the same Trainer
    else:
        trainer = make_trainer(tmp_path / "second", guard, steps=2)
    trainer.fit(model)
    assert guard.levels == LEVELS and guard.state_dict()["ladder"]["levels"] == LEVELS
    assert trainer.precision == "32-true" and set(dtypes.seen) == {torch.bfloat16}  # own precision after the fit
    assert sum(is_checkpointed(b) for b in model.blocks) == 2
    assert guard.events["action"].tolist() == ["resume"]
    assert "a further fit of the same model: the run goes on at amp 1, checkpointing 2" in guard.events["reason"][0]
    assert sorted(guard.history["step"].unique()) == ([2, 3] if same_trainer else [0, 1])


class Predicting(BlockStack):
    """:func:`stack`'s model with a predict loop over 128 samples and a validation loss."""

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def predict_dataloader(self):
        return self.train_dataloader()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]))

    def val_dataloader(self):
        return self.train_dataloader()


def test_predict_and_validate_after_a_fit_that_switched_to_amp_run_in_the_trainers_own_precision(tmp_path):
    """The AMP rung switched the fp32 Trainer's plugin to bf16-mixed for the fit; it stayed after the fit, so a
    ``trainer.predict`` returned bf16 predictions and ``validate`` a bf16 loss, and ``trainer.precision`` said
    "bf16-mixed", though the user asked for neither. The Trainer's own plugin is back when the fit ends, the level is
    kept (a further fit runs in bf16 again)."""
    torch.manual_seed(0)
    model = Predicting(width=32, depth=4, batch_size=64, n_samples=128, log_loss=False)
    guard = guard_at(LEVELS)
    trainer = make_trainer(tmp_path, guard, steps=2)
    dtypes = ForwardDtypes(model)
    trainer.fit(model)
    assert set(dtypes.seen) == {torch.bfloat16} and guard.levels == LEVELS
    assert trainer.precision == "32-true"
    predictions = trainer.predict(model)
    validated = trainer.validate(model, verbose=False)[0]["val_loss"]
    unguarded = pl.Trainer(**trainer_kwargs(logger=False, default_root_dir=str(tmp_path / "plain")))
    assert [p.dtype for p in predictions] == [torch.float32] * 2
    for got, want in zip(predictions, unguarded.predict(model)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert validated == unguarded.validate(model, verbose=False)[0]["val_loss"]
    trainer.fit_loop.epoch_loop.max_steps = 3
    dtypes.seen.clear()
    trainer.fit(model)  # goes on at the levels: bf16 again
    assert set(dtypes.seen) == {torch.bfloat16} and trainer.precision == "32-true"


def test_a_further_fit_of_the_same_trainer_goes_on_in_the_first_fits_files(tmp_path):
    """The same Trainer fits again (two more steps, the same log directory): its rows and events used to replace the
    first fit's files, so what the first fit did (here its resume event; a rescue alike) was gone from disk while
    Lightning's own metrics went on. The files now go on from the first fit's rows; ``history``/``events`` hold the
    latest fit's. A fit whose steps start again from 0 in that directory (a new Trainer) writes files of its own,
    versioned, and leaves these as they are."""
    model = stack()
    guard = guard_at(LEVELS)
    trainer = make_trainer(tmp_path, guard, steps=2)
    trainer.fit(model)
    log_dir = trainer.log_dir
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(model)
    assert trainer.log_dir == log_dir and sorted(guard.history["step"].unique()) == [2, 3]
    history = pd.read_csv(os.path.join(log_dir, "memguard_history.csv"))
    events = pd.read_csv(os.path.join(log_dir, "memguard_events.csv"))
    assert history["step"].tolist() == [step for step in range(4) for _ in range(4)]  # four phases a step, one header
    assert events[["step", "action"]].values.tolist() == [[0, "resume"], [2, "resume"]]
    assert "a further fit of the same model" in events["reason"].iloc[1]

    again = pl.Trainer(**trainer_kwargs(max_steps=1, callbacks=[guard], logger=False, default_root_dir=log_dir))
    again.fit(model)  # steps from 0 again: a new run in the same directory
    assert pd.read_csv(os.path.join(log_dir, "memguard_history-v1.csv"))["step"].tolist() == [0] * 4
    assert pd.read_csv(os.path.join(log_dir, "memguard_history.csv"))["step"].tolist() == history["step"].tolist()


# --- two instances ----------------------------------------------------------------------------------------------------

def test_two_guards_on_one_trainer_are_refused_at_setup_naming_them(tmp_path):
    """Lightning refuses two callbacks with one state_key; with the key overridden, both guards would change the same
    training step and write the same files (a CSV that then failed to parse)."""

    class KeyedGuard(MemGuardCallback):
        def __init__(self, key: str, **settings) -> None:
            super().__init__(**settings)
            self.key = key

        @property
        def state_key(self) -> str:
            return f"MemGuardCallback[{self.key}]"

    guards = [KeyedGuard("a"), KeyedGuard("b", threshold=0.5)]
    trainer = pl.Trainer(**trainer_kwargs(max_steps=1, callbacks=guards, logger=False, default_root_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="2 MemGuardCallback instances") as info:
        trainer.fit(stack())
    assert "'MemGuardCallback[a]'" in str(info.value) and "'MemGuardCallback[b]'" in str(info.value)
    assert not list(tmp_path.rglob("memguard_*"))


# --- logging cadence --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("every", [50, 2])
def test_metrics_reach_tensorboard_at_the_loggers_cadence_with_the_latest_counted_values(tmp_path, every):
    """On CPU without a budget every 4th step is counted; an even log_every_n_steps used to log nothing at all."""
    steps = 100 if every == 50 else 8
    guard = MemGuardCallback()
    logger = lightning_class("loggers", "TensorBoardLogger")(str(tmp_path), name="tb")
    trainer = pl.Trainer(**trainer_kwargs(max_steps=steps, log_every_n_steps=every, callbacks=[guard], logger=logger,
                                          default_root_dir=str(tmp_path)))
    trainer.fit(BlockStack(width=32, depth=4, batch_size=8, n_samples=8 * steps))
    history = guard.history
    assert sorted(history["step"].unique()) == list(range(0, steps, 4))  # counted: every 4th step
    scalars = EventAccumulator(logger.log_dir).Reload()
    logged = scalars.Scalars("memguard/after_forward/allocated_GiB")
    assert [point.step for point in logged] == list(range(every - 1, steps, every))
    allocated = history[history["phase"] == "after_forward"].set_index("step")["allocated_bytes"]
    for point in logged:
        latest_counted = point.step - point.step % 4
        assert point.value == pytest.approx(allocated[latest_counted] / 2**30, rel=1e-5)


# --- the batch-size search --------------------------------------------------------------------------------------------

def test_the_batch_size_search_holds_the_budget_and_its_pick_fits_without_the_ladder(tmp_path):
    """The finder takes every other callback off the Trainer for its trials: they used to run unguarded and pick a
    batch that the fit then ran only by rescuing it."""
    limit = "16MiB"
    guard = MemGuardCallback(budget=limit, cpu_hard_limit=limit, explain=False)
    model = BlockStack(width=64, depth=4, batch_size=16, n_samples=8192)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=3, callbacks=[guard], logger=False, default_root_dir=str(tmp_path)))
    tuner = lightning_class("tuner", "Tuner")(trainer)
    size = tuner.scale_batch_size(model, mode="power", init_val=16, max_trials=10, steps_per_trial=2)
    assert 16 < size < 8192 and model.hparams.batch_size == size  # the search ended at an out-of-memory trial
    trainer.fit(model)
    assert trainer.global_step == 3
    assert guard.events.empty  # no rescue, no rung: the picked batch fits the budget as it is
    assert guard.history["peak_bytes"].max() <= 16 * MiB


def test_lightnings_oom_check_recognises_the_guards_out_of_memory_errors(tmp_path):
    from lightning_memguard import CpuTensorAccountant, MemGuardOutOfMemoryError
    from tests.helpers import run
    from tests.models import Stack, regression_batches

    is_oom_error = lightning_class("utilities.memory", "is_oom_error")
    accountant = CpuTensorAccountant(limit_bytes=1024)
    accountant.start()
    try:
        with pytest.raises(torch.OutOfMemoryError) as limit_error:
            torch.zeros(4096)
    finally:
        accountant.stop()
    assert is_oom_error(limit_error.value)
    # nothing to climb: the guard gives up with its report
    result = run("lightning", Stack(), regression_batches(1), tmp_path, cpu_hard_limit="1MiB", mitigations=(),
                 explain=False, raises=MemGuardOutOfMemoryError)
    assert is_oom_error(result.error)
