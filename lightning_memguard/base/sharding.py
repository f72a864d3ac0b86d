"""How a module is spread over ranks, read from the module alone (torch only): its parameters sharded (FSDP2), or
the module replicated on every rank (DistributedDataParallel)."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["data_parallel_of", "sharding_of"]


def sharding_of(module: nn.Module) -> Optional[tuple[str, int]]:
    """``("fsdp", ranks)`` for a module whose parameters are DTensors (FSDP2's ``fully_shard``, sharded over a mesh of
    ``ranks``), else ``None``."""
    for param in module.parameters():
        mesh = getattr(param, "device_mesh", None)
        if is_traceable_wrapper_subclass(param) and mesh is not None:
            return "fsdp", int(mesh.size())
    return None


def data_parallel_of(module: Optional[nn.Module]) -> Optional[tuple[str, int]]:
    """``("ddp", ranks)`` for a DistributedDataParallel module (a replica on each of ``ranks``, with its gradient
    buckets), ``("fsdp", ranks)`` for one FSDP2 shards (:func:`sharding_of`), else ``None``: how an estimate of one
    rank's step (:func:`~lightning_memguard.estimate_memory`'s ``strategy``, ``world_size``) must see the module the
    front door trains through."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        group = getattr(module, "process_group", None)
        return "ddp", dist.get_world_size(group) if dist.is_initialized() else 1
    return sharding_of(module) if module is not None else None
