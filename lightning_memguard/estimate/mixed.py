"""Mixed execution for the meta path of the estimate: the weights are shapes only, the batch keeps its values.

A meta-device step cannot answer the questions a model asks about its inputs: transformers' mask helpers read the
attention mask (``padding_mask.all()``) and the position ids, and meta tensors have no values. Those answers do not
depend on the weights. So :class:`MixedExecution` runs the step with two kinds of tensors:

* real CPU tensors: the batch and everything computed from it alone (ids, masks, positions, lengths), and the
  integer and boolean constants the model makes on its device (``torch.arange(n, device=...)``): their values are
  real, and reading them just works;
* meta tensors: the parameters and everything that touches them.

Where the two meet in one op, the real side becomes meta (a shape-only copy) and the result is meta. Reading a meta
value (``.item()`` of a routing decision, a branch on an activation) raises :class:`NeedsValues`, naming the op and
where the model asked: those models must run on CPU. A real tensor overwritten in place with a meta result keeps its
memory but not its values: it is *stale*, and from then on it is treated as meta.

For the accounting, the real tensors are "on the device" (the GPU of a CUDA run holds them too) when they come from the
batch, from a device-side real tensor, or from an op asked to put its result on the meta device;
:meth:`MixedExecution.on_device` says which. Host-side ones (the optimizer's CPU step counters, ``torch.tensor(data)``
without a device) are not.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .meta_cache import aten_tensors, call_meta

__all__ = ["MixedExecution", "NeedsValues", "describe", "error_location", "reads_values"]

_aten = torch.ops.aten
_META = torch.device("meta")
_CPU = torch.device("cpu")
# ops that read values, and how a model's author wrote them
_VALUE_READS = {
    _aten._local_scalar_dense.default: "a tensor's value (.item(), bool(), int(), float() or an if on a tensor)",
    _aten.nonzero.default: "nonzero() (or indexing with a boolean mask)",
    _aten.equal.default: "torch.equal()",
    # these read values only where they fail on meta
    _aten._to_copy.default: "a copy to the CPU (.cpu(), .tolist(), .numpy())",
    _aten.index.Tensor: "indexing with a boolean mask",
}
_OWN_FILES = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(torch.__file__))


class NeedsValues(Exception):
    """The step read a value that depends on the weights: meta tensors have none. ``operation`` names the op and
    where the model called it."""

    def __init__(self, operation: str) -> None:
        super().__init__(operation)
        self.operation = operation


def reads_values(err: BaseException) -> bool:
    """Whether an error is a meta tensor refusing to give a value, or an op the meta device cannot run (its output
    shape depends on values: masked_select, unique), rather than, say, a shape mismatch. Either way the step needs
    real values."""
    text = str(err).lower()
    return isinstance(err, (RuntimeError, NotImplementedError)) and any(
        words in text for words in ("meta", "item()", "data-dependent"))


def describe(func, err: BaseException | None = None) -> str:
    """The op and the first caller outside torch and this package: ``aten::_local_scalar_dense (a tensor's value
    ...) at transformers/models/x/modeling_x.py:123 in forward``."""
    what = _VALUE_READS.get(func, "")
    text = f"{func._schema.name}" + (f" ({what})" if what else "")
    if err is not None and not what:
        text += f": {str(err).splitlines()[0][:120]}"  # the op's own words
    return text + where_called()


def where_called() -> str:
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_OWN_FILES) and "contextlib" not in path:
            short = os.sep.join(path.split(os.sep)[-3:])
            return f" at {short}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return " (in autograd's backward or the optimizer)"


def error_location(err: BaseException) -> str:
    """Where in the model's code an error was raised (the innermost frame outside torch and this package)."""
    location = ""
    tb = err.__traceback__
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not path.startswith(_OWN_FILES):
            location = f" at {os.sep.join(path.split(os.sep)[-3:])}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return location


def _shape_only(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=_META)


def _shapes(value: Any, copies: dict) -> Any:
    """``value`` with its real tensors replaced by shape-only copies (recorded in ``copies``). A plain function, not
    a closure: a recursive closure is a reference cycle, which would keep the real tensors alive until the garbage
    collector runs (and the accounting would see them live)."""
    if isinstance(value, torch.Tensor) and not value.is_meta:
        copy = _shape_only(value)
        copies[id(copy)] = value
        return copy
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_shapes(v, copies) for v in value)
    return value


_WRITTEN: dict = {}


def _written_arguments(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments an op writes into (in-place ops' self, out= tensors)."""
    written = _WRITTEN.get(func)
    if written is None:
        written = _WRITTEN[func] = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                                         if a.alias_info is not None and a.alias_info.is_write)
    return written


def _grouped_mm(func, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """``torch._grouped_mm`` (mixture-of-experts layers: transformers runs every expert in one call, the routing given
    as group offsets, so no value is read) on meta. Its meta kernel checks the inputs as CUDA's bf16 kernel does, but
    CUDA (torch 2.9 and later) and the CPU run other dtypes too, with the output of the same shape: the shapes come
    from bf16 stand-ins, the result has the inputs' dtype."""
    if mat_a.dtype == mat_b.dtype == torch.bfloat16:
        return func(mat_a, mat_b, offs, bias, out_dtype)
    # a broadcast operand (the gradient of a sum) is made contiguous, as the kernels do
    standins = [torch.empty_strided(t.size(), t.stride(), dtype=torch.bfloat16, device=_META) if 0 not in t.stride()
                else torch.empty(t.size(), dtype=torch.bfloat16, device=_META) for t in (mat_a, mat_b)]
    shaped = func(*standins, offs, None if bias is None else bias.to(torch.bfloat16), None)
    return torch.empty(shaped.shape, dtype=out_dtype or mat_a.dtype, device=_META)


def _ctc_loss(func, log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False, *, values):
    """``torch.nn.functional.ctc_loss`` given its lengths as tensors (transformers' CTC loss: Wav2Vec2, HuBERT...),
    which has no meta kernel: its outputs' shapes depend on the longest target, a value. The lengths come from the
    batch (labels, masks), so they are real here: the overload with the lengths as lists, which has a meta kernel,
    gives the same outputs (the loss of every sample, and the alphas of shape (batch, frames, 2 x longest target +
    1))."""
    return _aten._ctc_loss.default(_shapes(log_probs, {}), _shapes(targets, {}), values(input_lengths),
                                   values(target_lengths), blank, zero_infinity)


def _ctc_loss_backward(func, grad, log_probs, *rest, values):
    """The CTC loss's backward (no meta kernel): a gradient of ``log_probs``'s shape, contiguous, as the CPU and CUDA
    kernels make it."""
    return torch.empty(log_probs.shape, dtype=log_probs.dtype, device=_META)


def _bincount(func, counted, weights=None, minlength=0, *, values):
    """``torch.bincount`` (no meta kernel: its length is the largest value plus one, at least ``minlength``). Counted
    values from the batch are read; values computed from the weights (the experts a router picked, in the load-balancing
    loss of transformers' mixture-of-experts models before 5.2x) are taken as class indices below ``minlength``, the
    number of classes the caller gives — the routing's case (top-k experts of ``num_experts``). Without a
    ``minlength`` such values are needed (the estimate leaves the meta device)."""
    if not counted.is_meta:
        length = max([minlength, *(v + 1 for v in values(counted))])
    elif minlength > 0:
        length = minlength
    else:
        values(counted)  # raises NeedsValues: the length is a value
    dtype = weights.dtype if weights is not None else torch.int64
    return torch.empty(length, dtype=dtype, device=_META)


def _shapes_only(stand_in):
    """A stand-in that needs no values: it is given every tensor as a shape-only one."""
    return lambda func, *args, values, **kwargs: stand_in(func, *[_shapes(a, {}) for a in args],
                                                          **{k: _shapes(v, {}) for k, v in kwargs.items()})


def _elementwise_loss(func, input, target, reduction=1, *args, values, **kwargs):
    """``mse_loss`` and ``smooth_l1_loss``: torch's kernel (the CPU's and CUDA's alike, one structured kernel) makes its
    output at the inputs' broadcast shape, writes the elementwise loss there and resizes it to the reduced scalar, which
    keeps the storage: the loss holds an input-sized buffer as long as it lives (through the backward). Meta's kernel
    makes a 4-byte scalar."""
    shape = torch.broadcast_shapes(input.shape, target.shape)
    out = torch.empty(shape, dtype=torch.result_type(input, target), device=_META)
    return out.resize_(()) if reduction else out


def _group_norm(func, input, weight, bias, N, C, HxW, group, eps, *, values):
    """``native_group_norm`` as the devices' kernels write it: the output in the input's dtype and suggested format,
    the mean and reciprocal deviation in fp32 for a half-precision input with fp32 weights (their mixed-type path;
    meta's kernel makes them half)."""
    mixed = input.dtype in (torch.bfloat16, torch.float16) and weight is not None and weight.dtype == torch.float32
    out = torch.empty(input.shape, dtype=input.dtype, device=_META, memory_format=_suggested_layout(input))
    stats = torch.float32 if mixed else input.dtype
    return out, torch.empty(N, group, dtype=stats, device=_META), torch.empty(N, group, dtype=stats, device=_META)


def _group_norm_backward(func, grad_output, input, mean, rstd, weight, N, C, HxW, group, output_mask, *, values):
    """``native_group_norm_backward`` as the devices' kernels write it: the input's gradient in the input's dtype and
    suggested format (channels-last on the CPU, which normalises such an input as it is), the weight's and bias's in
    the weight's dtype. Meta's kernel (torch's decomposition) computes in fp32 and returns an fp32 input gradient for a
    bf16 input — which autograd then copies to bf16 — and a contiguous one for a channels-last input."""
    wanted = list(output_mask) + [False] * (3 - len(output_mask))
    grad_input = torch.empty(input.shape, dtype=input.dtype, device=_META,
                             memory_format=_suggested_layout(input)) if wanted[0] else None
    dtype = weight.dtype if weight is not None else input.dtype
    grad_weight = torch.empty(C, dtype=dtype, device=_META) if wanted[1] else None
    grad_bias = torch.empty(C, dtype=dtype, device=_META) if wanted[2] else None
    return grad_input, grad_weight, grad_bias


# backward ops whose gradient of an input can be that of a real tensor: (output, the input's argument) pairs
_GRADIENTS_OF_INPUTS = {_aten.convolution_backward.default: ((0, 1),)}
# ops whose meta kernel refuses what the device's kernel runs, or that have none: how to run them on meta. Each gets
# the op's arguments as they are, and values(tensor): a real tensor's values as a list (NeedsValues for a meta one)
_META_STAND_INS = {_aten._grouped_mm.default: _shapes_only(_grouped_mm), _aten._ctc_loss.Tensor: _ctc_loss,
                   _aten._ctc_loss_backward.Tensor: _ctc_loss_backward, _aten.bincount.default: _bincount,
                   _aten.mse_loss.default: _elementwise_loss, _aten.smooth_l1_loss.default: _elementwise_loss,
                   _aten.native_group_norm.default: _group_norm,
                   _aten.native_group_norm_backward.default: _group_norm_backward}


def _suggested_layout(tensor: torch.Tensor) -> torch.memory_format:
    """The memory format torch's ``suggest_memory_format`` gives ``tensor``: channels-last where its strides are
    channels-last (and not plainly contiguous), else contiguous."""
    if not tensor.is_contiguous():
        for dim, layout in ((4, torch.channels_last), (5, torch.channels_last_3d)):
            if tensor.dim() == dim and tensor.is_contiguous(memory_format=layout):
                return layout
    return torch.contiguous_format


def _convolution_layout(input: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """The format a convolution's output (and its input's gradient) is written in on the CPU (oneDNN, and torch's own
    2-D kernels) and on CUDA (cuDNN): channels-last where the input or the weight is, except in float64; meta's kernel
    writes it contiguous whatever it is given."""
    if torch.float64 in (input.dtype, weight.dtype):
        return torch.contiguous_format
    layouts = {_suggested_layout(input), _suggested_layout(weight)}
    for dim, layout in ((4, torch.channels_last), (5, torch.channels_last_3d)):
        if weight.dim() == dim and layout in layouts:
            return layout
    return torch.contiguous_format


# ops whose output, on the CPU and on CUDA, is written in another memory format than meta's kernel writes it in:
# op -> (which output, None for the only one; the format, from the op's arguments). A norm writes its input's
# suggested format (contiguous for a transposed input: PatchTST normalises ``x.transpose(1, 2)``, where the meta
# kernel keeps the input's strides or the gradient's), a convolution channels-last where its input or weight is
# (diffusers' spatial attention blocks hand on a channels-last residual: an upsampler's convolution, and on the CPU
# every convolution after, keeps the format). The layers after then copy their inputs as the real step does, keep
# the copies it keeps, and make none where the real output needs none. (A GroupNorm's gradient: its stand-in above.)
_REAL_LAYOUTS = {
    _aten.native_batch_norm.default: (0, lambda args: _suggested_layout(args[0])),
    _aten.native_batch_norm_backward.default: (0, lambda args: _suggested_layout(args[1])),
    _aten.native_layer_norm_backward.default: (0, lambda args: torch.contiguous_format),
    _aten.convolution.default: (None, lambda args: _convolution_layout(args[0], args[1])),
    _aten.convolution_backward.default: (0, lambda args: _convolution_layout(args[1], args[2])),
}


def _in_real_layout(func, out: Any, args: tuple) -> Any:
    """``out`` with the output :data:`_REAL_LAYOUTS` names for ``func`` in the layout the device's kernel writes (a
    fresh meta tensor, never counted in the other layout)."""
    index, rule = _REAL_LAYOUTS[func]
    tensor = out if index is None else out[index]
    if tensor is None or not tensor.is_meta:
        return out
    layout = rule(args)
    if tensor.is_contiguous(memory_format=layout):
        return out
    fresh = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device, memory_format=layout)
    if index is None:
        return fresh
    return type(out)((fresh if i == index else o) for i, o in enumerate(out))


class MixedExecution(TorchDispatchMode):
    """Runs a step whose parameters are on meta with the batch's tensors real on CPU (see the module's docstring).

    Enter it before any accounting mode, or have the accounting mode call :meth:`run` to run its ops (as the
    estimate's accountant does): the shape-only copies it makes where real and meta tensors meet are its own business,
    not allocations of the step.
    """

    def __init__(self) -> None:
        super().__init__()
        # storage key -> [on the device, stale, weakref keeping the free-callback alive]
        self._real: dict[int, list] = {}
        self._largest_input = 0  # elements of the batch's largest tensor: the size of a mask the model makes

    # --- what the accounting asks ---------------------------------------------------------------------------------
    def place(self, tensors: Iterable[torch.Tensor]) -> None:
        """Marks real tensors (the batch) as living on the device."""
        for tensor in aten_tensors(tensors):
            self._mark(tensor, on_device=True)
            self._largest_input = max(self._largest_input, tensor.numel())

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether a tensor is device memory in the run being estimated: meta, or real and device-side."""
        if tensor.is_meta:
            return True
        entry = self._real.get(tensor.untyped_storage()._cdata)
        return entry is not None and entry[0]

    # --- bookkeeping ----------------------------------------------------------------------------------------------
    def _mark(self, tensor: torch.Tensor, on_device: bool = False, stale: bool = False) -> None:
        if tensor.is_meta or tensor.device.type != "cpu":
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        entry = self._real.get(key)
        if entry is None:
            self._real[key] = [on_device, stale, weakref.ref(storage, lambda _ref, key=key: self._real.pop(key, None))]
        else:
            entry[0] |= on_device
            entry[1] |= stale

    def _stale(self, tensor: torch.Tensor) -> bool:
        entry = self._real.get(tensor.untyped_storage()._cdata)
        return entry is not None and entry[1]

    # --- the ops --------------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.run(func, args, kwargs or {})

    def run(self, func, args: tuple, kwargs: dict):
        """One op as this mode runs it; for a mode just above, which can run it so without a dispatch of its own."""
        tensors = [*aten_tensors(args), *aten_tensors(kwargs.values())]
        reals = [t for t in tensors if not t.is_meta]
        if len(reals) < len(tensors) or any(self._stale(t) for t in reals):
            out = self._on_meta(func, args, kwargs, reals)
            return _in_real_layout(func, out, args) if func in _REAL_LAYOUTS else out
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "meta":
            return self._made_for_the_device(func, args, kwargs, reals)
        out = func(*args, **kwargs)
        # computed from device-side tensors: on the device too (an explicit copy to the CPU is not)
        if device is None and any(self.on_device(t) for t in reals):
            for tensor in aten_tensors(out if isinstance(out, (tuple, list)) else (out,)):
                self._mark(tensor, on_device=True)
        return out

    def _on_meta(self, func, args, kwargs, reals):
        stand_in = _META_STAND_INS.get(func)
        if stand_in is not None:
            return stand_in(func, *args, values=lambda tensor: self._values(func, tensor), **kwargs)
        if not reals:  # the weights' side alone: most ops of the step
            try:
                return call_meta(func, args, kwargs)
            except (RuntimeError, NotImplementedError) as err:
                if reads_values(err) or func in (_aten._local_scalar_dense.default, _aten.nonzero.default):
                    raise NeedsValues(describe(func, err)) from None
                raise
        if func is _aten._local_scalar_dense.default:  # a stale tensor's value
            raise NeedsValues(describe(func))
        if func is _aten._to_copy.default and reals:  # its one tensor is real, so stale
            # a stale tensor copied (a real input's gradient cast back to its dtype and device by autocast's
            # backward): a copy, stale too, where the meta device cannot make one on the CPU
            out = func(*args, **kwargs)
            self._mark(out, on_device=self.on_device(reals[0]), stale=True)
            return out
        copies: dict[int, torch.Tensor] = {}  # id(shape-only copy) -> the real tensor it stands for
        try:
            shaped = [_shapes(a, copies) for a in args], {k: _shapes(v, copies) for k, v in kwargs.items()}
            out = call_meta(func, *shaped)
        except (RuntimeError, NotImplementedError) as err:
            if reads_values(err):
                raise NeedsValues(describe(func, err)) from None
            raise
        for output, argument in _GRADIENTS_OF_INPUTS.get(func, ()):
            out = self._real_gradient(out, output, args[argument])
        # a real tensor written with a result computed from the weights keeps its memory, not its values
        for position, name in _written_arguments(func):
            target = args[position] if position < len(args) else kwargs.get(name)
            for tensor in aten_tensors((target,)):
                self._mark(tensor, stale=True)
        if not copies:
            return out
        # in-place and out= ops return what they wrote into: the real tensor, not its copy
        if isinstance(out, (tuple, list)):
            return type(out)(copies.get(id(o), o) for o in out)
        return copies.get(id(out), out)

    def _real_gradient(self, out: tuple, output: int, tensor: Any) -> tuple:
        """``out`` with its gradient for a real input made real (zeros, stale): autograd wants a tensor's gradient
        on the tensor's device. A real input gets a gradient where the model asks for one: Wav2Vec2's and HuBERT's
        feature encoders set requires_grad on the batch's audio (for gradient checkpointing)."""
        gradient = out[output]
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta or not isinstance(gradient, torch.Tensor):
            return out
        real = torch.empty_strided(gradient.size(), gradient.stride(), dtype=gradient.dtype).zero_()
        self._mark(real, on_device=self.on_device(tensor), stale=True)
        return type(out)((real if index == output else o) for index, o in enumerate(out))

    def _values(self, func, tensor: torch.Tensor) -> list:
        """A real tensor's values, for a stand-in whose outputs' shapes depend on them."""
        if tensor.is_meta or self._stale(tensor):
            raise NeedsValues(describe(func))
        return tensor.tolist()

    def _made_for_the_device(self, func, args, kwargs, reals):
        """An op asked to put a result on the meta device that needs no weights."""
        if not reals:
            # a constant: integer and boolean ones (positions, masks) get values; floating ones larger than the
            # batch's largest tensor stay shapes, since they are buffers and accumulators that weight-dependent
            # results are added into (real, they would cost the estimate their memory for nothing). Smaller floating
            # ones get values: a mask the model makes in the activations' dtype (BART's decoder makes
            # torch.ones(batch, length, device=embeddings.device) when given no decoder mask), which transformers'
            # mask helpers read; written into with a weight-dependent result, one goes stale like any real tensor
            shaped = func(*args, **kwargs)
            if not isinstance(shaped, torch.Tensor) or ((shaped.is_floating_point() or shaped.is_complex())
                                                        and shaped.numel() > self._largest_input):
                return shaped
        elif func is _aten._to_copy.default and self._is_no_op_copy(reals[0], kwargs):
            # a device-side tensor moved to the device it is on: the real run returns it as it is
            return _aten.alias.default(reals[0])
        out = func(*args, **{**kwargs, "device": _CPU})
        for tensor in aten_tensors(out if isinstance(out, (tuple, list)) else (out,)):
            self._mark(tensor, on_device=True)
        return out

    def _is_no_op_copy(self, tensor: torch.Tensor, kwargs: dict) -> bool:
        dtype, layout, memory_format = kwargs.get("dtype"), kwargs.get("layout"), kwargs.get("memory_format")
        return (self.on_device(tensor) and dtype in (None, tensor.dtype) and layout in (None, tensor.layout)
                and memory_format in (None, torch.preserve_format))
