"""Which tensors appeared and disappeared between two moments of a training step (framework-free).

A dispatch mode sees every storage when it is created (so the activations autograd saves inside the graph are
included, which a walk over ``gc.get_objects()`` would miss) and a weak reference sees it freed. Each storage
carries its shape, dtype and the module that was running when it was made; at each mark the live storages are also
sorted into parameters, gradients, optimizer state and the rest.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Iterable, Optional

import pandas as pd
import torch
from torch import nn

from ..base.checks import check_bool
from ..base.compiled import compiled_code
from ..base.module_stack import ForwardModuleStack
from ..sources.cpu import NewTensorMode, optimizer_state_tensors

__all__ = ["TensorDiff"]

CATEGORIES = ("parameter", "gradient", "optimizer_state", "activation_or_other")


@dataclass(frozen=True)
class _StorageInfo:
    nbytes: int
    shape: tuple
    dtype: str
    device: str
    module: str


class TensorDiff:
    """Records storages between named marks, on any device.

    Args:
        model: parameters, buffers and gradients that exist before recording starts are registered from it, and
            its module names label what each forward and backward creates.
        optimizers: their state tensors are registered and labelled ``optimizer_state``.
        module_names: label what is created with the module whose forward runs (global forward hooks). Off, and off
            by itself for a model that holds compiled code: the modules inside a compiled graph run no hooks (there
            are no names to give), and torch warns about global hooks on a torch.compile'd module. Unlabelled
            storages have module ``""``.

    Example::

        with TensorDiff(model, [optimizer]) as diff:
            diff.mark("start")
            loss = model(x).sum()
            diff.mark("after_forward")
        diff.diff("start", "after_forward")   # DataFrame: change, category, shape, dtype, count, bytes, module
        diff.consumers("after_forward")       # bytes by category and module at that mark
    """

    def __init__(self, model: Optional[nn.Module] = None, optimizers: Iterable[torch.optim.Optimizer] = (),
                 module_names: bool = True) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model={model!r} must be an nn.Module or None")
        try:
            self.optimizers = list(optimizers)
        except TypeError:
            self.optimizers = [None]
        if not all(isinstance(o, torch.optim.Optimizer) for o in self.optimizers):
            raise ValueError(f"optimizers={optimizers!r} must be an iterable of torch optimizers (may be empty)")
        self.model = model
        self.module_names = check_bool("module_names", module_names)
        # storage address -> (serial, info, weakref). An address is reused once its storage is freed, so marks
        # remember serials: a gradient allocated where an activation used to be is a different storage.
        self._live: dict[int, tuple[int, _StorageInfo, weakref.ref]] = {}
        self._serial = 0
        self._marks: dict[str, dict[int, tuple[_StorageInfo, str]]] = {}
        self._mode: Optional[NewTensorMode] = None
        self._tracker = None
        self._root = type(model).__name__ if model is not None else ""

    # --- recording --------------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._mode is not None:
            return
        for tensor, module in self._known_tensors():
            self._add(tensor, module)
        # Forward hooks only. torch's ModuleTracker also hooks the gradients of every module's inputs and outputs;
        # a checkpointed block's recomputation never delivers those, so its hooks kept the recomputed tensors alive
        # until recording stopped (+40 % of the step's memory on a checkpointed stack): the diff changed what it
        # measured. Gradients are attributed to their parameter's module at each mark instead.
        names = self.module_names and self.model is not None and not compiled_code(self.model)
        self._tracker = ForwardModuleStack(self.model) if names else None
        if self._tracker is not None:
            self._tracker.__enter__()
        self._mode = NewTensorMode(self._add)
        self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker = None

    def __enter__(self) -> "TensorDiff":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def mark(self, name: str) -> None:
        """Remembers which storages are alive now, and what each of them is."""
        categories = self._categories()
        # dict.copy() copies in one C call: a garbage collection during the loop below may free storages, and
        # their callbacks remove entries from the live dict
        live = self._live.copy()
        marked = {}
        for key, (serial, info, _) in live.items():
            category, module = categories.get(key, ("activation_or_other", None))
            marked[serial] = (info if module is None else replace(info, module=module), category)
        self._marks[name] = marked

    @property
    def marks(self) -> list[str]:
        return list(self._marks)

    # --- reading ----------------------------------------------------------------------------------------------------
    def diff(self, before: str, after: str) -> pd.DataFrame:
        """Storages alive at ``after`` but not ``before`` (``+``) and the reverse (``-``), grouped as count × shape ×
        dtype per category and module, largest first."""
        a, b = self._mark(before), self._mark(after)
        rows = [("+", key, *b[key]) for key in b.keys() - a.keys()]
        rows += [("-", key, *a[key]) for key in a.keys() - b.keys()]
        frame = pd.DataFrame(
            [{"change": change, "category": category, "module": info.module, "shape": str(list(info.shape)),
              "dtype": info.dtype, "device": info.device, "bytes": info.nbytes}
             for change, _, info, category in rows],
            columns=["change", "category", "module", "shape", "dtype", "device", "bytes"])
        if frame.empty:
            return frame.assign(count=pd.Series(dtype=int))
        grouped = (frame.groupby(["change", "category", "module", "shape", "dtype", "device"], as_index=False)
                   .agg(count=("bytes", "size"), bytes=("bytes", "sum")))
        return grouped.sort_values("bytes", ascending=False, ignore_index=True)

    def consumers(self, at: str) -> pd.DataFrame:
        """Live bytes at a mark by category and module, largest first: the top consumers."""
        live = self._mark(at)
        frame = pd.DataFrame([{"category": category, "module": info.module, "bytes": info.nbytes}
                              for info, category in live.values()], columns=["category", "module", "bytes"])
        grouped = frame.groupby(["category", "module"], as_index=False).agg(count=("bytes", "size"),
                                                                            bytes=("bytes", "sum"))
        return grouped.sort_values("bytes", ascending=False, ignore_index=True)

    def _mark(self, name: str) -> dict:
        if name not in self._marks:
            raise ValueError(f"mark {name!r} was not recorded; marks: {self.marks}")
        return self._marks[name]

    # --- internals --------------------------------------------------------------------------------------------------
    def _known_tensors(self):
        if self.model is not None:
            for module_name, module in self.model.named_modules():
                for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
                    yield tensor, module_name
                    if tensor.grad is not None:
                        yield tensor.grad, module_name
        for value in optimizer_state_tensors(self.optimizers):
            yield value, "optimizer"

    def _categories(self) -> dict[int, tuple[str, Optional[str]]]:
        """Storage -> (category, the module it belongs to where that is known better than where it was made: a
        gradient belongs to its parameter's module, though backward made it)."""
        categories: dict[int, tuple[str, Optional[str]]] = {}

        def put(tensor, category, module=None):
            if isinstance(tensor, torch.Tensor) and not tensor.is_sparse:
                categories.setdefault(tensor.untyped_storage()._cdata, (category, module))

        if self.model is not None:
            for module_name, module in self.model.named_modules():
                for param in module.parameters(recurse=False):
                    put(param, "parameter")
                    put(param.grad, "gradient", module_name)
                for buffer in module.buffers(recurse=False):
                    put(buffer, "parameter")
        for value in optimizer_state_tensors(self.optimizers):
            put(value, "optimizer_state")
        return categories

    def _current_module(self) -> str:
        return self._tracker.innermost if self._tracker is not None else ""

    def _add(self, tensor: torch.Tensor, module: Optional[str] = None) -> None:
        if tensor.is_sparse or tensor.device.type == "meta":
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata
        if key in self._live:
            return
        info = _StorageInfo(storage.nbytes(), tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                            str(tensor.device), self._current_module() if module is None else module)
        self._serial += 1
        self._live[key] = (self._serial, info, weakref.ref(storage, lambda _ref, key=key: self._live.pop(key, None)))
