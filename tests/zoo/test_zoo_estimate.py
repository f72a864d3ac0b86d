"""estimate_memory on the transformers zoo: models with attention masks run on the meta device (their mask helpers read
the batch, which keeps its values), the CPU fallback counts what CUDA's kernels keep, and meta and CPU accounting agree
where both run the same kernels."""

import json
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_memguard.estimate import EstimateFallbackWarning, estimate_memory
from tests.zoo.models import (MOE, MORE_FAMILIES, SIGNALS, STRUCTURES, TOKEN_MODELS, WIDER, ZOO, build, loss_of,
                              transformers)

CASES = [(name, padded) for name in ZOO for padded in ((False, True) if name in TOKEN_MODELS else (False,))]
IDS = [f"{name}-{'padded' if padded else 'full'}" for name, padded in CASES]
# the further families, structures, the wider set of decoders, encoders and mixtures (padded batches), and images,
# segmentation maps and time series beyond ViT and ResNet
ON_META = CASES + [(name, True) for name in MORE_FAMILIES + STRUCTURES + WIDER + SIGNALS]
ON_META_IDS = [f"{name}-{'padded' if padded else 'full'}" for name, padded in ON_META]


def estimate(name, padded, **kwargs):
    model, make = build(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = estimate_memory(model, make(0, padded=padded), optimizer=torch.optim.AdamW, loss_fn=loss_of,
                                 **kwargs)
    return result, [w for w in caught if issubclass(w.category, EstimateFallbackWarning)]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("name, padded", ON_META, ids=ON_META_IDS)
def test_every_zoo_model_estimates_on_meta_for_cuda_without_a_fallback(name, padded, precision):
    # bf16-mixed: a learned attention bias (T5's) needs a mask gradient, which cuDNN attention does not give
    result, fallbacks = estimate(name, padded, target="cuda", precision=precision)
    assert result.path == "meta" and not fallbacks
    assert result.activations_bytes > 0 and not result.modules.empty


@pytest.mark.parametrize("name, padded", CASES, ids=IDS)
def test_a_cuda_estimate_run_on_cpu_agrees_with_the_one_on_meta(name, padded):
    # the CPU path models CUDA's kernels too (its fused attention keeps no s x s matrix); the runtime workspaces are
    # the same on both and would hide a difference in what the step holds, so they are left out
    meta, _ = estimate(name, padded, target="cuda")
    cpu, _ = estimate(name, padded, target="cuda", path="cpu")
    assert cpu.path == "cpu" and cpu.runtime_bytes == meta.runtime_bytes
    for phase, peak in meta.phase_peaks.items():
        held = cpu.phase_peaks[phase] - cpu.runtime_bytes
        assert peak - meta.runtime_bytes == pytest.approx(held, rel=0.05), phase
    assert meta.activations_bytes == pytest.approx(cpu.activations_bytes, rel=0.05)


# "The same kernels": attention on the math path on both sides, as transformers' eager attention or SDPA restricted to
# its math backend. Otherwise the CPU runs its fused flash kernel (output and log-sum-exp kept) where the meta device
# has only the math path (the s x s probabilities kept): a real difference of kernels, not of accounting.
@pytest.mark.parametrize("kernels", ["eager", "sdpa-math"])
@pytest.mark.parametrize("name", ZOO)
def test_meta_and_cpu_accounting_agree_within_1_percent_with_the_same_kernels(name, kernels):
    model, make = build(name)
    if kernels == "eager" and name != "resnet":
        model.set_attn_implementation("eager")
    batch = make(0)
    with sdpa_kernel(SDPBackend.MATH), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cpu = estimate_memory(model, batch, optimizer=torch.optim.AdamW, loss_fn=loss_of, target="cpu")
        meta = estimate_memory(model, batch, optimizer=torch.optim.AdamW, loss_fn=loss_of, target="cpu", path="meta")
    assert (cpu.path, meta.path) == ("cpu", "meta")
    for phase, peak in cpu.phase_peaks.items():
        assert meta.phase_peaks[phase] == pytest.approx(peak, rel=0.01), phase
    assert meta.activations_bytes == pytest.approx(cpu.activations_bytes, rel=0.01)


def test_a_gpt2_small_sized_model_with_a_padded_mask_estimates_on_meta_in_seconds():
    config = transformers.GPT2Config()  # n_layer=12, n_embd=768, vocab 50257: 124M parameters
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    model.train()
    batch_size, seq = 8, 1024
    ids = torch.randint(0, config.vocab_size, (batch_size, seq), generator=torch.Generator().manual_seed(0))
    padded = torch.ones(batch_size, seq, dtype=torch.long)
    for row in range(1, batch_size):
        padded[row, seq - 64 * row:] = 0
    results, seconds = {}, 0.0
    for name, mask in (("full", torch.ones_like(padded)), ("padded", padded)):
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("error", EstimateFallbackWarning)
            results[name] = estimate_memory(model, batch, optimizer=torch.optim.AdamW, loss_fn=loss_of,
                                            target="cuda")
        seconds = time.perf_counter() - started
    assert results["full"].path == results["padded"].path == "meta"
    params = sum(p.numel() for p in model.parameters()) * 4
    assert results["padded"].parameters_bytes == pytest.approx(params, rel=0.01)
    assert results["padded"].optimizer_state_bytes == pytest.approx(2 * params, rel=0.01)
    # the mask helpers read the batch's mask: all ones, it is skipped (causal attention); padded, every layer's fused
    # attention keeps an additive (b, 1, s, s) fp32 mask made from it, and nothing else changes
    masks = config.n_layer * batch_size * seq * seq * 4
    assert results["padded"].activations_bytes - results["full"].activations_bytes == masks
    # 1-2 s measured on the 2-core machine (4-4.5 s with other jobs on it); a real CPU run takes minutes
    assert seconds < 10, seconds


@pytest.mark.parametrize("name", MOE)
def test_a_mixture_of_experts_estimates_on_meta_for_cuda_and_agrees_with_the_cpu_run(name):
    # transformers runs the experts in one torch._grouped_mm, the routing given as group offsets: no value is read,
    # so the meta path runs without a fallback (its meta kernel refused fp32 before the op was stood in for)
    meta, fallbacks = estimate(name, True, target="cuda")
    cpu, _ = estimate(name, True, target="cuda", path="cpu")
    assert (meta.path, cpu.path) == ("meta", "cpu") and not fallbacks
    for phase, peak in meta.phase_peaks.items():
        assert peak == pytest.approx(cpu.phase_peaks[phase], rel=0.01), phase
    half, fallbacks = estimate(name, True, target="cuda", precision="bf16-mixed")
    assert half.path == "meta" and not fallbacks and half.activations_bytes > 0


REFERENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "cuda_reference.json"
#: the reference of 2026-11-25 was measured with transformers 5.17 (issue 27); later ones record the version
REFERENCE_TRANSFORMERS = "5.17"
#: zoo cases the estimate misses by more than 2 % (see benchmarks/RESULTS.md); ResNet in bf16 (-2.7 %) was the caching
#: allocator's unsplit blocks, which the estimate now models
ZOO_MISSES: set[tuple[str, str]] = set()


def zoo_reference_cases():
    if not REFERENCE.exists():
        return []
    params = []
    for case in json.loads(REFERENCE.read_text()).get("zoo_models", []):
        version = case.get("transformers") or REFERENCE_TRANSFORMERS
        marks = []
        if case["model"] == "zoo:t5" and version.split(".")[:2] != transformers.__version__.split(".")[:2]:
            marks.append(pytest.mark.skip(reason=f"T5's attention kernels depend on transformers' version: measured "
                                                 f"with {version}, installed {transformers.__version__}"))
        if case["kwargs"] and (case["model"], case["precision"]) in ZOO_MISSES:
            marks.append(pytest.mark.xfail(strict=True, reason="known miss, see benchmarks/RESULTS.md"))
        size = "large" if case["kwargs"] else "tiny"
        params.append(pytest.param(case, marks=marks, id=f"{case['model'][4:]}-{size}-{case['precision']}"))
    return params


@pytest.mark.parametrize("case", zoo_reference_cases())
def test_the_zoo_reference_cases_are_estimated_within_2_percent(case, monkeypatch):
    # the H100's measurement of each zoo model trained by Lightning: the estimate made here (no GPU: Hopper's
    # workspaces) within 2 % of its peak, and no phase more than 5 % off
    import sys

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.syspath_prepend(str(REFERENCE.parent))
    sys.modules.pop("reference_models", None)
    from reference_models import build_case

    model = build_case(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = estimate_memory(model, next(iter(model.train_dataloader())), precision=case["precision"],
                                 target="cuda")
    assert result.peak_bytes == pytest.approx(case["peak"], rel=0.02)
    for phase, column in (("forward", "after_forward"), ("backward", "after_backward"),
                          ("optimizer_step", "after_optimizer_step")):
        assert result.phase_peaks[phase] == pytest.approx(case[column], rel=0.05), phase
