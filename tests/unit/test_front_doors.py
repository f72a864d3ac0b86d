"""The three front doors take the guard's settings the same way: by keyword or as one ``GuardSettings``, not both, and
an unknown name fails at the door naming it and the allowed ones."""

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_memguard import FabricMemGuard, GuardSettings, MemGuard, MemGuardCallback
from lightning_memguard.base.snapshot import MiB

DOORS = ["callback", "loop", "fabric"]
#: a setting of every kind, none at its default
SETTINGS = dict(threshold=0.8, budget="3MiB", mitigations=("checkpointing", "microbatch"), min_gain=0.1,
                rescue_oom=False, max_retries=2, plan_at_start=True, explain=False, log_every_n_steps=5,
                history_max_rows=50, cpu_hard_limit="8MiB", cpu_sample_every=2)


def open_door(door: str, **arguments):
    """The front door ``door`` built with ``arguments`` (a CPU model and SGD for the loop doors)."""
    if door == "callback":
        return MemGuardCallback(**arguments)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if door == "loop":
        return MemGuard(model, optimizer, **arguments)
    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(model, optimizer)
    return FabricMemGuard(fabric, model, optimizer, **arguments)


@pytest.mark.parametrize("door", DOORS)
def test_the_settings_by_keyword_and_as_guard_settings_are_the_same(door):
    by_keyword = open_door(door, **SETTINGS)
    as_object = open_door(door, settings=GuardSettings(**SETTINGS))
    assert by_keyword.settings == as_object.settings == GuardSettings(**SETTINGS)
    for guard in (by_keyword, as_object):
        assert guard.budget_bytes == 3 * MiB and guard.cpu_hard_limit_bytes == 8 * MiB
        assert guard.mitigations == ("checkpointing", "microbatch") and guard.threshold == 0.8
        assert guard.rescue_oom is False and guard.cpu_sample_every == 2


@pytest.mark.parametrize("door", DOORS)
def test_settings_and_keywords_together_are_refused(door):
    with pytest.raises(ValueError, match=r"both given.*\['budget'\]|\['budget'\].*both given"):
        open_door(door, settings=GuardSettings(threshold=0.8), budget="3MiB")


@pytest.mark.parametrize("door", DOORS)
def test_an_unknown_setting_is_refused_naming_it_and_the_allowed_ones(door):
    with pytest.raises(ValueError, match="treshold") as info:
        open_door(door, treshold=0.8)
    assert "'threshold'" in str(info.value) and "'microbatch_weight'" in str(info.value)


@pytest.mark.parametrize("door", DOORS)
def test_settings_must_be_a_guard_settings(door):
    with pytest.raises(ValueError, match="settings=dict must be a GuardSettings"):
        open_door(door, settings={"threshold": 0.8})


def test_a_guard_settings_acts_in_the_run():
    """The object is the run's settings, not just stored: here only every second step is counted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    guard = MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.01),
                     settings=GuardSettings(cpu_sample_every=2, mitigations=()))
    x = torch.randn(4, 8)
    with guard:
        for _ in range(4):
            guard.step((x, x.sum(1, keepdim=True)), lambda m, b: F.mse_loss(m(b[0]), b[1]))
    assert sorted(guard.history["step"].unique()) == [0, 2]


def test_a_checkpoint_loaded_into_a_closed_loop_guard_sets_the_rungs_of_its_next_steps():
    """A guard used, closed, then given a checkpoint's state: the next step runs with the saved levels."""
    from tests.models import Stack, regression_batches

    model = Stack()
    guard = MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.01), mitigations=("checkpointing",),
                     cpu_sample_every=1)
    batch = regression_batches(1)[0]

    def loss_fn(m, b):
        return F.mse_loss(m(b[0]), b[1])

    guard.step(batch, loss_fn)
    guard.close()
    assert guard.levels == {"checkpointing": 0}
    guard.load_state_dict({"ladder": {"levels": {"checkpointing": 2}}, "global_step": 8})
    guard.step(batch, loss_fn)
    guard.close()
    assert guard.levels == {"checkpointing": 2}
    assert guard.history["step"].max() == 8



@pytest.mark.parametrize("door", ["loop", "fabric"])
def test_arguments_in_the_wrong_order_are_refused_before_the_step_naming_the_order(door, tmp_path):
    guard = open_door(door, log_dir=str(tmp_path))
    batch = torch.randn(4, 8)

    def loss(model, b):
        return model(b).pow(2).mean()

    with pytest.raises(ValueError, match=r"loss_fn=Tensor is not callable: step\(batch, loss_fn\)"):
        guard.step(loss, batch)
    with pytest.raises(ValueError, match=r"before_optimizer_step=int is not callable"):
        guard.step(batch, loss, 1)
    with pytest.raises(ValueError, match=r"fn=Tensor is not callable: evaluate\(batch, fn\)"):
        guard.evaluate(lambda model, part: model(part), batch)
    assert guard.history.empty  # nothing ran: no step began
    assert guard.step(batch, loss).ndim == 0
    guard.close()
