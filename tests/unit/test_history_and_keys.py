import csv

import pandas as pd
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lightning_memguard import MemGuard
from lightning_memguard.base.keys import (
    KEY_TABLE,
    METRIC_KEYS,
    RUNG_NAMES,
    phase_key,
    rung_key,
    step_metrics,
    tensorboard_layout,
)
from lightning_memguard.base.snapshot import (
    EVALUATION_PHASES,
    PHASES,
    Event,
    GiB,
    MemorySnapshot,
    format_bytes,
    format_bytes_apart,
    parse_bytes,
)
from lightning_memguard.monitor.history import EventLog, MemoryHistory, read_rows
from lightning_memguard.monitor.run_files import RunFiles, files_beside, latest_fit_history


def snap(step, phase, peak=GiB, capacity=4 * GiB, **kw):
    return MemorySnapshot(step=step, phase=phase, device="cpu", allocated_bytes=peak // 2, peak_bytes=peak,
                          capacity_bytes=capacity, **kw)


def test_history_keeps_last_rows_in_memory_and_all_in_csv(tmp_path):
    history = MemoryHistory(max_rows=3)
    path = tmp_path / "h.csv"
    history.attach_csv(str(path))
    for step in range(5):
        history.add(snap(step, "batch_start"))
    history.flush()
    frame = history.to_dataframe()
    assert list(frame["step"]) == [2, 3, 4]
    assert len(history) == 5
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4]
    assert {"step", "phase", "allocated_bytes", "peak_bytes", "reserved_bytes", "nvml_used_bytes", "device"} <= set(
        frame.columns)


def test_rows_reach_the_csv_only_on_flush(tmp_path):
    history = MemoryHistory()
    path = tmp_path / "h.csv"
    history.attach_csv(str(path))
    history.add(snap(0, "batch_start"))
    assert path.read_text().count("\n") == 1  # header only
    history.flush()
    history.flush()  # idempotent
    assert path.read_text().count("\n") == 2


def test_rows_before_the_csv_is_attached_are_written_too(tmp_path):
    events = EventLog()
    events.add(Event(step=1, action="apply", rung="amp", reason="r"))
    events.attach_csv(str(tmp_path / "e.csv"))
    events.flush()
    assert "apply,amp,r" in (tmp_path / "e.csv").read_text()


def test_a_snapshot_is_an_immutable_row_written_field_by_field_under_its_own_column(tmp_path):
    history = MemoryHistory()
    path = tmp_path / "h.csv"
    history.attach_csv(str(path))
    one = MemorySnapshot(step=4, phase="after_backward", device="cuda:0", allocated_bytes=300, peak_bytes=900,
                         reserved_bytes=1000, alloc_retries=2, num_ooms=0, capacity_bytes=4000, micro_batches=3,
                         time=12.5, inactive_split_bytes=64)
    with pytest.raises(AttributeError):
        one.peak_bytes = 1  # a row once kept is never changed
    assert one.reserved_free_bytes == 700
    history.extend([one, snap(5, "batch_start")])  # a step's rows in one go
    history.flush()
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert rows[0] == {"step": "4", "phase": "after_backward", "device": "cuda:0", "allocated_bytes": "300",
                       "peak_bytes": "900", "reserved_bytes": "1000", "alloc_retries": "2", "num_ooms": "0",
                       "nvml_used_bytes": "", "nvml_total_bytes": "", "nvml_process_bytes": "",
                       "capacity_bytes": "4000", "micro_batches": "3", "time": "12.5", "inactive_split_bytes": "64"}
    assert rows[1]["step"] == "5" and len(history) == 2
    frame = history.to_dataframe()
    assert frame.loc[0, "peak_bytes"] == 900 and frame.loc[1, "phase"] == "batch_start"


def test_a_steps_rows_are_written_exactly_as_the_csv_module_writes_them(tmp_path):
    # the history's own formatting (faster than the csv writer) against the csv writer itself: empty cells, large and
    # odd floats, texts that need quoting (those rows take the csv writer's path) and ones that only look like it
    history = MemoryHistory()
    path = tmp_path / "h.csv"
    history.attach_csv(str(path))
    expected = tmp_path / "expected.csv"
    texts = ["batch_start", "cuda:0", "a,b", 'say "x"', "two\nlines", "None", "NoneOfThese", "", " padded "]
    with open(expected, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(history.columns)
        for step, (phase, device) in enumerate(zip(texts, reversed(texts))):
            values = [None, 0, 2**40 + step, -3, None, 7, 10**15, None, 8 * GiB]
            times = [0.0, 1795698400.8285997, 1e-7, float("nan"), 1.5e300, float(step)]
            rows = [MemorySnapshot(step, phase, device, *values[i:] + values[:i], i % 3 + 1, times[i % len(times)],
                                   values[-i]) for i in range(4)]
            rows.append(MemorySnapshot(step, "after_forward", "cpu", None, None))
            now = 1795698400.0 + step / 7  # one time for a step's rows, as the recorder gives them
            rows += [MemorySnapshot(step, phase, "cuda:1", 2**30, 2**31 + step % 2, time=now) for phase in PHASES]
            rows.append(MemorySnapshot(step, "after_forward", "cpu", 0, -1, time=-0.0))
            history.extend(rows)
            writer.writerows(rows)
    history.flush()
    assert path.read_bytes() == expected.read_bytes()


def test_a_streamed_table_reads_back_as_it_was_kept(tmp_path):
    """What a launching process shows of a spawned rank's run: the rows of its CSV, its last max_rows, every column
    in order (one an older file lacks is empty), an empty cell as NaN."""
    history = MemoryHistory(max_rows=3)
    history.attach_csv(str(tmp_path / "h.csv"))
    for step in range(5):
        history.add(snap(step, "batch_start"))
    history.close()
    frame = read_rows(str(tmp_path / "h.csv"), history.columns, max_rows=3)
    kept = history.to_dataframe()
    assert list(frame.columns) == list(kept.columns)
    valued = [column for column in kept.columns if kept[column].notna().all()]
    assert {"step", "phase", "peak_bytes", "capacity_bytes"} <= set(valued)
    pd.testing.assert_frame_equal(frame[valued], kept[valued], check_dtype=False)
    assert frame.drop(columns=valued).isna().all().all()  # no value kept: an empty cell, NaN
    assert len(read_rows(str(tmp_path / "h.csv"), history.columns)) == 5
    older = read_rows(str(tmp_path / "h.csv"), (*history.columns, "a_later_column"))
    assert older["a_later_column"].isna().all()
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(ValueError):
        read_rows(str(tmp_path / "empty.csv"), history.columns)


def test_bad_max_rows():
    with pytest.raises(ValueError, match="max_rows=0"):
        MemoryHistory(max_rows=0)


def test_step_metrics_names_units_and_interval_peak():
    snaps = [snap(7, p, peak=(i + 1) * GiB) for i, p in enumerate(PHASES)]
    metrics = step_metrics(snaps, interval_peaks={"after_forward": 3 * GiB})
    assert metrics[phase_key("after_forward", "peak")] == 3.0  # the interval's max, not the step's 2 GiB
    assert metrics["memguard/after_backward/peak_GiB"] == 3.0
    assert metrics["memguard/capacity_GiB"] == 4.0
    assert metrics["memguard/peak_share"] == 1.0  # 4 GiB peak after the optimizer step / 4 GiB
    assert "memguard/nvml_used_GiB" not in metrics  # no value, no key
    assert set(metrics) <= set(METRIC_KEYS)


def test_metric_keys_spell_out_the_key_table():
    assert METRIC_KEYS["memguard/after_forward/peak_GiB"] == KEY_TABLE["memguard/<phase>/peak_GiB"]
    assert METRIC_KEYS["memguard/batch_start/allocated_GiB"] == KEY_TABLE["memguard/<phase>/allocated_GiB"]
    assert METRIC_KEYS["memguard/rung/microbatch"] == KEY_TABLE["memguard/rung/<name>"]
    assert METRIC_KEYS["memguard/num_ooms"] == KEY_TABLE["memguard/num_ooms"]
    assert METRIC_KEYS["memguard/test/peak_GiB"] == KEY_TABLE["memguard/<evaluation>/peak_GiB"]
    # allocated and peak per phase, nine per step, allocated and peak per evaluation loop, one per rung
    assert len(METRIC_KEYS) == 2 * 4 + 9 + 2 * 3 + 4
    assert set(METRIC_KEYS.values()) == set(KEY_TABLE.values()) and not any("<" in key for key in METRIC_KEYS)


def test_the_rung_keys_are_the_ladders_rungs():
    from lightning_memguard.guard.ladder import RUNGS

    assert set(RUNG_NAMES) == set(RUNGS)
    assert {rung_key(name) for name in RUNGS} <= set(METRIC_KEYS)


def test_a_guarded_run_logs_only_metric_keys_and_its_rung_levels(tmp_path):
    """A plain loop whose budget every step crosses: each event logs the rung levels; every key is a METRIC_KEYS key."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    guard = MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), budget="1KiB", log_dir=str(tmp_path))
    batch = (torch.randn(16, 8), torch.randn(16, 1))
    with pytest.warns(UserWarning):  # no CUDA; activation remedies cannot help a 1 KiB budget
        for _ in range(3):
            guard.step(batch, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    guard.close()
    assert not guard.events.empty
    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    logged = {tag for tag in accumulator.Tags()["scalars"] if tag.startswith("memguard/")}
    rungs = {tag for tag in logged if tag.startswith("memguard/rung/")}
    assert phase_key("after_backward", "peak") in logged and rungs
    assert logged <= set(METRIC_KEYS), logged - set(METRIC_KEYS)


def test_layout_regexes_cover_the_memory_keys():
    """The training steps' GiB curves on one chart, the evaluation batches' peaks (another x axis) on their own."""
    import re

    layout = tensorboard_layout()["memguard"]
    chart = next(v for k, v in layout.items() if k.startswith("memory (GiB)"))
    pattern = re.compile(chart[1][0])
    evaluation = re.compile(layout["evaluation batch peaks (GiB)"][1][0])
    gib_keys = [k for k in METRIC_KEYS if k.endswith("_GiB")]
    evaluation_keys = [k for k in gib_keys if k.split("/")[1] in EVALUATION_PHASES]
    training_keys = [k for k in gib_keys if k not in evaluation_keys]
    assert training_keys and all(pattern.fullmatch(k) for k in training_keys)
    assert evaluation_keys and not any(pattern.fullmatch(k) for k in evaluation_keys)
    assert [k for k in gib_keys if evaluation.fullmatch(k)] == [f"memguard/{p}/peak_GiB" for p in EVALUATION_PHASES]
    phase_peaks = re.compile(layout["phase peaks (GiB)"][1][0])
    assert not any(phase_peaks.fullmatch(k) for k in evaluation_keys)


@pytest.mark.parametrize("text,expected", [
    ("1.5GiB", int(1.5 * GiB)), ("800MB", 800_000_000), ("512 MiB", 512 * 2**20), (4096, 4096), ("10", 10)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "1.5 GiBs", "-3MB", 0, True, None])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="size="):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(3 * 2**20) == "3.0 MiB"
    assert format_bytes(None) == "n/a"


def test_sizes_compared_in_one_text_never_read_the_same_unless_they_are():
    assert format_bytes_apart(3 * 2**20, 2**20) == ["3.0 MiB", "1.0 MiB"]
    assert format_bytes_apart(1_150_000, 1_160_000) == ["1.10 MiB", "1.11 MiB"]
    assert format_bytes_apart(1_150_000, 1_150_100) == ["1.097 MiB", "1.097 MiB"]  # three decimals at most
    assert format_bytes_apart(5 * 2**20, 5 * 2**20, None) == ["5.0 MiB", "5.0 MiB", "n/a"]


def test_a_file_that_can_take_no_more_rows_is_one_warning_and_the_rows_stay_in_memory(tmp_path):
    # a real write error mid-run: the process may not grow files past their size now (as on a full disk)
    resource = pytest.importorskip("resource")
    import signal

    history = MemoryHistory()
    path = tmp_path / "h.csv"
    history.attach_csv(str(path))
    history.extend([snap(0, phase) for phase in PHASES])
    history.flush()
    written = path.read_bytes()
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(written), limits[1]))
        with pytest.warns(UserWarning, match="cannot write .*h.csv.* rows stay in memory"):
            for step in range(1, 40):  # more than the file's buffer holds: a write reaches the OS before the flush
                history.extend([snap(step, phase) for phase in PHASES])
            history.flush()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    history.extend([snap(40, phase) for phase in PHASES])  # no file any more: no second warning
    history.flush()
    assert len(history) == 41 * 4 and history.to_dataframe()["step"].iloc[-1] == 40
    assert path.read_bytes() == written


def test_each_run_in_a_directory_gets_files_of_its_own_version_per_rank_and_loop(tmp_path):
    def attached(rank: int = 0, name: str = "") -> str:
        files = RunFiles(rank=rank, name=name)
        files.attach(str(tmp_path), {}, warn=lambda text: None)
        files.close()
        return files.history.path

    names = [attached(), attached(), attached(rank=1), attached(name="test"), attached(rank=1), attached()]
    assert [p.rsplit("/", 1)[1] for p in names] == [
        "memguard_history.csv", "memguard_history-v1.csv", "memguard_history.rank1.csv", "memguard_test_history.csv",
        "memguard_history-v1.rank1.csv", "memguard_history-v2.csv"]
    assert sorted(p.name for p in tmp_path.glob("memguard_*run*.json")) == [
        "memguard_run-v1.json", "memguard_run-v2.json", "memguard_run.json", "memguard_test_run.json"]
    assert latest_fit_history(str(tmp_path)) == (names[-1], 3)
    assert files_beside(names[4]) == (str(tmp_path / "memguard_events-v1.rank1.csv"),
                                      str(tmp_path / "memguard_run-v1.json"))
    assert files_beside(names[3])[1] == str(tmp_path / "memguard_test_run.json")
    (tmp_path / "empty").mkdir()
    assert latest_fit_history(str(tmp_path / "empty")) == (None, 0)
