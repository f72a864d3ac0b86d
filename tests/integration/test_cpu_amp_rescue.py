"""The AMP rung predicted for a CPU run: a GPT-2 under a hard limit that AMP alone does not meet is rescued by AMP and
checkpointing applied together, after one out-of-memory error (CPU autocast emulated on meta, see
``estimate/cpu_kernels.py``). The limit is probed from monitoring runs of the same model."""

import warnings

import pytest

from lightning_memguard import MemGuardCallback
from lightning_memguard.estimate.plan import ladder_peak_model
from lightning_memguard.mitigations.checkpointing import ActivationCheckpointing
from tests.models import pl, trainer_kwargs
from tests.zoo.models import ZooModule

BATCH = 16
STEPS = 3


class CountsSteps(ZooModule):
    """The zoo's GPT-2, counting its training-step calls (a batch retried after an OOM runs again)."""

    def __init__(self):
        super().__init__("gpt2", n_batches=STEPS, batch_size=BATCH)
        self.step_calls = []

    def training_step(self, batch, batch_idx):
        self.step_calls.append(batch_idx)
        return super().training_step(batch, batch_idx)


def gpt2() -> CountsSteps:
    return CountsSteps()


def fit(module, guard, root, **overrides):
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(root), logger=False,
                         **trainer_kwargs(max_steps=STEPS, **overrides))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on small data sets and the like
        trainer.fit(module)
    return trainer


def monitored_peak(root, amp: bool, checkpoint_all: bool) -> int:
    """The steady peak of a run that only watches (no rung), in bf16-mixed or fp32, with every block checkpointed or
    none."""
    module = gpt2()
    if checkpoint_all:
        rung = ActivationCheckpointing(module)
        rung.set_level(rung.max_level)
    guard = MemGuardCallback(mitigations=(), cpu_sample_every=1, explain=False)
    fit(module, guard, root, precision="bf16-mixed" if amp else "32-true")
    steady = guard.history[guard.history["step"] >= 1]  # gradients and optimizer state exist, as when rescued
    return int(steady["peak_bytes"].max())


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    return {"amp": monitored_peak(root / "amp", True, False), "amp+all": monitored_peak(root / "all", True, True)}


def test_the_peak_model_of_a_cpu_run_covers_amp_and_predicts_the_monitored_bf16_peaks(peaks):
    module = gpt2()
    model = ladder_peak_model(module, module.batches[0], target="cpu", amp=True)
    assert model.covers("amp") and model.covers("checkpointing")
    n_blocks = len(module.model.transformer.h)
    assert model.peak({"amp": 1}) == pytest.approx(peaks["amp"], rel=0.03)
    assert model.peak({"amp": 1, "checkpointing": n_blocks}) == pytest.approx(peaks["amp+all"], rel=0.03)


def test_a_cpu_rescue_applies_amp_and_checkpointing_together_after_one_oom(tmp_path, peaks):
    # between AMP alone and AMP with every block checkpointed: AMP alone runs out of memory again
    limit = (peaks["amp"] + peaks["amp+all"]) // 2
    module = gpt2()
    # threshold 1.0: no warning before the OOM; the amp rung named explicitly (the default ladder leaves it out on a
    # CPU without native bf16)
    guard = MemGuardCallback(mitigations=("amp", "checkpointing", "microbatch"), cpu_hard_limit=limit, threshold=1.0,
                             explain=False)
    trainer = fit(module, guard, tmp_path)
    assert trainer.global_step == STEPS
    assert module.step_calls == [0, 0, 1, 2]  # one out-of-memory error: the first batch ran again, once
    rescues = guard.events[guard.events["action"] == "rescue"]
    assert list(rescues["rung"]) == ["amp", "checkpointing"]  # both in that one rescue
    assert "predicted not to be enough alone" in rescues["reason"].iloc[0]
    assert guard.levels["amp"] == 1 and guard.levels["checkpointing"] > 0 and guard.levels["microbatch"] == 0
    assert (guard.history["peak_bytes"] <= limit).all()
