"""Activation checkpointing of repeated blocks, switched on and off at run time.

A block is checkpointed by giving the instance a ``forward`` attribute that runs the class's forward under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. Parameter objects, names, ``state_dict`` keys
and module types stay as they are (unlike wrapping the module), gradients are identical, and deleting the attribute
undoes it.

What a block's forward does besides computing its output must not happen twice when backward recomputes it:

- caches: a block given a key/value cache (``past_key_values``, ``past_key_value``, ``layer_past``, a transformers
  ``Cache`` under any name) would append its keys and values again. In training with gradients on, the
  checkpointed call gets no cache and ``use_cache=False``, as transformers' own checkpointing layer does;
- running statistics: BatchNorm (any module updating buffers in place) would update its running mean, variance
  and ``num_batches_tracked`` again. The recomputation puts back what it changed (see :class:`_RunningBuffers`).

Blocks the model already checkpoints itself (transformers' ``gradient_checkpointing_enable()``, torch's
``checkpoint_wrapper``) are left to it. A model compiled with ``torch.compile`` cannot be checkpointed from outside
(see :func:`compiled_reason`). Nothing here imports transformers: it is recognised by class names.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from typing import Any, Callable, ContextManager, Iterable, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

BlockSpec = Union[None, Iterable[type], Callable[[str, nn.Module], bool]]

_MARK = "_memguard_checkpointed"  # the attribute that tells a forward set by checkpoint_module
#: the names transformers (and models written like it) give a block's key/value cache argument
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")


def validate_block_spec(blocks: BlockSpec) -> BlockSpec:
    """Checks a ``blocks=`` argument: ``None``, a (name, module) predicate, or a non-empty set of module classes.

    Raises:
        ValueError: naming the value and what is allowed.
    """
    if blocks is None or (callable(blocks) and not isinstance(blocks, type)):
        return blocks
    try:
        classes = (blocks,) if isinstance(blocks, type) else tuple(blocks)
    except TypeError:
        classes = ()
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise ValueError(f"blocks={blocks!r} must be None, a non-empty set of nn.Module classes, or a "
                         "(name, module) -> bool predicate")
    return classes


def find_blocks(model: nn.Module, blocks: BlockSpec = None) -> list[tuple[str, nn.Module]]:
    """The blocks worth checkpointing, as ``(qualified name, module)``.

    Args:
        model: the model to search.
        blocks: ``None`` to detect them: every ``nn.ModuleList``/``nn.Sequential`` whose children (at least two) are
            all of one class that itself has submodules — transformer layers, residual blocks. All such stacks
            count (an encoder-decoder has two), stacks inside a found block are skipped. Or a set of module classes,
            or a predicate ``(name, module) -> bool``.

    Blocks the model checkpoints itself (:func:`checkpoints_itself`) are left out. The result interleaves the stacks
    (first block of each stack, then the second, ...) so that taking the first k spreads checkpointing over all
    stacks.
    """
    return [(name, module) for name, module in _candidate_blocks(model, blocks)
            if not checkpoints_itself(model, name)]


def _candidate_blocks(model: nn.Module, blocks: BlockSpec) -> list[tuple[str, nn.Module]]:
    spec = validate_block_spec(blocks)
    if spec is None:
        stacks = _repeated_stacks(model)
    else:
        if isinstance(spec, tuple):
            match = lambda name, module: isinstance(module, spec)  # noqa: E731
        else:
            match = spec
        found = [(name, module) for name, module in model.named_modules() if name and match(name, module)]
        # a matched block inside another matched block would be checkpointed twice
        stacks = [[(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found if o != n)]]
    interleaved = []
    for position in range(max((len(s) for s in stacks), default=0)):
        interleaved += [stack[position] for stack in stacks if position < len(stack)]
    return interleaved


def _repeated_stacks(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    stacks: list[list[tuple[str, nn.Module]]] = []
    taken: list[str] = []
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or any(name.startswith(t + ".") for t in taken):
            continue
        children = list(container.named_children())
        # a layer the model wraps in torch's CheckpointWrapper is still one of the stack (it is left to the model)
        classes = {type(getattr(child, "_checkpoint_wrapped_module", child)) for _, child in children}
        if len(children) < 2 or len(classes) != 1 or not any(True for _ in children[0][1].children()):
            continue
        prefix = f"{name}." if name else ""
        stacks.append([(prefix + child_name, child) for child_name, child in children])
        taken += [prefix + child_name for child_name, _ in children]
    return stacks


# --- what the model does itself ----------------------------------------------------------------------------------

def _class_names(module: Any) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def _own_checkpoint_wrapper(module: nn.Module) -> bool:
    """torch's ``checkpoint_wrapper`` (a ``CheckpointWrapper`` module) or composable ``checkpoint(module)``."""
    if "CheckpointWrapper" in _class_names(module):
        return True
    contract = sys.modules.get("torch.distributed._composable.contract")
    try:
        registry = contract._get_registry(module) if contract is not None else None
    except Exception:  # a private API: if it changed, this way of checkpointing is simply not recognised
        registry = None
    return bool(registry) and "checkpoint" in registry


def checkpoints_itself(model: nn.Module, name: str) -> bool:
    """Whether the model checkpoints its submodule ``name`` by its own mechanism.

    That is: the block or one of its ancestors is a torch ``CheckpointWrapper`` (or carries composable
    ``checkpoint``); or transformers' flag says so. A block with its own ``gradient_checkpointing`` flag (transformers'
    ``GradientCheckpointingLayer``) checkpoints exactly when it is ``True`` — ``every_n_layers`` sets it on some layers
    only, while the containing model's flag is ``True``. A block without one is checkpointed by the layer loop of an
    ancestor whose flag is ``True`` (older transformers versions).
    """
    module = model.get_submodule(name)
    parts = name.split(".") if name else []
    ancestors = [model.get_submodule(".".join(parts[:i])) for i in range(len(parts))]
    if any(_own_checkpoint_wrapper(m) for m in [module, *ancestors]):
        return True
    if hasattr(module, "gradient_checkpointing"):
        return getattr(module, "gradient_checkpointing", False) is True
    return any(getattr(m, "gradient_checkpointing", False) is True for m in ancestors)


def compiled_reason(model: nn.Module) -> Optional[str]:
    """Why the blocks of ``model`` cannot be checkpointed from outside because it is compiled, or ``None``.

    A ``torch.compile``d model (an ``OptimizedModule`` at the top or among the submodules, or a module compiled in
    place by ``module.compile()``) traced its blocks' forwards when it compiled: a forward replaced afterwards is
    either never called (the compiled graph runs) or makes dynamo recompile at every level change, with the
    checkpoint, its recomputation context and the cache handling traced into a new graph. Checkpointing inside a
    compiled region is the compiler's business: blocks checkpointed before compiling (or the model's own gradient
    checkpointing) are traced as such.
    """
    for _, module in model.named_modules():
        if "OptimizedModule" in _class_names(module) or getattr(module, "_compiled_call_impl", None) is not None:
            return ("the model is compiled with torch.compile; checkpoint its blocks before compiling, or use the "
                    "model's own gradient checkpointing")
    return None


# --- the checkpointed call ---------------------------------------------------------------------------------------

def _is_transformers_cache(value: Any) -> bool:
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers") for cls in type(value).__mro__)


class _CacheFreeCall:
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
        names = _class_names(module)
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
            if parameter.kind in positional and parameter.name in (*_CACHE_ARGUMENTS, "use_cache"):
                self.positions[parameter.name] = index

    def __call__(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        if not self.keep_cache:
            for name in _CACHE_ARGUMENTS:
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


class _RunningBuffers:
    """Keeps a checkpointed block's recomputation from updating its running buffers (BatchNorm's running mean and
    variance, ``num_batches_tracked``) a second time.

    Which buffers a forward changes: those of modules keeping running statistics in training mode
    (``track_running_stats``: BatchNorm, InstanceNorm), and those whose ``_version`` counter the forward moved —
    with the other buffers of the same module, since a kernel may update a buffer without moving its counter
    (``batch_norm`` updates ``running_mean`` so; only ``num_batches_tracked`` moves). The recomputation saves those
    buffers (their values now), starts from the values the forward saw, and puts the saved values back when it
    ends. Values are copied at the forward for the statistics modules and for buffers an earlier forward was seen
    to change. So nothing is copied for a block whose forward changes no buffer, and big constant buffers (causal
    masks) never are. The price: a buffer that a forward both reads and changes, other than running statistics (a
    spectral norm's power-iteration vectors), is seen changed by the recomputation of the block's first checkpointed
    forward; from the second on, the recomputation sees what the forward saw.
    """

    #: per block, the buffers its earlier forwards changed (kept while the rung switches the block off and on)
    _learned: "weakref.WeakKeyDictionary[nn.Module, set[str]]" = weakref.WeakKeyDictionary()

    def __init__(self, module: nn.Module) -> None:
        # The block's buffers as (owner, attribute), taken when the block is checkpointed: a call reads them through
        # the owner (a buffer replaced by assignment is the new one) without walking the module tree again.
        self.slots = [(owner, key) for _, owner in module.named_modules() for key in owner._buffers]
        self.names = [f"{prefix}.{key}" if prefix else key for prefix, owner in module.named_modules()
                      for key in owner._buffers]
        self.statistics = [i for i, (owner, _) in enumerate(self.slots)
                           if getattr(owner, "track_running_stats", False) is True]
        self.changing = self._learned.setdefault(module, set())

    def contexts(self) -> tuple[ContextManager, ContextManager]:
        """The forward's and the recomputation's context for one checkpointed call (``context_fn`` of
        :func:`torch.utils.checkpoint.checkpoint`)."""
        seen: dict[int, Optional[torch.Tensor]] = {}  # this call: slots its forward changed -> value before (or None)
        return self._forward(seen), self._recompute(seen)

    def _tensors(self) -> list[Optional[torch.Tensor]]:
        return [owner._buffers.get(key) for owner, key in self.slots]

    @contextlib.contextmanager
    def _forward(self, seen: dict):
        tensors = self._tensors()
        versions = [None if t is None else t._version for t in tensors]
        expected = {i for i, name in enumerate(self.names) if name in self.changing}
        expected |= {i for i in self.statistics if self.slots[i][0].training}
        before = {i: tensors[i].detach().clone() for i in expected if tensors[i] is not None}
        yield
        after = self._tensors()
        moved = {i for i, t in enumerate(after)
                 if t is not None and (t is not tensors[i] or t._version != versions[i])}
        owners = {id(self.slots[i][0]) for i in moved}
        moved |= {i for i, (owner, _) in enumerate(self.slots) if id(owner) in owners}
        self.changing.update(self.names[i] for i in moved)
        for i in moved | expected:
            if after[i] is not None:
                seen[i] = before.get(i)

    @contextlib.contextmanager
    def _recompute(self, seen: dict):
        tensors = self._tensors()
        now = {i: tensors[i].detach().clone() for i in seen if tensors[i] is not None}
        with torch.no_grad():
            for i, value in seen.items():
                if value is not None and tensors[i] is not None:
                    tensors[i].copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                after = self._tensors()
                for i, value in now.items():
                    if after[i] is not None:
                        after[i].copy_(value)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether MemGuard checkpoints ``module`` (:func:`checkpoint_module`)."""
    return getattr(module.__dict__.get("forward"), _MARK, False)


class _CheckpointedForward:
    """A checkpointed block's ``forward`` (the instance attribute :func:`checkpoint_module` sets).

    An object, not a closure: a deep copy of the model (an EMA copy, a copy to estimate on) then gets a forward that
    runs its own block rather than the original's, and the model still pickles."""

    _memguard_checkpointed = True

    def __init__(self, module: nn.Module, context: Optional[Callable[[], ContextManager]]) -> None:
        self.module = module
        self._memguard_previous = module.__dict__.get("forward")  # a forward the user set on the instance, or None
        self._memguard_inner = module.forward  # that one, or the class's forward bound to the module
        self.context = context
        self.cache_free = _CacheFreeCall(module, self._memguard_inner)
        self.running = _RunningBuffers(module)

    def _run(self, *args, **kwargs):
        if self.context is None:
            return self._memguard_inner(*args, **kwargs)
        with self.context():
            return self._memguard_inner(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        if self.module.training and torch.is_grad_enabled():
            args, kwargs = self.cache_free(args, kwargs)
            # keyword arguments through partial: a block's own `context_fn=` or `debug=` is not checkpoint's
            return checkpoint(functools.partial(self._run, **kwargs), *args, use_reentrant=False,
                              context_fn=self.running.contexts if self.running.slots else noop_context_fn)
        return self._run(*args, **kwargs)


def checkpoint_module(module: nn.Module, context: Optional[Callable[[], ContextManager]] = None) -> None:
    """Makes ``module`` recompute its activations in backward instead of keeping them. Idempotent.

    In training with gradients on, the call runs without its key/value cache (:class:`_CacheFreeCall`) and the
    recomputation leaves running buffers as the forward left them (:class:`_RunningBuffers`); otherwise the
    forward runs as it is. ``context``, if given, makes the context manager the forward and its recomputation run in
    (the estimate runs a recomputation on meta under the same kernel model as the forward)."""
    if not is_checkpointed(module):
        module.forward = _CheckpointedForward(module, context)


def uncheckpoint_module(module: nn.Module) -> None:
    """Undoes :func:`checkpoint_module`."""
    current = module.__dict__.get("forward")
    if not getattr(current, _MARK, False):
        return
    previous = current._memguard_previous
    if previous is None:
        del module.forward
    else:
        module.forward = previous


class ActivationCheckpointing:
    """The checkpointing rung: level k checkpoints the first k blocks of :func:`find_blocks`.

    Blocks the model checkpoints itself are not among them (``own_checkpointed`` names them); when that is all of
    them, or the model is compiled (:func:`compiled_reason`), :meth:`unavailable_reason` says why the rung is off.

    Raises:
        ValueError: if no block is found (name the classes with ``blocks=`` then).
    """

    name = "checkpointing"
    safe_mid_step = True  # takes effect on the next forward call

    def __init__(self, model: nn.Module, blocks: BlockSpec = None,
                 context: Optional[Callable[[], ContextManager]] = None) -> None:
        candidates = _candidate_blocks(model, blocks)
        self.context = context
        if not candidates:
            raise ValueError(
                f"no blocks to checkpoint in {type(model).__name__} (blocks={blocks!r}); pass blocks= as module "
                "classes or a (name, module) predicate, or leave 'checkpointing' out of mitigations")
        own = {name for name, _ in candidates if checkpoints_itself(model, name)}
        #: the found blocks the model checkpoints itself, left to it
        self.own_checkpointed = [name for name, _ in candidates if name in own]
        self.blocks = [(name, module) for name, module in candidates if name not in own]
        self.model = model
        # a model that comes back from an earlier fit may still have checkpointed blocks: start from them
        self.level = 0
        self.set_level(sum(is_checkpointed(module) for _, module in self.blocks))

    @property
    def max_level(self) -> int:
        return len(self.blocks)

    def set_level(self, level: int) -> None:
        if not 0 <= level <= self.max_level:
            raise ValueError(f"level={level} must be in [0, {self.max_level}]")
        for index, (_, module) in enumerate(self.blocks):
            if index < level:
                checkpoint_module(module, self.context)
            else:
                uncheckpoint_module(module)
        self.level = level

    def checkpointed_names(self) -> list[str]:
        return [name for name, module in self.blocks if is_checkpointed(module)]

    def unavailable_reason(self) -> Optional[str]:
        """Why this rung cannot act on the model, or ``None``: the model is compiled, or it checkpoints all the
        blocks itself."""
        compiled = compiled_reason(self.model)  # now, not at construction: a model may be compiled in between
        if compiled:
            return compiled
        if not self.blocks:
            return (f"the model checkpoints its blocks itself ({len(self.own_checkpointed)} of them, e.g. "
                    f"{self.own_checkpointed[0]}: transformers' gradient checkpointing or torch's checkpoint_wrapper)")
        return None
