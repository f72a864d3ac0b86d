"""The three commands on bad input: one line on stderr and exit code 2, never a traceback; and `report` on runs that
are partial or broken in every way a killed or edited run can be."""

import csv
import json
import sys

import pytest

from lightning_memguard.commands.cli import main
from lightning_memguard.core.snapshot import SNAPSHOT_COLUMNS

FACTORY = "lightning_memguard.commands.demo:TinyGPT"


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["estimate", "no_such_module_xyz:build"], "cannot import 'no_such_module_xyz'"),
    (["estimate", "lightning_memguard.commands.demo:Nope"], "has no attribute 'Nope'"),
    (["estimate", "lightning_memguard.commands.demo"], "expected an importable 'module:callable'"),
    (["estimate", "lightning_memguard.commands.demo:__doc__"], "not a callable"),
    (["estimate", "lightning_memguard.commands.demo:DemoTransformer", "--batch", "2x-3"], "--batch '2x-3'"),
    (["estimate", FACTORY, "--batch", "2x16:int64:0"], "--batch '2x16:int64:0'"),
    (["estimate", FACTORY, "--batch", "2x16:complex"], "--batch '2x16:complex'"),
    (["estimate", FACTORY, "--batch", "2x16:abs"], "--batch '2x16:abs'"),
    (["estimate", FACTORY, "--batch", ""], "--batch ''"),
    (["estimate", FACTORY, "--batch", "99999x99999x99"], "elements"),
    (["estimate", FACTORY, "--batch", "2x16:float32"], "does not fit TinyGPT's training step"),
    (["estimate", FACTORY, "--precision", "64"], "invalid choice"),
    (["demo", "--steps", "0"], "'0' must be a positive int"),
    (["demo", "--steps", "many"], "'many' must be a positive int"),
    (["demo", "--budget", "5XB"], "unknown unit"),
    (["demo", "--budget=-1MiB"], "--budget='-1MiB' is not a size"),
    (["report"], "the following arguments are required: run"),
    (["teleport"], "invalid choice"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_2(argv, says, capsys):
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and says in err, err


def write_history(path, rows, cut_last=False):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(SNAPSHOT_COLUMNS)
        writer.writerows(rows)
    if cut_last:  # a process killed in the middle of writing its last row
        with open(path, "rb+") as f:
            f.truncate(f.seek(0, 2) - 40)


def row(step, phase, peak):
    values = dict.fromkeys(SNAPSHOT_COLUMNS, "")
    values.update(step=step, phase=phase, device="cpu", allocated_bytes=peak // 2, peak_bytes=peak,
                  capacity_bytes=10 * 2**20, micro_batches=1, time=0.0)
    return [values[c] for c in SNAPSHOT_COLUMNS]


ROWS = [row(s, p, (s + 1) * 2**20) for s in range(3) for p in ("batch_start", "after_forward", "after_backward",
                                                                 "after_optimizer_step")]


def test_header_only_history_says_no_steps_yet(tmp_path, capsys):
    write_history(tmp_path / "memguard_history.csv", [])
    assert main(["report", str(tmp_path)]) == 0
    assert "no steps recorded yet" in capsys.readouterr().out


def test_a_cut_last_row_is_skipped_with_a_note(tmp_path, capsys):
    write_history(tmp_path / "memguard_history.csv", ROWS, cut_last=True)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "note: the last row of memguard_history.csv was cut off" in out
    assert "steps 0-2" in out and (tmp_path / "r.png").stat().st_size > 1000


@pytest.mark.parametrize("content,says", [
    (b"", "is empty"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe binary", "cannot be read as text"),
    (b"a,b,c\n1,2,3\n", "lacks the column(s)"),
    ((",".join(SNAPSHOT_COLUMNS) + "\n" + ",".join(["1"] * 20) + "\n" + ",".join(["1"] * 14) + "\n").encode(),
     "not a readable CSV"),
    ((",".join(SNAPSHOT_COLUMNS) + "\n" + ",".join(["oops"] * len(SNAPSHOT_COLUMNS)) + "\n").encode(),
     "steps that are not numbers"),
])
def test_an_unreadable_history_is_one_line(tmp_path, capsys, content, says):
    (tmp_path / "memguard_history.csv").write_bytes(content)
    code, err = run_cli(["report", str(tmp_path)], capsys)
    assert code == 2 and err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize("events,settings,note", [
    ("step,reason\n1,x\n", None, "events left out"),
    (None, "{not json", "memguard_run.json left out"),
    (None, "[1, 2]", "memguard_run.json left out"),
])
def test_broken_events_or_settings_are_left_out_with_a_note(tmp_path, capsys, events, settings, note):
    write_history(tmp_path / "memguard_history.csv", ROWS)
    if events is not None:
        (tmp_path / "memguard_events.csv").write_text(events)
    if settings is not None:
        (tmp_path / "memguard_run.json").write_text(settings)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert f"note: {note}" in out and "Per-phase peaks" in out


def test_report_reads_events_and_threshold(tmp_path, capsys):
    write_history(tmp_path / "memguard_history.csv", ROWS)
    (tmp_path / "memguard_run.json").write_text(json.dumps({"threshold": 0.8}))
    (tmp_path / "memguard_events.csv").write_text("step,action,rung,reason,level\n1,apply,amp,near the limit,1\n")
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "threshold 0.8" in out and "near the limit" in out and "note:" not in out


def test_demo_prints_commands_that_run_as_printed(tmp_path, capsys):
    assert main(["demo", "--steps", "2", "--layers", "1", "--batch-size", "2", "--seq-len", "8",
                 "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    report = [line for line in lines if "-m lightning_memguard report" in line]
    board = [line for line in lines if "-m tensorboard.main --logdir" in line]
    assert report and report[0].startswith(sys.executable + " ")
    assert board and board[0].startswith(sys.executable + " ")
