import pytest

from lightning_memguard import MemGuardCallback


@pytest.mark.parametrize("kwargs,match", [
    ({"budget": "a lot"}, "size='a lot'"),
    ({"budget": -5}, "size=-5"),
    ({"cpu_hard_limit": "1XB"}, "unknown unit"),
    ({"log_every_n_steps": 0}, "log_every_n_steps=0"),
    ({"nvml_interval_s": 0}, "nvml_interval_s=0"),
    ({"history_max_rows": 0}, "max_rows=0"),
    ({"cpu_sample_every": 0}, "cpu_sample_every=0"),
    ({"max_retries": 0}, "max_retries=0 must be a positive int"),
    ({"max_retries": True}, "max_retries=True"),
    ({"snapshot_max_entries": 2.5}, "snapshot_max_entries=2.5"),
    ({"min_gain": True}, "min_gain=True"),
])
def test_bad_arguments_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemGuardCallback(**kwargs)


def test_defaults_construct():
    guard = MemGuardCallback()
    assert guard.history.empty and guard.events.empty
