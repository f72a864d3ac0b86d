"""Blocks a model checkpoints itself, recomputed in the estimate under the kernel model their forward ran under.

diffusers' ``enable_gradient_checkpointing()`` and transformers' ``gradient_checkpointing_enable()`` call
``torch.utils.checkpoint.checkpoint`` inside the model's forward. On meta the forward runs under a kernel model (a
``TorchFunctionMode``: the target's attention kernel, emulated autocast), but the recomputation runs in the backward,
where torch function modes are not active: it ran meta's own kernels (the math attention path for a fused kernel,
fp32 for emulated bf16), saved other tensors than the forward had, and torch's checkpoint raised (``CheckpointError``:
"different metadata", "a different number of tensors") or a convolution refused its mixed dtypes — so no estimate at
all of a model trained with its own gradient checkpointing, on meta or for CUDA.

:func:`recomputed_under` makes every checkpoint started inside it recompute under a given context: a non-reentrant one
(``use_reentrant=False``, both libraries' default) gets it added to its ``context_fn``'s recomputation context, a
reentrant one runs its backward in it. It reaches into ``torch.utils.checkpoint`` (the generator the non-reentrant
checkpoint is made by, the reentrant ``CheckpointFunction``); where those are not found, nothing is changed (the
estimate is then as before). MemGuard's own checkpointed blocks pass their context themselves
(:mod:`~lightning_memguard.mitigations.checkpointed_call`); the context given here is one that does nothing where a
mode is already active (``CudaKernelMode.outside_only``), so entering it twice is harmless.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager, Iterator

import torch.utils.checkpoint as torch_checkpoint

__all__ = ["recomputed_under"]

_GENERATOR = "_checkpoint_without_reentrant_generator"
_REENTRANT = "CheckpointFunction"


@contextlib.contextmanager
def recomputed_under(context: Callable[[], ContextManager]) -> Iterator[None]:
    """Inside, a checkpoint the model starts recomputes under ``context()`` (a fresh one per recomputation)."""
    generator = getattr(torch_checkpoint, _GENERATOR, None)
    reentrant = getattr(torch_checkpoint, _REENTRANT, None)
    patched = []
    if callable(generator):
        setattr(torch_checkpoint, _GENERATOR, _with_recompute_context(generator, context))
        patched.append((_GENERATOR, generator))
    if isinstance(reentrant, type) and hasattr(reentrant, "backward"):
        setattr(torch_checkpoint, _REENTRANT, _reentrant_under(reentrant, context))
        patched.append((_REENTRANT, reentrant))
    try:
        yield
    finally:
        for name, original in patched:
            setattr(torch_checkpoint, name, original)


def _with_recompute_context(generator: Callable, context: Callable[[], ContextManager]) -> Callable:
    noop = getattr(torch_checkpoint, "noop_context_fn", None)

    @functools.wraps(generator)
    def wrapped(fn, preserve_rng_state=True, context_fn=noop, *args, **kwargs):
        # debug takes no context_fn of its own (args: determinism_check, debug, early_stop, then fn's)
        if getattr(torch_checkpoint, "_checkpoint_debug_enabled", None) or (len(args) > 1 and args[1] is True):
            return generator(fn, preserve_rng_state, context_fn, *args, **kwargs)
        own = context_fn

        def composed():
            forward, recompute = own() if own is not None else (contextlib.nullcontext(), contextlib.nullcontext())
            return forward, _both(recompute, context)

        return generator(fn, preserve_rng_state, composed, *args, **kwargs)

    return wrapped


@contextlib.contextmanager
def _both(first: ContextManager, second: Callable[[], ContextManager]) -> Iterator[None]:
    with first, second():
        yield


def _reentrant_under(function: type, context: Callable[[], ContextManager]) -> type:
    class ReentrantUnder(function):  # type: ignore[misc, valid-type]
        @staticmethod
        def backward(ctx, *grads):
            with context():
                return function.backward(ctx, *grads)

    ReentrantUnder.__name__ = ReentrantUnder.__qualname__ = function.__name__
    return ReentrantUnder
