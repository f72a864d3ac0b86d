"""estimate_memory(target="cuda") against this GPU's own max_memory_allocated of real Lightning steps (skipped
without CUDA): the demo models at their small reference sizes, fp32 and bf16-mixed."""

import gc

import pytest
import torch

from lightning_memguard import MemGuardCallback, estimate_memory
from lightning_memguard.commands.demo import DemoTransformer, SmallCNN, TinyGPT
from tests.models import BlockStack, LightningDemoTransformer, pl, trainer_kwargs
# known misses on the H100 reference; they may differ here
from tests.helpers import ESTIMATE_PHASES, KNOWN_ESTIMATE_MISSES

pytestmark = pytest.mark.gpu

MODELS = {
    "BlockStack": lambda: BlockStack(width=128, depth=8, batch_size=256),
    "DemoTransformer": DemoTransformer,
    "TinyGPT": lambda: TinyGPT(d_model=128, nlayers=4, seq_len=64),
    "SmallCNN": SmallCNN,
}


def cases() -> list:
    """Every model in both precisions, a known miss (KNOWN_ESTIMATE_MISSES) as an xfail: a list, as pytest asks."""
    return [pytest.param(name, precision, id=f"{name}-{precision}",
                         marks=[pytest.mark.xfail(strict=False, reason="known miss")]
                         if (name, precision) in KNOWN_ESTIMATE_MISSES else [])
            for name in MODELS for precision in ("32-true", "bf16-mixed")]


def assert_estimate_within_5_percent(model, precision: str, tmp_path) -> None:
    """Estimates the model's first batch for CUDA, then trains it 5 steps on this GPU under a monitoring guard: every
    phase's steady peak (steps 2-4) within 5 % of the estimate."""
    batch = next(iter(model.train_dataloader()))
    estimate = estimate_memory(model, batch, precision=precision, target="cuda")
    gc.collect()
    torch.cuda.empty_cache()
    guard = MemGuardCallback(mitigations=(), explain=False)
    pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
               **trainer_kwargs(accelerator="cuda", max_steps=5, precision=precision)).fit(model)
    steady = guard.history[guard.history["step"] >= 2]
    for phase, column in ESTIMATE_PHASES.items():
        measured = int(steady[steady["phase"] == column]["peak_bytes"].max())
        assert estimate.phase_peaks[phase] == pytest.approx(measured, rel=0.05), phase


@pytest.mark.parametrize("name, precision", cases())
def test_the_estimate_is_within_5_percent_of_this_gpu(tmp_path, name, precision):
    torch.manual_seed(0)
    model = MODELS[name]()
    assert_estimate_within_5_percent(model, precision, tmp_path)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_dropout_is_estimated_as_cudas_fused_kernel(tmp_path, precision):
    # before dropout was modelled as CUDA runs it (a bool mask, not the composite's noise tensor) this model's
    # estimate was ~13 % (fp32) and ~6 % (bf16) high: 960 MiB and 336 MiB of noise in forward and backward
    torch.manual_seed(0)
    model = LightningDemoTransformer()  # the held-out case: dropout 0.2, ~8 GiB
    assert_estimate_within_5_percent(model, precision, tmp_path)


def test_the_first_batchs_predictions_hold_no_device_memory_and_equal_those_of_the_batch_on_the_host():
    """The guard keeps the first batch's predictions for the whole fit (later estimates, micro-batch parts): what it
    keeps of the batch is a host copy, so a model's batch on the GPU is freed after its step, and every number is the
    one the same batch on the host gives."""
    from lightning_memguard.estimate.plan import ladder_predictions

    model = TinyGPT(d_model=128, nlayers=4, seq_len=64).cuda()
    batch = next(iter(model.train_dataloader()))
    on_device = tuple(t.cuda() for t in batch) if isinstance(batch, (tuple, list)) else batch.cuda()
    before = torch.cuda.memory_allocated()
    predictions = ladder_predictions(model, on_device, target="cuda", amp=True)
    del on_device
    gc.collect()
    freed = before - torch.cuda.memory_allocated()
    assert freed > 0, "the device batch is still held"
    host = ladder_predictions(model, batch, target="cuda", amp=True)
    levels = [{"amp": a, "checkpointing": b, "microbatch": m} for a in (0, 1) for b in (0, 1, 4) for m in (0, 1)]
    assert [predictions.model.peak(at) for at in levels] == [host.model.peak(at) for at in levels]
