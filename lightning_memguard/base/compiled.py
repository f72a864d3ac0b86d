"""Where a module holds code compiled by ``torch.compile``: one answer for the CPU accountant (whose counting cannot
see compiled kernels' buffers), the tensor diff and the checkpointing rung (which cannot checkpoint compiled code from
outside). Framework-free."""

from __future__ import annotations

import sys
from typing import Callable, Iterator

from torch import nn

__all__ = ["compiled_code", "compiled_methods"]


def compiled_code(module: nn.Module) -> list[str]:
    """Where ``module`` holds code compiled by ``torch.compile``, one description per place (empty: none found):
    the module or a submodule wrapped by ``torch.compile(module)``, compiled in place by ``module.compile()``, or
    with methods replaced by compiled functions (``trainer.fit(torch.compile(lightning_module))`` does that to
    ``forward``, ``training_step``, ...). A function compiled inside ``forward`` cannot be seen from outside."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # torch.compile imports it: nothing was compiled (and importing it costs seconds)
        return []
    found = []
    for name, sub in module.named_modules():
        where = name or type(getattr(module, "_orig_mod", module)).__name__  # torch.compile(m) is named as m
        if isinstance(sub, eval_frame.OptimizedModule):
            found.append(f"{where} (torch.compile(module))")
        elif getattr(sub, "_compiled_call_impl", None) is not None:
            found.append(f"{where} (module.compile())")
        else:
            methods = sorted(attr for attr, _ in compiled_methods(sub))
            if methods:
                found.append(f"{where} (compiled {', '.join(methods)})")
    return found


def compiled_methods(module: nn.Module) -> Iterator[tuple[str, Callable]]:
    """The instance attributes of ``module`` (not of its submodules) that are compiled functions."""
    for attr, value in vars(module).items():
        if callable(value) and hasattr(value, "_torchdynamo_orig_callable"):
            yield attr, value
