"""The zoo's models estimated for a CPU target on the meta device, CPU autocast and the CPU's attention kernel
emulated, against real CPU steps under the same accounting: in bf16-mixed (a real step is slow on a CPU without
native bf16, the estimate on meta is not) and in fp32 with the CPU's fused attention (no s x s probabilities kept)."""

import warnings

import pytest
import torch

from lightning_memguard.estimate import estimate_memory
from tests.zoo.models import TOKEN_MODELS, ZOO, build, loss_of

CASES = [(name, padded, precision) for name in ZOO for padded in ((False, True) if name in TOKEN_MODELS else (False,))
         for precision in ("bf16-mixed", "32-true")
         if precision == "bf16-mixed" or (name in ("gpt2", "llama") and padded)]
IDS = [f"{name}-{'padded' if padded else 'full'}-{precision}" for name, padded, precision in CASES]


@pytest.mark.parametrize("name, padded, precision", CASES, ids=IDS)
def test_a_cpu_estimate_on_meta_agrees_with_a_real_cpu_step(name, padded, precision):
    model, make = build(name)
    batch = make(0, padded=padded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on its configs
        meta = estimate_memory(model, batch, optimizer=torch.optim.AdamW, loss_fn=loss_of, precision=precision,
                               target="cpu", path="meta")
        cpu = estimate_memory(model, batch, optimizer=torch.optim.AdamW, loss_fn=loss_of, precision=precision,
                              target="cpu", path="cpu")
    assert (meta.path, cpu.path) == ("meta", "cpu")
    for phase, peak in cpu.phase_peaks.items():
        assert meta.phase_peaks[phase] == pytest.approx(peak, rel=0.01), phase
    assert meta.activations_bytes == pytest.approx(cpu.activations_bytes, rel=0.01)
