"""Metrics an attempt of a batch updates, saved before it and put back when it fails, so that a batch run again after
an out-of-memory error counts once in them, as unguarded training does.

A metric here is anything with a torchmetrics-style ``metric_state`` dict (torchmetrics' ``Metric``, and Lightning's
own holders of logged values, which are such metrics). Framework-free: the front doors say which metrics to watch.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

__all__ = ["has_metric_state", "metric_modules", "save_metrics", "save_list_lengths", "WholeBatchMetrics"]


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


#: the state reductions under which merging a batch's states into the earlier ones (torchmetrics' ``merge_state``)
#: gives what the batch's updates made one after another give: a sum, a max, a min, a concatenation
_MERGEABLE_REDUCTIONS = {"dim_zero_sum", "dim_zero_max", "dim_zero_min", "dim_zero_cat"}
_WARNED: set[str] = set()  # the metric classes whose merge failed, said once


class WholeBatchMetrics:
    """The metrics a batch run in parts updates, each left with the whole batch's value as its step value.

    A torchmetrics metric called in a step (``self.train_acc(preds, target)``) returns the metric over that call's
    samples and keeps it in ``_forward_cache``, where Lightning reads a metric logged ``on_step``: a batch run in k
    parts would show the last part's value. So at the batch's start each metric whose states merge (no
    ``dist_sync_on_step``, every state reduced by a sum, max, min or concatenation) is set to
    fresh default states, keeping the states it held; the parts' updates then add up to the whole batch's states, from
    which :meth:`finish` computes the whole batch's value (as ``forward`` computes a call's: not synchronised across
    processes) and merges the kept states back in (``merge_state``): the states k updates one after another leave.
    Any other metric (a state reduced by a mean or by none) keeps the last part's value, as does a metric called more
    than once in a part.
    Framework-free: duck-typed on torchmetrics' ``Metric``.

    Args:
        metrics: the candidates (a module's :func:`metric_modules`); those no part updates are put back untouched.
    """

    def __init__(self, metrics: Iterable[Any]) -> None:
        self._held: list[tuple[Any, dict[str, Any], dict[str, Any]]] = []
        for metric in metrics:
            if not _merges(metric):
                continue
            states = {name: getattr(metric, name) for name in metric._defaults}
            counters = {name: getattr(metric, name) for name in ("_update_count", "_forward_cache", "_computed")}
            for name, default in metric._defaults.items():
                # new objects, never reset(): it empties a list state in place, and the held one is that list
                current = states[name]
                fresh = default.detach().clone().to(current.device) if isinstance(default, torch.Tensor) else []
                setattr(metric, name, fresh)
            metric._update_count, metric._forward_cache, metric._computed = 0, None, None
            self._held.append((metric, states, counters))
        self._updates_by_part: list[list[int]] = []

    def part_done(self) -> list[Any]:
        """A part ran: each metric's updates so far are noted, to tell a metric called once a step from one called
        twice. Returns the metrics held (each with the part's value, where the part updated it)."""
        self._updates_by_part.append([metric._update_count for metric, _, _ in self._held])
        return [metric for metric, _, _ in self._held]

    def finish(self) -> list[Any]:
        """The batch ran: every metric a part updated gets the whole batch's value in ``_forward_cache`` and the
        states it held merged with the batch's. Returns the metrics given a new value."""
        valued = []
        for index, (metric, states, counters) in enumerate(self._held):
            updates = metric._update_count
            if updates == 0:  # no part updated it: as it was
                _put_back(metric, states, counters)
                continue
            value = self._whole_batch_value(metric) if self._once_a_part(index) else None
            error = _merge_back(metric, states, counters)
            if error is not None:  # never a failed step: its states as before the batch, one warning a class
                if type(metric).__name__ not in _WARNED:
                    _WARNED.add(type(metric).__name__)
                    warnings.warn(f"lightning-memguard: {type(metric).__name__}'s states could not be merged after a "
                                  f"batch run in parts ({error}); such batches are not counted in it.", stacklevel=2)
                continue
            if value is not None:
                metric._forward_cache = value
                valued.append(metric)
        self._held, self._updates_by_part = [], []
        return valued

    def abandon(self) -> None:
        """The batch stopped in a part: the held states merged with what the parts that ran added (as k updates one
        after another would leave them), the last part's value kept."""
        for metric, states, counters in self._held:
            if metric._update_count == 0:
                _put_back(metric, states, counters)
            else:
                _merge_back(metric, states, counters)
        self._held, self._updates_by_part = [], []

    def _once_a_part(self, index: int) -> bool:
        """Whether the metric was called through ``forward`` (it has a call's value) in more than one part, once in
        each it was called in: a metric called twice a step shows its last call's value, as it does unsplit."""
        metric = self._held[index][0]
        counts = [0] + [updates[index] for updates in self._updates_by_part]
        added = [after - before for before, after in zip(counts, counts[1:])]
        return metric._forward_cache is not None and max(added, default=0) == 1 and sum(added) > 1

    @staticmethod
    def _whole_batch_value(metric: Any) -> Any:
        """``compute()`` over the batch's states alone, in the context torchmetrics' ``forward`` computes a call's
        value in (no synchronisation across processes unless ``dist_sync_on_step``); ``None`` where it fails."""
        saved = metric._to_sync, metric._should_unsync
        try:
            metric._to_sync, metric._should_unsync = metric.dist_sync_on_step, False
            with torch.no_grad():
                return metric.compute()
        except Exception:
            return None
        finally:
            metric._to_sync, metric._should_unsync = saved
            metric._computed = None


def _merges(metric: Any) -> bool:
    """Whether ``metric``'s states merge exactly (see :class:`WholeBatchMetrics`)."""
    try:
        if metric.dist_sync_on_step or not metric._defaults:
            return False
        if not all(hasattr(metric, name) for name in ("_reduce_states", "compute", "_to_sync", "_should_unsync")):
            return False
        for name, default in metric._defaults.items():
            reduction = getattr(metric._reductions.get(name), "__name__", None)
            if isinstance(default, list):
                if reduction not in (None, "dim_zero_cat"):
                    return False
            elif reduction not in _MERGEABLE_REDUCTIONS:
                return False
        return True
    except AttributeError:  # not torchmetrics' Metric
        return False


def _merge_back(metric: Any, states: dict[str, Any], counters: dict[str, Any]) -> Optional[Exception]:
    """The states ``metric`` held before the batch merged with the batch's, and its update count what its updates one
    after another leave; where the merge fails, the held states are put back and the error returned."""
    try:
        metric._update_count += counters["_update_count"]
        with torch.no_grad():
            _merge(metric, states)
    except Exception as error:
        _put_back(metric, states, counters)
        return error
    metric._computed = None  # a compute() cached over the batch's states alone
    return None


def _merge(metric: Any, states: dict[str, Any]) -> None:
    """Merges ``states`` (the earlier ones) into ``metric``'s. torchmetrics' public ``merge_state`` refuses a metric
    that declares ``full_state_update`` (its update reads the states: MaxMetric's keeps the larger); its states merge
    all the same where each is reduced as :func:`_merges` asks — the reduction torchmetrics itself merges processes'
    states by — and its own merge is what ``merge_state`` calls."""
    if metric.full_state_update is False:
        metric.merge_state(states)
    else:
        metric._reduce_states(states)


def _put_back(metric: Any, states: dict[str, Any], counters: dict[str, Any]) -> None:
    for name, value in {**states, **counters}.items():
        setattr(metric, name, value)
