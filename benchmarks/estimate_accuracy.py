"""How close is estimate_memory to what a real Lightning training step allocates? Compares the estimate's overall
and per-phase peaks with MemGuard's measurement of the same model and batch (CPU: live tensor accounting; CUDA:
max_memory_allocated), for a residual MLP stack, Lightning's demo Transformer, a GPT-style model and a small CNN.

    .venv/bin/python benchmarks/estimate_accuracy.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from _common import quiet

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.models: the residual MLP stack

from lightning_memguard import MemGuardCallback, estimate_memory  # noqa: E402
from lightning_memguard.demo import DemoTransformer, SmallCNN, TinyGPT  # noqa: E402
from tests.models import BlockStack  # noqa: E402

STEPS = 4  # measured steps 1..3 (step 0 has no optimizer state)
MODELS = {
    "residual MLP stack": lambda: BlockStack(width=128, depth=8, batch_size=256),
    "demo Transformer": lambda: DemoTransformer(),
    "GPT-style": lambda: TinyGPT(d_model=128, nlayers=4, seq_len=64),
    "small CNN": lambda: SmallCNN(),
}
PHASE_OF = {"forward": "after_forward", "backward": "after_backward", "optimizer_step": "after_optimizer_step"}


def measure(model, accelerator: str) -> dict[str, int]:
    guard = MemGuardCallback(mitigations=(), cpu_sample_every=1, explain=False)
    pl.Trainer(max_steps=STEPS, accelerator=accelerator, devices=1, callbacks=[guard], logger=False,
               enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False).fit(model)
    history = guard.history
    steady = history[history["step"] >= 1]
    return {phase: int(steady[steady["phase"] == column]["peak_bytes"].max()) for phase, column in PHASE_OF.items()}


def rows(accelerator: str):
    for name, make in MODELS.items():
        pl.seed_everything(0, verbose=False)
        model = make()
        batch = next(iter(model.train_dataloader()))
        started = time.perf_counter()
        estimate = estimate_memory(model, batch)
        seconds = time.perf_counter() - started
        with torch.device("meta"):  # the same model built without memory: how models too big for RAM are estimated
            pl.seed_everything(0, verbose=False)
            meta_model = make()
        try:
            meta = estimate_memory(meta_model, batch).peak_bytes / 2**20
        except ValueError:  # the model's forward reads a value (.item()), which meta tensors do not have
            meta = float("nan")
        measured = measure(model, accelerator)
        yield name, estimate, meta, measured, seconds


def main() -> None:
    quiet()
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.cuda.get_device_name() if accelerator == "cuda" else "cpu"
    print(f"\ndevice: {device}; torch {torch.__version__}; estimate counted on CPU, measurement on {accelerator}")
    print(f"{'model':<20}{'estimate MiB':>13}{'on meta MiB':>12}{'measured MiB':>14}{'error':>8}"
          f"   per phase (estimate/measured){'':>4}{'est. s':>7}")
    for name, estimate, meta, measured, seconds in rows(accelerator):
        peak = max(measured.values())
        error = estimate.peak_bytes / peak - 1
        phases = "  ".join(f"{p[:3]} {estimate.phase_peaks[p] / measured[p]:.3f}" for p in PHASE_OF)
        print(f"{name:<20}{estimate.peak_bytes / 2**20:>13.1f}{meta:>12.1f}{peak / 2**20:>14.1f}"
              f"{error:>+8.1%}   {phases}{seconds:>9.2f}")


if __name__ == "__main__":
    main()
