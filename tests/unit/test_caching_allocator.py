"""The model of the CUDA caching allocator (lightning_memguard.estimate.caching_allocator): its rules one by one, and
the estimate of a CUDA step counting storages as the blocks it hands out."""

import pytest
import torch
from torch import nn

from lightning_memguard import estimate_memory
from lightning_memguard.estimate.caching_allocator import CachingAllocatorModel, unmodelled_options

MiB = 2**20


def test_requests_are_rounded_to_512_bytes_and_an_empty_one_takes_no_block():
    allocator = CachingAllocatorModel()
    assert allocator.malloc("one byte", 1) == 512
    assert allocator.malloc("513", 513) == 1024
    assert allocator.malloc("empty", 0) == 0
    assert allocator.allocated_bytes == 1536
    assert allocator.requested_bytes("513") == 513
    assert allocator.free("empty") == 0  # nothing to give back


def test_small_requests_share_2_mib_segments_and_large_ones_get_20_mib_or_their_own_rounded_to_2_mib():
    allocator = CachingAllocatorModel()
    allocator.malloc("a", 4096)
    allocator.malloc("b", MiB)  # 1 MiB is still small
    assert allocator.reserved_bytes == 2 * MiB
    allocator.malloc("c", MiB + 512)  # large, under 10 MiB: a 20 MiB segment
    assert allocator.reserved_bytes == 22 * MiB
    allocator.malloc("d", 15 * MiB)  # fits the cached rest of that segment: no new one
    assert allocator.reserved_bytes == 22 * MiB
    allocator.malloc("e", 15 * MiB + 1)  # 10 MiB and over, no cached block fits: its own, rounded up to 2 MiB
    assert allocator.reserved_bytes == 38 * MiB
    assert allocator.block_size("e") == 16 * MiB  # the rest, 1 MiB - 512 B, is not split off


def test_a_large_block_is_split_only_where_more_than_1_mib_would_be_left():
    allocator = CachingAllocatorModel()
    assert allocator.malloc("split", 18 * MiB + 512) == 18 * MiB + 512  # 20 MiB segment, 2 MiB - 512 B left: split
    assert allocator.malloc("tail", 2 * MiB - 512) == 2 * MiB - 512  # the rest, exactly
    assert allocator.reserved_bytes == 20 * MiB
    other = CachingAllocatorModel()
    assert other.malloc("whole", 19 * MiB) == 20 * MiB  # rest 1 MiB exactly: handed out whole
    assert other.allocated_bytes == other.peak_allocated_bytes == 20 * MiB
    assert other.requested_bytes("whole") == 19 * MiB


def test_a_small_block_is_split_down_to_512_bytes():
    allocator = CachingAllocatorModel()
    allocator.malloc("a", MiB)
    assert allocator.malloc("b", MiB - 512) == MiB - 512  # 512 B left: split
    assert allocator.malloc("c", 512) == 512  # fits the last 512 B of the segment
    assert allocator.reserved_bytes == 2 * MiB


def test_the_smallest_free_block_that_fits_is_taken():
    allocator = CachingAllocatorModel()
    for key, size in (("five", 5 * MiB), ("wall 1", 2 * MiB), ("three", 3 * MiB), ("wall 2", 2 * MiB)):
        allocator.malloc(key, size)  # one 20 MiB segment; 8 MiB left at its end
    allocator.free("five")
    allocator.free("three")
    assert allocator.malloc("x", 5 * MiB // 2) == 3 * MiB  # the 3 MiB block: 0.5 MiB left, handed out whole
    assert allocator.malloc("y", 4 * MiB + 512) == 5 * MiB  # the 5 MiB block, not the 8 MiB at the end
    assert allocator.malloc("z", 7 * MiB) == 8 * MiB  # the 8 MiB at the end, 1 MiB left: whole
    assert allocator.reserved_bytes == 20 * MiB


def test_freed_blocks_merge_with_free_neighbours_in_their_segment():
    allocator = CachingAllocatorModel()
    for key in "abc":
        allocator.malloc(key, 6 * MiB)  # 18 MiB of a 20 MiB segment
    allocator.free("a")
    allocator.free("b")
    assert allocator.malloc("d", 11 * MiB) == 12 * MiB  # a and b merged: 12 MiB, 1 MiB left: whole
    allocator.free("d")
    allocator.free("c")  # merges with a+b before it and the 2 MiB after it: the whole segment
    assert allocator.malloc("e", 19 * MiB) == 20 * MiB
    assert allocator.reserved_bytes == 20 * MiB


def test_blocks_of_different_segments_do_not_merge():
    allocator = CachingAllocatorModel()
    allocator.malloc("a", 12 * MiB)
    allocator.malloc("b", 12 * MiB)  # two 12 MiB segments, next to each other
    allocator.free("a")
    allocator.free("b")
    allocator.malloc("c", 20 * MiB)  # fits neither: a third segment
    assert allocator.reserved_bytes == 44 * MiB
    assert allocator.allocated_bytes == 20 * MiB


def test_peaks_follow_the_totals_and_restart_from_them():
    allocator = CachingAllocatorModel()
    allocator.malloc("a", 3 * MiB)
    allocator.malloc("b", 3 * MiB)
    allocator.free("a")
    assert (allocator.allocated_bytes, allocator.peak_allocated_bytes) == (3 * MiB, 6 * MiB)
    allocator.reset_peaks()
    assert allocator.peak_allocated_bytes == 3 * MiB
    assert allocator.peak_reserved_bytes == allocator.reserved_bytes == 20 * MiB


def test_a_resize_allocates_the_new_block_before_freeing_the_old():
    allocator = CachingAllocatorModel()
    allocator.malloc("grown", 4 * MiB)
    assert allocator.resize("grown", 8 * MiB) == 8 * MiB
    assert allocator.peak_allocated_bytes == 12 * MiB
    assert allocator.allocated_bytes == 8 * MiB
    assert allocator.requested_bytes("grown") == 8 * MiB


def test_a_key_that_holds_a_block_or_a_negative_size_is_refused():
    allocator = CachingAllocatorModel()
    allocator.malloc("a", 512)
    with pytest.raises(ValueError, match="already holds"):
        allocator.malloc("a", 512)
    with pytest.raises(ValueError, match="nbytes=-1"):
        allocator.malloc("b", -1)


def test_the_options_the_model_does_not_replay_are_named():
    """The model replays the default policy: options for host memory, locking, CUDA graphs, the memory fraction or
    how an OOM is raised change none of it; expandable segments, other split or rounding rules, garbage collection,
    another backend and options it does not know do."""
    neutral = {"pinned_use_cuda_host_register": "True", "pinned_num_register_threads": "8",
               "release_lock_on_cudamalloc": "True", "per_process_memory_fraction": "0.5",
               "graph_capture_record_stream_reuse": "True", "throw_on_cudamalloc_oom": "True",
               "expandable_segments": "False", "backend": "native"}
    assert unmodelled_options(neutral) == {}
    changed = {"expandable_segments": "True", "max_split_size_mb": "128", "roundup_power2_divisions": "[256:1,>:4]",
               "garbage_collection_threshold": "0.6", "backend": "cudaMallocAsync", "max_non_split_rounding_mb": "40",
               "a_future_option": "1"}
    assert unmodelled_options({**neutral, **changed}) == changed


def test_a_cuda_estimate_counts_the_blocks_handed_out_whole():
    # a weight of 11 MiB gets a 12 MiB segment whose 1 MiB rest is not split off: the weight, its gradient and
    # AdamW's two moments are four such blocks on CUDA, 4 MiB more than their bytes
    torch.manual_seed(0)
    model = nn.Linear(1024, 2816, bias=False)  # 1024 * 2816 * 4 bytes = 11 MiB
    batch = torch.randn(8, 1024)
    optimizer = torch.optim.AdamW(model.parameters())
    cuda = estimate_memory(model, batch, optimizer, target="cuda")
    cpu = estimate_memory(model, batch, optimizer, target="cpu")
    assert cuda.parameters_bytes == cpu.parameters_bytes == 11 * MiB  # the categories stay the tensors' bytes
    # the forward holds the four (the previous step's gradient is freed after it) and small tensors beside them
    assert 4 * 12 * MiB <= cuda.phase_peaks["forward"] - cuda.runtime_bytes < 4 * 12 * MiB + MiB
    assert 4 * 11 * MiB <= cpu.phase_peaks["forward"] < 4 * 11 * MiB + MiB
