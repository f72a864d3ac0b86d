"""Fragmentation explained, with a scripted allocator on CPU: the cache's free bytes and split blocks are kept and
logged; an OOM whose request the cache could have held is said to be fragmentation in the report and one event, with
the numbers and what helps (or that expandable segments are already on); allocator retries with a cache full of free
memory give one event a fit, not one a step; a reading without a cache says nothing."""

import pandas as pd
import pytest
import torch

from lightning_memguard.guard.engine import MemGuardEngine
from lightning_memguard.monitor.fragmentation import requested_bytes, reserved_free_in
from lightning_memguard.guard.oom import MemGuardOutOfMemoryError, OomFailure
from lightning_memguard.guard.settings import GuardSettings
from lightning_memguard.sources.base import AllocatorReading
from lightning_memguard.sources.cuda import expandable_segments_on
from tests.helpers import Said, ScriptedSource
from tests.models import LinearStack

DEPTH = 4  # blocks of the stack: the ladder gives up after checkpointing them all

# PyTorch's own message (torch >= 2.2), sizes as its allocator prints them
CUDA_OOM = ("OutOfMemoryError: CUDA out of memory. Tried to allocate {asked}. GPU 0 has a total capacity of 79.19 GiB "
            "of which 3.94 MiB is free. Including non-PyTorch memory, this process has 79.18 GiB memory in use. Of "
            "the allocated memory 60.12 GiB is allocated by PyTorch, and {free} is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def reading(allocated, peak, reserved=None, retries=None, split=None):
    return AllocatorReading(allocated_bytes=allocated, peak_bytes=peak, reserved_bytes=reserved,
                            alloc_retries=retries, num_ooms=0 if reserved is not None else None,
                            inactive_split_bytes=split)


def engine_for(readings, tmp_path=None):
    engine = MemGuardEngine(GuardSettings(budget=1000, mitigations=("checkpointing",), min_gain=0.0, explain=False,
                                          log_every_n_steps=1),
                            name="the test", source=ScriptedSource(readings))
    said = Said()
    engine.begin_fit(LinearStack(depth=DEPTH), torch.device("cpu"), None, said.host)
    engine.start(list, None if tmp_path is None else str(tmp_path))
    return engine, said


def give_up(engine, error):
    """OOMs of the same batch until the ladder is exhausted; the report."""
    for attempt in range(1, DEPTH + 2):
        try:
            engine.attempts.on_oom(OomFailure(phase="forward", first_micro_batch=True, error=error, attempt=attempt,
                                     max_retries=None))
        except MemGuardOutOfMemoryError as err:
            return err.report
    pytest.fail("the engine never gave up")


def fragmentation_events(engine):
    events = engine.events
    return events[events["action"] == "fragmentation"]


def test_the_request_and_the_free_cache_are_read_from_pytorchs_message():
    message = CUDA_OOM.format(asked="2.00 GiB", free="5.50 GiB")
    assert requested_bytes(message) == 2 * 1024**3 and reserved_free_in(message) == int(5.5 * 1024**3)
    assert requested_bytes(CUDA_OOM.format(asked="512 bytes", free="0 bytes")) == 512
    old = ("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.00 GiB already "
           "allocated; 1.50 MiB free; 14.50 GiB reserved in total by PyTorch)")
    assert requested_bytes(old) == 20 * 1024**2 and reserved_free_in(old) == 512 * 1024**2
    assert requested_bytes("OutOfMemoryError: scripted") is None and reserved_free_in("scripted") is None


def test_an_oom_the_cache_could_have_held_is_fragmentation_in_the_report_and_one_event(tmp_path, monkeypatch):
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    # at the failure 900 bytes reserved, 500 allocated: 400 free in the cache, 300 of them in split blocks
    engine, said = engine_for([reading(100, 100, 200, 0, 0), reading(500, 990, 900, 0, 300)], tmp_path)
    engine.batch_start(0, torch.randn(4, 8))
    report = give_up(engine, "OutOfMemoryError: CUDA out of memory. Tried to allocate 250 bytes.")
    assert report["fragmentation"] == {"kind": "oom", "step": 0, "requested_bytes": 250, "reserved_free_bytes": 400,
                                       "inactive_split_bytes": 300, "new_retries": None,
                                       "expandable_segments": False}
    text = report["text"]
    assert "fragmentation: a request of 250 B ran out of memory while the allocator's cache held 400 B reserved " \
           "but unallocated, 300 B of it in blocks split off segments still in use" in text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True set before CUDA starts" in text
    assert "CUDA IPC" in text and "max_split_size_mb" in text
    found = fragmentation_events(engine)
    assert len(found) == 1  # once a fit, though each of the attempts ran out of memory the same way
    event = found.iloc[0]
    assert event["step"] == 0 and event["peak_before_bytes"] == 990 and event["capacity_bytes"] == 1000
    assert event["reason"] in text and any(event["reason"] in warning for warning in said.warnings)
    written = pd.read_csv(tmp_path / "memguard_events.csv")
    assert written[written["action"] == "fragmentation"]["reason"].tolist() == [event["reason"]]
    assert event["reason"] in (tmp_path / "memguard_oom_report.txt").read_text()


def test_the_messages_own_figure_wins_and_expandable_segments_already_on_is_said(monkeypatch):
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings",
                        lambda: "max_split_size_mb:256,expandable_segments:True", raising=False)
    assert expandable_segments_on()
    # the cache read after the failure is empty; PyTorch's message says what it held at the failure
    engine, _ = engine_for([reading(100, 100, 200, 0, 0), reading(500, 990, 500, 0, 0)])
    engine.batch_start(0, torch.randn(4, 8))
    report = give_up(engine, CUDA_OOM.format(asked="64.00 MiB", free="1.50 GiB"))
    numbers = report["fragmentation"]
    assert numbers["requested_bytes"] == 64 * 1024**2 and numbers["reserved_free_bytes"] == int(1.5 * 1024**3)
    assert numbers["expandable_segments"] is True
    assert "expandable_segments is already on in this run" in report["text"]
    assert "max_split_size_mb:64" in report["text"]  # blocks of the failed request's size kept whole
    assert "set before CUDA starts" not in report["text"]


def test_an_oom_larger_than_the_free_cache_or_without_a_cache_says_nothing():
    too_big = "OutOfMemoryError: CUDA out of memory. Tried to allocate 600 bytes."
    engine, _ = engine_for([reading(100, 100, 200, 0, 0), reading(500, 990, 900, 0, 300)])
    engine.batch_start(0, torch.randn(4, 8))
    report = give_up(engine, too_big)
    assert report["fragmentation"] is None and "fragmentation" not in report["text"]
    assert fragmentation_events(engine).empty
    # the CPU accountant: no cache, so no such numbers and nothing said
    engine, _ = engine_for([reading(100, 100), reading(500, 990)])
    engine.batch_start(0, torch.randn(4, 8))
    report = give_up(engine, too_big.replace("600", "1"))
    assert report["fragmentation"] is None and fragmentation_events(engine).empty


def run_steps(steps):
    """An engine run through ``steps`` (four readings each: its boundaries); the engine and what it said."""
    engine, said = engine_for([one for readings in steps for one in readings])
    for step in range(len(steps)):
        engine.batch_start(step, torch.randn(4, 8))
        engine.boundary("after_forward")
        engine.boundary("after_backward")
        engine.step_end()
    assert engine.monitor.source.reads == 4 * len(steps)  # each step read its own four readings
    return engine, said


def logged_at(said, step):
    """The step metrics logged at ``step`` (not the rung levels an event logs)."""
    return next(metrics for at, metrics in said.metrics if at == step and "memguard/capacity_GiB" in metrics)


def step_with_retries(before, after, free=400, split=100):
    """Four boundaries: 200 allocated, 200 + free reserved; the retry count goes from ``before`` to ``after`` in
    the forward."""
    return [reading(200, 250, 200 + free, before, split), reading(300, 350, 200 + free, after, split),
            reading(200, 350, 200 + free, after, split), reading(200, 250, 200 + free, after, split)]


def test_retries_while_the_cache_holds_free_memory_are_one_event_a_fit_with_the_numbers(monkeypatch):
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    engine, said = run_steps([step_with_retries(0, 0), step_with_retries(0, 2), step_with_retries(2, 3),
                              step_with_retries(3, 5)])
    found = fragmentation_events(engine)
    assert len(found) == 1, found
    event = found.iloc[0]
    assert event["step"] == 1
    assert event["reason"].startswith("fragmentation: the allocator had to flush its cache and retry 2 time(s) in "
                                      "step 1 while it held 400 B reserved but unallocated, 100 B of it in blocks "
                                      "split off segments still in use")
    assert "expandable_segments:True" in event["reason"]
    assert sum("fragmentation" in warning for warning in said.warnings) == 1
    # the numbers behind it are logged every step: the max over the step's boundaries, in GiB
    logged = logged_at(said, 3)
    assert logged["memguard/reserved_free_GiB"] == pytest.approx(400 / 1024**3)
    assert logged["memguard/inactive_split_GiB"] == pytest.approx(100 / 1024**3)
    history = engine.history
    assert history["inactive_split_bytes"].tolist() == [100] * len(history)


def test_retries_with_a_nearly_empty_cache_are_a_full_device_not_fragmentation():
    # 20 bytes free of 1000: under 5 % of the capacity
    engine, _ = run_steps([step_with_retries(0, 0, free=20), step_with_retries(0, 4, free=20, split=20)])
    assert fragmentation_events(engine).empty


def test_a_source_without_a_cache_logs_no_fragmentation_keys():
    engine, said = run_steps([[reading(100, 150)] * 4])
    logged = logged_at(said, 0)
    assert "memguard/after_forward/peak_GiB" in logged
    assert "memguard/reserved_free_GiB" not in logged and "memguard/inactive_split_GiB" not in logged
    assert engine.history["inactive_split_bytes"].isna().all()
