"""Every GPU test starts and ends with the device as a fresh process would have it: no per-process memory fraction,
no garbage of an earlier test (a dropped Trainer or guard sits in reference cycles, holding its model's memory until
the garbage collector runs), an empty cache and fresh peak statistics. Without this the tests depend on their order:
on an H100 a fraction or a collectable model left by one test made the next one fail or pass for the wrong reason."""

import pytest
import torch

from lightning_memguard.guard.oom import free_cached_memory


def _fresh_device() -> None:
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    free_cached_memory()  # gc.collect(), then the cache goes back to the driver
    torch.cuda.reset_peak_memory_stats(0)


@pytest.fixture(autouse=True)
def fresh_cuda_device():
    if not torch.cuda.is_available():
        yield
        return
    _fresh_device()
    yield
    _fresh_device()
