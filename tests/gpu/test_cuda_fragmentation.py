"""Fragmentation of the real CUDA caching allocator, diagnosed by the engine (skipped without CUDA): blocks of
4 MiB fill 20 MiB segments, every other one is freed, and under a per-process memory fraction with no room for a
new segment a request of 8 MiB fails although the cache holds ten times that, in 4 MiB pieces."""

import pytest
import torch
from torch import nn

from lightning_memguard.base.host import Host
from lightning_memguard.base.snapshot import format_bytes
from lightning_memguard.guard.engine import MemGuardEngine
from lightning_memguard.guard.attempts import BatchState
from lightning_memguard.guard.oom import MemGuardOutOfMemoryError, free_cached_memory
from lightning_memguard.guard.settings import GuardSettings
from lightning_memguard.sources.cuda import expandable_segments_on

pytestmark = pytest.mark.gpu

MiB = 1024**2
BLOCK = 4 * MiB  # requests of 1-10 MB share 20 MiB segments: five blocks a segment
BLOCKS = 40
SEGMENT = 20 * MiB  # the caching allocator's segment for requests of 1-10 MB


@pytest.fixture
def fragmented_cache():
    """Live and free 4 MiB blocks alternating in every segment, and no room for one more segment."""
    if expandable_segments_on():
        pytest.skip("expandable_segments is on: segments grow in place and this layout cannot be made")
    free_cached_memory()
    blocks = [torch.empty(BLOCK, dtype=torch.uint8, device="cuda") for _ in range(BLOCKS)]
    kept = blocks[::2]
    del blocks  # every other block is freed: 4 MiB holes between live blocks, never merged
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 2 * MiB) / total, 0)
    try:
        yield kept
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        del kept
        free_cached_memory()


def test_an_oom_in_a_fragmented_cache_is_explained_with_the_numbers(tmp_path, fragmented_cache):
    warnings = []
    engine = MemGuardEngine(GuardSettings(mitigations=(), plan_at_start=False, explain=False), name="the test")
    model = nn.Linear(8, 8).cuda()
    engine.begin_fit(model, torch.device("cuda", 0), None, Host(warn=warnings.append))
    engine.start(list, str(tmp_path))
    free_in_holes = (BLOCKS // 2) * BLOCK
    reading = engine.source.read(reset_peak=False)
    assert reading.reserved_bytes - reading.allocated_bytes >= free_in_holes
    assert reading.inactive_split_bytes >= free_in_holes  # the holes are split blocks of live segments

    engine.batch_start(0, torch.randn(4, 8, device="cuda"))
    with pytest.raises(MemGuardOutOfMemoryError) as raised:
        engine.train_batch(lambda: torch.empty(2 * BLOCK, dtype=torch.uint8, device="cuda"), BatchState(),
                           release=lambda: None)
    engine.stop()

    report = raised.value.report
    numbers = report["fragmentation"]
    assert numbers is not None, report["text"]
    # the size PyTorch's message names: the request (8 MiB) in older releases; from torch 2.11 on an H100, the
    # 20 MiB segment the allocator tried to map for it (requests of 1-10 MB get segments of 20 MiB)
    assert numbers["kind"] == "oom" and numbers["requested_bytes"] in (2 * BLOCK, SEGMENT)
    # PyTorch's message states the cache at the failure: at least the holes, far more than the request
    assert numbers["reserved_free_bytes"] >= free_in_holes > numbers["requested_bytes"]
    assert numbers["inactive_split_bytes"] >= free_in_holes  # read after the failure: the holes cannot be released
    assert numbers["expandable_segments"] is False
    requested = format_bytes(numbers["requested_bytes"])
    assert f"fragmentation: a request of {requested} ran out of memory" in report["text"]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in report["text"]
    events = engine.events
    said = events[events["action"] == "fragmentation"]
    assert len(said) == 1 and said.iloc[0]["reason"] in report["text"]
    assert any("fragmentation" in warning for warning in warnings)
    history = engine.history
    assert (history["inactive_split_bytes"] >= free_in_holes).all()
