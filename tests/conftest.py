import warnings

import pytest
import torch


# A rank of a finished multi-process run is now and then aborted at interpreter exit ("terminate called without an
# active exception"): a gloo worker thread lets go of a tensor after finalization began, under Lightning's launchers
# with or without the guard (unguarded reference runs too; adapters/worker_release.py covers the guard's own
# tensors). A test that fails that way, and only that way, runs once more; a second abort fails it. Set here, not in
# pyproject's addopts, so the suite also runs where pytest-rerunfailures is not installed (the GPU image has none).
_ABORTED_AT_EXIT = "terminated with signal SIGABRT"


def _rerun_plugin(config):
    return config.pluginmanager.hasplugin("rerunfailures")


def pytest_configure(config):
    if not _rerun_plugin(config):
        config.addinivalue_line("markers", "flaky(reruns, only_rerun): reruns a failed test (pytest-rerunfailures)")


def pytest_collection_modifyitems(config, items):
    if _rerun_plugin(config):
        for item in items:
            if item.get_closest_marker("flaky") is None:
                item.add_marker(pytest.mark.flaky(reruns=1, only_rerun=[_ABORTED_AT_EXIT]))
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


@pytest.fixture
def fresh_port():
    """For tests that launch ranks in this process (Lightning's ``ddp_spawn``): Lightning writes MASTER_PORT into
    this process's environment on the first launch and reuses it; a second launch (or a child process inheriting it)
    can then hit the previous run's port in TIME_WAIT."""
    import os

    names = ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    yield
    for name in names:
        os.environ.pop(name, None)
    os.environ.update(saved)


@pytest.fixture
def handoff_root(tmp_path, monkeypatch):
    """For tests of a fit run in other processes (``ddp_spawn``, ``ddp_fork``): the temporary directory the launching
    process names hand-off directories in (the ranks get its full path)."""
    import tempfile

    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _tree_status():
    """Files git sees as changed, new or ignored in the working tree (None outside a git checkout)."""
    import subprocess

    root = __file__.rsplit("/tests/", 1)[0]
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=normal"], cwd=root,
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    noise = (".venv", "__pycache__", ".pytest_cache", ".egg-info", ".hypothesis")
    return {line for line in out.splitlines() if not any(part in line for part in noise)}


def pytest_sessionstart(session):
    session.config._memguard_tree_before = _tree_status()


def pytest_sessionfinish(session, exitstatus):
    """Tests write only under temporary directories: the working tree must look the same after the suite."""
    before = getattr(session.config, "_memguard_tree_before", None)
    after = _tree_status()
    if before is None or after is None:
        return
    written = sorted(after - before)
    if written:
        print("\nThe test suite wrote outside its temporary directories:\n  " + "\n  ".join(written))
        session.exitstatus = 1


# hypothesis keeps no example database: the suite writes only under temporary directories
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("memguard", database=None, deadline=None)
_hypothesis_settings.load_profile("memguard")
