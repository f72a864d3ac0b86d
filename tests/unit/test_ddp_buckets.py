"""DistributedDataParallel's first gradient buckets, made before the CPU accountant starts, are counted from the start
(in a one-rank gloo group): no gradient copy appears from nowhere when DDP rebuilds them at the second forward, the
count is what the rank holds at every step, and a rebuild while the accountant is off keeps their bytes counted. What
the accountant holds for memory no tensor showed it is replaced by that memory's own count once seen, and released
where it was freed before what was counted since, without a peak it never had."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_memguard.sources.cpu import CpuTensorAccountant
from lightning_memguard.sources.ddp_buckets import FirstBuckets
from tests.helpers import mse
from tests.models import Stack, regression_batches
from tests.ranks import gloo_group


def held_after_each_step(tmp_path, counted_steps=(0, 1, 2), **ddp) -> tuple[int, list, DistributedDataParallel]:
    """The bytes of the parameters and the batches, what the accountant holds beside them at the start and after each
    of three backwards (``None`` where the step was not counted), and the DDP module."""
    with gloo_group(0, tmp_path, world_size=1):
        model = DistributedDataParallel(Stack(), **ddp)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        batches = regression_batches(3, size=32)
        data = [t for batch in batches for t in batch]
        params += sum(t.numel() * t.element_size() for t in data)  # held all along beside the parameters
        accountant = CpuTensorAccountant()
        accountant.track([*model.parameters(), *data])
        watch = FirstBuckets(accountant, model)
        held = [accountant.read().allocated_bytes - params]
        for step, batch in enumerate(batches):
            if step in counted_steps:
                accountant.start()
            model.zero_grad(set_to_none=False)
            mse(model, batch).backward()
            counted = accountant.started
            accountant.stop()
            held.append(accountant.read().allocated_bytes - params if counted else None)
        watch.close()
        return params, held, model


@pytest.mark.parametrize("bucket_view", [False, True], ids=["buckets", "gradients as bucket views"])
def test_the_first_buckets_are_held_from_the_start_and_the_rebuilt_ones_replace_them(tmp_path, bucket_view):
    params, held, model = held_after_each_step(tmp_path, gradient_as_bucket_view=bucket_view)
    assert model._has_rebuilt_buckets and "_pre_forward" not in vars(model)  # the watch ended with the rebuild
    gradients = sum(p.numel() * p.element_size() for p in model.parameters())  # every parameter trains
    assert held[0] == gradients  # the buckets, before any gradient exists
    # then buckets and gradients (one storage where the gradients are views of the buckets), the same at every step
    assert held[1:] == [gradients * (1 if bucket_view else 2)] * 3


def test_a_rebuild_while_the_accountant_is_off_keeps_the_buckets_bytes_counted(tmp_path):
    _, held, model = held_after_each_step(tmp_path, counted_steps=(0, 2))
    gradients = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held == [gradients, 2 * gradients, None, 2 * gradients]  # rebuilt in step 1, uncounted: counted all the same


def test_held_memory_seen_at_last_counts_once_and_released_memory_leaves_no_peak_it_never_had():
    accountant = CpuTensorAccountant()
    accountant.hold("first", 4096)
    with accountant:
        seen = torch.empty(1024)  # 4096 bytes: the held memory itself, now counted as a storage
        assert accountant.read().allocated_bytes == 4096
        del seen
        accountant.hold("second", 8192)
        peak = accountant.read(reset_peak=False).peak_bytes
        replacement = torch.empty(1024)  # made after the held memory was freed (as DDP rebuilds its buckets)
        assert accountant.read(reset_peak=False).peak_bytes == 8192 + 4096  # both, as the count saw them
        accountant.release("second", peak_before=peak)
        reading = accountant.read()
        assert (reading.allocated_bytes, reading.peak_bytes) == (4096, 8192)  # as they were in memory
        del replacement


def test_held_memory_of_one_size_twice_is_replaced_once_each_as_each_is_seen():
    accountant = CpuTensorAccountant()
    accountant.hold("bucket-0", 4096)  # two buckets of one size, as DDP makes where the layers are alike
    accountant.hold("bucket-1", 4096)
    with accountant:
        first = torch.empty(1024)
        assert accountant.read().allocated_bytes == 2 * 4096  # one seen, one still held
        second = torch.empty(1024)
        assert accountant.read().allocated_bytes == 2 * 4096  # the other seen: still the two buckets, not three
        third = torch.empty(1024)
        assert accountant.read().allocated_bytes == 3 * 4096  # nothing held is left: new memory counts
        accountant.release("bucket-0")  # replaced already: nothing more comes off
        assert accountant.read().allocated_bytes == 3 * 4096
        del first, second, third
