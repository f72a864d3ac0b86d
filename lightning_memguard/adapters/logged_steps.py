"""The whole batch's ``on_step`` values when a training batch ran as micro-batches.

Lightning keeps a value logged ``on_step`` (``self.log("train_loss", loss)`` in ``training_step``: ``on_step`` is
its default there) as the last one logged in the step (``_ResultMetric._forward_cache``, one per key of the trainer's
result collection). A batch run in k parts logs it k times, so without this the step's value — what the loggers, the
progress bar and ``trainer.callback_metrics`` get, what ``ModelCheckpoint(monitor="train_loss")`` ranks checkpoints by
and ``EarlyStopping`` stops on — would be the last part's alone: a loss over a k-th of the samples.

:class:`StepValues` records each part's value and, after the last part, puts the whole batch's in its place, reduced
as the key's ``reduce_fx`` reduces an epoch's values: a mean weighs each part by its share of the batch (the weight
its loss got), a sum adds the parts, a max or min takes theirs. A key only some parts logged is reduced over those
parts. A torchmetrics metric logged as a value (its ``forward`` output: the metric over that part alone) or a custom
``reduce_fx`` keeps the last part's value: the whole batch's is not a function of the parts' values.

Only what ``training_step`` logs: the hooks the closure runs per part after it see the sum so far, not the part's
share — a gradient norm logged in ``on_after_backward`` is the whole batch's at the last part, where gradients have
added up, and a value logged in ``on_before_backward`` is the part's loss scaled by its weight — so their last value
stays.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["StepValues"]


class StepValues:
    """Each part's ``on_step`` values of one training batch run in parts, and the whole batch's from them.

    Args:
        results: the trainer's result collection (``trainer._results``, a dict of ``_ResultMetric`` by key); anything
            else (another Lightning's) leaves the values as Lightning has them.
    """

    def __init__(self, results: Any) -> None:
        self.results = results if isinstance(results, dict) else {}
        # the value each key holds now: a part that leaves it in place did not log it
        self._latest: dict[str, Any] = {key: getattr(metric, "_forward_cache", None)
                                        for key, metric in self._step_values()}
        self._parts: dict[str, list[tuple[torch.Tensor, float]]] = {}

    def part_done(self, share: float) -> None:
        """A part ran; ``share``: its share of the batch (what its loss was weighted by, over the parts' sum)."""
        for key, metric in self._step_values():
            value = getattr(metric, "_forward_cache", None)
            if value is None or value is self._latest.get(key):
                continue
            self._latest[key] = value
            self._parts.setdefault(key, []).append((value, share))

    def combine(self) -> None:
        """Puts the whole batch's value of every key the parts logged in the place Lightning reads it from."""
        for key, parts in self._parts.items():
            metric = self.results.get(key)
            if metric is None or len(parts) < 2:
                continue
            try:
                combined = _reduced(metric.meta, parts)
            except Exception:  # another Lightning's values: left as Lightning has them, never a failed step
                combined = None
            if combined is None:
                continue
            metric._forward_cache = combined
            if not metric.meta.on_epoch:  # Lightning keeps an on_step-only value there too
                metric.value = combined

    def _step_values(self):
        for key, metric in self.results.items():
            meta = getattr(metric, "meta", None)
            if (getattr(metric, "is_tensor", False) and getattr(meta, "on_step", False)
                    and str(getattr(meta, "fx", "")).split(".")[0] == "training_step"):
                yield key, metric


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
