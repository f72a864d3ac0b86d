"""``import pytorch_lightning as pl`` users get the same guard as ``lightning.pytorch`` users: the integration tests
(every rung, rescue, resume, loggers, DDP, run files) run again with every Trainer, module, logger and precision
plugin taken from the standalone ``pytorch_lightning`` package (see tests/models.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_integration_tests_pass_under_pytorch_lightning(tmp_path):
    pytest.importorskip("pytorch_lightning", reason="the pytorch-lightning package is a test extra")
    if os.environ.get("MEMGUARD_TEST_LIGHTNING"):
        pytest.skip("already running under the other namespace")
    env = {**os.environ, "MEMGUARD_TEST_LIGHTNING": "pytorch_lightning"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"),
         "tests/integration", "--deselect", "tests/integration/test_notebook.py",
         "--deselect", "tests/integration/test_loop_ddp.py",  # no Lightning in it: nothing to learn there
         "--deselect", "tests/integration/test_namespaces.py::test_the_integration_tests_pass_under_pytorch_lightning"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:]
    # it really ran under pytorch_lightning: the check below passed inside it
    assert ("PASSED tests/integration/test_namespaces.py::"
            "test_the_trainer_and_the_rungs_are_from_the_namespace_under_test") in result.stdout


def test_the_trainer_and_the_rungs_are_from_the_namespace_under_test(tmp_path):
    """Under either namespace the AMP rung ends in that namespace's MixedPrecision (with the other one's class it
    used to say the trainer 'already runs 32-true' and never switch)."""
    from lightning_memguard import MemGuardCallback
    from tests.models import NAMESPACE, BlockStack, lightning_class, pl, trainer_kwargs

    # one step: AMP is applied at its end (this tiny model's bf16 weight copies would get it reverted a step later)
    guard = MemGuardCallback(budget="1MiB", mitigations=("amp",), explain=False)
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
                         **trainer_kwargs(max_steps=1))
    trainer.fit(BlockStack(width=64, depth=4, batch_size=64))
    assert type(trainer).__module__.startswith(NAMESPACE.split(".")[0])
    assert guard.levels == {"amp": 1}
    assert isinstance(trainer.strategy.precision_plugin, lightning_class("plugins.precision", "MixedPrecision"))
    assert trainer.precision == "bf16-mixed"
