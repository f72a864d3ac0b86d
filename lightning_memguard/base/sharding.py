"""How a module is spread over ranks, read from the module alone (torch only): its parameters sharded (FSDP2), or
the module replicated on every rank (DistributedDataParallel)."""

from __future__ import annotations

import sys
from typing import Optional

import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["data_parallel_of", "fsdp2_class", "fsdp2_modules", "sharding_of"]


def sharding_of(module: nn.Module) -> Optional[tuple[str, int]]:
    """``("fsdp", ranks)`` for a module whose parameters are DTensors (FSDP2's ``fully_shard``, sharded over a mesh of
    ``ranks``), else ``None``."""
    for param in module.parameters():
        mesh = getattr(param, "device_mesh", None)
        if is_traceable_wrapper_subclass(param) and mesh is not None:
            return "fsdp", int(mesh.size())
    return None


def fsdp2_class() -> Optional[type]:
    """torch's ``FSDPModule`` (the class ``fully_shard`` gives each module it shards) where FSDP2 has been imported in
    this process, else ``None``: no module is sharded before it is, and looking it up imports nothing."""
    return getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)


def fsdp2_modules(module: Optional[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Every module of ``module`` (itself included) sharded with FSDP2, as ``(name, module)`` the way
    ``named_modules`` names them (``""``: ``module`` itself), outermost first; ``[]`` for anything else."""
    cls = fsdp2_class()
    if cls is None or not isinstance(module, nn.Module):
        return []
    return [(name, m) for name, m in module.named_modules() if isinstance(m, cls)]


def data_parallel_of(module: Optional[nn.Module]) -> Optional[tuple[str, int]]:
    """``("ddp", ranks)`` for a DistributedDataParallel module (a replica on each of ``ranks``, with its gradient
    buckets), ``("fsdp", ranks)`` for one FSDP2 shards (:func:`sharding_of`), else ``None``: how an estimate of one
    rank's step (:func:`~lightning_memguard.estimate_memory`'s ``strategy``, ``world_size``) must see the module the
    front door trains through."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        group = getattr(module, "process_group", None)
        return "ddp", dist.get_world_size(group) if dist.is_initialized() else 1
    return sharding_of(module) if module is not None else None
