"""The AMP rung predicted for a CPU run: a GPT-2 under a hard limit that AMP alone does not meet is rescued by AMP and
checkpointing applied together, after one out-of-memory error (CPU autocast emulated on meta, see
``estimate/cpu_kernels.py``). The limit is probed from monitoring runs of the same model."""

import warnings

import pytest

from lightning_memguard.estimate.plan import ladder_peak_model
from tests.helpers import checkpoint_every_block, probe
from tests.zoo.models import ZooModule, build, loss_of, zoo_batches, zoo_run

BATCH = 16
STEPS = 3


def monitored_peak(root, checkpoint_all: bool) -> int:
    """The steady peak of a bf16-mixed run that only watches (no rung), with every block checkpointed or none."""
    model, _ = build("gpt2")
    if checkpoint_all:
        checkpoint_every_block(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on small data sets and the like
        peaks = probe("lightning", model, zoo_batches("gpt2", STEPS, BATCH), root, loss=loss_of, logger=False,
                      trainer={"precision": "bf16-mixed"})
    return peaks.highest(from_step=1)  # gradients and optimizer state exist, as when rescued


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    return {"amp": monitored_peak(root / "amp", False), "amp+all": monitored_peak(root / "all", True)}


def test_the_peak_model_of_a_cpu_run_covers_amp_and_predicts_the_monitored_bf16_peaks(peaks):
    module = ZooModule("gpt2", n_batches=STEPS, batch_size=BATCH)
    model = ladder_peak_model(module, module.batches[0], target="cpu", amp=True)
    assert model.covers("amp") and model.covers("checkpointing")
    n_blocks = len(module.model.transformer.h)
    assert model.peak({"amp": 1}) == pytest.approx(peaks["amp"], rel=0.03)
    assert model.peak({"amp": 1, "checkpointing": n_blocks}) == pytest.approx(peaks["amp+all"], rel=0.03)


def test_a_cpu_rescue_applies_amp_and_checkpointing_together_after_one_oom(tmp_path, peaks):
    # between AMP alone and AMP with every block checkpointed: AMP alone runs out of memory again
    limit = (peaks["amp"] + peaks["amp+all"]) // 2
    # threshold 1.0: no warning before the OOM; the amp rung named explicitly (the default ladder leaves it out on a
    # CPU without native bf16)
    result = zoo_run("lightning", "gpt2", tmp_path, STEPS, batch_size=BATCH, mitigations=("amp", "checkpointing",
                     "microbatch"), cpu_hard_limit=limit, threshold=1.0, explain=False,
                     plan_at_start=False)  # the rescue is tested: no plan before the first step
    guard = result.guard
    assert result.steps_done == STEPS
    assert [step for step, _ in result.seen] == [0, 0, 1, 2]  # one out-of-memory error: the first batch ran again
    rescues = guard.events[guard.events["action"] == "rescue"]
    assert list(rescues["rung"]) == ["amp", "checkpointing"]  # both in that one rescue
    assert "the cheapest combination predicted to fit" in rescues["reason"].iloc[0]
    assert guard.levels["amp"] == 1 and guard.levels["checkpointing"] > 0 and guard.levels["microbatch"] == 0
    assert (guard.history["peak_bytes"] <= limit).all()
