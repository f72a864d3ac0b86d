"""Run on a machine with a CUDA device (skipped elsewhere)."""

import lightning.pytorch as pl
import pytest
import torch

from lightning_memguard import MemGuardCallback
from lightning_memguard.base.snapshot import MiB
from lightning_memguard.sources import CudaAllocatorSource, NvmlSampler
from tests.models import BlockStack, trainer_kwargs

pytestmark = pytest.mark.gpu


def test_cuda_peak_matches_a_known_allocation():
    source = CudaAllocatorSource(0)
    source.start()
    base = source.read()
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    del x
    reading = source.read()
    # the caching allocator rounds large blocks to 2 MiB; 64 MiB is already a multiple
    assert reading.peak_bytes - base.allocated_bytes == 64 * MiB
    assert reading.allocated_bytes == base.allocated_bytes
    assert reading.reserved_bytes >= 64 * MiB
    assert source.read().peak_bytes == base.allocated_bytes  # reset per phase


def test_nvml_used_is_at_least_torch_reserved():
    keep = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    sampler = NvmlSampler(str(torch.cuda.get_device_properties(0).uuid), interval_s=0.05)
    sampler.start()
    try:
        reading = sampler.latest()
        assert reading.used_bytes is not None
        assert reading.used_bytes >= torch.cuda.memory_reserved(0)
        assert reading.total_bytes >= torch.cuda.get_device_properties(0).total_memory * 0.9
    finally:
        sampler.stop()
    del keep


def test_callback_on_cuda_records_allocator_and_nvml(tmp_path):
    guard = MemGuardCallback()
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path),
                         **trainer_kwargs(accelerator="cuda", max_steps=4, logger=False))
    trainer.fit(BlockStack(batch_size=1024))
    history = guard.history
    assert history["device"].str.startswith("cuda").all()
    assert (history["reserved_bytes"] >= history["allocated_bytes"]).all()
    assert history["nvml_used_bytes"].notna().any()
    forward = history[history["phase"] == "after_forward"]
    assert (forward["peak_bytes"] > 0).all()
