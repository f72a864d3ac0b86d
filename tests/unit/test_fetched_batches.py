"""A step that fetches its own batches (base/fetched_batches.py): what tells it from a step given its batch, and the
iterator its attempts share, so that a step run again meets the batches it fetched before."""

from __future__ import annotations

import itertools

import pytest

from lightning_memguard.base.fetched_batches import ReplayedFetches, iterator_over
from lightning_memguard.base.step_signature import fetches_own_batches


class Source:
    """An iterator with the attributes Lightning's own carries (``done``), counting what it handed out."""

    def __init__(self, n: int) -> None:
        self.items, self.handed = iter(range(n)), 0

    @property
    def done(self) -> bool:
        return self.handed >= 3

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.items)
        self.handed += 1
        return item


def test_an_attempt_after_a_rewind_meets_the_fetched_items_again_before_new_ones():
    source = Source(5)
    fetches = ReplayedFetches(source)
    assert [next(fetches), next(fetches)] == [0, 1]
    fetches.rewind()
    assert [next(fetches), next(fetches), next(fetches)] == [0, 1, 2]  # the first two again, then a new one
    assert source.handed == 3 and fetches.fetched == [0, 1, 2]
    assert fetches.done  # the source's own attributes
    fetches.rewind()
    assert list(itertools.islice(fetches, 5)) == [0, 1, 2, 3, 4]
    with pytest.raises(StopIteration):
        next(fetches)


def test_a_step_that_takes_the_iterator_is_told_from_one_given_its_batch():
    class Module:
        def training_step(self, dataloader_iter):
            return next(dataloader_iter)

        def validation_step(self, batch, batch_idx):
            return batch

    module = Module()
    assert fetches_own_batches(module.training_step)
    assert not fetches_own_batches(module.validation_step)
    assert not fetches_own_batches(None) and not fetches_own_batches(print)
    # what the estimate hands such a step: the batch as batch 0, at every fetch
    step = iterator_over("batch")
    assert [next(step), next(step)] == [("batch", 0, 0), ("batch", 0, 0)]
