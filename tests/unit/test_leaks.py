"""The leak rule on scripted numbers, the search on real tensors held in real places, and the monitor feeding both
from a scripted source."""

import pytest
import torch
from torch import nn

from lightning_memguard.base.host import Host
from lightning_memguard.monitor.leaks import LeakRule, LeakSearch
from lightning_memguard.monitor.monitor import MemoryMonitor
from lightning_memguard.monitor.settings import MonitorSettings
from lightning_memguard.sources.base import AllocatorReading
from tests.helpers import ScriptedSource, run_step


def verdicts(rule, readings):
    return [(index, verdict) for index, value in enumerate(readings) if (verdict := rule.observe(value))]


def test_the_optimizer_state_of_the_first_step_is_not_a_leak():
    # parameters at step 0; gradients and Adam's two moments appear at step 1; then the same bytes for 50 steps
    assert verdicts(LeakRule(), [1000, 4000, 4000] + [4000] * 50) == []


def test_growth_every_step_is_suspected_then_confirmed_once():
    readings = [1000, 4000, 4000] + [4000 + 64 * k for k in range(1, 20)]
    rule = LeakRule()
    # the third reading ends the warm-up; the 4th rise after it suspects, the 8th confirms, then the rule waits
    assert verdicts(rule, readings) == [(6, "suspect"), (10, "confirm")]
    assert rule.streak_start == 4000


def test_a_step_without_a_rise_ends_the_streak():
    rise = [4000, 4100, 4200, 4300]
    readings = [1000, 4000, 4000] + rise[1:] + [4300] + [4300 + 100 * k for k in range(1, 5)]
    assert verdicts(LeakRule(), readings) == [(10, "suspect")]


def test_variable_batches_go_up_and_down_and_say_nothing():
    sizes = [4000, 4400, 4100, 4700, 4200, 4300, 4900, 4000, 4500, 4600, 4100] * 5
    assert verdicts(LeakRule(), [1000, 4000, 4000] + sizes) == []


def test_back_off_doubles_the_rises_a_suspicion_needs():
    rule = LeakRule(warmup=1, suspect=2, confirm=3)
    assert verdicts(rule, [10, 11, 12, 13]) == [(2, "suspect"), (3, "confirm")]
    rule.back_off()
    assert (rule.suspect, rule.confirm) == (4, 6)
    assert verdicts(rule, [14, 15, 16, 17, 18, 19]) == [(3, "suspect"), (5, "confirm")]


def test_readings_that_count_nothing_are_ignored():
    rule = LeakRule(warmup=0, suspect=1, confirm=2)
    assert verdicts(rule, [None, None, None]) == []


@pytest.mark.parametrize("suspect, confirm", [(0, 3), (4, 4), (5, 2)])
def test_a_rule_that_cannot_confirm_is_refused(suspect, confirm):
    with pytest.raises(ValueError, match=f"suspect={suspect}"):
        LeakRule(suspect=suspect, confirm=confirm)


class Cache:
    def __init__(self):
        self.outputs = {"train": []}


def test_the_search_names_growing_tensors_and_the_model_attribute_holding_them():
    model = nn.Linear(4, 2)
    model.kept = []
    search = LeakSearch(model, list)
    last = None
    for step in range(3):
        model.kept.append(model(torch.ones(3, 4)).sum(dim=1))
        last = torch.zeros(7, 5)  # replaced every step: held, but not growing
    search.count(batch=None, step=2)
    for step in range(3):
        model.kept.append(model(torch.ones(3, 4)).sum(dim=1))
        last = torch.zeros(7, 5)
    grown = search.growing(batch=None)
    # the kept sums, and the inputs their graphs saved (held by autograd, not by a Python container)
    assert [(g.shape, g.dtype, g.grad_fn, g.count, g.added) for g in grown] == [
        ((3, 4), "float32", "", 6, 3), ((3,), "float32", "SumBackward1", 6, 3)]
    assert last.shape == (7, 5)
    assert search.holder(grown[0].tensors) is None
    assert search.holder(grown[1].tensors) == "model.kept (a list of 6)"
    assert (grown[0].module, grown[1].module) == (None, "Linear")  # the root module, by its class


def test_the_module_is_the_nearest_one_with_parameters_in_the_graph():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 3)))
    search = LeakSearch(model, list)
    kept = (model(torch.ones(2, 4)) ** 2).mean(dim=1)
    kept.sum().backward()  # backward frees what the graph saved, not its nodes
    assert search.module_of(kept) == "2.0"
    assert search.module_of(kept.detach()) is None


def test_the_search_names_a_dict_in_another_object_and_a_closure_variable():
    cache = Cache()
    search = LeakSearch(None, list)
    search.count(batch=None)
    for _ in range(4):
        cache.outputs["train"].append(torch.full((2, 9), 1.0))
    grown = [g for g in search.growing(batch=None) if g.shape == (2, 9)]
    assert search.holder(grown[0].tensors) == "Cache.outputs['train'] (a list of 4)"

    def make_step():
        seen = []

        def step():
            seen.append(torch.zeros(11, 3))
        return step

    step = make_step()
    search.count(batch=None)
    for _ in range(3):
        step()
    grown = [g for g in search.growing(batch=None) if g.shape == (11, 3)]
    named = search.holder(grown[0].tensors)
    assert named.startswith("the variable seen in the closure of step() at test_leaks.py:"), named
    assert named.endswith(" (a list of 3)")


def test_the_monitor_says_a_leak_once_with_an_event_a_warning_and_a_text(tmp_path):
    model = nn.Linear(3, 3)
    model.kept_losses = []
    readings = []
    for step in range(30):  # batch start grows by 64 bytes a step after the first two
        start = 100 + 64 * max(step - 1, 0) + (200 if step else 0)
        readings += [AllocatorReading(start, start), AllocatorReading(start + 50, start + 60),
                     AllocatorReading(start + 10, start + 70), AllocatorReading(start, start + 20)]
    said, texts = [], []
    monitor = MemoryMonitor("the test", MonitorSettings(log_every_n_steps=1), source=ScriptedSource(readings))
    monitor.begin(model, torch.device("cpu"), Host(warn=said.append, log_text=lambda text, step: texts.append(step)))
    monitor.start(list, str(tmp_path))
    for step in range(30):
        model.kept_losses.append(model(torch.ones(1, 3)).sum())
        run_step(monitor, step)
    monitor.stop()
    leaks = monitor.events[monitor.events["action"] == "leak"]
    assert len(leaks) == 1
    (step,) = leaks["step"]
    assert step == 10  # warm-up 0-2, rises at 3-10: the count at step 6, the second at step 10
    assert "model.kept_losses (a list of 11)" in leaks["reason"].iloc[0]
    assert "[] float32 on cpu, grad_fn=SumBackward0, made from the output of module Linear" in leaks["reason"].iloc[0]
    assert [s for s in said if "leak -" in s] == [f"lightning-memguard step 10: leak - {leaks['reason'].iloc[0]}"]
    assert texts == [10]


def test_the_rise_is_shared_among_all_the_steps_of_the_streak_counted_or_not():
    rule = LeakRule()
    # measured every 4th step: 4 bytes kept per step, 16 per measured step
    for step in range(0, 48, 4):
        rule.observe(1000 + 4 * step, step)
    assert rule.streak_start_step == 8  # the reading the streak rose from (after the warm-up's three)
    assert rule.per_step(1000 + 4 * 44, 44) == (4, 36)
    assert LeakRule().per_step(5000, 10) is None  # no streak yet
