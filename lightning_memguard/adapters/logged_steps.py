"""The whole batch's ``on_step`` values when a training batch ran as micro-batches.

Lightning keeps a value logged ``on_step`` (``self.log("train_loss", loss)`` in ``training_step``: ``on_step`` is
its default there) as the last one logged in the step (``_ResultMetric._forward_cache``, one per key of the trainer's
result collection). A batch run in k parts logs it k times, so without this the step's value — what the loggers, the
progress bar and ``trainer.callback_metrics`` get, what ``ModelCheckpoint(monitor="train_loss")`` ranks checkpoints by
and ``EarlyStopping`` stops on — would be the last part's alone: a loss over a k-th of the samples.

:class:`StepValues` records each part's value and, after the last part, puts the whole batch's in its place, reduced
as the key's ``reduce_fx`` reduces an epoch's values: a mean weighs each part by its share of the batch (the weight
its loss got), a sum adds the parts, a max or min takes theirs. A key only some parts logged is reduced over those
parts. A torchmetrics metric's value is computed from the whole batch's states
(:class:`~lightning_memguard.base.metric_states.WholeBatchMetrics`), whether the metric is logged as itself
(``self.log("train_f1", self.train_f1)``) or as what its ``forward`` returned in each part
(``self.log_dict(self.train_metrics(preds, target))``: told by the value, equal to one metric's part value in every
part; its ``on_epoch`` mean then counts the whole batch's value, also where it is logged for the epoch only, told
from what each part added to the epoch's sum). A custom ``reduce_fx`` keeps the last part's value.

Only what ``training_step`` logs: the hooks the closure runs per part after it see the sum so far, not the part's
share — a gradient norm logged in ``on_after_backward`` is the whole batch's at the last part, where gradients have
added up, and a value logged in ``on_before_backward`` is the part's loss scaled by its weight — so their last value
stays.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Sequence

import torch

from ..base.metric_states import WholeBatchMetrics

__all__ = ["EpochsFirstLog", "SplitLogs", "StepValues"]


class StepValues:
    """Each part's ``on_step`` values of one training batch run in parts, and the whole batch's from them.

    Args:
        results: the trainer's result collection (``trainer._results``, a dict of ``_ResultMetric`` by key); anything
            else (another Lightning's) leaves the values as Lightning has them.
        step: the step method whose logged values are combined (an evaluation loop's ``validation_step``).
    """

    def __init__(self, results: Any, step: str = "training_step") -> None:
        self.results = results if isinstance(results, dict) else {}
        self.step = step
        # the value each key holds now: a part that leaves it in place did not log it
        self._latest: dict[str, Any] = {key: getattr(metric, "_forward_cache", None)
                                        for key, metric in self._logged(on_step=True)}
        self._parts: dict[str, list[tuple[torch.Tensor, float]]] = {}
        self._sources: dict[str, list[list[Any]]] = {}  # by key, each part's metrics whose value it logged
        self._weights: dict[str, list[Any]] = {}  # by key, the epoch mean's weight so far after each part
        # every on_epoch key's sum and weight before and after each part: what each part added, which tells a
        # batch_size= of the user's, and a value logged on_epoch only (Lightning keeps it in its sum alone) with the
        # parts' shares and the metrics' values in each part
        self._sums: dict[str, list[tuple[Any, Any]]] = {key: [_sum_of(metric)]
                                                         for key, metric in self._logged(on_epoch=True)}
        #: the sizes each part's own ``batch_size=`` may follow: the one it was attached with (its share of the
        #: batch's), and its samples
        self._own_sizes: list[tuple[Optional[float], Optional[int]]] = []
        self._shares: list[float] = []
        self._metric_values: list[list[tuple[Any, Any]]] = []
        #: the dtype of each epoch mean's sum of batch sizes before the parts (see :meth:`_sizes_keep_their_dtype`)
        self._size_dtypes = {key: sizes.dtype for key, sizes in _batch_size_sums(self.results)}

    def part_done(self, share: float, metrics: Sequence[Any] = (), attached: Optional[float] = None,
                  samples: Optional[int] = None) -> None:
        """A part ran; ``share``: its share of the batch (what its loss was weighted by, over the parts' sum).
        ``metrics``: the torchmetrics metrics the parts update, whose part value (``_forward_cache``) a key may have
        logged (``self.log_dict(self.train_metrics(preds, target))``). ``attached``: the batch size the part was
        attached with (its share of the batch's), which an epoch mean weighs its value by unless the step gives its
        own ``batch_size=``; ``samples``: the part's."""
        self._shares.append(share)
        self._own_sizes.append((attached, samples))
        self._metric_values.append([(m, getattr(m, "_forward_cache", None)) for m in metrics])
        for key, metric in self._logged(on_epoch=True):
            self._sums.setdefault(key, [(None, None)]).append(_sum_of(metric))
        for key, metric in self._logged(on_step=True):
            value = getattr(metric, "_forward_cache", None)
            if value is None or value is self._latest.get(key):
                continue
            self._latest[key] = value
            self._parts.setdefault(key, []).append((value, share))
            self._sources.setdefault(key, []).append(_sources_of(value, metrics))
            self._weights.setdefault(key, []).append(getattr(metric, "cumulated_batch_size", None))

    def combine(self, metrics: list = ()) -> None:
        """Puts the whole batch's value of every key the parts logged in the place Lightning reads it from.
        ``metrics``: the torchmetrics metrics given the whole batch's value (their ``_forward_cache``), for the keys
        they are logged under."""
        if metrics:
            for metric in self.results.values():
                if not getattr(metric, "is_tensor", True) and any(metric.value is m for m in metrics):
                    metric._forward_cache = metric.value._forward_cache
        counted_once = set()
        for key in self._sums:
            try:
                if self._user_size_counts_once(key, metrics):
                    counted_once.add(key)
            except Exception:  # another Lightning's values: left as Lightning has them, never a failed step
                pass
        for key, parts in self._parts.items():
            metric = self.results.get(key)
            if metric is None or len(parts) < 2:
                continue
            try:
                whole_batch = self._whole_batch_value(key, metrics)
                if whole_batch is not None and metric.meta.on_epoch and key not in counted_once:
                    self._epoch_counts_whole_batch(key, metric, whole_batch)
                combined = whole_batch if whole_batch is not None else _reduced(metric.meta, parts)
            except Exception:  # another Lightning's values: left as Lightning has them, never a failed step
                combined = None
            if combined is None:
                continue
            metric._forward_cache = combined
            if not metric.meta.on_epoch:  # Lightning keeps an on_step-only value there too
                metric.value = combined
        for key, _ in self._logged(epoch_only=True):
            if key in counted_once or key not in self._sums:
                continue
            try:
                self._epoch_only_counts_whole_batch(key, metrics)
            except Exception:  # another Lightning's values: left as Lightning has them, never a failed step
                pass
        self._sizes_keep_their_dtype()

    def _sizes_keep_their_dtype(self) -> None:
        """Lightning sums an ``on_epoch`` mean's batch sizes in an int64 tensor; a part's share of the batch's size (a
        float) makes that sum float32. With several processes the sums are reduced at the epoch's end (``sync_dist``),
        and a rank that split a batch alone would reduce float32 where the others reduce int64: a collective whose
        sizes differ (gloo aborts both ranks). After the last part the parts' shares add up to the batch's size, a
        whole number: the sum goes back to its dtype, rounded."""
        for key, sizes in _batch_size_sums(self.results):
            dtype = self._size_dtypes.get(key, torch.int64)  # a key first logged in a part: Lightning's torch.tensor(0)
            if sizes.is_floating_point() and not dtype.is_floating_point:
                self.results[key].cumulated_batch_size = sizes.round().to(dtype)

    def _user_size_counts_once(self, key: str, metrics: Sequence[Any]) -> bool:
        """A value logged with a ``batch_size=`` of the user's that does not follow the part (a constant, as
        ``batch_size=self.hparams.batch_size``) weighs every part as much as the whole batch: the batch would count k
        times in the epoch's mean where a batch run whole counts once. Told where every part added the same weight
        and that is neither the size the part was attached with nor its samples; the parts' additions are then
        replaced by one of the whole batch's value (the metric's, where one logged it; else the parts' values weighted
        by their shares) at that weight. Returns whether it did."""
        metric, sums = self.results.get(key), self._sums[key]
        parts = len(self._shares)
        if metric is None or not metric.meta.is_mean_reduction or parts < 2 or len(sums) != parts + 1:
            return False
        added = [(value - before, weight - weight_before)
                 for (before, weight_before), (value, weight) in zip(sums[1:], sums[2:])]
        if any(weight is None for _, weight in added):
            return False
        weight = float(added[0][1])
        if weight <= 0 or any(not math.isclose(float(w), weight, rel_tol=1e-6) for _, w in added):
            return False  # not logged in every part, or weighed by sizes that differ by part
        for own in zip(*self._own_sizes[1:]):  # the attached sizes, the samples: the part's own, not a constant
            if all(size is not None and math.isclose(weight, size, rel_tol=1e-6) for size in own):
                return False
        (before, weight_before), (first, weight_first) = sums[0], sums[1]
        if weight_before is not None and math.isclose(float(weight_first - weight_before), weight, rel_tol=1e-6):
            first_added = first - before
        elif math.isclose(float(weight_first), weight, rel_tol=1e-6):  # the part's log began the epoch's sum
            first_added = first
        else:
            return False
        values = [first_added / weight] + [value / weight for value, _ in added]
        whole = self._whole_batch_value(key, metrics) if key in self._parts else None
        if whole is None:
            whole = sum(value * share for value, share in zip(values, _normalised(self._shares)))
        metric.value = metric.value - sum(values) * weight + whole * weight
        metric.cumulated_batch_size = metric.cumulated_batch_size - (parts - 1) * weight
        return True

    def _epoch_only_counts_whole_batch(self, key: str, metrics: Sequence[Any]) -> None:
        """A metric's value logged on_epoch only in every part (``self.log("val_f1", self.val_f1(preds, y))`` in
        ``validation_step``) counts the whole batch's value in the epoch's mean, as unsplit. Lightning keeps no part
        value of such a key: the parts after the first each added value × size to its sum and size to its weight, so
        their values are the quotients, and the metric is the one whose part values agree with those in every part
        (its first part's value then stands for the first part, whose addition may have begun the sum at zero). The
        sizes must be in proportion to the parts' shares, as for :meth:`_epoch_counts_whole_batch`."""
        metric, sums = self.results.get(key), self._sums[key]
        if metric is None or not metric.meta.is_mean_reduction or len(sums) < 3 or len(sums) != len(self._shares) + 1:
            return
        added = [(value - before, weight - weight_before)
                 for (before, weight_before), (value, weight) in zip(sums[1:], sums[2:])]
        if any(weight is None or float(weight) <= 0 for _, weight in added):
            return  # not logged in every part
        values = [float(value) / float(weight) for value, weight in added]
        shares = _normalised(self._shares)
        size = _batch_size([weight for _, weight in added], shares)
        if size is None:
            return
        candidates = [m for m in metrics if all(
            _close(part_values, m, value) for part_values, value in zip(self._metric_values[1:], values))]
        if len(candidates) != 1:
            return
        source = candidates[0]
        first = next((value for m, value in self._metric_values[0] if m is source), None)
        if not isinstance(first, torch.Tensor) or first.numel() != 1:
            return
        parts_mean = float(first) * shares[0] + sum(value * share for value, share in zip(values, shares[1:]))
        whole = float(source._forward_cache)
        metric.value = metric.value + (whole - parts_mean) * size

    def _whole_batch_value(self, key: str, metrics: Sequence[Any]) -> Optional[torch.Tensor]:
        """The whole batch's value of the one metric whose part values ``key`` logged in every part (two metrics may
        agree in a part: an F1 and an AUROC of one sample, both 0), where that metric was given one; ``None``
        otherwise."""
        by_part = self._sources.get(key, [])
        common = [m for m in by_part[0] if all(any(m is other for other in part) for part in by_part[1:])] \
            if by_part else []
        if len(common) != 1 or not any(m is common[0] for m in metrics):
            return None
        source = common[0]
        logged = self._latest[key]
        return source._forward_cache.detach().to(device=logged.device, dtype=logged.dtype).clone()

    def _epoch_counts_whole_batch(self, key: str, metric: Any, whole_batch: torch.Tensor) -> None:
        """The epoch's mean of ``key`` counts the whole batch's metric value, as unsplit, not its parts' values: each
        part added its value times its batch size (its share of the whole batch's), so the sum gets the whole batch's
        value minus the parts' share-weighted mean, times the batch's size. The size is read from what the parts after
        the first added to the weight (the first part's may have begun the epoch's sum at zero); where those are not
        in proportion to the shares (a ``batch_size=`` of the user's), the parts' values stay."""
        if not metric.meta.is_mean_reduction or any(weight is None for weight in self._weights[key]):
            return
        parts, weights = self._parts[key], self._weights[key]
        shares = _normalised([share for _, share in parts])
        size = _batch_size([after - before for before, after in zip(weights, weights[1:])], shares)
        if size is not None:
            parts_mean = sum(value * share for (value, _), share in zip(parts, shares))
            metric.value = metric.value + (whole_batch - parts_mean) * size

    def _logged(self, on_step: bool = False, on_epoch: bool = False, epoch_only: bool = False):
        """The tensor values this step logged (key, Lightning's result metric): ``on_step`` ones, ``on_epoch`` ones,
        or those logged for the epoch only."""
        for key, metric in self.results.items():
            meta = getattr(metric, "meta", None)
            if not getattr(metric, "is_tensor", False) or str(getattr(meta, "fx", "")).split(".")[0] != self.step:
                continue
            if on_step and not getattr(meta, "on_step", False):
                continue
            if (on_epoch or epoch_only) and not getattr(meta, "on_epoch", False):
                continue
            if epoch_only and getattr(meta, "on_step", True):
                continue
            yield key, metric

def _normalised(shares: list[float]) -> list[float]:
    total = sum(shares)
    return [share / total for share in shares]


def _batch_size(added: list[Any], shares: list[float]) -> Optional[float]:
    """The whole batch's size in an epoch mean's weight, read from what the parts after the first added to it
    (``added``; ``shares``: every part's, the first's included), where those are in proportion to the shares (not so
    with a ``batch_size=`` of the user's); ``None`` otherwise."""
    sizes = [float(weight) / share for weight, share in zip(added, shares[1:])]
    if not sizes or min(sizes) <= 0 or max(sizes) - min(sizes) > 1e-6 * max(sizes):
        return None
    return sizes[0]


def _batch_size_sums(results: dict):
    """Each key's sum of batch sizes (an ``on_epoch`` mean's weight), where it has one."""
    for key, metric in results.items():
        sizes = getattr(metric, "cumulated_batch_size", None)
        if isinstance(sizes, torch.Tensor):
            yield key, sizes


def _sum_of(metric: Any) -> tuple[Any, Any]:
    """An on_epoch mean's sum and weight so far."""
    return getattr(metric, "value", None), getattr(metric, "cumulated_batch_size", None)


def _close(part_values: list[tuple[Any, Any]], metric: Any, value: float) -> bool:
    """Whether ``metric``'s value in a part (among ``part_values``) is ``value`` up to the rounding of a value
    multiplied by a size and divided by it again."""
    own = next((v for m, v in part_values if m is metric), None)
    return isinstance(own, torch.Tensor) and own.numel() == 1 and math.isclose(float(own), value, rel_tol=1e-5,
                                                                               abs_tol=1e-7)


def _sources_of(value: torch.Tensor, metrics: Sequence[Any]) -> list[Any]:
    """The metrics among ``metrics`` whose value now (``_forward_cache``) equals ``value`` (which Lightning logged as
    a copy)."""
    found = []
    for metric in metrics:
        own = getattr(metric, "_forward_cache", None)
        if isinstance(own, torch.Tensor) and own.shape == value.shape and torch.equal(
                own.detach().to(device=value.device, dtype=value.dtype), value):
            found.append(metric)
    return found


def _reduced(meta: Any, parts: list[tuple[torch.Tensor, float]]):
    """The parts' values reduced as ``meta.reduce_fx`` reduces; ``None`` for a reduction that is not one of
    Lightning's four (the last part's value stays)."""
    values = [value for value, _ in parts]
    if meta.is_mean_reduction:
        total = sum(share for _, share in parts)
        if total <= 0:
            return None
        return sum(value * (share / total) for value, share in parts)
    if meta.is_sum_reduction:
        return sum(values)
    if meta.is_max_reduction:
        return functools.reduce(torch.maximum, values)
    if meta.is_min_reduction:
        return functools.reduce(torch.minimum, values)
    return None


class SplitLogs:
    """What a batch run in parts logs (:class:`StepValues`) and counts in the module's torchmetrics metrics
    (:class:`~lightning_memguard.base.metric_states.WholeBatchMetrics`), made the whole batch's: built before the
    first part, told of each part that ran, finished after the last (or abandoned where a part failed and nothing
    puts the states back).

    Args:
        results: as :class:`StepValues` takes it.
        metrics: the module's metric modules.
        step: the step method that logs (``training_step``, ``validation_step``...).
    """

    def __init__(self, results: Any, metrics: Sequence[Any], step: str = "training_step") -> None:
        self.values = StepValues(results, step)
        self.metrics = WholeBatchMetrics(metrics)

    def part_done(self, share: float, attached: Optional[float] = None, samples: Optional[int] = None) -> None:
        """A part ran; ``share``: its share of the batch, what its loss was weighted by; ``attached``: the batch size
        it was attached with; ``samples``: its samples."""
        self.values.part_done(share, self.metrics.part_done(), attached, samples)

    def finish(self) -> None:
        """The last part ran: the whole batch's values where Lightning reads them."""
        self.values.combine(self.metrics.finish())

    def abandon(self) -> None:
        """A part failed: the metrics keep what the parts that ran added."""
        self.metrics.abandon()


class EpochsFirstLog:
    """Keeps Lightning from clearing, in an epoch's first batch run in parts, what the earlier parts logged.

    Lightning clears the values ``training_step`` logged in the epoch before at the first ``self.log`` of the
    epoch's first batch, and tells that log by the hook logged from last (the logger connector's ``_current_fx``)
    differing from ``training_step``. A batch in parts runs ``training_step`` again after the hooks of backward; one
    that logs (``on_after_backward``, a gradient norm) makes the next part's first log look like the epoch's first, and
    the earlier parts' ``on_epoch`` values would be cleared (the epoch's mean missing them). So before a part's
    ``training_step``, the hook logged from last is put back to what it was after the part before's, where that was
    ``training_step``.

    Args:
        trainer: the Trainer; another Lightning's without the connector's attribute is left as it is.
    """

    def __init__(self, trainer: Any) -> None:
        self.connector = getattr(trainer, "_logger_connector", None)
        self._after_step: Any = None

    def step(self, training_step, *args: Any) -> Any:
        """Runs ``training_step(*args)`` (a part's), the hook logged from last as the part before left it."""
        has_it = hasattr(self.connector, "_current_fx")
        if has_it and self._after_step == "training_step":
            self.connector._current_fx = self._after_step
        result = training_step(*args)
        if has_it:
            self._after_step = self.connector._current_fx
        return result
