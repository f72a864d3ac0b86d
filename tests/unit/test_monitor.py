"""MemoryMonitor on its own (no ladder): a scripted source read at the boundaries of real steps' calls, rows per phase,
the logging interval's peaks, the log_every_n_steps cadence, the CSV files read back, the rows kept on an exception,
the CPU accountant's sampled steps, and an evaluation batch's row."""

import json
import weakref

import pandas as pd
import pytest
import torch
from torch import nn

from lightning_memguard.base.host import Host
from lightning_memguard.monitor.monitor import MemoryMonitor
from lightning_memguard.monitor.settings import MonitorSettings
from lightning_memguard.sources import CpuTensorAccountant
from tests.helpers import ScriptedSource, r, run_step
from tests.ranks import gloo_group

PHASES = ("batch_start", "after_forward", "after_backward", "after_optimizer_step")


class Logged:
    """A host's logger: every (metrics, step) it was given."""

    def __init__(self):
        self.calls = []

    def __call__(self, metrics, step):
        self.calls.append((step, metrics))


def monitor_for(readings, tmp_path=None, log_every_n_steps=1, **kw):
    monitor = MemoryMonitor("the test", MonitorSettings(log_every_n_steps=log_every_n_steps, **kw),
                            source=ScriptedSource(readings))
    logged, said = Logged(), []
    monitor.begin(nn.Linear(2, 2), torch.device("cpu"), Host(log_metrics=logged, warn=said.append))
    monitor.start(list, None if tmp_path is None else str(tmp_path), {"threshold": 0.9})
    return monitor, logged, said


def step_readings(scale):
    """One step's four readings: allocated and peak grow through the phases, times ``scale``."""
    return [r(10 * scale, 20 * scale), r(50 * scale, 90 * scale), r(30 * scale, 95 * scale), r(12 * scale, 40 * scale)]


def test_each_step_is_one_row_per_phase_with_the_readings_of_its_boundaries():
    monitor, _, _ = monitor_for(step_readings(1) + step_readings(2))
    run_step(monitor, 0)
    run_step(monitor, 1)
    history = monitor.history
    assert list(zip(history["step"], history["phase"])) == [(s, p) for s in (0, 1) for p in PHASES]
    assert history["peak_bytes"].tolist() == [20, 90, 95, 40, 40, 180, 190, 80]
    assert history["allocated_bytes"].tolist() == [10, 50, 30, 12, 20, 100, 60, 24]
    assert (history["capacity_bytes"] == 1000).all() and (history["device"] == "scripted").all()


def test_metrics_follow_the_cadence_and_carry_the_interval_peaks():
    # step 1 peaks lower than step 0: the logged peak of each phase is the interval's highest, not the last step's
    monitor, logged, _ = monitor_for(step_readings(3) + step_readings(1) + step_readings(2), log_every_n_steps=2)
    assert run_step(monitor, 0) is None  # (step + 1) % 2 != 0: not logged
    metrics = run_step(monitor, 1)
    assert [step for step, _ in logged.calls] == [1]
    assert logged.calls[0][1] == metrics
    gib = 1024**3
    assert metrics["memguard/after_backward/peak_GiB"] == pytest.approx(3 * 95 / gib)  # step 0's, the interval's max
    assert metrics["memguard/after_forward/allocated_GiB"] == pytest.approx(50 / gib)  # step 1's own
    assert metrics["memguard/peak_share"] == pytest.approx(95 / 1000)  # the logged step's highest peak
    assert run_step(monitor, 2) is None
    # stopping logs whatever the cadence says, with the peaks since the last log only
    monitor2, logged2, _ = monitor_for(step_readings(1), log_every_n_steps=5)
    last = run_step(monitor2, 0, stopping=True)
    assert [step for step, _ in logged2.calls] == [0]
    assert last["memguard/after_backward/peak_GiB"] == pytest.approx(95 / gib)


def test_the_step_hook_sees_the_rows_before_the_metrics_are_logged():
    seen = []
    monitor = MemoryMonitor(settings=MonitorSettings(log_every_n_steps=1), source=ScriptedSource(step_readings(1)),
                            on_step=lambda snaps: seen.append((len(logged.calls), [s.phase for s in snaps])))
    logged = Logged()
    monitor.begin(nn.Linear(2, 2), torch.device("cpu"), Host(log_metrics=logged))
    monitor.start(list, None)
    run_step(monitor, 0)
    assert seen == [(0, list(PHASES))] and len(logged.calls) == 1


def test_the_csv_files_hold_what_the_tables_hold(tmp_path):
    monitor, _, _ = monitor_for(step_readings(1) + step_readings(2), tmp_path)
    run_step(monitor, 0)
    run_step(monitor, 1)
    monitor.stop()
    on_disk = pd.read_csv(tmp_path / "memguard_history.csv")
    pd.testing.assert_frame_equal(on_disk[["step", "phase", "allocated_bytes", "peak_bytes"]],
                                  monitor.history[["step", "phase", "allocated_bytes", "peak_bytes"]],
                                  check_dtype=False)
    run = json.loads((tmp_path / "memguard_run.json").read_text())
    assert run == {"threshold": 0.9, "budget_bytes": None, "capacity_bytes": 1000, "device": "scripted"}
    assert pd.read_csv(tmp_path / "memguard_events.csv").empty


def test_an_exception_keeps_the_unfinished_step_and_the_memory_at_that_moment(tmp_path):
    monitor, _, _ = monitor_for(step_readings(1) + [r(10, 20), r(70, 99), r(66, 70)], tmp_path)
    run_step(monitor, 0)
    monitor.batch_start(1, batch=None)
    monitor.boundary("after_forward")
    monitor.on_exception()  # the forward of step 1 raised
    monitor.stop()
    rows = pd.read_csv(tmp_path / "memguard_history.csv")
    assert list(zip(rows["step"], rows["phase"]))[-3:] == [(1, "batch_start"), (1, "after_forward"),
                                                           (1, "exception")]
    assert rows["allocated_bytes"].tolist()[-1] == 66


def test_a_run_without_logger_is_told_where_its_history_is(tmp_path):
    monitor = MemoryMonitor("the loop", source=ScriptedSource(step_readings(1)))
    said = []
    monitor.begin(nn.Linear(2, 2), torch.device("cpu"), Host(has_logger=False, warn=said.append))
    monitor.start(list, str(tmp_path))
    monitor.stop()
    monitor.start(list, str(tmp_path))  # once per monitor, not once per start
    assert len(said) == 1 and "the loop has no logger" in said[0] and str(tmp_path) in said[0]


def test_on_cpu_only_every_nth_step_is_counted():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    said = []
    monitor = MemoryMonitor(settings=MonitorSettings(cpu_sample_every=2, log_every_n_steps=1))
    monitor.begin(model, torch.device("cpu"), Host(warn=said.append))
    monitor.start(lambda: [optimizer], None)
    assert isinstance(monitor.source, CpuTensorAccountant) and "give budget= to guard it" in said[0]
    try:
        for step in range(4):
            optimizer.zero_grad(set_to_none=True)
            batch = torch.randn(32, 16)
            monitor.batch_start(step, batch)
            loss = model(batch).square().mean()
            monitor.boundary("after_forward")
            loss.backward()
            monitor.boundary("after_backward")
            optimizer.step()
            monitor.step_end()
    finally:
        monitor.stop()
    history = monitor.history
    assert sorted(set(history["step"])) == [0, 2]
    forward = history[history["phase"] == "after_forward"]
    # the forward's activations (32 x 64 floats at least) are counted on top of what the step started with
    starts = history[history["phase"] == "batch_start"]
    assert (forward["peak_bytes"].to_numpy() >= starts["allocated_bytes"].to_numpy() + 32 * 64 * 4).all()


def test_an_evaluation_batch_is_one_row_counted_even_between_sampled_steps_and_the_accountant_left_as_found():
    """cpu_sample_every=2 stops the accountant for step 1; the evaluation after it is counted all the same (the
    weights and the batch included), one row on the training's step, logged on the loop's own axis, and the
    accountant is stopped again afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = Logged()
    monitor = MemoryMonitor(settings=MonitorSettings(cpu_sample_every=2, log_every_n_steps=1))
    monitor.begin(model, torch.device("cpu"), Host(log_metrics=logged, warn=lambda message: None))
    monitor.start(lambda: [optimizer], None)
    try:
        for step in range(2):
            batch = torch.randn(32, 16)
            monitor.batch_start(step, batch)
            model(batch).square().mean().backward()
            optimizer.step()
            monitor.step_end()
        assert not monitor.source.started  # step 1 is not sampled
        for _ in range(2):
            val = torch.randn(256, 16)
            monitor.evaluation_start("validation", val)
            assert monitor.source.started
            with torch.no_grad():
                model(val)
            monitor.evaluation_end("validation", 2)
            assert not monitor.source.started  # as the training's sampling had it
    finally:
        monitor.stop()
    rows = monitor.history[monitor.history["phase"] == "validation"]
    assert list(rows["step"]) == [1, 1] and list(rows["micro_batches"]) == [2, 2]
    weights = sum(p.numel() * 4 for p in model.parameters())
    # the weights, their gradients, the batch and the hidden activations (256 x 64 floats) at least
    assert (rows["peak_bytes"] >= 2 * weights + 256 * 16 * 4 + 256 * 64 * 4).all()
    evaluation = [(step, metrics) for step, metrics in logged.calls if "memguard/validation/peak_GiB" in metrics]
    assert [step for step, _ in evaluation] == [0, 1]
    assert evaluation[0][1]["memguard/validation/peak_GiB"] * 2**30 == rows["peak_bytes"].iloc[0]


def test_gradient_bytes_count_each_gradient_storage_once_as_gradients_come_and_go():
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)  # frozen: never a gradient
    monitor = MemoryMonitor("the test", MonitorSettings(), source=ScriptedSource([]))
    monitor.begin(model, torch.device("cpu"), Host())
    assert monitor.gradient_bytes() == 0
    model(torch.randn(3, 8)).sum().backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert monitor.gradient_bytes() == sum(p.nbytes for p in trainable) == (32 + 4 + 8) * 4
    model[0].weight.grad = None  # set to None between steps
    assert monitor.gradient_bytes() == (4 + 8) * 4
    # views of one flat buffer, as DDP's gradient_as_bucket_view makes them: the buffer's bytes, once
    bucket, offset = torch.zeros(64), 0
    for param in trainable:
        param.grad = bucket[offset:offset + param.numel()].view_as(param)
        offset += param.numel()
    assert monitor.gradient_bytes() == bucket.nbytes == 256


def test_gradient_bytes_are_counted_again_for_new_gradients_and_hold_none_alive():
    """The same gradient tensors as at the last call give its answer without a count; new ones (set to None, then
    another backward) are counted; and what the monitor remembers does not keep a step's gradients alive."""
    model = nn.Linear(8, 4)
    monitor = MemoryMonitor("the test", MonitorSettings(), source=ScriptedSource([]))
    monitor.begin(model, torch.device("cpu"), Host())
    model(torch.randn(3, 8)).sum().backward()
    assert monitor.gradient_bytes() == (32 + 4) * 4
    counted = []
    count = monitor._count_gradient_bytes
    monitor._count_gradient_bytes = lambda *args: counted.append(1) or count(*args)
    assert monitor.gradient_bytes() == (32 + 4) * 4 and counted == []  # the same tensors: not counted again
    gone = weakref.ref(model.weight.grad)
    model.zero_grad(set_to_none=True)
    assert gone() is None  # freed: the monitor holds no reference to it
    assert monitor.gradient_bytes() == 0 and counted == [1]
    model.bias.grad = torch.ones(4)  # a new gradient of one parameter
    assert monitor.gradient_bytes() == 4 * 4 and counted == [1, 1]


def test_gradient_bytes_of_a_sharded_parameter_are_its_local_shards(tmp_path):
    # FSDP2's parameters and gradients are DTensors whose own nbytes is the global shape's: one rank of two holds
    # half, as a DTensor says where the global shape is twice its local one
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    with gloo_group(0, tmp_path, world_size=1):
        mesh = init_device_mesh("cpu", (1,))

        def half_of(local):
            return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                      shape=torch.Size((2 * local.shape[0], *local.shape[1:])), stride=local.stride())

        model = nn.Linear(4, 4)
        model.weight = nn.Parameter(half_of(torch.randn(4, 4)))
        monitor = MemoryMonitor("the test", MonitorSettings(), source=ScriptedSource([]))
        monitor.begin(model, torch.device("cpu"), Host())
        model.weight.grad = half_of(torch.ones(4, 4))
        model.bias.grad = torch.ones(4)
        assert model.weight.grad.nbytes == 128
        assert monitor.gradient_bytes() == 64 + 16
