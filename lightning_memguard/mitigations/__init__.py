"""Reversible remedies applied between optimizer steps. Each is a plain object with ``max_level``, ``level`` and
``set_level``; only :mod:`~lightning_memguard.mitigations.amp` knows Lightning."""

from .checkpointing import ActivationCheckpointing, find_blocks
from .offload import ActivationOffload

__all__ = ["ActivationCheckpointing", "ActivationOffload", "find_blocks"]
