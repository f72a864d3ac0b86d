"""The report command on a real run's files."""

import struct

from lightning_memguard import MemGuardCallback
from lightning_memguard.commands.cli import main
from tests.models import BlockStack, pl, trainer_kwargs


def png_size(path):
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_report_prints_the_summary_and_events_and_writes_a_png(tmp_path, capsys):
    guard = MemGuardCallback(budget="8MiB")  # the plain step peaks at ~8.2 MiB
    pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
               **trainer_kwargs(max_steps=6)).fit(BlockStack(width=64, depth=8, batch_size=256))
    assert (guard.events["action"] == "apply").any()
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "threshold 0.9" in out
    for phase in ("batch_start", "after_forward", "after_backward", "after_optimizer_step"):
        assert phase in out
    assert "peak_p95_MiB" in out and "capacity_share" in out
    assert "apply" in out and "Events:" in out
    width, height = png_size(tmp_path / "memguard_report.png")
    assert width >= 800 and height >= 400
    custom = tmp_path / "pictures" / "run.png"
    assert main(["report", str(tmp_path / "memguard_history.csv"), "--out", str(custom)]) == 0
    assert png_size(custom) == (width, height)


def test_report_on_a_directory_without_a_run_says_so_in_one_line(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no memguard_history.csv" in err
