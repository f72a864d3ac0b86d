"""``import pytorch_lightning as pl`` users get the same guard as ``lightning.pytorch`` users. What depends on the
namespace is which Trainer, Callback, logger and precision plugin the callback meets: a handful of runs under each
namespace — monitoring with a logger, a rescue, a resume, the AMP rung's precision switch — covers it."""

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import checkpoint_every_block, limit_between, probe, run
from tests.models import Stack, lightning_class, regression_batches

NAMESPACES = ["lightning.pytorch", "pytorch_lightning"]


@pytest.fixture(params=NAMESPACES)
def namespace(request):
    if request.param == "pytorch_lightning":
        pytest.importorskip("pytorch_lightning", reason="the pytorch-lightning package is a test extra")
    return request.param


def test_monitoring_logs_every_phase_to_the_namespaces_logger(tmp_path, namespace):
    result = run("lightning", Stack(width=32, depth=4), regression_batches(3, size=64), tmp_path, namespace=namespace,
                 cpu_sample_every=1)
    assert type(result.trainer).__module__.startswith(namespace.split(".")[0])
    assert sorted(result.guard.history["step"].unique()) == [0, 1, 2]
    assert (tmp_path / "tb" / "version_0" / "memguard_history.csv").exists()  # the namespace's logger's log_dir
    tags = EventAccumulator(result.log_dir).Reload().Tags()["scalars"]
    assert "memguard/after_forward/peak_GiB" in tags and "train_loss" in tags


def test_an_oom_is_rescued_under_the_namespace(tmp_path, namespace):
    plain = probe("lightning", Stack(), regression_batches(2), tmp_path / "plain", namespace=namespace).highest()
    low = probe("lightning", checkpoint_every_block(Stack()), regression_batches(2), tmp_path / "low",
                namespace=namespace).highest()
    limit = limit_between(plain, low)
    result = run("lightning", Stack(), regression_batches(3), tmp_path / "run", namespace=namespace,
                 cpu_hard_limit=limit, threshold=1.0, mitigations=("checkpointing",), explain=False,
                 plan_at_start=False)  # the rescue is tested, not the plan before the first step
    assert result.steps_done == 3 and result.steps_seen() == [0, 1, 2]
    assert "rescue" in set(result.guard.events["action"]) and result.guard.levels["checkpointing"] > 0


def test_resume_restores_the_levels_from_the_namespaces_checkpoint(tmp_path, namespace):
    model = checkpoint_every_block(Stack(width=32, depth=4))  # the callback takes the level over
    first = run("lightning", model, regression_batches(2, size=64), tmp_path / "first", namespace=namespace,
                mitigations=("checkpointing",))
    assert first.guard.levels == {"checkpointing": 4}
    second = run("lightning", Stack(width=32, depth=4), regression_batches(1, size=64), tmp_path / "second",
                 namespace=namespace, resume=first, mitigations=("checkpointing",))
    assert second.guard.levels == {"checkpointing": 4} and second.seen[0] == (2, 4)


def test_the_amp_rung_switches_to_the_namespaces_mixed_precision(tmp_path, namespace):
    """With the other namespace's class the AMP rung used to say the trainer 'already runs 32-true' and never
    switch."""
    # two steps: AMP is applied at the end of the first, the second runs in it (this tiny model's bf16 weight copies
    # may get it reverted at the second's end)
    result = run("lightning", Stack(width=64, depth=4), regression_batches(2, size=64), tmp_path, namespace=namespace,
                 budget="1MiB", mitigations=("amp",), explain=False)
    applied = result.guard.events[result.guard.events["action"] == "apply"]
    assert applied[["step", "rung"]].values.tolist() == [[0, "amp"]]
    plugin = result.plugins[-1]  # the second step's
    assert isinstance(plugin, lightning_class("plugins.precision", "MixedPrecision", namespace))
    assert plugin.precision == "bf16-mixed"
    assert result.trainer.precision == "32-true"  # the Trainer's own, back after the fit
    assert torch.float32 == next(result.model.parameters()).dtype
