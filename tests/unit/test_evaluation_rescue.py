"""An evaluation batch through the engine with a scripted step that runs out of memory above a number of samples: it
runs again in parts (no capacity needed), the loop's later batches start split, another loop and training are not
touched, what a failed attempt logged is undone, the split survives a checkpoint, and a batch that cannot be split
(or a run of several processes) ends with the report."""

import os

import pytest
import torch
from torch import nn

from lightning_memguard.base.host import Host
from lightning_memguard.guard.engine import MemGuardEngine
from lightning_memguard.guard.oom import MemGuardOutOfMemoryError
from lightning_memguard.guard.settings import GuardSettings
from lightning_memguard.sources.base import AllocatorReading
from tests.helpers import ScriptedSource, r


class ScriptedStep:
    """An evaluation step that runs out of memory on parts of more than ``fits`` samples; notes each part's size."""

    def __init__(self, fits: int) -> None:
        self.fits = fits
        self.sizes: list[int] = []
        self.grad_enabled: list[bool] = []

    def __call__(self, part: torch.Tensor, share: float = 1.0) -> dict:
        self.sizes.append(part.shape[0])
        self.grad_enabled.append(torch.is_grad_enabled())
        if part.shape[0] > self.fits:
            raise torch.OutOfMemoryError(f"scripted: {part.shape[0]} samples do not fit")
        return {"double": part * 2, "mean": part.mean()}


def evaluation_engine(tmp_path=None, phase="validation", world_size=1, **settings):
    said = []
    engine = MemGuardEngine(GuardSettings(explain=False, **settings), name="the test",
                            source=ScriptedSource([r(100, 100)]))
    host = Host(warn=said.append, info=said.append, world_size=world_size,
                reduce_max=(lambda values: values) if world_size > 1 else None)
    assert engine.begin_evaluation(phase, nn.Linear(2, 2), torch.device("cpu"), host,
                                   None if tmp_path is None else str(tmp_path))
    return engine, said


def test_an_oom_runs_the_batch_in_parts_and_later_batches_start_split(tmp_path):
    engine, said = evaluation_engine(tmp_path)  # no budget, no limit: rescue_oom is the switch
    step = ScriptedStep(fits=5)
    batch = torch.arange(16.0).reshape(16, 1)
    out = engine.evaluation_batch("validation", batch, step)
    assert step.sizes == [16, 8, 4, 4, 4, 4] and not any(step.grad_enabled)
    assert torch.equal(out["double"], batch * 2) and out["mean"].item() == pytest.approx(batch.mean().item())
    splits = engine.events[engine.events["action"] == "eval_split"]
    assert list(splits["phase"]) == ["validation", "validation"] and list(splits["level"]) == [2, 4]
    assert splits["reason"].iloc[0].startswith("out of memory in validation batch of 16 samples (OutOfMemoryError")
    assert splits["reason"].iloc[0].endswith("it and later validation batches run in 2 parts")
    assert "run in 2 parts" in splits["reason"].iloc[1] and any("eval_split" in s for s in said)
    step.sizes.clear()
    engine.evaluation_batch("validation", batch[:12], step)  # a later, smaller batch: split at once, no new event
    assert step.sizes == [3, 3, 3, 3] and len(engine.events) == 2
    assert engine.evaluation_parts("test") == 1 and engine.levels == {}  # other loops and training untouched
    rows = engine.history
    assert list(rows["phase"]) == ["validation", "validation"] and list(rows["micro_batches"]) == [4, 4]
    engine.end_evaluation()
    assert os.path.isfile(tmp_path / "memguard_validation_history.csv")
    assert not os.path.exists(tmp_path / "memguard_history.csv")  # a fit's file is never this run's


def test_what_a_failed_attempt_logged_is_undone_before_the_retry():
    engine, _ = evaluation_engine()
    logged: list[int] = []

    def savepoint():
        kept = len(logged)
        return lambda: logged.__delitem__(slice(kept, None))

    def step(part, share):
        logged.append(part.shape[0])  # logged before the part runs out of memory
        if part.shape[0] > 4:
            raise torch.OutOfMemoryError("scripted")
        return part.sum()

    engine.evaluation_batch("test", torch.ones(8, 3), step, savepoint)
    assert logged == [4, 4]  # the failed whole batch's entry is gone


def test_the_split_is_saved_with_the_state_and_an_older_checkpoint_loads():
    engine, _ = evaluation_engine(phase="predict")
    engine.evaluation_batch("predict", torch.ones(8, 1), ScriptedStep(fits=4))
    state = engine.state_dict()
    assert state["evaluation"] == {"parts": {"predict": 2}}
    fresh = MemGuardEngine(GuardSettings(explain=False))
    fresh.load_state_dict(state)
    assert fresh.evaluation_parts("predict") == 2
    fresh.load_state_dict({"ladder": None})  # a checkpoint from before evaluation was rescued
    assert fresh.evaluation_parts("predict") == 1
    with pytest.raises(ValueError, match="predict=0"):
        fresh.load_state_dict({"evaluation": {"parts": {"predict": 0}}})


def test_a_sample_that_does_not_fit_alone_ends_with_the_report(tmp_path):
    engine, _ = evaluation_engine(tmp_path)
    with pytest.raises(MemGuardOutOfMemoryError) as raised:
        engine.evaluation_batch("validation", torch.ones(2, 3), ScriptedStep(fits=0))
    text = str(raised.value)
    assert text.startswith("lightning-memguard could not rescue a validation batch of 2 samples: each of its 2 "
                           "samples alone does not fit")
    assert "out of memory in: validation" in text and "eval_split" in text  # what was tried
    assert raised.value.report["phase"] == "validation"
    assert list(engine.events["action"]) == ["eval_split", "gave_up"]
    assert (tmp_path / "memguard_validation_oom_report.txt").read_text().startswith("lightning-memguard could not")


def test_several_processes_do_not_split_and_without_rescue_the_oom_is_the_callers():
    engine, _ = evaluation_engine(world_size=2)
    with pytest.raises(MemGuardOutOfMemoryError, match="several processes"):
        engine.evaluation_batch("validation", torch.ones(8, 1), ScriptedStep(fits=4))
    assert engine.evaluation_parts("validation") == 1
    engine, _ = evaluation_engine(rescue_oom=False)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        engine.evaluation_batch("validation", torch.ones(8, 1), ScriptedStep(fits=4))
    assert not isinstance(raised.value, MemGuardOutOfMemoryError) and engine.events.empty


def test_an_unknown_loop_is_refused():
    engine, _ = evaluation_engine()
    with pytest.raises(ValueError, match="phase='train'"):
        engine.evaluation_batch("train", torch.ones(2, 1), ScriptedStep(fits=2))


def test_an_evaluation_oom_the_cache_could_have_held_is_said_to_be_fragmentation(monkeypatch):
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    for variable in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(variable, raising=False)
    said = []
    # at the failure 900 bytes reserved, 500 allocated: 400 free in the cache, 300 of them in split blocks
    engine = MemGuardEngine(GuardSettings(explain=False), name="the test",
                            source=ScriptedSource([AllocatorReading(500, 990, 900, 0, 0, 300)]))
    engine.begin_evaluation("validation", nn.Linear(2, 2), torch.device("cpu"), Host(warn=said.append), None)

    def fragmented(part, share):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 250 bytes.")

    with pytest.raises(MemGuardOutOfMemoryError) as raised:
        engine.evaluation_batch("validation", torch.ones(1, 2), fragmented)
    assert "fragmentation: a request of 250 B ran out of memory while the allocator's cache held 400 B" in str(
        raised.value)
    found = engine.events[engine.events["action"] == "fragmentation"]
    assert len(found) == 1 and found["phase"].iloc[0] == "validation"
    assert sum("fragmentation" in message for message in said) == 1


def test_outputs_too_large_together_end_at_once_with_what_to_return_instead(monkeypatch):
    engine, _ = evaluation_engine()
    import lightning_memguard.guard.attempts as attempts

    def combined_too_large(outputs, sizes, shares=None, **how):
        raise torch.OutOfMemoryError("scripted: the concatenated outputs do not fit")

    monkeypatch.setattr(attempts, "combine_outputs", combined_too_large)
    step = ScriptedStep(fits=4)
    with pytest.raises(MemGuardOutOfMemoryError, match="its 2 parts ran, but their outputs put together do not fit"):
        engine.evaluation_batch("validation", torch.ones(8, 1), step)
    assert step.sizes == [8, 4, 4]  # split once (the whole batch failed in the step), never split further
    assert list(engine.events["action"]) == ["eval_split", "gave_up"]


def test_a_part_that_ran_is_not_run_again_when_a_later_part_runs_out_of_memory():
    # rows 0-3 are light, rows 4-7 heavy: the whole batch and its heavy half run out of memory, quarters fit
    engine, _ = evaluation_engine()
    ran, saves, undone = [], [], []

    def step(part, share):
        ran.append(part[:, 0].tolist())
        if part.shape[0] > 2 and part.max() >= 4:
            raise torch.OutOfMemoryError("scripted: heavy rows")
        return {"rows": part * 10, "share": share}

    def savepoint():
        saves.append(len(ran))
        return lambda: undone.append(len(ran))

    out = engine.evaluation_batch("validation", torch.arange(8.0).reshape(8, 1), step, savepoint)
    assert ran == [list(range(8)), [0, 1, 2, 3], [4, 5, 6, 7], [4, 5], [6, 7]]  # rows 0-3 ran once
    assert torch.equal(out["rows"], torch.arange(8.0).reshape(8, 1) * 10)
    # the weights the parts that ran were logged with add up to the batch's: 1/2 + 1/4 + 1/4
    assert out["share"] == pytest.approx(0.5 * 0.5 + 0.25 * 0.25 + 0.25 * 0.25)  # (a float: weighted by samples)
    # saved before each part: a failed part's logging is undone, the parts before it keep theirs
    assert saves == [0, 1, 2, 3, 4] and undone == [1, 3]
    assert list(engine.events["level"]) == [2, 4] and engine.history["micro_batches"].tolist() == [4]
