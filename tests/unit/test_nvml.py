import sys
import types
import warnings

import pytest

from lightning_memguard.sources.nvml import NvmlReading, NvmlSampler


def fake_pynvml(pid_usage):
    """A stand-in for the driver (this machine has none): records the UUID asked for and returns fixed numbers."""
    calls = {}
    module = types.ModuleType("pynvml")
    module.nvmlMemory_v2 = object()
    module.nvmlInit = lambda: calls.setdefault("init", 0)
    module.nvmlShutdown = lambda: calls.setdefault("shutdown", True)

    def by_uuid(uuid):
        calls["uuid"] = uuid
        return "handle"

    module.nvmlDeviceGetHandleByUUID = by_uuid
    module.nvmlDeviceGetMemoryInfo = lambda handle, version=None: types.SimpleNamespace(used=300, total=1000)
    module.nvmlDeviceGetComputeRunningProcesses = lambda handle: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in pid_usage.items()]
    return module, calls


def test_maps_by_uuid_and_reads_used_total_and_this_process(monkeypatch):
    import os

    module, calls = fake_pynvml({os.getpid(): 120, 1: 999})
    monkeypatch.setitem(sys.modules, "pynvml", module)
    sampler = NvmlSampler("1234-abcd", interval_s=0.01)
    sampler.start()
    try:
        assert sampler.available
        assert sampler.latest() == NvmlReading(300, 1000, 120)
    finally:
        sampler.stop()
    assert calls["uuid"] == "GPU-1234-abcd"
    assert calls["shutdown"] is True


def test_process_missing_from_the_list_is_none(monkeypatch):
    module, _ = fake_pynvml({1: 999})  # host PIDs only, as in containers
    monkeypatch.setitem(sys.modules, "pynvml", module)
    sampler = NvmlSampler("GPU-x", interval_s=0.01)
    sampler.start()
    sampler.stop()
    assert sampler.latest().process_bytes is None


def test_without_driver_values_are_none_with_one_warning(monkeypatch):
    module = types.ModuleType("pynvml")

    def no_driver():
        raise OSError("NVML Shared Library Not Found")

    module.nvmlInit = no_driver
    monkeypatch.setitem(sys.modules, "pynvml", module)
    sampler = NvmlSampler("GPU-x")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sampler.start()
    assert len([w for w in caught if "NVML is unavailable" in str(w.message)]) == 1
    assert sampler.latest() == NvmlReading(None, None, None)
    assert not sampler.available
    sampler.stop()


def test_bad_interval():
    with pytest.raises(ValueError, match="interval_s=0"):
        NvmlSampler("GPU-x", interval_s=0)
