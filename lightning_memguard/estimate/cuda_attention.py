"""Scaled dot-product attention as the CUDA build of torch runs it, reproduced on the meta device (or on CPU, for a
step that had to run there): which kernel CUDA picks for the call, and what that kernel keeps for the backward.

Which kernel: torch's ``select_sdp_backend`` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, torch 2.11 on an
H100, the reference's machine) tries cuDNN attention, flash attention, memory-efficient attention, then the math
path, and takes the first whose checks pass. What decides memory here:

* every fused kernel wants the last dimension of ``query``, ``key``, ``value`` *and of the mask* to have stride 1
  (``check_last_dim_stride_equals_1_dense``; on CPU the mask is exempt, on CUDA it is not). A mask that is a
  permuted view — transformers 5.17's T5 passes its relative position bias, ``(1, h, s, s)`` permuted from the
  embedding's ``(s, s, h)`` — takes the math path, in every precision;
* cuDNN and flash attention take only half types; efficient attention takes fp32 too, but grouped-query attention
  (``enable_gqa=True`` with fewer key/value heads) only on flash and cuDNN (its dense check takes no grouped heads;
  pytorch/pytorch#191085 added them later), so fp32 grouped-query attention — transformers' Llama, Qwen2 and
  Mistral without a padding mask — takes the math path;
* efficient attention wants the head dimension a multiple of 4 (fp32) or 8 (half types) on sm80 and newer;
* cuDNN attention gives no gradient for the mask: a learned bias (T5's) takes efficient attention.

What it keeps: cuDNN, flash and efficient attention keep the output and a ``b·h·s`` fp32 log-sum-exp besides their
inputs, never the ``s × s`` probabilities; grouped key/value heads go to cuDNN and flash attention as they are, not
repeated (the H200 reference's Llama in bf16 asks for 4 MiB a layer less than repeated copies would keep). The math
path (torch's composite ``_scaled_dot_product_attention_math``, run here as it is) keeps the scaled query and key,
the probabilities and the value — in fp32 even for half inputs, which it upcasts for accuracy: ``b·h·s²·4`` bytes an
attention call, the measured difference (an H100 kept 64 MiB a layer more for the Llama of the reference at 8 × 512
tokens, 8 heads, fp32, and as much for T5 in bf16 as in fp32).
Its dropout is CUDA's fused kernel there (a one-byte mask kept), given to the composite as its ``dropout_mask``.
"""

from __future__ import annotations

import math

import torch
from torch.torch_version import TorchVersion

__all__ = ["cuda_attention", "cuda_attention_backend"]

_HALF = (torch.bfloat16, torch.float16)


#: whether this torch's CUDA attention takes grouped key/value heads without repeating them (measured with 2.11)
_GROUPED_HEADS_AS_THEY_ARE = TorchVersion(torch.__version__) >= "2.8"


def cuda_attention_backend(query, key, value, attn_mask=None, enable_gqa: bool = False) -> str:
    """The kernel CUDA runs for an SDPA call with these tensors: ``"cudnn"``, ``"efficient"`` or ``"math"`` (flash
    attention, where it would run, keeps what cuDNN attention keeps and is reported as it)."""
    if any(t.stride(-1) != 1 and t.shape[-1] != 1 for t in (query, key, value)):
        return "math"
    if attn_mask is not None and attn_mask.stride(-1) != 1 and attn_mask.shape[-1] != 1:
        return "math"
    grouped = key.shape[-3] != query.shape[-3]
    half = query.dtype in _HALF
    learned_mask = attn_mask is not None and attn_mask.requires_grad
    if half and not learned_mask:
        return "cudnn"
    if grouped:  # efficient attention takes as many key/value heads as query heads
        return "math"
    alignment = 8 if half else 4
    if query.shape[-1] % alignment or value.shape[-1] % alignment:
        return "math"
    return "efficient"


def cuda_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    """SDPA as CUDA runs it (see the module's docstring), on meta, or on CPU with the CPU's fused kernel standing in
    for CUDA's fused ones (it keeps what they keep: the output, an fp32 log-sum-exp of ``b·h·s`` and the additive
    mask, not the ``s × s`` probabilities; it has no dropout, whose memory is a seed there)."""
    backend = cuda_attention_backend(query, key, value, attn_mask, enable_gqa)
    grouped = enable_gqa and key.shape[-3] != query.shape[-3]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            # the kernels take an additive mask: torch makes one of the query's dtype, and the backward keeps it
            attn_mask = torch.full(attn_mask.shape, float("-inf"), dtype=query.dtype,
                                   device=query.device).masked_fill_(attn_mask, 0.0)
        else:  # under autocast CUDA casts the mask with the query (a copy of its layout)
            attn_mask = attn_mask.to(query.dtype)
    if backend == "math":
        return _math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, grouped)
    if grouped and (query.device.type == "cpu" or not _GROUPED_HEADS_AS_THEY_ARE):
        # CUDA's cuDNN and flash attention take the grouped key/value heads as they are (torch >= 2.8 checks them as
        # such and passes them on; before, torch repeated them) and keep them so; the CPU's fused kernel, which stands
        # in for them on a CPU step, takes as many as the query has: repeated for it there (kept: a CPU step keeps
        # these copies as well)
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, dim=-3), value.repeat_interleave(repeats, dim=-3)
    if attn_mask is not None:
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[-2], key.shape[-2])
    if scale is None:
        scale = 1 / math.sqrt(query.shape[-1])
    if query.device.type == "cpu":
        if attn_mask is not None and attn_mask.requires_grad:  # a learned bias (T5): its gradient too
            return _CpuFusedAttentionWithBias.apply(query, key, value, attn_mask, is_causal, scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]
    if backend == "efficient":
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, False, scale=scale)[0]


def _math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, grouped):
    # torch's own composite, as CUDA runs it after choosing it; its dropout would be the composite's noise tensor of
    # the probabilities' dtype here (meta and CPU have no fused dropout): a one-byte mask stands for CUDA's instead
    dropout_mask = None
    if dropout_p > 0:
        shape = (*query.shape[:-1], key.shape[-2])
        dropout_mask = torch.empty(shape, dtype=torch.bool, device=query.device)
        if query.device.type == "cpu":
            dropout_mask.bernoulli_(1 - dropout_p)
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, dropout_mask, scale=scale, enable_gqa=grouped)[0]


class _CpuFusedAttentionWithBias(torch.autograd.Function):
    """The CPU's fused attention for a mask that needs a gradient, which its kernel does not give: the forward keeps
    what CUDA's efficient attention keeps (inputs, output, log-sum-exp), the backward recomputes on the math path."""

    @staticmethod
    def forward(ctx, query, key, value, bias, is_causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=bias, scale=scale)
        ctx.save_for_backward(query, key, value, bias, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, bias, _, _ = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(needed) for t, needed in zip((query, key, value, bias),
                                                                         ctx.needs_input_grad[:4])]
        with torch.enable_grad():
            out = torch.ops.aten._scaled_dot_product_attention_math(
                *inputs[:3], attn_mask=inputs[3], is_causal=ctx.is_causal, scale=ctx.scale)[0]
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_out))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None)
