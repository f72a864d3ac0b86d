import warnings

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_lightning_tips():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(litlogger|litmodels|LeafSpec|does not have many workers).*")
        yield


@pytest.fixture(autouse=True)
def _no_dispatch_mode_left_behind():
    """Every test must leave torch's dispatch-mode stack as it found it: a mode left on would count (and slow) all
    later work in the process."""
    yield
    assert torch._C._len_torch_dispatch_stack() == 0, "a TorchDispatchMode was left active"
