"""What runs inside a block that :func:`~lightning_memguard.mitigations.checkpointing.checkpoint_module` checkpoints:
the forward object the block gets (:class:`CheckpointedForward`), which calls it under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` without its key/value cache
(:class:`CacheFreeCall`) and keeps the recomputation from updating running buffers a second time
(:class:`RecomputationBuffers`). Nothing here imports transformers: its classes are recognised by name.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from ..base.buffers import BufferSlots

#: the names transformers (and models written like it) give a block's key/value cache argument
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")


def class_names(obj: Any) -> set[str]:
    """The names of the classes ``obj`` is an instance of (its class and all bases)."""
    return {cls.__name__ for cls in type(obj).__mro__}


def _is_transformers_cache(value: Any) -> bool:
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers") for cls in type(value).__mro__)


class CacheFreeCall:
    """Takes the key/value cache out of a block's call, for the checkpointed (training) call only.

    Why here and not through the model's own switch (transformers' ``gradient_checkpointing`` flags): the switch
    moved between versions (the model's layer loop in 4.x, ``GradientCheckpointingLayer.__call__``, then its
    ``forward``), it is not only per layer (GPT-2 passes the cache positionally and drops it in ``GPT2Model.forward``
    on the model's flag, which the layers' flags do not cover), setting it needs private attributes
    (``_gradient_checkpointing_func``), and it would checkpoint every layer rather than the rung's k and look like the
    user's own checkpointing. The call itself is the same in every version: drop what would be updated twice.

    ``use_cache`` becomes ``False`` too (a block may keep state of its own when it is true, e.g. recurrent layers),
    except for transformers layers that are not ``GradientCheckpointingLayer``\\ s: in older versions those return a
    tuple whose length depends on ``use_cache`` and which the model's loop indexes; their legacy tuple caches are
    not updated in place, so dropping the cache is enough there. A layer that declares
    ``_can_checkpoint_with_cache`` (it only reads the cache) keeps it, as transformers does.
    """

    def __init__(self, module: nn.Module, forward: Callable) -> None:
        names = class_names(module)
        from_transformers = type(module).__module__.startswith("transformers")
        self.switch_use_cache = "GradientCheckpointingLayer" in names or not from_transformers
        self.keep_cache = getattr(module, "_can_checkpoint_with_cache", False) is True
        self.positions: dict[str, int] = {}
        try:
            parameters = list(inspect.signature(forward).parameters.values())
        except (TypeError, ValueError):  # no signature: keyword arguments and Cache objects are still found
            parameters = []
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for index, parameter in enumerate(parameters):
            if parameter.kind in positional and parameter.name in (*CACHE_ARGUMENTS, "use_cache"):
                self.positions[parameter.name] = index

    def __call__(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        if not self.keep_cache:
            for name in CACHE_ARGUMENTS:
                index = self.positions.get(name)
                if index is not None and index < len(args):
                    args[index] = None
                if name in kwargs:
                    kwargs[name] = None
            args = [None if _is_transformers_cache(value) else value for value in args]
            kwargs = {key: None if _is_transformers_cache(value) else value for key, value in kwargs.items()}
        if self.switch_use_cache:
            index = self.positions.get("use_cache")
            if index is not None and index < len(args) and args[index]:
                args[index] = False
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
        return tuple(args), kwargs


class RecomputationBuffers:
    """Keeps a checkpointed block's recomputation from updating its running buffers (BatchNorm's running mean and
    variance, ``num_batches_tracked``) a second time.

    Which buffers a forward changes is :class:`~lightning_memguard.base.buffers.BufferSlots`' to say: those of
    modules keeping running statistics in training mode, and those the forward moved — with the other buffers of the
    same module (:meth:`~lightning_memguard.base.buffers.BufferSlots.with_their_modules`). The recomputation saves
    those buffers (their values now), starts from the values the forward saw, and puts the saved values back when it
    ends. Values are copied at the forward for the statistics modules and for buffers an earlier forward was seen
    to change. So nothing is copied for a block whose forward changes no buffer, and big constant buffers (causal
    masks) never are. The price: a buffer that a forward both reads and changes, other than those of the modules
    known to (running statistics, a spectral norm's power-iteration vectors: ``BufferSlots.statistics``; a module of
    your own that counts its calls in a buffer, say), is seen changed by the recomputation of the block's first
    checkpointed forward; from the second on, the recomputation sees what the forward saw.
    """

    #: per block, the buffers its earlier forwards changed (kept while the rung switches the block off and on)
    _learned: "weakref.WeakKeyDictionary[nn.Module, set[str]]" = weakref.WeakKeyDictionary()

    def __init__(self, module: nn.Module) -> None:
        # taken when the block is checkpointed: a call reads the buffers through their owners without walking the
        # module tree again
        self.buffers = BufferSlots(module)
        self.changing = self._learned.setdefault(module, set())

    def contexts(self) -> tuple[ContextManager, ContextManager]:
        """The forward's and the recomputation's context for one checkpointed call (``context_fn`` of
        :func:`torch.utils.checkpoint.checkpoint`)."""
        seen: dict[int, Optional[torch.Tensor]] = {}  # this call: slots its forward changed -> value before (or None)
        return self._forward(seen), self._recompute(seen)

    @contextlib.contextmanager
    def _forward(self, seen: dict):
        buffers = self.buffers
        tensors = buffers.tensors()
        versions = buffers.versions(tensors)
        expected = {i for i, name in enumerate(buffers.names) if name in self.changing}
        expected |= {i for i in buffers.statistics if buffers.slots[i][0].training}
        before = {i: tensors[i].detach().clone() for i in expected if tensors[i] is not None}
        yield
        moved = buffers.with_their_modules(buffers.moved(tensors, versions))
        self.changing.update(buffers.names[i] for i in moved)
        after = buffers.tensors()
        for i in moved | expected:
            if after[i] is not None:
                seen[i] = before.get(i)

    @contextlib.contextmanager
    def _recompute(self, seen: dict):
        tensors = self.buffers.tensors()
        now = {i: tensors[i].detach().clone() for i in seen if tensors[i] is not None}
        with torch.no_grad():
            for i, value in seen.items():
                if value is not None and tensors[i] is not None:
                    tensors[i].copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                after = self.buffers.tensors()
                for i, value in now.items():
                    if after[i] is not None:
                        after[i].copy_(value)


class CheckpointedForward:
    """A checkpointed block's ``forward``: the instance attribute that
    :func:`~lightning_memguard.mitigations.checkpointing.checkpoint_module` sets
    (:func:`~lightning_memguard.base.wrapping.wrap_method`).

    An object, not a closure: a deep copy of the model (an EMA copy, a copy to estimate on) then gets a forward that
    runs its own block rather than the original's, and the model still pickles.

    Args:
        module: the block.
        inner: the forward it checkpoints (public, read-only): the one the user set on the instance, or the class's
            forward bound to the block.
        context: a context manager factory the forward and its recomputation run in, or ``None``.
    """

    def __init__(self, module: nn.Module, inner: Callable,
                 context: Optional[Callable[[], ContextManager]]) -> None:
        self.module = module
        self.inner = inner
        self.context = context
        self.cache_free = CacheFreeCall(module, inner)
        self.running = RecomputationBuffers(module)

    def _run(self, *args, **kwargs):
        if self.context is None:
            return self.inner(*args, **kwargs)
        with self.context():
            return self.inner(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        if self.module.training and torch.is_grad_enabled():
            args, kwargs = self.cache_free(args, kwargs)
            # keyword arguments through partial: a block's own `context_fn=` or `debug=` is not checkpoint's
            return checkpoint(functools.partial(self._run, **kwargs), *args, use_reentrant=False,
                              context_fn=self.running.contexts if self.running.buffers.slots else noop_context_fn)
        return self._run(*args, **kwargs)
