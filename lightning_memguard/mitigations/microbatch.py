"""The micro-batch rung: run the batch of one optimizer step as k smaller micro-batches, so that only one micro-batch's
activations are alive at a time, while the optimizer still sees the whole batch's gradient.

Level L means k = 2**L micro-batches (capped at the batch size). Each micro-loss is weighted by its share of the
batch, the convention of gradient accumulation: for a loss that is a mean over the batch the summed gradients equal
the whole batch's. What the rung only describes is here; the training loop that runs the micro-batches belongs to
the framework adapter (:mod:`lightning_memguard.rescue` for Lightning). Framework-free.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["MicroBatching", "batch_size_of", "split_batch"]

#: A level past any real batch (2**16 micro-batches); the rung caps it at the batch size once it has seen a batch.
_UNKNOWN_MAX_LEVEL = 16


def batch_size_of(batch: Any) -> Optional[int]:
    """The leading size of the batch's first tensor leaf (the sample dimension), or ``None`` if it has none."""
    leaves, _ = tree_flatten(batch)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def split_batch(batch: Any, k: int) -> list[tuple[Any, float]]:
    """Splits every tensor leaf whose leading size is the batch size into ``k`` nearly equal parts (other leaves go
    whole into every part). Returns ``(micro_batch, share of the batch)`` pairs; the shares add up to 1.

    Raises:
        ValueError: the batch has no tensor leaf with a sample dimension to split.
    """
    size = batch_size_of(batch)
    if size is None:
        raise ValueError(f"a batch of type {type(batch).__name__} has no tensor with a sample dimension to split")
    k = max(1, min(k, size))
    leaves, spec = tree_flatten(batch)
    parts = [torch.tensor_split(leaf, k) if _splits(leaf, size) else None for leaf in leaves]
    chunks = []
    for i in range(k):
        micro = [part[i] if part is not None else leaf for leaf, part in zip(leaves, parts)]
        share = next(p[i].shape[0] for p in parts if p is not None) / size
        chunks.append((tree_unflatten(micro, spec), share))
    return chunks


def _splits(leaf: Any, size: int) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == size


class MicroBatching:
    """Level L runs each batch as ``2**L`` micro-batches inside one optimizer step; level 0 runs it whole.

    Args:
        module: the model (to say when BatchNorm layers will see smaller batches).
        automatic_optimization: the framework runs forward and backward for us (micro-batching needs to split them).
    """

    name = "microbatch"
    safe_mid_step = True  # a retried batch runs from its first micro-batch, after the gradients were zeroed

    def __init__(self, module: nn.Module, automatic_optimization: bool = True) -> None:
        self.module = module
        self.automatic_optimization = automatic_optimization
        self.level = 0
        self.max_level = _UNKNOWN_MAX_LEVEL
        self.splittable = True
        self.notices: list[str] = []

    def unavailable_reason(self) -> Optional[str]:
        if not self.automatic_optimization:
            return "it needs automatic optimization (the training loop must run forward and backward)"
        return None

    def observe_batch(self, batch: Any) -> None:
        """Learns the batch size from a batch: the top level becomes the one whose micro-batches hold one sample."""
        size = batch_size_of(batch)
        self.splittable = size is not None
        if size is not None:
            self.max_level = max(1, math.ceil(math.log2(size))) if size > 1 else 0

    @property
    def micro_batches(self) -> int:
        return self.micro_batches_at(self.level)

    @staticmethod
    def micro_batches_at(level: int) -> int:
        """How many micro-batches level ``level`` runs a batch as (before the cap at the batch size)."""
        return 2**level if level else 1

    def set_level(self, level: int) -> None:
        if not 0 <= level <= _UNKNOWN_MAX_LEVEL:
            raise ValueError(f"level={level} must be in [0, {_UNKNOWN_MAX_LEVEL}]")
        if level and not self.level:
            self.notices = self._caveats()
        self.level = level

    def _caveats(self) -> list[str]:
        notes = ["micro-batching weights each micro-batch's loss by its share of the batch, which is exact for a "
                 "loss that is a mean over the batch; a summed loss or one that couples samples (contrastive, "
                 "ranking) changes"]
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.module.modules()):
            notes.append("the model has BatchNorm layers: their statistics are now taken over each micro-batch, not "
                         "the whole batch")
        return notes
