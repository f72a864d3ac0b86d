"""What the CUDA estimate models of the kernels CUDA picks at run time, on a machine without a GPU: the math path of
SDPA where no fused kernel takes the call (fp32 grouped-query attention, a mask that is a permuted view), cuDNN's
workspace in the backward of fp32 convolutions, and torch._grouped_mm (mixture-of-experts layers) on meta.

The reference (benchmarks/cuda_reference.json, an H100) showed each: the zoo's Llama at hidden 512 in fp32 kept one
fp32 8 x 8 x 512 x 512 matrix a layer more than estimated (grouped-query attention without a mask), T5 under
transformers 5.17 one a position-biased attention in fp32 and bf16 alike, the demo CNN's fp32 backward ~13 MB."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from lightning_memguard import estimate_memory
from lightning_memguard.estimate import EstimateFallbackWarning
from lightning_memguard.estimate.cuda_attention import cuda_attention_backend
from lightning_memguard.estimate.cuda_kernels import CUDNN_FP32_BACKWARD_WORKSPACE_BYTES

B, H, S, D = 4, 8, 128, 16


@pytest.fixture(autouse=True)
def _as_on_a_machine_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


class GroupedQueryAttention(torch.nn.Module):
    """Self-attention with half as many key/value heads as query heads, as transformers' Llama runs it without a
    padding mask (``enable_gqa=True``), or with the key/value heads repeated first (``repeat=True``, as it does
    with a mask)."""

    def __init__(self, repeat: bool = False):
        super().__init__()
        self.q, self.kv, self.repeat = torch.nn.Linear(D * H, D * H), torch.nn.Linear(D * H, D * H), repeat

    def forward(self, x):
        q = self.q(x).view(B, S, H, D).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, H // 2, D).permute(2, 0, 3, 1, 4)
        if self.repeat:
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


PROBABILITIES = B * H * S * S * 4  # one fp32 attention matrix


@pytest.mark.parametrize("precision, kept", [("32-true", PROBABILITIES), ("bf16-mixed", 0)])
def test_fp32_grouped_query_attention_runs_the_math_path_and_keeps_the_probabilities(precision, kept):
    # efficient attention (the fused kernel for fp32) takes no grouped key/value heads: CUDA runs the math path and
    # keeps the s x s probabilities; cuDNN and flash attention (bf16) take them, and keep no such matrix
    batch = torch.randn(B, S, D * H)
    grouped = estimate_memory(GroupedQueryAttention(), batch, target="cuda", precision=precision)
    repeated = estimate_memory(GroupedQueryAttention(repeat=True), batch, target="cuda", precision=precision)
    assert grouped.path == repeated.path == "meta"
    # the math path keeps the probabilities where the fused kernel keeps its output and log-sum-exp
    fused_only = B * H * S * D * 4 + B * H * S * 4
    assert grouped.activations_bytes - repeated.activations_bytes >= kept - fused_only - 1024
    if not kept:
        assert grouped.activations_bytes <= repeated.activations_bytes


class BiasedAttention(torch.nn.Module):
    """Attention with a learned (1, h, s, s) bias looked up from an embedding of relative positions, as T5 makes it:
    a permuted view of the embedding's (s, s, h) output, or a contiguous copy of it."""

    def __init__(self, contiguous: bool):
        super().__init__()
        self.qkv, self.bias, self.contiguous = torch.nn.Linear(D * H, 3 * D * H), torch.nn.Embedding(32, H), contiguous

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, S, 3, H, D).permute(2, 0, 3, 1, 4)
        positions = torch.arange(S, device=x.device)
        buckets = (positions[None, :] - positions[:, None]).clamp(-16, 15) + 16
        bias = self.bias(buckets).permute(2, 0, 1).unsqueeze(0)  # last dimension's stride: h
        if self.contiguous:
            bias = bias.contiguous()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_mask_that_is_a_permuted_view_takes_the_math_path_in_fp32_on_cuda(precision):
    # every fused kernel wants the mask's last dimension contiguous on CUDA; the math path upcasts half inputs, so it
    # keeps fp32 probabilities in bf16 too (the reference's T5 measured as much in bf16 as in fp32)
    batch = torch.randn(B, S, D * H)
    permuted = estimate_memory(BiasedAttention(contiguous=False), batch, target="cuda", precision=precision)
    contiguous = estimate_memory(BiasedAttention(contiguous=True), batch, target="cuda", precision=precision)
    # the math path keeps the probabilities, the scaled query and key and the value; the fused kernel the query,
    # key, value, output, log-sum-exp and the bias
    assert permuted.activations_bytes - contiguous.activations_bytes > PROBABILITIES // 2


def test_the_kernel_choice_follows_cudas_checks():
    q = torch.empty(B, H, S, D, device="meta")
    kv = torch.empty(B, H // 2, S, D, device="meta")
    mask = torch.empty(1, H, S, S, device="meta")
    permuted = torch.empty(S, S, H, device="meta").permute(2, 0, 1).unsqueeze(0)
    assert cuda_attention_backend(q, q, q) == "efficient"
    assert cuda_attention_backend(q.bfloat16(), q.bfloat16(), q.bfloat16()) == "cudnn"
    assert cuda_attention_backend(q, kv, kv, enable_gqa=True) == "math"
    assert cuda_attention_backend(q.bfloat16(), kv.bfloat16(), kv.bfloat16(), enable_gqa=True) == "cudnn"
    assert cuda_attention_backend(q, q, q, mask) == "efficient"
    assert cuda_attention_backend(q, q, q, permuted) == "math"
    assert cuda_attention_backend(q.bfloat16(), q.bfloat16(), q.bfloat16(), permuted.bfloat16()) == "math"
    odd = torch.empty(B, H, S, 6, device="meta")  # efficient attention wants fp32 head dims in multiples of 4
    assert cuda_attention_backend(odd, odd, odd) == "math"


class Convolutions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.convs = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1, bias=False),
                                         torch.nn.Conv2d(8, 8, 3, padding=1, bias=False))

    def forward(self, x):
        return self.convs(x).sum()


@pytest.mark.parametrize("side, workspace", [(32, 4 * 8 * 8 * 32 * 32 * 4), (256, CUDNN_FP32_BACKWARD_WORKSPACE_BYTES)])
def test_an_fp32_convolutions_backward_holds_a_cudnn_workspace_on_cuda(side, workspace):
    # the same step on meta for a CPU target has no cuDNN: the backward's peak (the second convolution's backward,
    # making the first one's output gradient) differs by the workspace alone — four times the convolution's largest
    # tensor, at most 16 MiB; no matmul, so no cuBLAS workspace either
    model, batch = Convolutions(), torch.randn(8, 8, side, side)
    cuda = estimate_memory(model, batch, target="cuda")
    cpu = estimate_memory(model, batch, target="cpu", path="meta")
    assert cuda.runtime_bytes == 0
    # (and CUDA's 512-byte rounding of each tensor)
    assert cuda.phase_peaks["backward"] - cpu.phase_peaks["backward"] == pytest.approx(workspace, abs=4096)
    assert cuda.phase_peaks["forward"] == pytest.approx(cpu.phase_peaks["forward"], abs=4096)
    half = estimate_memory(model, batch, target="cuda", precision="bf16-mixed")  # none in half precision
    assert half.phase_peaks["backward"] - half.phase_peaks["forward"] < workspace


class Experts(torch.nn.Module):
    """Four experts run in one torch._grouped_mm, the tokens sorted by expert, as transformers runs Mixtral's."""

    def __init__(self):
        super().__init__()
        self.router, self.experts = torch.nn.Linear(16, 4), torch.nn.Parameter(torch.randn(4, 16, 32) / 4)

    def forward(self, x):
        expert = self.router(x).argmax(-1)
        order = torch.sort(expert).indices
        counts = torch.histc(expert.float(), bins=4, min=0, max=3)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x[order], self.experts, offs=offsets).square().sum()


def test_grouped_matrix_products_run_on_meta_in_fp32():
    # the meta kernel of torch._grouped_mm checks for CUDA's bf16 kernel; fp32 runs on CUDA and the CPU alike, and
    # the routing is offsets, not a value read: no fallback, and the meta estimate is the CPU run's
    model, batch = Experts(), torch.randn(64, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EstimateFallbackWarning)
        meta = estimate_memory(model, batch, target="cuda")
    cpu = estimate_memory(model, batch, target="cuda", path="cpu")
    assert (meta.path, cpu.path) == ("meta", "cpu")
    assert meta.phase_peaks == cpu.phase_peaks


class RoutedWithBalanceLoss(torch.nn.Module):
    """Top-2 routing over four experts with a load-balancing loss that counts each expert's tokens with
    ``torch.bincount(..., minlength=4)``, as transformers' Mixtral-style models did before 5.2x (no meta kernel)."""

    def __init__(self, minlength: int = 4):
        super().__init__()
        self.router, self.expert = torch.nn.Linear(16, 4), torch.nn.Linear(16, 16)
        self.minlength = minlength

    def forward(self, x):
        probabilities = self.router(x).softmax(-1)
        chosen = probabilities.topk(2, dim=-1).indices
        tokens = torch.bincount(chosen.reshape(-1), minlength=self.minlength).float()
        balance = (tokens / tokens.sum() * probabilities.mean(0)).sum()
        return self.expert(x).square().mean() + balance


def test_counting_the_experts_a_router_picked_stays_on_meta_where_the_number_of_experts_is_given():
    model, batch = RoutedWithBalanceLoss(), torch.randn(64, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EstimateFallbackWarning)
        assert estimate_memory(model, batch, target="cuda").path == "meta"
    # the tensors the step holds, to the byte, as the CPU run's (a CUDA target's blocks may be laid out otherwise by
    # a few: the CPU's bincount kernel makes temporaries of its own)
    meta = estimate_memory(model, batch, target="cpu", path="meta")
    assert meta.phase_peaks == estimate_memory(model, batch, target="cpu", path="cpu").phase_peaks


def test_counting_values_computed_from_the_weights_without_a_number_of_classes_leaves_meta():
    model, batch = RoutedWithBalanceLoss(minlength=0), torch.randn(64, 16)
    with pytest.warns(EstimateFallbackWarning, match="bincount"):
        estimate = estimate_memory(model, batch, target="cuda")
    assert estimate.path == "cpu"


class CountsItsLabels(torch.nn.Module):
    """A loss weighted by how often each label occurs in the batch: ``torch.bincount`` of the batch's own labels."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x, labels):
        counts = torch.bincount(labels, weights=torch.ones_like(labels, dtype=x.dtype))
        losses = F.cross_entropy(self.head(x), labels, reduction="none")
        return (losses / counts[labels]).sum()


def test_counting_the_batchs_own_labels_reads_them_on_meta():
    model, batch = CountsItsLabels(), (torch.randn(32, 16), torch.randint(0, 5, (32,)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", EstimateFallbackWarning)
        assert estimate_memory(model, batch, target="cuda").path == "meta"
    meta = estimate_memory(model, batch, target="cpu", path="meta")
    assert meta.phase_peaks == estimate_memory(model, batch, target="cpu", path="cpu").phase_peaks
