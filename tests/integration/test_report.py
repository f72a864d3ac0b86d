"""The report command on a real run's files."""

import struct
from pathlib import Path

from lightning_memguard.commands.cli import main
from tests.helpers import probe, run
from tests.models import Stack, regression_batches


def png_size(path):
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_report_prints_the_summary_and_events_and_writes_a_png(tmp_path, capsys):
    data = regression_batches(6, size=256)
    plain = probe("lightning", Stack(), data[:3], tmp_path / "probe").highest(from_step=1)
    # the plain step crosses the threshold (0.9) of this budget: the report has events to show
    result = run("lightning", Stack(), data, tmp_path / "run", budget=int(plain / 0.95))
    assert (result.guard.events["action"] == "apply").any()
    files = Path(result.log_dir)
    assert main(["report", str(files)]) == 0
    out = capsys.readouterr().out
    assert "threshold 0.9" in out
    for phase in ("batch_start", "after_forward", "after_backward", "after_optimizer_step"):
        assert phase in out
    assert "peak_p95_MiB" in out and "capacity_share" in out
    assert "apply" in out and "Events:" in out
    width, height = png_size(files / "memguard_report.png")
    assert width >= 800 and height >= 400
    custom = tmp_path / "pictures" / "run.png"
    assert main(["report", str(files / "memguard_history.csv"), "--out", str(custom)]) == 0
    assert png_size(custom) == (width, height)


def test_report_on_a_directory_without_a_run_says_so_in_one_line(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no memguard_history.csv" in err
