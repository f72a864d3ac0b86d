"""Every bad argument of every public entry point fails at the door with a ValueError naming it, the value and what is
allowed (table-driven), and the size and batch-spec parsers never fail any other way (property-based)."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_memguard import (
    GuardSettings,
    MemGuard,
    MemGuardCallback,
    TensorDiff,
    estimate_memory,
    parse_bytes,
    plan_configuration,
)
from lightning_memguard.base.snapshot import GiB, MiB
from lightning_memguard.commands.cli import parse_tensor_spec

NAN, INF = float("nan"), float("inf")

CALLBACK_CASES = [
    # (argument, bad value)
    ("threshold", 0), ("threshold", 1.5), ("threshold", NAN), ("threshold", INF), ("threshold", "0.9"),
    ("threshold", True),
    ("budget", "a lot"), ("budget", -5), ("budget", 0), ("budget", INF), ("budget", NAN), ("budget", 1.5),
    ("budget", ""), ("budget", True), ("budget", "1XB"), ("budget", [1]),
    ("cpu_hard_limit", 1.5), ("cpu_hard_limit", "1XB"), ("cpu_hard_limit", INF), ("cpu_hard_limit", False),
    ("mitigations", "amp"), ("mitigations", ("amp", "amp")), ("mitigations", ("zram",)),
    ("mitigations", (1,)),
    ("blocks", 3), ("blocks", ()), ("blocks", [int]),
    ("min_gain", True), ("min_gain", 1), ("min_gain", -0.1), ("min_gain", NAN), ("min_gain", "x"),
    ("rescue_oom", "no"), ("rescue_oom", 0), ("rescue_oom", None),
    ("plan_at_start", "yes"), ("progress_bar", 1), ("explain", None), ("record_memory_history", "no"),
    ("max_retries", 0), ("max_retries", True), ("max_retries", 2.0), ("max_retries", "3"),
    ("snapshot_max_entries", 2.5), ("snapshot_max_entries", -1),
    ("log_every_n_steps", 0), ("log_every_n_steps", "5"), ("log_every_n_steps", False),
    ("history_max_rows", 0), ("history_max_rows", "x"), ("history_max_rows", 1.5), ("history_max_rows", True),
    ("nvml_interval_s", 0), ("nvml_interval_s", "lots"), ("nvml_interval_s", None), ("nvml_interval_s", NAN),
    ("nvml_interval_s", INF), ("nvml_interval_s", -1),
    ("cpu_sample_every", 0), ("cpu_sample_every", 1.0), ("cpu_sample_every", True),
]


@pytest.mark.parametrize("name,value", CALLBACK_CASES)
def test_callback_rejects_bad_arguments_naming_them(name, value):
    with pytest.raises(ValueError, match=re.escape(f"{name}=")) as info:
        MemGuardCallback(**{name: value})
    message = str(info.value)
    assert repr(value) in message or repr(tuple(value)) in message  # the value, as given
    assert len(message.split()) > 4  # and what is allowed, in words


@pytest.mark.parametrize("door", ["loop", "settings"])
@pytest.mark.parametrize("name,value", [case for case in CALLBACK_CASES if case[0] != "progress_bar"])
def test_the_loop_and_guard_settings_reject_the_same_bad_settings(door, name, value):
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match=re.escape(f"{name}=")) as info:
        if door == "loop":
            MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), **{name: value})
        else:
            GuardSettings(**{name: value})
    assert repr(value) in str(info.value) or repr(tuple(value)) in str(info.value)


def test_callback_accepts_every_good_form():
    guard = MemGuardCallback(threshold=1, budget="1.5GiB", cpu_hard_limit=2e9, mitigations=[], min_gain=0,
                             rescue_oom=False, history_max_rows=None, nvml_interval_s=1, cpu_sample_every=None)
    assert guard.budget_bytes == int(1.5 * GiB) and guard.cpu_hard_limit_bytes == 2_000_000_000
    assert guard.history.empty and guard.events.empty and guard.rescue_oom is False


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


ESTIMATE_CASES = [
    ("model", "not a model"), ("model", None),
    ("example_batch", None),
    ("optimizer", 3), ("optimizer", "adamw"),
    ("precision", "64"), ("precision", None),
    ("loss_fn", "mse"),
    ("blocks", 3),
    ("checkpointed_blocks", -1), ("checkpointed_blocks", 1.5), ("checkpointed_blocks", True),
    ("variants", "yes"),
    ("target", "tpu"), ("target", 3),
]


@pytest.mark.parametrize("name,value", ESTIMATE_CASES)
def test_estimate_rejects_bad_arguments_naming_them(name, value):
    kwargs = {"model": _model(), "example_batch": torch.randn(2, 4), name: value}
    with pytest.raises(ValueError, match=re.escape(f"{name}=")):
        estimate_memory(**kwargs)


PLAN_CASES = [
    ("capacity_bytes", 0), ("capacity_bytes", -1), ("capacity_bytes", NAN), ("capacity_bytes", INF),
    ("capacity_bytes", "lots"), ("capacity_bytes", None), ("capacity_bytes", True),
    ("threshold", 0), ("threshold", NAN), ("threshold", "0.5"),
    ("allow_amp", "no"), ("allow_checkpointing", 1),
    ("model", 5),
]


@pytest.mark.parametrize("name,value", PLAN_CASES)
def test_plan_rejects_bad_arguments_naming_them(name, value):
    kwargs = {"model": _model(), "example_batch": torch.randn(2, 4), "capacity_bytes": GiB, name: value}
    with pytest.raises(ValueError, match=re.escape(f"{name}=")):
        plan_configuration(**kwargs)


def test_plan_accepts_a_capacity_string():
    plan = plan_configuration(_model(), torch.randn(2, 4), "20GiB")
    assert plan.fits and plan.limit_bytes == int(0.9 * 20 * GiB)


@pytest.mark.parametrize("kwargs,name", [
    ({"model": "m"}, "model"), ({"optimizers": 3}, "optimizers"), ({"optimizers": ["sgd"]}, "optimizers"),
])
def test_tensor_diff_rejects_bad_arguments_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=re.escape(f"{name}=")):
        TensorDiff(**kwargs)


# --- the parsers: every input gives a size or a ValueError, nothing else --------------------------------------------
_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KiB": 1024, "MiB": MiB, "GiB": GiB}


@given(st.integers(min_value=1, max_value=2**62))
def test_parse_bytes_keeps_positive_ints(n):
    assert parse_bytes(n) == n


@given(st.decimals(min_value=0, max_value=10**6, places=3, allow_nan=False), st.sampled_from(sorted(_UNITS)))
def test_parse_bytes_reads_number_and_unit(number, unit):
    expected = int(float(number) * _UNITS[unit])
    text = f"{number}{unit}"
    if expected >= 1:
        assert parse_bytes(text) == expected
    else:
        with pytest.raises(ValueError, match="at least one byte"):
            parse_bytes(text)


@settings(max_examples=300)
@given(st.one_of(st.text(), st.floats(), st.integers(), st.booleans(), st.none()))
def test_parse_bytes_gives_a_size_or_a_value_error_naming_it(value):
    try:
        size = parse_bytes(value, "budget")
    except ValueError as err:
        assert str(err).startswith(f"budget={value!r}")
    else:
        assert isinstance(size, int) and size >= 1
        if isinstance(value, float):
            assert math.isfinite(value) and value == size


@given(st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=4),
       st.sampled_from(["float32", "bfloat16", "int64", "int32"]), st.integers(min_value=1, max_value=1000))
def test_batch_spec_builds_the_tensor_it_names(shape, dtype, high):
    spec = "x".join(map(str, shape)) + f":{dtype}:{high}"
    tensor = parse_tensor_spec(spec)
    assert list(tensor.shape) == shape and tensor.dtype == getattr(torch, dtype)
    if not tensor.dtype.is_floating_point:
        assert int(tensor.min()) >= 0 and int(tensor.max()) < high


@settings(max_examples=300)
@given(st.text(alphabet="0123456789x:-.abcdefghijklmnopqrstuvwyz", max_size=24))
def test_batch_spec_gives_a_tensor_or_a_value_error_naming_it(spec):
    try:
        tensor = parse_tensor_spec(spec)
    except ValueError as err:
        assert f"--batch {spec!r}" in str(err)
    else:
        assert isinstance(tensor, torch.Tensor) and tensor.numel() >= 1
