"""A rung of the user's own (``lightning_memguard.Rung``) in ``mitigations=``: transformers' own gradient
checkpointing switched on a GPT-2 from a tiny config. Through all three front doors it is climbed at a threshold
crossing, verified (kept: it lowers the peak), logged and saved like a built-in rung; training equals unguarded
training (checkpointing does not change the gradients); a rung that breaks is put back with one warning."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from lightning_memguard import GuardSettings, Rung
from tests.helpers import DOORS, budget_crossed_between, probe, run
from tests.zoo.models import build, loss_of, train_unguarded, zoo_batches

STEPS = 3


class HFGradientCheckpointing(Rung):
    """Level 1: the model's own gradient checkpointing (transformers), level 0: off."""

    name, levels = "hf_checkpointing", 1

    def apply(self, module, level):
        model = getattr(module, "model", module)  # the Lightning door wraps the zoo model
        if level:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()


class Broken(Rung):
    name, levels = "broken", 2

    def apply(self, module, level):
        if level:
            raise RuntimeError("this rung cannot change the model")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gpt2():
    model, _ = build("gpt2")
    model.config.use_cache = False
    return model


def test_the_model_s_own_checkpointing_lowers_the_peak(tmp_path):
    """The premise: the rung has something to win on this model and batch."""
    batches = zoo_batches("gpt2", STEPS, batch_size=8)
    plain = probe("loop", gpt2(), batches, tmp_path / "plain", loss=loss_of).highest(1)
    model = gpt2()
    HFGradientCheckpointing().apply(model, 1)
    checkpointed = probe("loop", model, batches, tmp_path / "ckpt", loss=loss_of).highest(1)
    assert checkpointed < 0.9 * plain


@pytest.mark.parametrize("door", DOORS)
def test_a_user_rung_is_climbed_kept_logged_and_saved_like_a_built_in(tmp_path, door):
    batches = zoo_batches("gpt2", STEPS, batch_size=8)
    plain = probe(door, gpt2(), batches, tmp_path / "plain", loss=loss_of).highest(1)
    model = gpt2()
    HFGradientCheckpointing().apply(model, 1)
    checkpointed = probe(door, model, batches, tmp_path / "ckpt", loss=loss_of).highest(1)
    HFGradientCheckpointing().apply(model, 0)

    rung = HFGradientCheckpointing()
    guarded = run(door, gpt2(), batches, tmp_path / "guarded", loss=loss_of,
                  budget=budget_crossed_between(plain, checkpointed), mitigations=(rung,), explain=False)
    guard = guarded.guard
    assert guard.levels == {"hf_checkpointing": 1}
    assert guarded.model.is_gradient_checkpointing
    events = guard.events
    assert list(events[events["rung"] == "hf_checkpointing"]["action"])[:2] == ["apply", "keep"]
    # the same files a built-in rung's decisions reach: the events CSV with the level
    written = pd.read_csv(next(tmp_path.joinpath("guarded").rglob("memguard_events.csv")))
    applied = written[(written["rung"] == "hf_checkpointing") & (written["action"] == "apply")]
    assert list(applied["level"]) == [1]
    assert guard.state_dict()["ladder"]["levels"] == {"hf_checkpointing": 1}
    # and the logger's curve of its level, as for every rung
    logged = rung_levels_logged(tmp_path / "guarded", "hf_checkpointing")
    assert logged and set(logged) == {1.0}  # logged at each event, after the rung went to 1
    # checkpointing recomputes the same forward: the parameters equal unguarded training's
    reference = train_unguarded("gpt2", STEPS, batch_size=8)
    for key, value in guarded.model.state_dict().items():
        torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6, msg=key)


def rung_levels_logged(root, name) -> list[float]:
    """The values of ``memguard/rung/<name>`` in the TensorBoard files under ``root``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for events in sorted(root.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events.parent))
        accumulator.Reload()
        if f"memguard/rung/{name}" in accumulator.Tags()["scalars"]:
            values += [e.value for e in accumulator.Scalars(f"memguard/rung/{name}")]
    return values


def test_a_saved_user_rung_level_is_restored_on_the_next_run(tmp_path):
    batches = zoo_batches("gpt2", 2, batch_size=8)
    first = run("loop", gpt2(), batches, tmp_path / "first", loss=loss_of, logger=False, budget="1GiB",
                mitigations=(HFGradientCheckpointing(),))
    state = first.guard.state_dict()
    state["ladder"]["levels"]["hf_checkpointing"] = 1  # as a run that climbed it saved it
    model = gpt2()
    again = run("loop", model, batches, tmp_path / "again", loss=loss_of, logger=False, budget="1GiB",
                mitigations=(HFGradientCheckpointing(),), resume=type(first)("loop", model, guard=_Saved(state)))
    assert again.guard.levels == {"hf_checkpointing": 1} and model.is_gradient_checkpointing


class _Saved:
    """Stands for a finished run's guard: what ``resume=`` reads is its ``state_dict``."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state


def test_a_rung_that_breaks_the_model_is_put_back_with_one_warning_and_training_goes_on(tmp_path):
    batches = zoo_batches("gpt2", STEPS, batch_size=8)
    plain = probe("loop", gpt2(), batches, tmp_path / "plain", loss=loss_of).highest(1)
    guarded = run("loop", gpt2(), batches, tmp_path / "guarded", loss=loss_of, logger=False,
                  budget=int(plain / 2), mitigations=(Broken(),), explain=False)
    assert guarded.steps_done == STEPS
    assert guarded.guard.levels == {"broken": 0}
    said = guarded.warnings_with("the broken rung failed to change level")
    assert len(said) == 1 and "cannot change the model" in said[0]


@pytest.mark.parametrize("bad, words", [
    ((HFGradientCheckpointing(), HFGradientCheckpointing()), "two rungs are named 'hf_checkpointing'"),
    ((object(),), "neither a rung name"),
    ((type("Nameless", (Rung,), {"apply": lambda self, m, level: None})(),), "name=''"),
    ((type("NoLevels", (Rung,), {"name": "n", "levels": 0, "apply": lambda self, m, level: None})(),), "levels=0"),
    ((type("Amp", (Rung,), {"name": "amp", "apply": lambda self, m, level: None})(),), "the name of a built-in"),
    ((type("NoApply", (Rung,), {"name": "na"})(),), "does not define apply"),
])
def test_a_bad_rung_is_refused_at_construction(bad, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        GuardSettings(mitigations=bad)
