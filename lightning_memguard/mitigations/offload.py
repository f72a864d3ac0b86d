"""The offload rung: keep the activations saved for backward in pinned CPU memory instead of on the GPU.

``torch.autograd.graph.save_on_cpu`` moves every tensor autograd saves during the forward to the host and brings it
back for the backward: GPU memory for PCIe traffic. It is the last resort after checkpointing, for when even
recomputing every block leaves too much alive. The forward runs under it by giving the LightningModule instance a
``training_step`` attribute, so deleting the attribute undoes it; a module without a ``training_step`` (the model of a
plain or Fabric loop, whose forward the user's loss function calls) cannot take the rung.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import nn

from ..base.wrapping import unwrap_method, wrap_method, wrapper_of
from .rung import BuiltinRung

KIND = "offload"  # the kind of wrapper on training_step (base/wrapping.py)


class ActivationOffload(BuiltinRung):
    """Level 1 runs ``training_step`` under ``save_on_cpu(pin_memory=True)``; level 0 restores it.

    Args:
        module: the LightningModule (anything with a ``training_step``; without one the rung is unavailable).
        device_type: where training runs. On CPU the rung is unavailable: saved tensors are in host memory already
            (and ``save_on_cpu`` would copy them).
    """

    name = "offload"
    max_level = 1
    safe_mid_step = True  # takes effect at the next forward; a failed forward is re-run from the start

    def __init__(self, module: nn.Module, device_type: str) -> None:
        self.module = module
        self.device_type = device_type
        self.level = 1 if wrapper_of(module, "training_step", KIND) is not None else 0

    def unavailable_reason(self) -> Optional[str]:
        """Why this rung cannot act in this run (what it needs and is missing), or ``None``."""
        if not callable(getattr(self.module, "training_step", None)):
            return (f"it runs a LightningModule's training_step under save_on_cpu, and {type(self.module).__name__} "
                    "has no training_step (a plain or Fabric loop calls the model from its own loss function)")
        if self.device_type != "cuda":
            return f"on {self.device_type} the saved activations are in host memory already"
        return None

    def set_level(self, level: int) -> None:
        if level not in (0, 1):
            raise ValueError(f"level={level} must be 0 or 1")
        if level:
            wrap_method(self.module, "training_step", KIND, _under_save_on_cpu)
        else:
            unwrap_method(self.module, "training_step", KIND)
        self.level = level


def _under_save_on_cpu(inner: Callable) -> Callable:
    # Lightning reads the step's signature at every batch (does it take batch_idx? dataloader_iter?): the wrapper's
    # is the step's, or a training_step(self, batch) would be handed an index it does not take
    @functools.wraps(inner)
    def training_step(*args, **kwargs):
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return inner(*args, **kwargs)

    return training_step
