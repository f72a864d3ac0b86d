"""The CUDA source's reading of the allocator's nested statistics, with the allocator scripted (this machine has no
GPU; tests/gpu checks the real thing)."""

import types

import pytest
import torch

from lightning_memguard.sources import CudaAllocatorSource
from lightning_memguard.sources.cuda import allocator_options, configured_allocator_options, expandable_segments_on


@pytest.fixture
def allocator(monkeypatch):
    state = {"resets": 0, "fraction": 0.5}
    stats = {
        "allocated_bytes": {"all": {"current": 100, "peak": 700, "allocated": 9, "freed": 9}, "large_pool": {}},
        "reserved_bytes": {"all": {"current": 1024, "peak": 2048}},
        "num_alloc_retries": 3,
        "num_ooms": 1,
        "inactive_split_bytes": {"all": {"current": 64, "peak": 128}},
    }
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: state.__setitem__("resets", state["resets"] + 1))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(total_memory=8000))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: state["fraction"],
                        raising=False)
    return state


def test_reads_allocated_peak_reserved_retries_and_ooms_and_resets_the_peak(allocator):
    source = CudaAllocatorSource("cuda:0")
    reading = source.read()
    assert tuple(reading) == (100, 700, 1024, 3, 1, 64)
    assert allocator["resets"] == 1
    source.read(reset_peak=False)
    assert allocator["resets"] == 1


def test_capacity_is_the_budget_or_total_times_the_memory_fraction(allocator):
    assert CudaAllocatorSource("cuda:0").capacity_bytes() == 4000
    assert CudaAllocatorSource("cuda:0", budget_bytes=123).capacity_bytes() == 123


def test_a_cpu_device_is_refused():
    with pytest.raises(ValueError, match="not a CUDA device"):
        CudaAllocatorSource("cpu")


def test_a_statistic_the_allocator_does_not_give_reads_as_zero(allocator, monkeypatch):
    stats = {"allocated_bytes": {"all": {"current": 100, "peak": 700}}, "num_ooms": 2}
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: stats)
    assert tuple(CudaAllocatorSource("cuda:0").read()) == (100, 700, 0, 0, 2, 0)


def test_allocator_settings_are_split_as_pytorch_splits_them():
    assert allocator_options("") == {}
    assert allocator_options(" expandable_segments : True ,max_split_size_mb:128,") == {
        "expandable_segments": "True", "max_split_size_mb": "128"}
    # a list value keeps its commas and colons; a later option replaces an earlier one of the same name
    assert allocator_options("roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:True,"
                             "expandable_segments:False") == {
        "roundup_power2_divisions": "[256:1,512:2,>:4]", "expandable_segments": "False"}
    assert expandable_segments_on("roundup_power2_divisions:[256:1,>:4],expandable_segments:true")
    assert not expandable_segments_on("expandable_segments:True,expandable_segments:False")


def test_the_configured_options_are_the_processs_and_both_environment_variables_read_now(monkeypatch):
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "max_split_size_mb:64", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert configured_allocator_options() == [{"max_split_size_mb": "64"}]
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")
    assert configured_allocator_options() == [{"max_split_size_mb": "64"}, {"garbage_collection_threshold": "0.6"},
                                              {"expandable_segments": "True"}]
