"""A training step that runs its optimizers itself, as the estimate runs it (framework-free).

A LightningModule with ``automatic_optimization = False`` (a GAN's two optimizers, ``manual_backward`` and
``opt.step()`` in its ``training_step``) asks its Trainer for its optimizers and its backward, and the estimate runs
the step on a copy of the module without one. On the copy, for the length of the step, those are stood in for:
``optimizers()`` gives the estimate's optimizers (``configure_optimizers`` run on the copy; one, or a list, as Lightning
gives them), ``manual_backward(loss)`` is the plain backward, ``toggle_optimizer`` and ``untoggle_optimizer`` freeze
and thaw the other optimizers' parameters as Lightning does, ``lr_schedulers()`` gives the schedulers
``configure_optimizers`` made on the copy, ``clip_gradients`` clips with torch's functions. The boundaries are
where the guard reads them under manual optimization: a forward ends where a backward begins, a backward where it
returns."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

__all__ = ["SelfOptimizingStep", "configured_optimizers", "optimizes_itself"]

#: what the step asks its Trainer for, stood in for on the copy
_STAND_INS = ("optimizers", "manual_backward", "toggle_optimizer", "untoggle_optimizer", "lr_schedulers",
              "clip_gradients")


def optimizes_itself(module: nn.Module) -> bool:
    """Whether ``module`` is a LightningModule whose ``training_step`` runs its optimizers itself."""
    return getattr(module, "automatic_optimization", True) is False and callable(getattr(module, "training_step",
                                                                                          None))


def configured_optimizers(module: nn.Module) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """Every optimizer and learning-rate scheduler ``module.configure_optimizers()`` returns, in order, whatever its
    form (one optimizer, a list, a tuple of an optimizer list and a scheduler list, dicts with ``"optimizer"`` and
    ``"lr_scheduler"`` keys, a scheduler given as a dict with its ``"scheduler"``)."""
    optimizers: list[torch.optim.Optimizer] = []
    schedulers: list[Any] = []

    def scheduler(item: Any) -> None:
        item = item.get("scheduler") if isinstance(item, dict) else item
        if item is not None:
            schedulers.append(item)

    def collect(configured: Any, depth: int = 0) -> None:
        if isinstance(configured, torch.optim.Optimizer):
            optimizers.append(configured)
        elif isinstance(configured, dict):
            collect(configured.get("optimizer"), depth + 1)
            scheduler(configured.get("lr_scheduler"))
        elif isinstance(configured, (list, tuple)) and depth < 2:
            if depth == 0 and len(configured) == 2 and all(isinstance(part, list) for part in configured):
                collect(configured[0], depth + 1)  # ([optimizers], [schedulers])
                for item in configured[1]:
                    scheduler(item)
            else:
                for item in configured:
                    collect(item, depth + 1)

    collect(module.configure_optimizers())
    if not optimizers:
        raise ValueError(f"{type(module).__name__}.configure_optimizers() returned no optimizer")
    return optimizers, schedulers


class _Optimizer:
    """One optimizer as the step gets it from ``optimizers()``: the optimizer's own methods and attributes, with
    ``optimizer`` and ``toggle_model()`` as Lightning's wrapper has them."""

    def __init__(self, optimizer: torch.optim.Optimizer, step: "SelfOptimizingStep") -> None:
        self.optimizer, self._step = optimizer, step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        return self.optimizer.step(closure, **kwargs) if closure is not None else self.optimizer.step(**kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Iterator[None]:
        self._step.toggle_optimizer(self)
        try:
            yield
        finally:
            self._step.untoggle_optimizer(self)


class SelfOptimizingStep:
    """The stand-ins on ``module`` (a copy) while the context is open, stepping ``optimizers``; ``backward_begins``
    and ``backward_ends`` are called around each ``manual_backward``."""

    def __init__(self, module: nn.Module, optimizers: list[torch.optim.Optimizer], schedulers: list[Any],
                 backward_begins: Callable[[], None], backward_ends: Callable[[], None]) -> None:
        self.module, self.backward_begins, self.backward_ends = module, backward_begins, backward_ends
        self.wrapped = [_Optimizer(optimizer, self) for optimizer in optimizers]
        self.schedulers = schedulers
        self._frozen: dict[nn.Parameter, bool] = {}

    def __enter__(self) -> "SelfOptimizingStep":
        for name in _STAND_INS:
            setattr(self.module, name, getattr(self, name))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in _STAND_INS:
            vars(self.module).pop(name, None)

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        found = self.wrapped if use_pl_optimizer else [opt.optimizer for opt in self.wrapped]
        return found[0] if len(found) == 1 else found

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.backward_begins()
        loss.backward(*args, **kwargs)
        self.backward_ends()

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Lightning's: every optimizer's parameters frozen, then ``optimizer``'s given their flags back."""
        flags: dict[nn.Parameter, bool] = {}
        for opt in self.wrapped:
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    if param not in flags:
                        flags[param] = param.requires_grad
                        param.requires_grad = False
        for group in _unwrapped(optimizer).param_groups:
            for param in group["params"]:
                param.requires_grad = flags[param]
        self._frozen = flags

    def untoggle_optimizer(self, optimizer: Any) -> None:
        for opt in self.wrapped:
            if opt.optimizer is not _unwrapped(optimizer):
                for group in opt.optimizer.param_groups:
                    for param in group["params"]:
                        if param in self._frozen:
                            param.requires_grad = self._frozen[param]
        self._frozen = {}

    def lr_schedulers(self) -> Any:
        if not self.schedulers:
            return None
        return self.schedulers[0] if len(self.schedulers) == 1 else list(self.schedulers)

    def clip_gradients(self, optimizer: Any, gradient_clip_val: Optional[float] = None,
                       gradient_clip_algorithm: Optional[str] = None) -> None:
        if not gradient_clip_val:
            return
        params = [p for group in _unwrapped(optimizer).param_groups for p in group["params"] if p.grad is not None]
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)


def _unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)
