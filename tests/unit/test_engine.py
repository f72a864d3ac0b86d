"""MemGuardEngine driven directly, with a scripted source and a real module: a threshold crossing applies a rung to
the module, an out-of-memory error climbs the ladder and then gives up with a report, several processes never retry,
and a checkpoint's levels are applied before or during a fit."""

import pandas as pd
import pytest
import torch

from lightning_memguard.guard.engine import MemGuardEngine
from lightning_memguard.guard.oom import MemGuardOutOfMemoryError, OomFailure
from lightning_memguard.guard.ranks import PeerRungError, Ranks
from lightning_memguard.guard.settings import GuardSettings
from lightning_memguard.mitigations.checkpointing import is_checkpointed
from tests.helpers import Said, ScriptedSource, r
from tests.models import LinearStack

DEPTH = 4


def engine_for(readings, tmp_path=None, **processes):
    # min_gain=0: the test is about what is applied, not about judging it; no plan before the first step: the
    # scripted readings are not what an estimate of the real model would say
    engine = MemGuardEngine(GuardSettings(budget=1000, mitigations=("checkpointing",), min_gain=0.0, explain=False,
                                          plan_at_start=False), name="the test", source=ScriptedSource(readings))
    model, said = LinearStack(depth=DEPTH), Said(**processes)
    engine.begin_fit(model, torch.device("cpu"), None, said.host)
    engine.start(list, None if tmp_path is None else str(tmp_path))
    return engine, model, said


def oom(phase="forward", attempt=1):
    return OomFailure(phase=phase, first_micro_batch=True, error="OutOfMemoryError: scripted", attempt=attempt,
                      max_retries=None)


def test_a_step_over_the_threshold_applies_a_rung_to_the_module():
    # 950 of 1000 bytes in the forward: over 90 %; activation checkpointing can lower it
    engine, model, said = engine_for([r(100, 100), r(500, 950), r(300, 600), r(200, 300)])
    engine.batch_start(0, torch.randn(4, 8))
    engine.boundary("after_forward")
    engine.boundary("after_backward")
    engine.step_end()
    events = engine.events
    assert events["action"].tolist() == ["threshold", "apply"]
    applied = events.iloc[-1]
    assert applied["rung"] == "checkpointing" and applied["level"] == engine.levels["checkpointing"] >= 1
    assert applied["peak_before_bytes"] == 950 and applied["capacity_bytes"] == 1000
    checkpointed = [is_checkpointed(block) for block in model.blocks]
    assert sum(checkpointed) == engine.levels["checkpointing"]
    assert (0, {"memguard/rung/checkpointing": float(applied["level"])}) in said.metrics


def test_an_oom_climbs_the_ladder_then_gives_up_with_a_report(tmp_path):
    engine, model, _ = engine_for([r(100, 100), r(990, 990)], tmp_path)
    engine.batch_start(0, torch.randn(4, 8))
    assert engine.can_retry
    for attempt in range(1, DEPTH + 2):
        try:
            engine.attempts.on_oom(oom(attempt=attempt))
        except MemGuardOutOfMemoryError as err:
            report = err.report
            break
    else:
        pytest.fail("the engine never gave up")
    assert engine.levels["checkpointing"] == DEPTH and all(is_checkpointed(block) for block in model.blocks)
    actions = engine.events["action"].tolist()
    assert actions[-1] == "gave_up" and set(actions[:-1]) == {"rescue"}
    # the policy's words: the one rung is at its top (not "did not help": it was never reverted)
    assert report["why"] == (f"no rung of the ladder can be raised to lower it: checkpointing at {DEPTH}/{DEPTH}: at "
                             "its top level")
    assert "could not rescue step 0" in report["text"] and len(report["tried"]) == len(actions) - 1
    assert (tmp_path / "memguard_oom_report.txt").read_text().strip() == report["text"]
    engine.stop()
    rows = pd.read_csv(tmp_path / "memguard_history.csv")
    assert rows["phase"].tolist() == ["batch_start", "oom"]


def test_several_processes_never_retry_a_batch():
    engine, model, said = engine_for([r(100, 100), r(990, 990)], world_size=2, rank=1,
                                     reduce_max=lambda values: values)
    assert not engine.can_retry and Ranks.NO_RETRY_WARNING in said.warnings
    engine.batch_start(0, torch.randn(4, 8))
    assert engine.attempts.on_rung_error("RuntimeError: a rung broke the step") is False
    with pytest.raises(MemGuardOutOfMemoryError, match="several processes") as raised:
        engine.attempts.on_oom(oom())
    assert raised.value.report["why"] == Ranks.NO_RETRY
    assert engine.levels["checkpointing"] == 0 and engine.events["action"].tolist() == ["gave_up"]


class _ScriptedRecovery:
    """The protocol a recovery (DDPRecovery, FSDPRecovery) offers the attempt loop, scripted: the other rank's
    numbers in the agreement are ``theirs`` (tests/integration/test_rungs_broken_ranks.py runs the real ones)."""

    def __init__(self, theirs: list[int], settled: bool = True) -> None:
        self.theirs, self.settled, self.reduces, self.calls = theirs, settled, True, []
        self.marked = False  # whether the gradients this rank received carry another rank's mark

    def begin_attempt(self) -> None:
        pass

    def shadow(self) -> None:
        self.calls.append("shadow")

    def agree(self, numbers: list[int]) -> list[int]:
        self.calls.append(list(numbers))
        return [max(mine, theirs) for mine, theirs in zip(numbers, self.theirs)]

    def peer_failed(self) -> bool:
        return self.marked

    def reset(self) -> None:
        self.calls.append("reset")


QUIET = [0] * 8  # a rank whose attempt ran: nothing failed
RUNG_BROKE = [2, 1, 0, 0, 0, 0, 0, 0]  # a rank whose backward failed with an error of the rungs just changed


def _rank_with_a_new_rung(recovery: _ScriptedRecovery):
    """Rank 1 of two, in step 1, whose checkpointing went on after step 0 crossed the threshold."""
    engine, model, said = engine_for([r(100, 100), r(500, 950), r(300, 600), r(200, 300), r(100, 100)],
                                     world_size=2, rank=1, reduce_max=lambda values: values)
    engine.ranks.recovery = recovery
    engine.batch_start(0, torch.randn(4, 8))
    engine.boundary("after_forward")
    engine.boundary("after_backward")
    engine.step_end()
    assert engine.levels["checkpointing"] >= 1
    engine.batch_start(1, torch.randn(4, 8))
    return engine, model


def test_a_rung_that_broke_one_ranks_step_is_put_back_on_every_rank_after_one_agreement():
    recovery = _ScriptedRecovery(QUIET)
    engine, model = _rank_with_a_new_rung(recovery)  # the rank whose step broke
    assert engine.attempts.on_rung_error("RuntimeError: a rung broke the step", "backward") is True
    assert recovery.calls == ["shadow", RUNG_BROKE]  # its reductions stood in for, then one agreement
    assert engine.levels["checkpointing"] == 0 and not any(is_checkpointed(block) for block in model.blocks)
    assert engine.events["action"].tolist()[-1] == "revert"

    recovery = _ScriptedRecovery(RUNG_BROKE)
    engine, model = _rank_with_a_new_rung(recovery)  # a rank whose step ran: it hears of it in its gradients
    recovery.marked = True
    with pytest.raises(PeerRungError, match="another rank's backward of step 1 failed") as raised:
        engine.attempts.check_peers()
    assert recovery.calls[-1] == "reset"
    engine.attempts.on_oom(OomFailure(phase="backward", first_micro_batch=True, error=f"PeerRungError: {raised.value}",
                                      attempt=1, max_retries=None))
    assert engine.levels["checkpointing"] == 0 and not any(is_checkpointed(block) for block in model.blocks)
    revert = engine.events.iloc[-1]
    assert revert["action"] == "revert" and "PeerRungError" in revert["reason"]


def test_ranks_that_cannot_run_a_broken_rungs_batch_again_alike_stop():
    from lightning_memguard.guard.attempts import BatchState

    # before DDP's buckets settled: the error is raised, the ladder as it was; the reductions its backward had not run
    # are stood in for and the ranks agree that none runs the batch again (the others stop with the report); a note
    # on the error names the rungs the guard changed, why they were not put back, and what to do
    recovery = _ScriptedRecovery(QUIET, settled=False)
    engine, _ = _rank_with_a_new_rung(recovery)
    level = engine.levels["checkpointing"]

    def broken_step():
        raise RuntimeError("a rung broke the step")

    with pytest.raises(RuntimeError, match="a rung broke the step") as raised:
        engine.train_batch(broken_step, BatchState(), release=lambda: None)
    assert recovery.calls[0] == "shadow" and recovery.calls[1][0] == 2 and recovery.calls[1][4] > 0
    assert engine.levels["checkpointing"] == level
    note = " ".join(raised.value.__notes__)
    assert f"step 1, the first to run with rungs the guard changed (checkpointing 0 -> {level})" in note
    assert "gradient buckets are not settled" in note and "leave it out of mitigations=" in note
    assert engine.attempts.rung_error_note is None  # said once, on that error
    # the model's own error, no rung changed since the last step that ran: raised as it is, no note
    engine.ladder.step_ran()
    with pytest.raises(RuntimeError) as raised:
        engine.train_batch(broken_step, BatchState(), release=lambda: None)
    assert not getattr(raised.value, "__notes__", [])
    # a rank whose step ran, inside a gradient-accumulation window (it cannot run its batch again), hears that
    # another's rungs broke its step: that rank ends with its error, this one with the report (it reverted and ran the
    # batch again, waiting for a rank that had ended)
    recovery = _ScriptedRecovery(RUNG_BROKE)
    engine, _ = _rank_with_a_new_rung(recovery)
    recovery.marked, engine.attempts._first_micro_batch = True, False
    with pytest.raises(PeerRungError) as raised:
        engine.attempts.check_peers()
    level = engine.levels["checkpointing"]
    with pytest.raises(MemGuardOutOfMemoryError) as stopped:
        engine.attempts.on_oom(OomFailure(phase="backward", first_micro_batch=False,
                                          error=f"PeerRungError: {raised.value}", attempt=1, max_retries=None))
    assert "gradient-accumulation window" in stopped.value.report["why"]
    assert engine.levels["checkpointing"] == level and "revert" not in engine.events["action"].tolist()
    # a rank that ran out of memory while another's rungs broke its step: the one would revert, the other climb
    recovery = _ScriptedRecovery(RUNG_BROKE)
    engine, _ = _rank_with_a_new_rung(recovery)
    with pytest.raises(MemGuardOutOfMemoryError) as raised:
        engine.attempts.on_oom(oom(phase="backward"))
    assert "cannot run it again alike" in raised.value.report["why"]


def test_a_checkpoints_levels_apply_at_the_next_fit_or_at_once_during_one():
    saved = {"ladder": {"levels": {"checkpointing": 2}}}
    engine = MemGuardEngine(GuardSettings(budget=1000, mitigations=("checkpointing",)),
                            source=ScriptedSource([r(0, 0)]))
    engine.load_state_dict(saved)  # before the fit: kept
    assert engine.levels == {}
    model = LinearStack(depth=DEPTH)
    engine.begin_fit(model, torch.device("cpu"), None, Said().host)
    assert engine.levels == {"checkpointing": 2} and sum(is_checkpointed(b) for b in model.blocks) == 2
    engine.load_state_dict({"ladder": {"levels": {"checkpointing": 3}}})  # during the fit: at once
    assert engine.levels == {"checkpointing": 3}
    engine.stop()
    # a later fit: nothing left to apply
    engine.begin_fit(LinearStack(depth=DEPTH), torch.device("cpu"), None, Said().host)
    assert engine.levels == {"checkpointing": 0}
    with pytest.raises(ValueError, match="level 9"):
        engine.load_state_dict({"ladder": {"levels": {"checkpointing": 9}}})


def test_ranks_decide_on_the_worst_ranks_numbers_and_keep_missing_ones_missing():
    other_rank = [500, 900, 80]  # rank 0's after_forward and after_backward peaks, and its static bytes

    def reduce_max(values):
        return [max(mine, theirs) for mine, theirs in zip(values, other_rank + [-1] * len(values))]

    ranks = Ranks(rank=1, world_size=2, reduce_max=reduce_max)
    peaks, static, retries = ranks.step_numbers({"after_backward": 700, "after_forward": 600}, 50, None)
    assert peaks == {"after_forward": 600, "after_backward": 900} and static == 80 and retries is None
    assert not ranks.can_retry
    alone = Ranks()
    assert alone.can_retry and alone.reduce_max is None
    assert alone.step_numbers({"after_forward": 1}, None) == ({"after_forward": 1}, None)


class _HeardNews:
    """What the ranks heard in a step's backward, as DDPRecovery reads it from the bucket that carries the news
    element (scripted: the agreement protocol is what is tested here; tests/integration/test_quiet_steps.py runs the
    real one)."""

    def __init__(self) -> None:
        self.heard, self.saying = None, False

    def say(self, news: bool) -> None:
        self.saying = news


def test_ranks_that_hear_each_others_news_agree_only_on_steps_with_news_on_the_worst_since_the_last():
    calls = []

    def reduce_max(values):
        calls.append(list(values))
        return values

    ranks = Ranks(rank=0, world_size=2, reduce_max=reduce_max)
    ranks.recovery = channel = _HeardNews()
    assert ranks.hears_news
    # the first step: no bucket carried news yet, so the ranks agree
    assert ranks.step_numbers({"after_backward": 100}, 10, news=False) == ({"after_backward": 100}, 10)
    # quiet: nobody had news, no collective, nothing to decide
    channel.heard = False
    assert ranks.step_numbers({"after_backward": 120}, 10, news=False) is None and not channel.saying
    # this rank's peak crossed the line: it says so in the next backward, and decides nothing alone
    assert ranks.step_numbers({"after_backward": 900}, 12, news=True) is None and channel.saying
    assert len(calls) == 1
    # the next backward carried it: every rank agrees, on the worst of both steps, and the news is spent
    channel.heard = True
    assert ranks.step_numbers({"after_backward": 200}, 11, news=False) == ({"after_backward": 900}, 12)
    assert calls[-1] == [900, 12] and not channel.saying
    # a step every rank must judge (a rung on trial) is agreed on whatever was heard
    channel.heard = False
    assert ranks.step_numbers({"after_backward": 150}, 11, news=False, due=True) == ({"after_backward": 150}, 11)
    assert len(calls) == 3


class _PartsHeard(_HeardNews):
    """What the ranks heard after each backward of a batch's parts, as FSDPRecovery reads it from the reduce-scatter
    that carries its flags (scripted, as above; tests/integration/test_fsdp_long_batch.py runs the real one)."""

    def __init__(self) -> None:
        super().__init__()
        self.more, self.saying_more = None, []

    def say_more(self, more: bool) -> None:
        self.saying_more.append(more)

    def shadow_part(self) -> None:  # what marks a recovery that runs shadow parts
        raise AssertionError("the engine runs shadow parts, not Ranks")


def test_a_rank_whose_parts_have_run_runs_shadow_parts_while_another_rank_has_parts_left():
    ranks = Ranks(rank=0, world_size=2, reduce_max=lambda values: values)
    ranks.recovery = channel = _PartsHeard()
    ranks.begin_parts(2)  # this rank's batch in two parts: the first part's backward says one is left
    assert channel.saying_more == [True]
    channel.more = True
    assert not ranks.part_ran() and channel.saying_more[-1] is False  # its second part, the last, runs next
    # its parts have run; another rank's has parts left: a shadow part, then another, until none is left
    assert ranks.part_ran() and channel.saying_more[-1] is False
    assert ranks.part_ran()
    channel.more = False
    assert not ranks.part_ran()
    ranks.begin_parts(1)  # the next batch, whole: nothing left after it
    assert channel.saying_more[-1] is False and not ranks.part_ran()
    # under DDP (no shadow parts: a part's gradients are reduced with the last) nothing is run in their place
    ranks.recovery = _HeardNews()
    ranks.begin_parts(4)
    assert not ranks.part_ran()


def test_a_manual_steps_gradients_are_emptied_again_only_where_its_backwards_began_without_them():
    """A step that runs its optimizers itself may run again after its backward broke only where every gradient that
    backward could add to was empty when it began, or made by an earlier backward of the same attempt."""
    from lightning_memguard.guard.attempts import BatchState

    model = LinearStack()
    first, second = list(model.parameters())[:2], list(model.parameters())[2:]
    state = BatchState()
    for p in second:
        p.requires_grad_(False)  # frozen (another optimizer's, toggled off): its stale gradient cannot change
        p.grad = torch.ones_like(p)
    state.backward_begins(model.parameters())
    for p in first:
        p.grad = torch.ones_like(p)  # what that backward added
    for p in second:
        p.requires_grad_(True)
    assert state.gradients_undoable
    state.backward_begins(first)  # another backward on the gradients this attempt made: still undoable
    assert state.gradients_undoable
    state.empty_gradients()
    assert all(p.grad is None for p in first) and all(p.grad is not None for p in second)
    state.backward_begins(model.parameters())  # the stale gradients can now change: not undoable, for the attempt
    assert not state.gradients_undoable
    state.backward_begins(first)
    assert not state.gradients_undoable
    state.reset()
    assert not state.gradients_undoable  # nothing tracked: as under automatic optimization


def test_a_last_part_the_engine_cannot_walk_is_left_as_it_is_with_one_warning(monkeypatch):
    """Where the last micro-batch's graph cannot be walked (mitigations/ddp_reach.py raising), the part's loss goes
    to its backward as it was, the run is told once what would make DDP safe, and later parts are not walked."""
    import lightning_memguard.guard.engine as engine_module

    engine, model, said = engine_for([])
    engine._waits_for_every_parameter = True  # what begin_fit sets for a DDP module without find_unused_parameters
    calls = []

    def unwalkable(loss, parameters):
        calls.append(1)
        raise RuntimeError("a node without next_functions")

    monkeypatch.setattr(engine_module, "reaching_every_parameter", unwalkable)
    loss = model(torch.randn(2, 8)).sum()
    assert engine.last_part_loss(loss) is loss and engine.last_part_loss(loss) is loss
    assert calls == [1]
    assert [w for w in said.warnings if "find_unused_parameters=True" in w and "a node without" in w] != []
    assert len([w for w in said.warnings if "last micro-batch" in w]) == 1


def test_an_fsdp2_switch_that_refuses_leaves_the_step_as_it_was_with_one_warning():
    """torch's set_reduce_scatter_unused_params raising (mitigations/fsdp_unused.py) ends no step: one warning, and
    the switch is not tried again."""
    from lightning_memguard.mitigations.fsdp_unused import UnusedReduced

    class Refusing(torch.nn.Module):
        def set_reduce_scatter_unused_params(self, value, recurse=True):
            raise RuntimeError("not an FSDP2 module after all")

    engine = MemGuardEngine(GuardSettings(budget=1000, mitigations=("microbatch",), explain=False,
                                          plan_at_start=False), name="the test", source=ScriptedSource([]))
    said = Said()
    engine.begin_fit(LinearStack(depth=DEPTH), torch.device("cpu"), None, said.host)
    engine._unused_reduced = UnusedReduced([Refusing()])  # what begin_fit finds for a model with FSDP2 modules
    batch = torch.randn(4, 8)
    engine.ladder.parts.split_once(2)  # this batch in two parts
    assert len(engine.split_batch(batch)) == 2 and len(engine.split_batch(batch)) == 2
    assert len([w for w in said.warnings if "FSDP2 reduce a zero" in w and "not an FSDP2 module" in w]) == 1
