"""What CUDA kernels keep and allocate, reproduced on the meta device, so a training step can be estimated for a GPU on
a machine without one (framework-free).

A :class:`CudaKernelMode` is a ``TorchFunctionMode`` around the forward of a meta-device copy of the model (or of a
CPU copy, for a model that reads values computed from its weights and so cannot run on meta). It does what the CUDA
build of torch would do differently from the CPU one, where that changes memory:

* attention (``F.scaled_dot_product_attention``, and ``nn.MultiheadAttention``'s training path) runs the kernel
  CUDA picks (:mod:`~lightning_memguard.estimate.cuda_attention`): a fused one — memory-efficient attention for
  fp32, cuDNN attention for bf16/fp16 — keeps the output and a ``b·h·s`` fp32 log-sum-exp, never the ``s × s``
  attention probabilities; a boolean mask becomes an additive ``s × s`` mask of the query's dtype, which the
  backward keeps. Where no fused kernel takes the call (fp32 grouped-query attention, a mask that is a permuted
  view) the math path runs and keeps the probabilities, in fp32. On CPU the CPU's fused kernel stands in for the
  fused ones (it keeps the same tensors).
* mixed precision: the meta device has no autocast, so the mode applies CUDA autocast's casting rules to the calls
  it sees (matmuls and convolutions in bf16/fp16 on copies of their inputs, as autocast without a weight cache does;
  norms and most losses in fp32 on copies; softmax, log-softmax and sums with an fp32 output from a half input;
  cross-entropy as torch composes it: log-softmax in half precision, nll_loss on an fp32 copy).
* dropout in training runs CUDA's fused kernel (``native_dropout``), which keeps a one-byte boolean mask for the
  backward; meta, like CPU, composes it as ``input * noise`` and keeps a noise tensor of the input's dtype (four
  bytes an element in fp32: three too many for every element that passes through a dropout).
* ``nn.Transformer`` asks whether the mask it was given is the causal one (``torch.equal``, or ``bool`` of an
  elementwise comparison): on meta there are no values to compare, and the answer is taken as yes.

The fixed allocations of the CUDA runtime are observed by :class:`BlasWorkspaces` (which threads run cuBLAS and
cuBLASLt matmuls) and added by the estimate; the caching allocator's blocks are modelled apart
(:mod:`~lightning_memguard.estimate.caching_allocator`). Facts measured on an
H100 (torch 2.11, see ``shared/cuda_reference.json`` of the project): efficient attention keeps ``out`` +
``(b, h, s)`` fp32; cuDNN attention keeps ``out`` + ``(b, h, s, 1)`` fp32; both are chosen over the math path with
and without dropout where their checks pass.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .cuda_attention import cuda_attention

__all__ = ["BlasWorkspaces", "CudaKernelMode", "CUBLAS_WORKSPACE_BYTES",
           "CUBLASLT_WORKSPACE_BYTES", "CUDA_ALLOCATION_GRANULARITY", "CUDNN_FP32_BACKWARD_WORKSPACE_BYTES",
           "cudnn_workspace_bytes", "workspace_sizes"]

#: The caching allocator rounds every allocation up to a multiple of this (``memory_allocated`` counts rounded sizes).
CUDA_ALLOCATION_GRANULARITY = 512
#: cuBLAS workspace per handle on sm90 (Hopper) with torch's default CUBLAS_WORKSPACE_CONFIG: allocated through the
#: caching allocator at a handle's first matmul and held for the life of the process.
CUBLAS_WORKSPACE_BYTES = 32 * 2**20
#: The same on other GPUs (torch's default ``:4096:2:16:8``).
CUBLAS_WORKSPACE_BYTES_OTHER = 4096 * 1024 * 2 + 16 * 1024 * 8
#: cuBLASLt workspace per handle (torch's default CUBLASLT_WORKSPACE_SIZE, 1024 KiB): a separate allocation unless
#: TORCH_CUBLASLT_UNIFIED_WORKSPACE=1, made at a thread's first Lt matmul (a bias-fused ``addmm``) and held like the
#: cuBLAS one. The H100 reference shows exactly this 1 MiB in every phase of every model with a biased Linear.
CUBLASLT_WORKSPACE_BYTES = 2**20
#: What the estimate allows for cuDNN's workspace while the backward of an fp32 convolution runs. cuDNN picks its
#: algorithms at run time (heuristics, TF32 tensor-core engines for fp32 by torch's default) and allocates their
#: workspace through the caching allocator for the call alone, so it shows in the backward's peak and nowhere else.
#: The H100 reference (torch 2.11, cuDNN 9) measured it as the gap of the demo CNN's fp32 backward: 12.8 MiB at
#: 32 x 64² and 12.3 MiB at 64 x 128² — independent of the activations' size — against at most 0.6 MiB in the
#: forward and in bf16 at the small size. A bound above both, not a model of the algorithm: the workspace of a
#: particular algorithm is not known without the GPU.
CUDNN_FP32_BACKWARD_WORKSPACE_BYTES = 16 * 2**20

_aten = torch.ops.aten
# matmuls that run on cuBLAS (any of them gives the calling thread's handle its cuBLAS workspace)
_BLAS_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.addbmm.default,
             _aten.mv.default, _aten.addmv.default, _aten.dot.default, _aten.vdot.default,
             _aten._addmm_activation.default}

# CUDA autocast's lists, as far as they matter for memory (torch/csrc/autograd/autocast_mode: lower_precision_fp and
# fp32 ops). Only calls the mode sees at the Python level are cast.
_LOWER_PRECISION = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
                    torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.baddbmm,
                    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
_FP32 = {F.layer_norm, F.group_norm, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss,
         F.binary_cross_entropy_with_logits, F.kl_div, F.cosine_similarity, torch.exp, torch.Tensor.exp, torch.pow,
         torch.Tensor.pow, torch.norm, torch.Tensor.norm}
# ops autocast runs in fp32 by passing dtype=float32, without a float32 copy of the input
_FP32_OUTPUT = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax,
                torch.Tensor.log_softmax, torch.cumsum, torch.Tensor.cumsum, torch.sum, torch.Tensor.sum,
                torch.prod, torch.Tensor.prod}


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


class CudaKernelMode(TorchFunctionMode):
    """Makes meta-device calls allocate and keep what their CUDA kernels would.

    Args:
        autocast_dtype: ``torch.bfloat16`` or ``torch.float16`` to emulate CUDA autocast; ``None`` for full precision.
        kernels: model CUDA's kernels; ``False`` keeps only the answers to value questions on meta (a CPU-target
            estimate on meta uses :class:`~lightning_memguard.estimate.cpu_kernels.CpuKernelMode`, which has them).
    """

    #: autocast's casting rules (CUDA's): calls run in half precision, in fp32 on copies, with an fp32 output
    LOWER_PRECISION = _LOWER_PRECISION
    FP32 = _FP32
    FP32_OUTPUT = _FP32_OUTPUT

    def __init__(self, autocast_dtype: Optional[torch.dtype] = None, kernels: bool = True) -> None:
        super().__init__()
        self.autocast_dtype = autocast_dtype if kernels else None
        self._handlers: dict[Callable, Callable] = {
            torch.equal: self._equal,
            torch.Tensor.equal: self._equal,
            torch.Tensor.__bool__: self._bool,
        }
        if kernels:
            self._handlers.update({
                F.scaled_dot_product_attention: self._sdpa,
                F.multi_head_attention_forward: self._multi_head_attention,
                F.cross_entropy: self._cross_entropy,
                F.dropout: self._dropout,
                torch.dropout: self._dropout,
                F.mse_loss: self._elementwise_loss,
                F.smooth_l1_loss: self._elementwise_loss,
            })

    def outside_only(self):
        """This mode where no torch function mode is active (a checkpointed block recomputing in backward), else
        nothing (the forward, already under it)."""
        return self if torch._C._len_torch_function_stack() == 0 else contextlib.nullcontext()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = self._handlers.get(func)
        if handler is not None:
            return handler(func, *args, **kwargs)
        if self.autocast_dtype is not None and torch.is_grad_enabled():
            if func in self.LOWER_PRECISION:
                args, kwargs = _cast(args, self.autocast_dtype), {k: _cast(v, self.autocast_dtype)
                                                                  for k, v in kwargs.items()}
            elif func in self.FP32:
                args, kwargs = _cast(args, torch.float32), {k: _cast(v, torch.float32) for k, v in kwargs.items()}
            elif func in self.FP32_OUTPUT and kwargs.get("dtype") is None and _is_half(args[0]):
                kwargs = {**kwargs, "dtype": torch.float32}
        return func(*args, **kwargs)

    def _cross_entropy(self, func, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                       reduction="mean", label_smoothing=0.0):
        if (self.autocast_dtype is None or not torch.is_grad_enabled() or not _is_half(input) or label_smoothing
                or target.is_floating_point()):
            return func(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        # what cross_entropy is under autocast (class-index targets): torch's composite passes the input's own dtype
        # to log_softmax, so autocast leaves it in half precision (kept for the backward), and nll_loss, on
        # autocast's fp32 list, runs on an fp32 copy of the log-probabilities, which it keeps too
        log_probs = F.log_softmax(input, dim=1 if input.dim() > 1 else 0, dtype=input.dtype)
        return F.nll_loss(log_probs.float(), target, weight, size_average, ignore_index, reduce, reduction)

    def _elementwise_loss(self, func, input, target, size_average=None, reduce=None, reduction="mean", *args,
                          **kwargs):
        """``mse_loss`` and ``smooth_l1_loss`` reduced: torch's kernel writes the elementwise loss into a temporary of
        the inputs' broadcast shape and reduces it into its output, itself made at that shape and resized to a scalar
        (it keeps its storage: see ``mixed.py``). The caching allocator hands out both at once; the temporary is freed
        when the kernel returns. Autocast runs both losses in fp32 on copies (its fp32 list)."""
        if self.autocast_dtype is not None and torch.is_grad_enabled():
            input, target = _cast((input, target), torch.float32)
        temporary = None
        if (reduction != "none" and size_average is None and reduce is None and kwargs.get("weight") is None
                and isinstance(target, torch.Tensor)):
            temporary = torch.empty(torch.broadcast_shapes(input.shape, target.shape),
                                    dtype=torch.result_type(input, target), device=input.device)
        out = func(input, target, size_average, reduce, reduction, *args, **kwargs)
        del temporary
        return out

    def _dropout(self, func, input, p=0.5, training=True, inplace=False, *, train=None):
        training = training if train is None else train
        # torch's dropout takes the fused kernel on CUDA for a training call with 0 < p < 1 on a non-empty input, and
        # the composite (noise tensor, then a multiply) elsewhere, meta included. The in-place form is the composite
        # on CUDA too.
        if input.is_meta and training and not inplace and 0 < p < 1 and input.numel() > 0:
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return func(input, p, training) if func is torch.dropout else func(input, p, training, inplace)

    # --- handlers -------------------------------------------------------------------------------------------------
    def _equal(self, func, a, b) -> bool:
        if isinstance(a, torch.Tensor) and a.is_meta:
            # no values on meta: a mask compared with the causal mask it was made as (nn.Transformer) is that mask
            return a.shape == b.shape
        return func(a, b)

    def _bool(self, func, tensor) -> bool:
        if tensor.is_meta and _called_from("_detect_is_causal_mask"):
            return True  # nn.Transformer asking whether the mask it was given is causal, as the demo's is
        return func(tensor)

    def _sdpa(self, func, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        if query.device.type not in ("meta", "cpu"):
            return func(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if self.autocast_dtype is not None and torch.is_grad_enabled():
            query, key, value = _cast((query, key, value), self.autocast_dtype)
        return cuda_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def _multi_head_attention(self, func, query, key, value, embed_dim_to_check, num_heads, in_proj_weight,
                              in_proj_bias, bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight,
                              out_proj_bias, training=True, key_padding_mask=None, need_weights=True,
                              attn_mask=None, use_separate_proj_weight=False, q_proj_weight=None,
                              k_proj_weight=None, v_proj_weight=None, static_k=None, static_v=None,
                              average_attn_weights=True, is_causal=False):
        simple = (query.device.type in ("meta", "cpu") and not need_weights and key_padding_mask is None
                  and bias_k is None and not add_zero_attn and static_k is None and static_v is None
                  and query.dim() == 3)
        if not simple:  # what this does not model runs as torch has it (on meta: the math path)
            return func(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias, bias_k,
                        bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias, training=training,
                        key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
                        use_separate_proj_weight=use_separate_proj_weight, q_proj_weight=q_proj_weight,
                        k_proj_weight=k_proj_weight, v_proj_weight=v_proj_weight, static_k=static_k,
                        static_v=static_v, average_attn_weights=average_attn_weights, is_causal=is_causal)
        # torch's training path, (seq, batch, embed) layout: in-projection, heads, fused attention, out-projection
        tgt_len, bsz, embed_dim = query.shape
        head_dim = embed_dim // num_heads
        linear = self._linear
        if not use_separate_proj_weight and query is key and key is value:
            q, k, v = linear(query, in_proj_weight, in_proj_bias).unflatten(-1, (3, embed_dim)).unsqueeze(0) \
                .transpose(0, -2).squeeze(-2).contiguous()
        elif not use_separate_proj_weight and key is value:
            # encoder-decoder attention: torch projects key and value in one matmul, so the key is cast (and kept
            # for the backward) once
            w_q, w_kv = in_proj_weight.split([embed_dim, 2 * embed_dim])
            b_q, b_kv = in_proj_bias.split([embed_dim, 2 * embed_dim]) if in_proj_bias is not None else (None, None)
            q = linear(query, w_q, b_q)
            k, v = linear(key, w_kv, b_kv).unflatten(-1, (2, embed_dim)).unsqueeze(0).transpose(0, -2) \
                .squeeze(-2).contiguous()
        else:
            w_q, w_k, w_v = ((q_proj_weight, k_proj_weight, v_proj_weight) if use_separate_proj_weight
                             else in_proj_weight.chunk(3))
            b_q, b_k, b_v = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
            q, k, v = linear(query, w_q, b_q), linear(key, w_k, b_k), linear(value, w_v, b_v)
        if is_causal and attn_mask is not None:
            attn_mask = None  # torch's hint: with no padding mask and no weights, is_causal replaces the mask
        q, k, v = (t.view(t.shape[0], bsz * num_heads, head_dim).transpose(0, 1).view(bsz, num_heads, -1, head_dim)
                   for t in (q, k, v))
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.view(bsz, num_heads, -1, attn_mask.shape[-1])
        p = dropout_p if training else 0.0
        out = self._sdpa(F.scaled_dot_product_attention, q, k, v, attn_mask, p, is_causal)
        out = self._attention_layout(out.permute(2, 0, 1, 3))
        out = out.contiguous().view(bsz * tgt_len, embed_dim)
        out = linear(out, out_proj_weight, out_proj_bias)
        return out.view(tgt_len, bsz, out.shape[-1]), None

    def _attention_layout(self, out: torch.Tensor) -> torch.Tensor:
        """nn.MultiheadAttention's fused output, (s, b, h, d) as a view, in the layout the target's kernel writes."""
        if out.device.type == "cpu" and out.dtype == torch.float32:
            # CUDA's efficient attention lays its output out as (b, s, h, d), so the reshape after copies there;
            # the CPU's kernel follows the query's (s, b, h, d) layout (as cuDNN attention does) and would not
            out = out.clone(memory_format=torch.contiguous_format)
        return out

    def _linear(self, x, weight, bias=None):
        if self.autocast_dtype is not None and torch.is_grad_enabled():
            x, weight, bias = _cast((x, weight, bias), self.autocast_dtype)
        return F.linear(x, weight, bias)


def _is_half(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16)


def _called_from(name: str, depth: int = 6) -> bool:
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


class BlasWorkspaces(TorchDispatchMode):
    """Watches a meta-device step for the matmuls that make CUDA hold cuBLAS workspaces, phase by phase.

    On CUDA every thread that runs a cuBLAS matmul gets its handle's workspace (:data:`CUBLAS_WORKSPACE_BYTES`), and
    one that runs a cuBLASLt matmul (``addmm`` with a 1-D bias: ``nn.Linear`` on a 2-D or contiguous input) also the
    Lt workspace (:data:`CUBLASLT_WORKSPACE_BYTES`); both stay allocated for the life of the process. The forward and
    the optimizer step run on the training thread, the backward on autograd's device thread (a second handle), so
    the phases map onto two threads. Set :attr:`phase` as the step moves on; read :meth:`held_bytes` at the end.

    With ``cudnn`` it also holds a cuDNN workspace while the backward of each fp32 convolution runs (see
    :data:`CUDNN_FP32_BACKWARD_WORKSPACE_BYTES`), allocated before the op and freed after it, as torch's cuDNN path
    does, so the accounting modes outside this one count it in the backward's peak.
    """

    def __init__(self, cudnn: bool = False) -> None:
        super().__init__()
        self.phase = "forward"
        self.cudnn = cudnn
        self._seen: set[tuple[str, str]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.needs_workspace(func, args):
            return _with_cudnn_workspace(func, args, kwargs)
        self.note(func, args, kwargs)
        return func(*args, **kwargs)

    def needs_workspace(self, func, args: tuple) -> bool:
        """Whether the op holds a cuDNN workspace while it runs (see :func:`cudnn_workspace_bytes`)."""
        return self.cudnn and func is _aten.convolution_backward.default and args[1].dtype == torch.float32

    def note(self, func, args: tuple, kwargs: dict) -> None:
        """Notes the workspaces an op makes its thread hold; for a dispatch layer that runs the ops itself, which
        calls this for every op instead of entering this mode (one Python dispatch fewer on every op)."""
        if func in _BLAS_OPS:
            thread = "backward" if self.phase == "backward" else "training"
            self._seen.add((thread, "cublas"))
            if _runs_on_cublaslt(func, args, kwargs):
                self._seen.add((thread, "cublaslt"))

    def held_bytes(self) -> int:
        """Workspace bytes held in a steady step: what the threads that ran matmuls allocated."""
        cublas, cublaslt = workspace_sizes()
        sizes = {"cublas": cublas, "cublaslt": cublaslt}
        return sum(sizes[kind] for _, kind in self._seen)


def cudnn_workspace_bytes(args: tuple) -> int:
    """The cuDNN workspace an fp32 convolution's backward (``convolution_backward``'s ``args``) holds while it runs:
    four times the convolution's largest tensor, at most the bound: a tiny convolution gets a tiny workspace (the
    reference's tiny ResNet shows none), a large one the bound (the demo CNN's fp32 backward)."""
    grad_output, input = args[0], args[1]
    return min(CUDNN_FP32_BACKWARD_WORKSPACE_BYTES, 4 * max(grad_output.numel(), input.numel()) * input.element_size())


def _with_cudnn_workspace(func, args, kwargs):
    # on the gradient's device: meta on the meta path, where the input may be the batch (real, on CPU)
    workspace = torch.empty(cudnn_workspace_bytes(args), dtype=torch.uint8, device=args[0].device)
    out = func(*args, **kwargs)
    del workspace
    return out


def workspace_sizes() -> tuple[int, int]:
    """(cuBLAS, separate cuBLASLt) workspace bytes per handle, by torch's rules: ``CUBLAS_WORKSPACE_CONFIG``
    (``:SIZE_KiB:COUNT`` pairs) when set, else 32 MiB on sm90 and 8 MiB + 128 KiB on other GPUs — on a machine without
    a GPU, Hopper's; ``CUBLASLT_WORKSPACE_SIZE`` (KiB, default 1024, at most the cuBLAS size), none of its own with
    ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1``."""
    cublas = CUBLAS_WORKSPACE_BYTES
    if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        cublas = CUBLAS_WORKSPACE_BYTES_OTHER
    pairs = re.findall(r":([0-9]+):([0-9]+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        cublas = sum(int(size) * 1024 * int(count) for size, count in pairs)
    if os.environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").strip().lower() in ("1", "true", "on", "yes", "y"):
        return cublas, 0
    lt_kib = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "").strip()
    cublaslt = int(lt_kib) * 1024 if lt_kib.isdigit() else CUBLASLT_WORKSPACE_BYTES
    return cublas, min(cublaslt, cublas)


def _runs_on_cublaslt(func, args, kwargs) -> bool:
    # torch's CUDA addmm takes the Lt path (bias fused in the epilogue) for a 1-D bias over 2-D matrices with
    # beta 1 and both output dimensions above 1; _addmm_activation always does
    if func is _aten._addmm_activation.default:
        return True
    if func is not _aten.addmm.default:
        return False
    bias, mat1, mat2 = args[:3]
    return (bias.dim() == 1 and kwargs.get("beta", 1) == 1 and mat1.shape[0] > 1 and mat2.shape[1] > 1
            and bias.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64))
