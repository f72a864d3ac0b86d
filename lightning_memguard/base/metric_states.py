"""Metrics an attempt of a batch updates, saved before it and put back when it fails, so that a batch run again after
an out-of-memory error counts once in them, as unguarded training does.

A metric here is anything with a torchmetrics-style ``metric_state`` dict (torchmetrics' ``Metric``, and Lightning's
own holders of logged values, which are such metrics). Framework-free: the front doors say which metrics to watch.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

__all__ = ["has_metric_state", "metric_modules", "save_metrics", "save_list_lengths"]


def has_metric_state(value: Any) -> bool:
    """Whether ``value`` keeps torchmetrics-style states (a ``metric_state`` dict)."""
    try:
        return isinstance(getattr(value, "metric_state", None), dict)
    except Exception:  # a property that fails is not a metric state
        return False


def metric_modules(module: nn.Module) -> list[nn.Module]:
    """The metrics among ``module``'s submodules (a LightningModule's ``self.train_acc = Accuracy(...)``): found
    once a fit, not at every batch (the walk costs a call per module)."""
    return [m for m in module.modules() if m is not module and has_metric_state(m)]


def save_metrics(metrics: Iterable[Any], *, reassigned: Iterable[Any] = ()) -> Callable[[], None]:
    """Saves the states of ``metrics`` and returns what puts them back. ``metrics``' tensors are copied (a
    torchmetrics update adds to its states in place); ``reassigned``: metrics whose updates assign new tensors to
    their states and never change one in place (Lightning's logged values), kept by reference — no copy, nothing
    made on the device at every step."""
    saved = [(metric, _state_of(metric, copy=True)) for metric in metrics]
    saved += [(metric, _state_of(metric, copy=False)) for metric in reassigned]

    def restore() -> None:
        for metric, state in saved:
            for name, value in state.items():
                setattr(metric, name, value)
            if hasattr(metric, "_computed"):
                metric._computed = None  # a cached compute() of the failed attempt's states

    return restore


def _state_of(metric: Any, copy: bool) -> dict[str, Any]:
    """The states (copied with ``copy``; a list always, as updates append to it) and the update count."""
    state = {}
    for name, value in metric.metric_state.items():
        if isinstance(value, torch.Tensor):
            state[name] = value.clone() if copy else value
        elif isinstance(value, list):
            state[name] = list(value)
        else:
            state[name] = value
    if hasattr(metric, "_update_count"):
        state["_update_count"] = metric._update_count
    return state


def save_list_lengths(owner: Any) -> Callable[[], None]:
    """Saves the lengths of the lists ``owner`` holds as attributes and returns what cuts each back to its length: a
    step that appends what it computed to a list of its module (Lightning's own pattern since ``*_epoch_end`` went:
    ``self.validation_step_outputs.append(...)``) and then runs out of memory has appended nothing once it runs
    again. Only appends are undone: a list replaced, or cut shorter, is left as it is."""
    try:
        held = [value for value in vars(owner).values() if type(value) is list]
    except TypeError:  # no __dict__: nothing held
        held = []
    saved = [(items, len(items)) for items in held]

    def restore() -> None:
        for items, length in saved:
            if len(items) > length:
                del items[length:]

    return restore
