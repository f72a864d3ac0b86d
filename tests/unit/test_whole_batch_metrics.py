"""WholeBatchMetrics on torchmetrics' own metrics: a batch updated in parts leaves each metric with the whole batch's
value and the states that one update after another leave; a metric no part touched, a metric called twice a part, a
mean state, and a batch stopped in a part."""

from __future__ import annotations

import pytest
import torch

from lightning_memguard.base.metric_states import WholeBatchMetrics

torchmetrics = pytest.importorskip("torchmetrics")


def batches(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.rand(12, generator=generator), torch.randint(0, 2, (12,), generator=generator)) for _ in range(3)]


def metrics():
    return [torchmetrics.classification.BinaryF1Score(), torchmetrics.classification.BinaryAUROC(),
            torchmetrics.aggregation.MaxMetric(), torchmetrics.aggregation.CatMetric()]


def call(metric, preds, target):
    if isinstance(metric, (torchmetrics.aggregation.MaxMetric, torchmetrics.aggregation.CatMetric)):
        return metric(preds)
    return metric(preds, target)


def test_a_batch_in_parts_gives_each_metric_the_whole_batchs_value_and_the_states_of_one_update_after_another():
    whole, split = metrics(), metrics()
    (first, first_target), *rest = batches()
    for metric_a, metric_b in zip(whole, split):  # a batch before: the states the batch's merge into
        call(metric_a, first, first_target), call(metric_b, first, first_target)
    for done, (preds, target) in enumerate(rest, start=1):
        for metric in whole:
            call(metric, preds, target)
        held = WholeBatchMetrics(split)
        for part in range(3):
            for metric in split:
                call(metric, preds[4 * part:4 * part + 4], target[4 * part:4 * part + 4])
            held.part_done()
        assert held.finish() == split
        for metric_a, metric_b in zip(whole, split):
            torch.testing.assert_close(metric_b._forward_cache, metric_a._forward_cache)
            assert metric_b.update_count == 1 + 3 * done  # one update a part, as the parts' own calls count
    for metric_a, metric_b in zip(whole, split):
        torch.testing.assert_close(metric_b.compute(), metric_a.compute())


def test_a_metric_no_part_updates_is_put_back_as_it_was():
    metric = torchmetrics.classification.BinaryAccuracy()
    preds, target = batches()[0]
    metric(preds, target)
    states, value = dict(metric.metric_state), metric._forward_cache
    held = WholeBatchMetrics([metric])
    held.part_done()
    assert held.finish() == []
    assert all(metric.metric_state[name] is state for name, state in states.items())
    assert metric._forward_cache is value and metric.update_count == 1


def test_a_metric_called_twice_a_part_keeps_its_last_calls_value_and_counts_every_call():
    metric, reference = torchmetrics.classification.BinaryAccuracy(), torchmetrics.classification.BinaryAccuracy()
    preds, target = batches()[0]
    held = WholeBatchMetrics([metric])
    for part in range(2):
        for half in (slice(6 * part, 6 * part + 3), slice(6 * part + 3, 6 * part + 6)):
            last = metric(preds[half], target[half])
            reference(preds[half], target[half])
        held.part_done()
    assert held.finish() == []
    torch.testing.assert_close(metric._forward_cache, last)
    torch.testing.assert_close(metric.compute(), reference.compute())


class MeanState(torchmetrics.Metric):
    """A metric whose state is reduced by a mean: its states do not merge as one update after another."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("mean", default=torch.tensor(0.0), dist_reduce_fx="mean")

    def update(self, values: torch.Tensor) -> None:
        self.mean = values.mean()

    def compute(self) -> torch.Tensor:
        return self.mean


def test_a_metric_with_a_mean_state_is_left_to_its_parts():
    metric = MeanState()
    preds, _ = batches()[0]
    held = WholeBatchMetrics([metric])
    metric(preds[:6]), metric(preds[6:])
    held.part_done()
    assert held.finish() == []
    torch.testing.assert_close(metric._forward_cache, preds[6:].mean())


def test_a_batch_stopped_in_a_part_keeps_what_the_parts_that_ran_added():
    metric, reference = torchmetrics.aggregation.SumMetric(), torchmetrics.aggregation.SumMetric()
    metric(torch.tensor(5.0)), reference(torch.tensor(5.0))
    held = WholeBatchMetrics([metric])
    metric(torch.tensor(2.0)), reference(torch.tensor(2.0))
    held.part_done()
    held.abandon()
    assert metric.compute().item() == reference.compute().item() == 7.0
    assert metric.update_count == 2 and metric._forward_cache.item() == 2.0


class MergeFails(torchmetrics.aggregation.SumMetric):
    """A sum whose public merge of earlier states fails (a subclass's own, say)."""

    def merge_state(self, incoming_state):
        raise RuntimeError("cannot merge")


def test_a_metric_whose_merge_fails_keeps_its_earlier_states_with_one_warning():
    metric = MergeFails()
    metric(torch.tensor(5.0))
    with pytest.warns(UserWarning, match="MergeFails's states could not be merged") as caught:
        for _ in range(2):
            held = WholeBatchMetrics([metric])
            metric(torch.tensor(1.0)), metric(torch.tensor(2.0))
            held.part_done()
            held.finish()
    assert len([w for w in caught if "could not be merged" in str(w.message)]) == 1
    assert metric.compute().item() == 5.0 and metric.update_count == 1
