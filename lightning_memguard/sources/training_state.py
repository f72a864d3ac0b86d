"""The tensors a training run keeps across steps, and their bytes."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from ..base.optimizer_step import zero_redundancy_ranks
from ..base.sharding import sharding_of
from .cpu import optimizer_state_tensors, storage_bytes

__all__ = ["training_state_tensors", "training_state_bytes"]


def training_state_tensors(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    """Tensors that live across steps: parameters, their gradients, buffers and optimizer state."""
    for param in module.parameters():
        yield param
        if param.grad is not None:
            yield param.grad
    yield from module.buffers()
    yield from optimizer_state_tensors(optimizers)


def training_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimizer state (each storage once); for a model FSDP2 shards, this
    rank's, with the ranks it is sharded over as ``sharded_over``; where a ``ZeroRedundancyOptimizer`` shards the
    optimizer state, the ranks it does over as ``state_sharded_over``."""
    params, optimizers = list(module.parameters()), list(optimizers)
    sharding, state_ranks = sharding_of(module), zero_redundancy_ranks(optimizers)
    return {"parameters": storage_bytes(params), "gradients": storage_bytes(p.grad for p in params),
            "optimizer_state": storage_bytes(optimizer_state_tensors(optimizers)),
            **({"sharded_over": sharding[1]} if sharding is not None else {}),
            **({"state_sharded_over": state_ranks} if state_ranks else {})}
