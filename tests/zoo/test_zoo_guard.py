"""The zoo's transformers models (GPT-2, Llama with grouped-query attention, BERT, T5, ViT, a BatchNorm ResNet)
through all three front doors — the callback in a real Trainer, the plain-loop guard, the Fabric guard — on padded
and ``BatchEncoding`` batches: monitoring; rescue under a real CPU hard limit, equal to unguarded training (bit for
bit, buffers included, when the rung was checkpointing); ``plan_at_start`` where the unguarded step does not fit; and
the checkpointing rung engaged by a threshold crossing on decoders that hand every block a ``DynamicCache``.

Every budget and limit comes from monitoring runs of this module, through the same front door on the same batches:
the unguarded run's highest phase peak, and the same run's with every block checkpointed (each measured once, shared
by the tests that need it)."""

from __future__ import annotations

import functools
import os

import pandas as pd
import pytest
import torch

from lightning_memguard import PHASES
from lightning_memguard.mitigations.checkpointing import ActivationCheckpointing, find_blocks, is_checkpointed
from tests.helpers import DOORS, Run
from tests.zoo.models import ZOO, train_unguarded, zoo_run

transformers = pytest.importorskip("transformers")

STEPS = 2  # step 1 is the first with gradients and momentum alive: the step every later one repeats
GUARDED = ("checkpointing", "microbatch")  # the ladder named, so that no machine's bf16 support changes the numerics


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The zoo's tensors are tiny: a second intra-op thread only adds synchronisation, and on a busy 2-core machine
    its waits made every step about 100 times slower (0.8 s instead of 6 ms for a GPT-2 step)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def checkpoint_every_block(model: torch.nn.Module) -> None:
    rung = ActivationCheckpointing(model)
    rung.set_level(rung.max_level)


def highest_peak(run: Run) -> int:
    return int(run.guard.history["peak_bytes"].max())


@pytest.fixture(scope="module")
def monitored(tmp_path_factory):
    """``monitored(front, name, encoding=False, checkpointed=False)``: the run of zoo model ``name`` through
    ``front`` under a monitoring-only guard (no budget), every step counted; ``checkpointed``: every block
    checkpointed before training. Each is run once per module."""
    runs: dict[tuple, Run] = {}

    def get(front: str, name: str, encoding: bool = False, checkpointed: bool = False) -> Run:
        key = (front, name, encoding, checkpointed)
        if key not in runs:
            root = tmp_path_factory.mktemp(f"{front}-{name}{'-encoding' if encoding else ''}"
                                           f"{'-checkpointed' if checkpointed else ''}")
            runs[key] = zoo_run(front, name, root, STEPS, encoding=encoding, cpu_sample_every=1,
                               prepare=checkpoint_every_block if checkpointed else None)
        return runs[key]

    return get


def probed_peaks(monitored, front: str, name: str, encoding: bool = False) -> tuple[int, int]:
    """The highest phase peak of unguarded training through ``front``, and of the same with every block
    checkpointed."""
    plain = highest_peak(monitored(front, name, encoding))
    checkpointed = highest_peak(monitored(front, name, encoding, checkpointed=True))
    assert checkpointed < plain
    return plain, checkpointed


@functools.lru_cache(maxsize=None)
def reference(name: str, steps: int = STEPS, encoding: bool = False) -> dict[str, torch.Tensor]:
    return train_unguarded(name, steps, encoding=encoding)


def assert_trains_like_unguarded(run: Run, name: str, steps: int = STEPS, encoding: bool = False,
                                 atol: float = 0.0) -> None:
    """Parameters and buffers (BatchNorm's running statistics and counters included) against unguarded training:
    equal bit for bit with ``atol=0``."""
    expected, state = reference(name, steps, encoding), run.model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        if atol == 0.0 or not value.is_floating_point():
            assert torch.equal(state[key], value), key
        else:
            assert torch.allclose(state[key], value, rtol=0.0, atol=atol), (key, (state[key] - value).abs().max())


def exact_tolerance(name: str) -> float:
    """What checkpointing keeps of unguarded training: everything, bit for bit — but T5, whose checkpointed blocks
    run without the cache, which rounds its attention differently (test_zoo_checkpointing: T5 checkpointed equals
    T5 run without a cache, bit for bit)."""
    return 1e-6 if name == "t5" else 0.0


def assert_completed(run: Run, steps: int) -> None:
    assert run.steps_done == steps
    assert sorted(run.guard.history["step"].unique()) == list(range(steps))  # no batch skipped


def actions(run: Run) -> list[tuple[int, str, str]]:
    return [(int(e.step), e.action, e.rung) for e in run.guard.events.itertuples()]


# --- monitoring -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("front", DOORS)
@pytest.mark.parametrize("name", ZOO)
def test_every_zoo_model_is_monitored_through_every_front_door(monitored, name, front):
    run = monitored(front, name)
    history = run.guard.history
    assert run.steps_done == STEPS
    assert list(history["step"]) == [step for step in range(STEPS) for _ in PHASES]
    assert list(history["phase"]) == list(PHASES) * STEPS
    assert (history["peak_bytes"] > 0).all() and (history["allocated_bytes"] > 0).all()
    assert (history["peak_bytes"] >= history["allocated_bytes"]).all()
    assert (history["micro_batches"] == 1).all()
    forward = history[history["phase"] == "after_forward"]["allocated_bytes"].to_numpy()
    start = history[history["phase"] == "batch_start"]["allocated_bytes"].to_numpy()
    assert (forward > start).all()  # the forward's saved activations were counted

    on_disk = pd.read_csv(os.path.join(run.log_dir, "memguard_history.csv"))
    empty = {column: float for column in history.columns if history[column].isna().all()}  # None in memory, NaN read
    # what a CPU run without a budget has not
    assert set(empty) == {"reserved_bytes", "alloc_retries", "nvml_used_bytes", "nvml_total_bytes",
                          "nvml_process_bytes", "capacity_bytes", "inactive_split_bytes"}
    pd.testing.assert_frame_equal(on_disk, history.astype(empty), check_dtype=False)
    # monitoring only: nothing to act on, so no events, no rung moved, and only the notice a CPU run without a budget
    # gives (where the files go without a logger is an info line, not a warning)
    assert run.guard.events.empty
    assert pd.read_csv(os.path.join(run.log_dir, "memguard_events.csv")).empty
    assert run.guard.levels and not any(run.guard.levels.values())
    # Fabric with no logger still warns where the files go: nobody chose logger=False there
    assert len(run.said) == (2 if run.door == "fabric" else 1), run.said
    assert "live CPU tensor memory is counted" in run.said[0] and all(run.log_dir in s for s in run.said[1:])


# --- rescue under a hard limit ----------------------------------------------------------------------------------------
RESCUES = [(front, name, False) for name in ("gpt2", "llama", "resnet") for front in DOORS] + [
    ("lightning", "bert", False), ("lightning", "t5", False), ("lightning", "vit", False),
    ("lightning", "gpt2", True), ("lightning", "bert", True)]


@pytest.mark.parametrize("front,name,encoding", RESCUES,
                         ids=[f"{f}-{n}{'-encoding' if e else ''}" for f, n, e in RESCUES])
def test_a_zoo_model_over_a_hard_limit_is_rescued_and_trains_like_the_unguarded_run(tmp_path, monitored, front, name,
                                                                                     encoding):
    plain, checkpointed = probed_peaks(monitored, front, name, encoding)
    limit = (plain + checkpointed) // 2  # the unguarded step runs out of memory; with every block checkpointed it fits
    # micro-batches change BatchNorm's statistics: for the ResNet only the rung that keeps the step exact
    ladder = ("checkpointing",) if name == "resnet" else GUARDED
    # threshold 1: the limit is the capacity, and only running out of it moves the ladder (no mitigation ahead)
    run = zoo_run(front, name, tmp_path, STEPS, encoding=encoding, cpu_hard_limit=limit, threshold=1.0,
                 mitigations=ladder, explain=False, plan_at_start=False)  # the rescue is tested, not the plan

    assert_completed(run, STEPS)
    events = run.guard.events
    rescues = events[events["action"] == "rescue"]
    assert len(rescues) >= 1 and "gave_up" not in set(events["action"]), events
    assert rescues["rung"].iloc[0] == "checkpointing" and run.guard.levels["checkpointing"] >= 1
    assert (run.guard.history["peak_bytes"] <= limit).all()
    checkpointed_blocks = [m for m in run.model.modules() if is_checkpointed(m)]
    assert len(checkpointed_blocks) == run.guard.levels["checkpointing"]  # still on at the end, as the levels say

    if run.guard.levels.get("microbatch", 0) > 0:  # the micro-batches' gradients add up to the whole batch's
        assert name != "resnet" and (run.guard.history["micro_batches"] > 1).any()
        assert_trains_like_unguarded(run, name, encoding=encoding, atol=1e-6)
    else:  # the step ran whole (the failed attempt is no micro-batch), its blocks recomputed exactly as they ran
        assert set(rescues["rung"]) == {"checkpointing"} and (run.guard.history["micro_batches"] == 1).all()
        assert_trains_like_unguarded(run, name, encoding=encoding, atol=exact_tolerance(name))
    if name == "resnet":  # the failed attempt's update of the running statistics was undone: one per step
        counters = [b for key, b in run.model.named_buffers() if key.endswith("num_batches_tracked")]
        assert counters and all(int(c) == STEPS for c in counters)


# --- plan_at_start ----------------------------------------------------------------------------------------------------
PLANS = [("lightning", name) for name in ("gpt2", "llama", "bert", "t5")] + [("loop", "llama"), ("fabric", "gpt2")]


@pytest.mark.parametrize("front,name", PLANS, ids=[f"{f}-{n}" for f, n in PLANS])
def test_plan_at_start_starts_a_zoo_model_mitigated_where_the_unguarded_step_does_not_fit(tmp_path, monitored, front,
                                                                                         name):
    plain, checkpointed = probed_peaks(monitored, front, name)
    budget = (plain + checkpointed) // 2
    assert plain > budget
    # the hard limit is the budget and rescue is off: one OOM anywhere and the run dies
    run = zoo_run(front, name, tmp_path, STEPS, budget=budget, cpu_hard_limit=budget, plan_at_start=True,
                 rescue_oom=False, mitigations=GUARDED, explain=False)

    assert_completed(run, STEPS)
    plan = run.guard.events[run.guard.events["action"] == "plan"]
    assert set(plan["step"]) == {0} and "cheapest configuration" in plan["reason"].iloc[0]
    assert not {"rescue", "gave_up"} & set(run.guard.events["action"])
    assert run.guard.levels["checkpointing"] >= 1 or run.guard.levels["microbatch"] >= 1
    assert (run.guard.history["peak_bytes"] <= budget).all()
    if run.guard.levels["microbatch"] == 0:  # on from the first batch: every step ran with the same blocks
        assert_trains_like_unguarded(run, name, atol=exact_tolerance(name))
    else:
        assert_trains_like_unguarded(run, name, atol=1e-6)


# --- a DynamicCache in every block ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_decoders_handing_blocks_a_dynamic_cache_train_exactly_once_a_threshold_crossing_checkpoints_them(
        tmp_path, monitored, name):
    """Padded batches, so that the causal mask is materialised; ``use_cache`` stays on in training, so every block
    gets the model's ``DynamicCache``. The checkpointing rung, engaged because a step crossed the threshold (not
    forced, not planned), must run those blocks without adding to the cache twice: training stays bit-identical."""
    steps = 4
    plain, checkpointed = probed_peaks(monitored, "lightning", name)
    budget = plain  # the unguarded step reaches the 90 % threshold; checkpointed, it stays under it
    assert checkpointed < 0.9 * budget

    calls: list[tuple[bool, bool]] = []  # (checkpointed, a Cache among the arguments), every block call

    def watch(model: torch.nn.Module) -> None:
        assert model.config.use_cache
        for _, block in find_blocks(model):
            block.register_forward_pre_hook(
                lambda block, args, kwargs: calls.append((is_checkpointed(block), any(
                    isinstance(v, transformers.Cache) for v in (*args, *kwargs.values())))), with_kwargs=True)

    run = zoo_run("lightning", name, tmp_path, steps, budget=budget, mitigations=("checkpointing",), explain=False,
                 prepare=watch, plan_at_start=False)

    assert_completed(run, steps)
    moves = [a for a in actions(run) if a[1] in ("plan", "threshold", "apply", "rescue", "keep", "revert")]
    assert [m[1:] for m in moves[:3]] == [("threshold", ""), ("apply", "checkpointing"), ("keep", "checkpointing")]
    assert moves[1][0] < steps - 1 and run.guard.levels["checkpointing"] >= 1
    assert (True, True) in calls and (False, True) in calls  # checkpointed blocks were handed the cache too
    assert_trains_like_unguarded(run, name, steps=steps)
