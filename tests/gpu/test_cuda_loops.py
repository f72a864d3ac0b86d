"""The plain-loop and Fabric guards under a real CUDA memory fraction (skipped without CUDA)."""

import traceback

import pytest
import torch
import torch.nn.functional as F

from lightning_memguard import FabricMemGuard, MemGuard
from lightning_memguard.guard.oom import free_cached_memory
from lightning_memguard.mitigations.checkpointing import ActivationCheckpointing
from tests.models import Stack

pytestmark = pytest.mark.gpu

STEPS = 4


def cuda_batches():
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        x = torch.randn(4096, 16, generator=generator)
        out.append((x.cuda(), x.sum(dim=1, keepdim=True).sin().cuda()))
    return out


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def big_stack():
    torch.manual_seed(0)
    return Stack(width=1024, depth=16)


def train(front, root, model, **settings):
    """Trains STEPS steps through one front door; returns the guard (closed)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if front == "fabric":
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cuda", devices=1)
        model, optimizer = fabric.setup(model, optimizer)
        guard = FabricMemGuard(fabric, model, optimizer, **settings)
    else:
        guard = MemGuard(model.cuda(), optimizer, log_dir=str(root), tensorboard=False, **settings)
    with guard:
        for batch in cuda_batches():
            guard.step(batch, mse)
    return guard


@pytest.fixture
def fraction_between_plain_and_checkpointed(tmp_path):
    def peak(checkpoint_all):
        model = big_stack()
        if checkpoint_all:
            ActivationCheckpointing(model).set_level(16)
        guard = train("loop", tmp_path / f"probe{checkpoint_all}", model, mitigations=())
        free_cached_memory()
        return int(guard.history["peak_bytes"].max())

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((peak(False) + peak(True)) / 2 / total, 0)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        free_cached_memory()


@pytest.mark.parametrize("front", ["loop", "fabric"])
def test_a_real_cuda_oom_is_rescued_on_the_same_batch(tmp_path, front, fraction_between_plain_and_checkpointed):
    try:  # the fraction binds: unguarded, the first step runs out
        train(front, tmp_path / "plain", big_stack(), mitigations=(), rescue_oom=False)
    except torch.OutOfMemoryError as err:
        traceback.clear_frames(err.__traceback__)  # the failed run's model and optimizer go with its frames
    else:
        pytest.fail("plain training fitted under the fraction")
    free_cached_memory()
    guard = train(front, tmp_path / "guarded", big_stack(), threshold=1.0, mitigations=("checkpointing",),
                  plan_at_start=False)  # the rescue is tested, not the plan before the first step
    assert guard.global_step == STEPS
    actions = set(guard.events["action"])
    assert "rescue" in actions and "gave_up" not in actions
    assert guard.levels["checkpointing"] >= 1


def checkpointed_probe(root):
    """(what persists across steps, the step peak) of the model with every block checkpointed. A function of its
    own so the probe's model dies with it: kept in the fixture's frame through the test, its parameters, gradients
    and momentum (1.1 GB) filled the fraction on an H100 and no rung could fit the batch."""
    model = big_stack()
    ActivationCheckpointing(model).set_level(16)
    history = train("loop", root, model, mitigations=()).history
    steady = history[history["step"] >= 1]
    # parameters, gradients and momentum: what persists (the loop zeroes gradients before batch start, and they
    # stay through every micro-batch's backward after the first)
    held = int(steady[steady["phase"] == "after_optimizer_step"]["allocated_bytes"].max())
    return held, int(steady["peak_bytes"].max())


@pytest.fixture
def fraction_where_only_micro_batches_fit(tmp_path):
    """A memory fraction under which every block checkpointed does not fit, nor do 2 micro-batches of it."""
    held, peak = checkpointed_probe(tmp_path / "probe")
    free_cached_memory()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((held + 0.6 * (peak - held)) / total, 0)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        free_cached_memory()


def test_where_only_micro_batches_fit_one_cuda_oom_is_enough(tmp_path, fraction_where_only_micro_batches_fit):
    """The rescue applies all blocks checkpointed and the micro-batch level the estimate predicts, together. (Written
    without a GPU: the CPU twin is test_where_only_micro_batches_of_a_checkpointed_model_fit_one_oom_is_enough.)"""
    guard = train("loop", tmp_path / "guarded", big_stack(), mitigations=("checkpointing", "microbatch"),
                  plan_at_start=False)  # the rescue is tested, not the plan before the first step
    assert guard.global_step == STEPS
    rescues = guard.events[guard.events["action"] == "rescue"]
    assert sum("retrying the batch" in reason for reason in rescues["reason"]) == 1  # one failed attempt
    assert guard.levels["checkpointing"] >= 1 and guard.levels["microbatch"] >= 1


def test_where_the_estimate_says_the_step_cannot_fit_the_default_plans_it_before_step_0(
        tmp_path, fraction_where_only_micro_batches_fit):
    """The default (plan_at_start=None): the levels are set before the first step from the CUDA estimate; at most
    one OOM where the estimate falls short (then one rescue, scaled up to the capacity, fits)."""
    guard = train("loop", tmp_path / "guarded", big_stack(), mitigations=("checkpointing", "microbatch"))
    assert guard.global_step == STEPS
    events = guard.events
    assert set(events[events["action"] == "plan"]["step"]) == {0}
    rescues = events[events["action"] == "rescue"]
    assert sum("retrying the batch" in reason for reason in rescues["reason"]) <= 1
    assert int(guard.history["num_ooms"].max()) - int(guard.history["num_ooms"].min()) <= 1
