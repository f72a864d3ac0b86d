"""The ladder on a real Trainer on CPU, with the CPU accountant and a budget between the mitigated and the
unmitigated peak of a model whose activations dominate."""

import math
import warnings

import pytest
import torch
from torch import nn

from lightning_memguard import MemGuardCallback
from lightning_memguard.mitigations.checkpointing import ActivationCheckpointing, is_checkpointed
from tests.models import BlockStack, lightning_class, pl, trainer_kwargs

MixedPrecision = lightning_class("plugins.precision", "MixedPrecision")
Precision = lightning_class("plugins.precision", "Precision")

WIDTH, DEPTH, BATCH = 64, 8, 512


def stack(**kw):
    kw = {"width": WIDTH, "depth": DEPTH, "batch_size": BATCH, "n_samples": 16 * BATCH, **kw}
    return BlockStack(**kw)


def fit(model, guard, root, **overrides):
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(root), logger=False,
                         **trainer_kwargs(**overrides))
    trainer.fit(model)
    return trainer


def step_peaks(guard):
    history = guard.history
    return history.groupby("step")["peak_bytes"].max()


def measured_peak(tmp_path, checkpoint_all=False, **model_kw):
    model = stack(**model_kw)
    if checkpoint_all:
        rung = ActivationCheckpointing(model)
        rung.set_level(rung.max_level)
    guard = MemGuardCallback(cpu_sample_every=1)
    fit(model, guard, tmp_path / f"measure{checkpoint_all}", max_steps=3)
    return int(step_peaks(guard).loc[2])


@pytest.fixture(scope="module")
def budget(tmp_path_factory):
    """threshold x budget halfway between the fully checkpointed and the plain step peak."""
    root = tmp_path_factory.mktemp("budget")
    plain, mitigated = measured_peak(root), measured_peak(root, checkpoint_all=True)
    assert mitigated < 0.7 * plain  # the model is activation-heavy, as these tests need
    return int((plain + mitigated) / 2 / 0.9), plain, mitigated


class RecordsCheckpointing(BlockStack):
    """Notes, per training batch, whether the blocks were checkpointed, and every loss."""

    def __init__(self, **kw):
        super().__init__(**{"width": WIDTH, "depth": DEPTH, "batch_size": BATCH, "n_samples": 16 * BATCH, **kw})
        self.seen = []
        self.losses = []

    def training_step(self, batch, batch_idx):
        self.seen.append((batch_idx, sum(is_checkpointed(b) for b in self.blocks)))
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


def test_checkpointing_rung_engages_between_steps_and_brings_later_peaks_under_the_threshold(tmp_path, budget):
    capacity, plain, _ = budget
    model = RecordsCheckpointing()
    guard = MemGuardCallback(budget=capacity, mitigations=("checkpointing",))
    fit(model, guard, tmp_path, max_steps=8, accumulate_grad_batches=2)
    events = guard.events
    applied = events[events["action"] == "apply"]
    assert len(applied) >= 1 and applied["rung"].eq("checkpointing").all()
    first = int(applied["step"].iloc[0])
    peaks = step_peaks(guard)
    limit = 0.9 * capacity
    assert peaks.loc[first] >= limit  # it acted on a real crossing ...
    last_change = int(events[events["action"].isin(["apply", "revert"])]["step"].max())
    assert (peaks.loc[last_change + 1:] < limit).all()  # ... and every step after its last change is under
    assert 0 < guard.levels["checkpointing"] < DEPTH  # as many blocks as needed, not all
    assert (events[events["action"] == "keep"]["peak_after_bytes"] < events[events["action"] == "keep"][
        "peak_before_bytes"]).all()
    # changes happen only between optimizer steps: both micro-batches of a step see the same blocks checkpointed
    windows = [model.seen[i:i + 2] for i in range(0, len(model.seen), 2)]
    assert all(a[1] == b[1] for a, b in windows)
    assert any(count > 0 for _, count in model.seen)


def test_amp_rung_switches_precision_mid_fit_and_training_stays_finite(tmp_path, budget):
    capacity, plain, _ = budget
    model = RecordsCheckpointing()
    guard = MemGuardCallback(budget=int(plain / 0.8), threshold=0.8, mitigations=("amp",))
    trainer = fit(model, guard, tmp_path, max_steps=6)
    assert guard.levels == {"amp": 1}
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(math.isfinite(loss) for loss in model.losses)
    keep = guard.events[guard.events["action"] == "keep"]
    assert len(keep) == 1 and keep["peak_after_bytes"].iloc[0] < keep["peak_before_bytes"].iloc[0]


class ParameterHeavy(pl.LightningModule):
    """Big weights, a small batch: autocast's bf16 weight copies (2 MiB) outweigh the activations it halves (1 MiB
    in fp32), and parameters with gradients (8 MiB) stay just under the limit."""

    def __init__(self, optimizer="sgd"):
        super().__init__()
        self.optimizer = optimizer
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(4)])

    def training_step(self, batch, batch_idx):
        return self.layers(batch[0]).square().mean()

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-4)
        return torch.optim.SGD(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(512, 512)), batch_size=64)


def test_a_rung_that_does_not_help_is_reverted_and_the_ladder_reports_exhaustion(tmp_path):
    probe = MemGuardCallback(cpu_sample_every=1)
    fit(ParameterHeavy(), probe, tmp_path / "probe", max_steps=3)
    peak = int(step_peaks(probe).loc[2])
    guard = MemGuardCallback(budget=int(peak / 0.95), mitigations=("amp",))
    trainer = fit(ParameterHeavy(), guard, tmp_path / "guarded", max_steps=6)
    events = guard.events
    amp = events[events["rung"] == "amp"]
    assert list(amp["action"]) == ["apply", "revert"]
    assert amp["peak_after_bytes"].iloc[1] > amp["peak_before_bytes"].iloc[1]  # bf16 copies made it worse
    assert type(trainer.strategy.precision_plugin) is Precision  # the original plugin is back
    assert "exhausted" in set(events["action"])
    assert guard.levels["amp"] == 0


def test_peak_in_the_optimizer_step_gets_one_clear_warning_and_no_flailing(tmp_path):
    probe = MemGuardCallback(cpu_sample_every=1)
    fit(ParameterHeavy("adam"), probe, tmp_path / "probe", max_steps=3)
    peaks = probe.history[probe.history["step"] == 2].set_index("phase")["peak_bytes"]
    assert peaks.idxmax() == "after_optimizer_step"  # Adam's state update is the peak
    guard = MemGuardCallback(budget=int(peaks.max() / 0.95))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(ParameterHeavy("adam"), guard, tmp_path / "guarded", max_steps=5)
    cannot = [str(w.message) for w in caught if "cannot lower it" in str(w.message)]
    assert len(cannot) == 1 and "after_optimizer_step" in cannot[0] and "MiB" in cannot[0]
    assert "apply" not in set(guard.events["action"])
    assert set(guard.levels.values()) == {0}  # no rung touched (amp is in the default ladder where bf16 is native)


def test_warn_only_records_the_crossing_and_changes_nothing(tmp_path, budget):
    capacity, _, _ = budget
    guard = MemGuardCallback(budget=capacity, mitigations=())
    fit(stack(), guard, tmp_path, max_steps=4)
    assert list(guard.events["action"]) == ["threshold", "exhausted", "explain"]
    assert "warn only" in guard.events["reason"].iloc[1]


def test_resume_reapplies_the_rungs_once_before_the_first_step(tmp_path, budget):
    capacity, _, _ = budget
    guard = MemGuardCallback(budget=capacity)
    trainer = fit(stack(), guard, tmp_path / "first", max_steps=6)
    levels = guard.levels
    assert levels.get("amp", 0) == 1 or levels["checkpointing"] > 0
    ckpt = str(tmp_path / "mid.ckpt")
    trainer.save_checkpoint(ckpt)

    model = RecordsCheckpointing()
    resumed = MemGuardCallback(budget=capacity)
    trainer = pl.Trainer(callbacks=[resumed], default_root_dir=str(tmp_path / "second"), logger=False,
                         **trainer_kwargs(max_steps=9))
    trainer.fit(model, ckpt_path=ckpt)
    assert resumed.levels == levels
    assert model.seen[0][1] == levels["checkpointing"]  # already on for the first batch after resume
    for block in model.blocks:
        if is_checkpointed(block):
            inner = block.forward._memguard_inner
            assert not hasattr(inner, "_memguard_inner")  # wrapped once, around the class's own forward
    if levels.get("amp", 0):
        assert isinstance(trainer.strategy.precision_plugin, MixedPrecision)
    assert "apply" not in set(resumed.events["action"])
    assert (step_peaks(resumed) < 0.9 * capacity).all()


@pytest.mark.parametrize("kwargs,match", [
    ({"threshold": 0}, "threshold=0"),
    ({"threshold": 1.01}, "threshold=1.01"),
    ({"mitigations": ("amp", "teleport")}, "unknown rung"),
    ({"mitigations": "amp"}, "mitigations='amp'"),
    ({"mitigations": ("amp", "amp")}, "twice"),
    ({"blocks": ()}, "blocks=()"),
    ({"blocks": [int]}, "blocks="),
    ({"min_gain": -0.1}, "min_gain=-0.1"),
])
def test_bad_ladder_arguments_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemGuardCallback(**kwargs)


def test_blocks_that_match_nothing_fail_at_setup_with_the_reason(tmp_path):
    guard = MemGuardCallback(budget="1GiB", blocks={nn.GRU})
    with pytest.raises(ValueError, match="no blocks to checkpoint in BlockStack"):
        fit(stack(), guard, tmp_path, max_steps=1)


def test_plan_at_start_begins_mitigated_so_a_run_that_would_oom_at_once_does_not(tmp_path, budget):
    capacity, plain, mitigated = budget
    # the hard limit is below the plain peak and rescue is off: only the plan can save this run
    guard = MemGuardCallback(budget=capacity, cpu_hard_limit=capacity, plan_at_start=True, rescue_oom=False)
    model = RecordsCheckpointing()
    trainer = fit(model, guard, tmp_path, max_steps=5)
    assert trainer.global_step == 5
    plan = guard.events[guard.events["action"] == "plan"]
    assert list(plan["step"]) == [0] and "cheapest configuration" in plan["reason"].iloc[0]
    assert model.seen[0][1] == guard.levels["checkpointing"] or guard.levels["amp"] == 1  # on from the first batch
    assert (step_peaks(guard) < 0.9 * capacity).all()
    # the estimate it planned with is what the run then measured
    assert plan["peak_before_bytes"].iloc[0] == pytest.approx(step_peaks(guard).loc[1:].max(), rel=0.05)


def test_state_loaded_after_setup_is_applied_at_once(tmp_path):
    """FSDP and DeepSpeed restore callback state after on_fit_start: the rungs must still be set before a step."""
    model = stack()
    guard = MemGuardCallback(mitigations=("checkpointing",))
    fit(model, guard, tmp_path, max_steps=1)
    assert guard.levels == {"checkpointing": 0}
    guard.load_state_dict({"ladder": {"levels": {"checkpointing": 3}}})
    assert guard.levels == {"checkpointing": 3}
    assert [is_checkpointed(b) for b in model.blocks] == [True] * 3 + [False] * (DEPTH - 3)


def test_a_second_fit_of_the_same_model_knows_the_blocks_left_checkpointed(tmp_path, budget):
    capacity, _, _ = budget
    model = stack()
    guard = MemGuardCallback(budget=capacity, mitigations=("checkpointing",))
    fit(model, guard, tmp_path / "first", max_steps=5)
    first = guard.levels["checkpointing"]
    assert first > 0
    again = MemGuardCallback(budget=capacity, mitigations=("checkpointing",))
    fit(model, again, tmp_path / "second", max_steps=3)
    assert again.levels["checkpointing"] == first == sum(is_checkpointed(b) for b in model.blocks)
    assert "apply" not in set(again.events["action"])  # nothing to do: already under the threshold
