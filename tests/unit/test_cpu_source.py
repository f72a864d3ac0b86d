import pytest
import torch

from lightning_memguard.core.snapshot import MiB
from lightning_memguard.sources import CpuTensorAccountant


def test_one_mib_tensor_shows_in_current_and_peak_and_leaves_when_freed():
    acc = CpuTensorAccountant()
    with acc:
        x = torch.empty(MiB // 4, dtype=torch.float32)
        during = acc.read(reset_peak=False)
        del x
        after = acc.read()
    assert during.allocated_bytes == MiB
    assert during.peak_bytes == MiB
    assert after.allocated_bytes == 0
    assert after.peak_bytes == MiB  # the peak of the window survives the free
    assert acc.read().peak_bytes == 0  # ... and the previous read reset it


def test_views_and_inplace_results_count_once():
    acc = CpuTensorAccountant()
    with acc:
        x = torch.zeros(1024, 256)  # 1 MiB
        y = x.view(-1)
        y.add_(1.0)
        z = x[:10]
        reading = acc.read()
    assert reading.allocated_bytes == MiB
    del x, y, z


def test_tracked_tensors_and_backward_are_counted():
    weight = torch.randn(128, 128, requires_grad=True)  # 64 KiB, exists before counting starts
    acc = CpuTensorAccountant()
    acc.track([weight, weight])  # tracked twice, counted once
    assert acc.read().allocated_bytes == 128 * 128 * 4
    with acc:
        inputs = torch.randn(256, 128)
        (inputs @ weight).relu().sum().backward()
        reading = acc.read()
    # weight + its new gradient + the inputs stay alive; the matmul output and relu mask were freed
    assert reading.allocated_bytes == 2 * 128 * 128 * 4 + 256 * 128 * 4
    assert reading.peak_bytes >= reading.allocated_bytes + 256 * 128 * 4


def test_hard_limit_raises_out_of_memory_and_frees_the_output():
    acc = CpuTensorAccountant(limit_bytes=2 * MiB)
    with acc:
        keep = torch.empty(MiB // 4)
        with pytest.raises(torch.OutOfMemoryError, match="limit"):
            torch.empty(2 * MiB // 4)
        reading = acc.read()
    assert reading.allocated_bytes == MiB
    assert reading.num_ooms == 1
    del keep


def test_capacity_is_budget_then_limit():
    assert CpuTensorAccountant().capacity_bytes() is None
    assert CpuTensorAccountant(budget_bytes=10).capacity_bytes() == 10
    assert CpuTensorAccountant(limit_bytes=20).capacity_bytes() == 20


@pytest.mark.parametrize("value", [0, -1, 1.5, "1GiB"])
def test_bad_budget_is_rejected(value):
    with pytest.raises(ValueError, match="budget_bytes"):
        CpuTensorAccountant(budget_bytes=value)


def test_stop_ends_counting():
    acc = CpuTensorAccountant()
    acc.start()
    acc.stop()
    x = torch.empty(1024)
    assert acc.read().allocated_bytes == 0
    del x


def test_out_and_resize_growing_a_known_storage_are_counted():
    acc = CpuTensorAccountant()
    with acc:
        a, b = torch.ones(MiB // 4), torch.ones(MiB // 4)
        c = torch.empty(0)
        torch.add(a, b, out=c)  # resizes c from 0 to 1 MiB
        assert acc.read(reset_peak=False).allocated_bytes == 3 * MiB
        c.resize_(2 * MiB // 4)
        assert acc.read(reset_peak=False).allocated_bytes == 4 * MiB
        del a, b, c
    assert acc.read().allocated_bytes == 0
