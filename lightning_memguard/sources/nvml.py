"""Device memory as the driver sees it (NVML), sampled on a background thread.

NVML's "used" is what ``nvidia-smi`` shows: the allocator's reserved memory plus the CUDA context, other libraries
and other processes. A driver call per boundary would sit on the training thread, so a daemon thread samples at a
fixed interval and each boundary only reads the latest sample.
"""

from __future__ import annotations

import os
import threading
from typing import NamedTuple, Optional

from ..base.checks import warn


class NvmlReading(NamedTuple):
    used_bytes: Optional[int] = None
    total_bytes: Optional[int] = None
    process_bytes: Optional[int] = None  # this process; None where the driver hides it (e.g. containers)


_UNAVAILABLE = NvmlReading()


class NvmlSampler:
    """Samples NVML memory of one GPU every ``interval_s`` seconds.

    Args:
        uuid: the device's UUID as torch reports it (``torch.cuda.get_device_properties(i).uuid``). Mapping by UUID
            keeps the right GPU under ``CUDA_VISIBLE_DEVICES``.
        interval_s: seconds between samples.

    Without the ``nvidia-ml-py`` package or a driver, :meth:`latest` returns a reading of ``None`` values and one
    warning is issued; nothing raises.
    """

    def __init__(self, uuid: str, interval_s: float = 0.2) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s!r} must be > 0")
        self.uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        self.interval_s = interval_s
        self._latest = _UNAVAILABLE
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._nvml = None
        self._handle = None

    @property
    def available(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        if self._thread is not None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()  # reference-counted by the driver library; paired with nvmlShutdown in stop()
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(self.uuid)
            self._nvml = pynvml
        except Exception as err:  # ImportError, NVMLError_LibraryNotFound, NVMLError_NotFound, ...
            warn(f"lightning-memguard: NVML is unavailable ({err!r}), so the NVML columns stay empty.")
            return
        self._sample()  # one sample before training starts, so the first boundary already has numbers
        self._thread = threading.Thread(target=self._run, name="memguard-nvml", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1)
            self._thread = None
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
            self._handle = None

    def latest(self) -> NvmlReading:
        return self._latest

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        nvml, handle = self._nvml, self._handle
        try:
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            except (TypeError, AttributeError):  # older bindings without the v2 struct
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
            self._latest = NvmlReading(int(info.used), int(info.total), self._process_bytes(nvml, handle))
        except Exception:
            self._latest = _UNAVAILABLE

    @staticmethod
    def _process_bytes(nvml, handle) -> Optional[int]:
        try:
            processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            return None
        pid = os.getpid()
        for process in processes:
            if process.pid == pid and process.usedGpuMemory is not None:
                return int(process.usedGpuMemory)
        return None  # not listed: inside a container the driver reports host PIDs
