"""What a CPU training step keeps and allocates, reproduced on the meta device, so that a step for a CPU target can be
estimated in mixed precision without running it (framework-free).

A real bf16 step on a CPU without native bf16 is hundreds of times slower than an fp32 one; on meta it costs what an
fp32 one does. The meta device has no autocast and runs its own kernel choices, so a :class:`CpuKernelMode` around
the forward does what the CPU would do differently, where that changes memory:

* mixed precision: CPU autocast's casting rules (its lists differ from CUDA's): matmuls, convolutions, ``prelu`` and
  attention in bf16/fp16 on copies of their inputs (autocast without a weight cache, as Lightning runs it); the losses
  (cross-entropy included: on an fp32 copy of the logits), ``prod`` and 3-D pooling in fp32 on copies. Norms,
  softmax and sums stay in the input's precision (CPU autocast leaves them alone; the CPU's norms take a half input
  with fp32 weights).
* attention (``F.scaled_dot_product_attention``, and ``nn.MultiheadAttention``'s training path) runs the kernel the
  CPU picks (torch's own choice, asked with empty CPU stand-ins of the same shapes): its fused flash kernel keeps the
  output and a ``b·h·s`` fp32 log-sum-exp, never the ``s × s`` probabilities that meta's math path keeps (grouped-query
  attention with its fewer key/value heads, not repeated); with
  dropout (or a mask that needs a gradient) the CPU takes the math path, as meta does.
* ``nn.Transformer``'s question whether its mask is the causal one, answered as on CUDA (yes, from the shape).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .cuda_kernels import _LOWER_PRECISION, CudaKernelMode, _cast
from .mixed import _suggested_layout

__all__ = ["CpuKernelMode", "CPU_LOWER_PRECISION", "CPU_FP32"]

# CPU autocast's lists (torch/csrc/autograd/autocast_mode: the CPU lower_precision_fp and fp32 ops), as far as they
# are called at the Python level and matter for memory. SDPA is on the lower-precision list too (its handler casts).
CPU_LOWER_PRECISION = _LOWER_PRECISION | {torch.addbmm, F.prelu, torch.prelu, torch.conv_tbc, torch.linalg.vecdot}
CPU_FP32 = {F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div,
            F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.cosine_embedding_loss,
            F.hinge_embedding_loss, F.poisson_nll_loss, F.margin_ranking_loss, F.soft_margin_loss,
            F.triplet_margin_loss, F.multi_margin_loss, F.multilabel_margin_loss, F.ctc_loss, torch.prod,
            torch.Tensor.prod, torch.cdist, F.avg_pool3d, F.max_pool3d, F.adaptive_avg_pool3d}

_FLASH = 1  # torch's SDPBackend index of the fused flash kernel in _fused_sdp_choice


class CpuKernelMode(CudaKernelMode):
    """Makes meta-device calls allocate and keep what the CPU's kernels would, under CPU autocast's casting rules.

    Args:
        autocast_dtype: ``torch.bfloat16`` or ``torch.float16`` to emulate CPU autocast; ``None`` for full precision.
    """

    LOWER_PRECISION = CPU_LOWER_PRECISION
    FP32 = CPU_FP32
    FP32_OUTPUT: set = set()  # CPU autocast runs softmax and sums in the input's precision

    def __init__(self, autocast_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(autocast_dtype, kernels=True)
        # CUDA's cross-entropy composition and fused dropout are CUDA's: the CPU, like meta, composes dropout, and
        # CPU autocast runs the whole cross-entropy in fp32 (on its fp32 list). The temporary inside an MSE loss's
        # kernel is not counted on the CPU, whose steps are measured by their live tensors
        for func in (F.cross_entropy, F.dropout, torch.dropout, F.mse_loss, F.smooth_l1_loss):
            del self._handlers[func]
        self._handlers.update({F.group_norm: self._group_norm, torch.group_norm: self._group_norm})

    def _sdpa(self, func, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        if self.autocast_dtype is not None and torch.is_grad_enabled():
            # autocast casts every floating argument, a float mask included
            query, key, value, attn_mask = _cast((query, key, value, attn_mask), self.autocast_dtype)
        if not query.is_meta or _cpu_choice(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                            enable_gqa) != _FLASH:
            return func(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # the kernel takes an additive mask: torch makes one of the query's dtype (the mask's own shape)
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
        if scale is None:
            scale = 1 / math.sqrt(query.shape[-1])
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]

    def _attention_layout(self, out: torch.Tensor) -> torch.Tensor:
        return out  # the CPU's kernel writes the query's layout: nn.MultiheadAttention's reshape copies as it does

    def _group_norm(self, func, input, num_groups, weight=None, bias=None, eps=1e-5, *args):
        """torch's ``group_norm`` as the CPU runs it: a channels-last input is normalised as it is (the CPU's kernel
        takes it and writes its output so, and its backward takes the gradient in that format), where elsewhere —
        meta, CUDA — torch copies the input contiguous first and the backward copies both again. diffusers' spatial
        attention blocks hand on a channels-last residual, which the next ResNet block's GroupNorm reads."""
        if not input.is_meta or input.dim() < 3 or _suggested_layout(input) is torch.contiguous_format:
            return func(input, num_groups, weight, bias, eps, *args)
        batch, channels = input.shape[:2]
        shape = (batch, channels, input[0, 0].numel(), num_groups, eps)
        weight = weight.contiguous() if weight is not None else None
        bias = bias.contiguous() if bias is not None else None
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias)):
            return _CpuGroupNorm.apply(input, weight, bias, shape)
        return torch.native_group_norm(input, weight, bias, *shape)[0]


class _CpuGroupNorm(torch.autograd.Function):
    """``native_group_norm`` of a channels-last input with the CPU's autograd formula: the input and the gradient go
    to the kernels in the input's format, as they are (autograd's formula copies them contiguous on any device but
    the CPU: on meta it made two copies the CPU does not). Saves what the formula saves."""

    @staticmethod
    def forward(ctx, input, weight, bias, shape):
        out, mean, rstd = torch.native_group_norm(input, weight, bias, *shape)
        ctx.save_for_backward(input, weight, mean, rstd)
        ctx.shape = shape
        return out

    @staticmethod
    def backward(ctx, grad):
        input, weight, mean, rstd = ctx.saved_tensors
        batch, channels, hxw, groups, _ = ctx.shape
        grad = grad.contiguous(memory_format=_suggested_layout(input))
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
                ctx.needs_input_grad[2]]
        grads = torch.ops.aten.native_group_norm_backward(grad, input, mean, rstd, weight, batch, channels, hxw,
                                                          groups, mask)
        return (*grads, None)


def _cpu_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    """The attention kernel torch picks on CPU for these meta tensors, asked with empty CPU tensors of the same
    shapes, strides, dtypes and gradient flags (uninitialised memory, never read)."""
    def stand_in(tensor):
        if tensor is None:
            return None
        real = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
        return real.requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else real

    return torch._fused_sdp_choice(stand_in(query), stand_in(key), stand_in(value), stand_in(attn_mask), dropout_p,
                                   is_causal, scale=scale, enable_gqa=enable_gqa)
