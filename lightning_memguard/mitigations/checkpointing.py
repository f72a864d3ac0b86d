"""Activation checkpointing of repeated blocks, switched on and off at run time.

A block is checkpointed by giving the instance a ``forward`` attribute that runs the class's forward under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. Parameter objects, names, ``state_dict`` keys
and module types stay as they are (unlike wrapping the module), gradients are identical, and deleting the attribute
undoes it.
"""

from __future__ import annotations

from typing import Callable, ContextManager, Iterable, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

BlockSpec = Union[None, Iterable[type], Callable[[str, nn.Module], bool]]

_MARK = "_memguard_checkpointed"


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

    The result interleaves the stacks (first block of each stack, then the second, ...) so that taking the first k
    spreads checkpointing over all stacks.
    """
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
        classes = {type(child) for _, child in children}
        if len(children) < 2 or len(classes) != 1 or not any(True for _ in children[0][1].children()):
            continue
        prefix = f"{name}." if name else ""
        stacks.append([(prefix + child_name, child) for child_name, child in children])
        taken += [prefix + child_name for child_name, _ in children]
    return stacks


def is_checkpointed(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), _MARK, False)


def checkpoint_module(module: nn.Module, context: Optional[Callable[[], ContextManager]] = None) -> None:
    """Makes ``module`` recompute its activations in backward instead of keeping them. Idempotent.

    ``context``, if given, makes the context manager the forward and its recomputation run in (the estimate runs a
    recomputation on meta under the same kernel model as the forward)."""
    if is_checkpointed(module):
        return
    inner = module.forward  # the class's forward, or a forward the user set on the instance
    if context is not None:
        bare = inner

        def inner(*args, **kwargs):
            with context():
                return bare(*args, **kwargs)

    def forward(*args, **kwargs):
        if module.training and torch.is_grad_enabled():
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    setattr(forward, _MARK, True)
    forward._memguard_inner = inner
    previous = module.__dict__.get("forward")
    forward._memguard_previous = previous
    module.forward = forward


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

    Raises:
        ValueError: if no block is found (name the classes with ``blocks=`` then).
    """

    name = "checkpointing"
    safe_mid_step = True  # takes effect on the next forward call

    def __init__(self, model: nn.Module, blocks: BlockSpec = None,
                 context: Optional[Callable[[], ContextManager]] = None) -> None:
        self.blocks = find_blocks(model, blocks)
        self.context = context
        if not self.blocks:
            raise ValueError(
                f"no blocks to checkpoint in {type(model).__name__} (blocks={blocks!r}); pass blocks= as module "
                "classes or a (name, module) predicate, or leave 'checkpointing' out of mitigations")
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
        return None
