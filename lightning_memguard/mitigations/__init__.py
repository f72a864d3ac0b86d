"""Reversible remedies applied between optimizer steps, each a :class:`~lightning_memguard.mitigations.rung.Rung`
(``name``, ``levels``, ``apply(module, level)``; the built-ins also ``max_level``, ``level`` and ``set_level``); only
:mod:`~lightning_memguard.mitigations.amp` knows Lightning."""

from .checkpointing import ActivationCheckpointing, find_blocks
from .offload import ActivationOffload
from .rung import Rung

__all__ = ["ActivationCheckpointing", "ActivationOffload", "Rung", "find_blocks"]
