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


# ops whose meta kernel refuses what the device's kernel runs: how to run them on meta
_META_STAND_INS = {_aten._grouped_mm.default: _grouped_mm}


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
            return self._on_meta(func, args, kwargs, reals)
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
            return stand_in(func, *[_shapes(a, {}) for a in args], **{k: _shapes(v, {}) for k, v in kwargs.items()})
        if not reals:  # the weights' side alone: most ops of the step
            try:
                return call_meta(func, args, kwargs)
            except (RuntimeError, NotImplementedError) as err:
                if reads_values(err) or func in (_aten._local_scalar_dense.default, _aten.nonzero.default):
                    raise NeedsValues(describe(func, err)) from None
                raise
        if func is _aten._local_scalar_dense.default:  # a stale tensor's value
            raise NeedsValues(describe(func))
        copies: dict[int, torch.Tensor] = {}  # id(shape-only copy) -> the real tensor it stands for
        try:
            shaped = [_shapes(a, copies) for a in args], {k: _shapes(v, copies) for k, v in kwargs.items()}
            out = call_meta(func, *shaped)
        except (RuntimeError, NotImplementedError) as err:
            if reads_values(err):
                raise NeedsValues(describe(func, err)) from None
            raise
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
