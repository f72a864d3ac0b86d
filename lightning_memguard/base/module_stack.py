"""Which of a model's modules is running its forward now (for naming where a tensor was made)."""

from __future__ import annotations

from functools import partial

from torch import nn

__all__ = ["ForwardModuleStack"]


class ForwardModuleStack:
    """The names of the modules whose forward is running, innermost last, from forward hooks on the model's own
    modules, removed on exit (global module hooks would reach every module in the process and make
    ``torch.compile`` warn). Forward only (unlike torch's ModuleTracker, it registers nothing on tensors, so it keeps
    nothing alive into backward)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stack: list[str] = []
        self._handles: list = []

    def __enter__(self) -> "ForwardModuleStack":
        def push(name: str, module, args) -> None:
            self.stack.append(name)

        def pop(module, args, output) -> None:
            if self.stack:
                self.stack.pop()

        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(partial(push, name)))
            # always_call: a forward that raises still leaves the stack as it found it
            self._handles.append(module.register_forward_hook(pop, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def innermost(self) -> str:
        return self.stack[-1] if self.stack else ""
