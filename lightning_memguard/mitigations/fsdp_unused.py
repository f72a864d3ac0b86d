"""Micro-batches under FSDP2 reduce-scatter the same parameters on every rank (torch only).

Under FSDP2 every micro-batch's backward reduce-scatters each parameter group's gradients, and a group builds its
reduce-scatter from the parameters that received a gradient in that backward. A parameter the whole batch reaches
but a part does not (a task's head chosen per sample, an expert no token of the part is routed to) leaves that rank's
reduce-scatter without it while another rank's has it: the ranks' buffers no longer line up, and the gradients of
different parameters are summed together without an error (two heads of one shape trained on each other's gradients
in a 2-rank test). Plain FSDP2 on the same batches is right: each rank's whole batch reached both. torch's own switch
for this, ``FSDPModule.set_reduce_scatter_unused_params``, has each group reduce a zero for every parameter without a
gradient; it is on for the steps that run split only, and put back after (a whole step reduces as the user set it).
The cost: a parameter no rank's batch reaches in a split step ends it with a zero gradient, not ``None``.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ..base.sharding import fsdp2_modules

__all__ = ["UnusedReduced"]


def _switched_on(module: nn.Module) -> bool:
    """Whether every parameter group of ``module`` (an FSDPModule) already reduces unused parameters (the user set
    it); torch has no getter, so its groups are read, and anything unexpected counts as not."""
    try:
        groups = module._get_fsdp_state()._fsdp_param_groups
        return bool(groups) and all(group.reduce_scatter_unused_params for group in groups)
    except Exception:
        return False


class UnusedReduced:
    """The FSDP2 modules of one model, whose groups reduce a zero for each parameter without a gradient while the
    step in progress runs split (:meth:`split`)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self._modules = modules
        self._switched: list[nn.Module] = []  # the modules this object turned on, turned off again by it

    @classmethod
    def of(cls, module: Optional[nn.Module]) -> Optional["UnusedReduced"]:
        """For a model with FSDP2 modules whose torch has the switch; else ``None``."""
        modules = [m for _, m in fsdp2_modules(module)]
        # torch older than about 2.9 has FSDP2 without the switch: nothing to switch, the old behaviour
        return cls(modules) if modules and hasattr(modules[0], "set_reduce_scatter_unused_params") else None

    def split(self, parts: int) -> None:
        """The step in progress runs in ``parts``: on for more than one, else back to how it was."""
        if parts > 1 and not self._switched:
            self._switched = [m for m in self._modules if not _switched_on(m)]
            for module in self._switched:
                module.set_reduce_scatter_unused_params(True, recurse=False)
        elif parts <= 1:
            self.restore()

    def restore(self) -> None:
        """Every module as it was before the split step (idempotent)."""
        for module in self._switched:
            module.set_reduce_scatter_unused_params(False, recurse=False)
        self._switched = []
