"""Whether a module's parameters are sharded across ranks, read from the parameters alone (torch only)."""

from __future__ import annotations

from typing import Optional

from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["sharding_of"]


def sharding_of(module: nn.Module) -> Optional[tuple[str, int]]:
    """``("fsdp", ranks)`` for a module whose parameters are DTensors (FSDP2's ``fully_shard``, sharded over a mesh of
    ``ranks``), else ``None``."""
    for param in module.parameters():
        mesh = getattr(param, "device_mesh", None)
        if is_traceable_wrapper_subclass(param) and mesh is not None:
            return "fsdp", int(mesh.size())
    return None
