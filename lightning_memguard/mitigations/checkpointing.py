"""Activation checkpointing of repeated blocks, switched on and off at run time.

A block is checkpointed by giving the instance a ``forward`` attribute that runs the class's forward under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. Parameter objects, names, ``state_dict`` keys
and module types stay as they are (unlike wrapping the module), gradients are identical, and deleting the attribute
undoes it.

What a block's forward does besides computing its output must not happen twice when backward recomputes it:

- caches: a block given a key/value cache (``past_key_values``, ``past_key_value``, ``layer_past``, a transformers
  ``Cache`` under any name) would append its keys and values again. In training with gradients on, the
  checkpointed call gets no cache and ``use_cache=False``, as transformers' own checkpointing layer does (the
  model's own cache then lacks the checkpointed layers, as with transformers' checkpointing: training does not
  read it);
- running statistics: BatchNorm (any module updating buffers in place) would update its running mean, variance
  and ``num_batches_tracked`` again. The recomputation puts back what it changed.

How: :mod:`~lightning_memguard.mitigations.checkpointed_call`.

Blocks the model already checkpoints itself (transformers' ``gradient_checkpointing_enable()``, torch's
``checkpoint_wrapper``) are left to it. A model compiled with ``torch.compile`` cannot be checkpointed from outside
(see :func:`compiled_reason`). Nothing here imports transformers: it is recognised by class names.
"""

from __future__ import annotations

import sys
from typing import Callable, ContextManager, Iterable, Optional, Union

from torch import nn

from ..base.compiled import compiled_code
from ..base.wrapping import unwrap_method, wrap_method, wrapper_of
from .checkpointed_call import CheckpointedForward, class_names
from .rung import BuiltinRung

KIND = "checkpointing"  # the kind of wrapper on a block's forward (base/wrapping.py)
BlockSpec = Union[None, Iterable[type], Callable[[str, nn.Module], bool]]


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


def find_blocks(model: nn.Module, blocks: BlockSpec = None,
                self_checkpointed: bool = False) -> list[tuple[str, nn.Module]]:
    """The blocks worth checkpointing, as ``(qualified name, module)``.

    Args:
        model: the model to search.
        blocks: ``None`` to detect them: in every ``nn.ModuleList``/``nn.Sequential``, each run of at least two
            consecutive children of one class that itself has submodules — transformer layers, residual blocks, the
            blocks between a stem and a head. All such stacks count (an encoder-decoder has two), stacks inside a
            found block are skipped. Or a set of module classes,
            or a predicate ``(name, module) -> bool``.
        self_checkpointed: keep the blocks the model checkpoints itself too (the units FSDP shards are all the
            blocks, however they are checkpointed).

    Blocks the model checkpoints itself (:func:`checkpoints_itself`) are left out unless ``self_checkpointed``. The
    result interleaves the stacks (first block of each stack, then the second, ...) so that taking the first k
    spreads checkpointing over all stacks.
    """
    return [(name, module) for name, module in _candidate_blocks(model, blocks)
            if self_checkpointed or not checkpoints_itself(model, name)]


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
        prefix = f"{name}." if name else ""
        for run in _runs_of_one_class(list(container.named_children())):
            stacks.append([(prefix + child_name, child) for child_name, child in run])
            taken += [prefix + child_name for child_name, _ in run]
    return stacks


def _runs_of_one_class(children: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """The runs of at least two consecutive children of one class that has submodules: the whole container where its
    children are all alike (transformer layers), else each run in it (``Sequential(stem, block, block, block, head)``,
    or Wav2Vec2's convolutional feature encoder, whose first layer normalises and the others do not). A layer the
    model wraps in torch's CheckpointWrapper counts as its wrapped class (it is left to the model)."""
    runs: list[list[tuple[str, nn.Module]]] = []
    last = None
    for child_name, child in children:
        kind = type(getattr(child, "_checkpoint_wrapped_module", child))
        if kind is last and runs:
            runs[-1].append((child_name, child))
        else:
            runs.append([(child_name, child)])
        last = kind
    return [run for run in runs if len(run) >= 2 and any(True for _ in run[0][1].children())]


# --- what the model does itself ----------------------------------------------------------------------------------

def _own_checkpoint_wrapper(module: nn.Module) -> bool:
    """torch's ``checkpoint_wrapper`` (a ``CheckpointWrapper`` module) or composable ``checkpoint(module)``."""
    if "CheckpointWrapper" in class_names(module):
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
    ancestor whose flag is ``True`` (older transformers versions; diffusers, whose ``enable_gradient_checkpointing()``
    sets the flag on the blocks that hold the layers). Where such an ancestor runs some of its children outside its
    checkpoint — diffusers' ``AttnDownBlock2D`` checkpoints its ResNet blocks, not its attention layers, and a
    ``UNetMidBlock2D`` not its first ResNet block — those count as checkpointed too: what the model leaves
    uncheckpointed is not told apart without running it.
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

    Compiled means an ``OptimizedModule`` (``torch.compile(module)``) at the top or among the submodules, a module
    compiled in place by ``module.compile()``, or methods replaced by compiled functions (Lightning's
    ``trainer.fit(torch.compile(lightning_module))`` compiles ``training_step`` and ``forward`` so: a checkpointed
    block inside them made dynamo fail, "checkpoint not implemented for ... context_fn", and the ladder reverted every
    rung it had just applied). Dynamo guards on the blocks' forwards, so every level change recompiles
    (13 s for a 3-layer GPT-2 with the ``aot_eager`` backend on CPU; inductor's first compile alone took 140 s), and
    the recompute context that keeps BatchNorm statistics right is not supported in a compiled region: the recompile
    fails (``BackendCompilerFailed``) with either backend. Blocks checkpointed before compiling (or the model's own
    gradient checkpointing) are traced as such; that is the way for a compiled model.
    """
    places = compiled_code(model)
    if places:
        return (f"the model is compiled with torch.compile ({', '.join(places[:3])}); checkpoint its blocks before "
                "compiling, or use the model's own gradient checkpointing")
    return None


def is_checkpointed(module: nn.Module) -> bool:
    """Whether MemGuard checkpoints ``module`` (:func:`checkpoint_module`)."""
    return wrapper_of(module, "forward", KIND) is not None


def checkpoint_module(module: nn.Module, context: Optional[Callable[[], ContextManager]] = None) -> None:
    """Makes ``module`` recompute its activations in backward instead of keeping them. Idempotent.

    In training with gradients on, the call runs without its key/value cache and the recomputation leaves running
    buffers as the forward left them (:mod:`~lightning_memguard.mitigations.checkpointed_call`); otherwise the
    forward runs as it is. ``context``, if given, makes the context manager the forward and its recomputation run in
    (the estimate runs a recomputation on meta under the same kernel model as the forward)."""
    wrap_method(module, "forward", KIND, lambda forward: CheckpointedForward(module, forward, context))


def uncheckpoint_module(module: nn.Module) -> None:
    """Undoes :func:`checkpoint_module`: the forward the user set on the instance comes back, else the class's."""
    unwrap_method(module, "forward", KIND)


class ActivationCheckpointing(BuiltinRung):
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
                    f"{self.own_checkpointed[0]}: transformers' or diffusers' gradient checkpointing, or torch's "
                    "checkpoint_wrapper)")
        return None
