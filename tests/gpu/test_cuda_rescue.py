"""Real CUDA out-of-memory under a per-process memory fraction (skipped without CUDA)."""

import pickle

import lightning.pytorch as pl
import pytest
import torch

from lightning_memguard import MemGuardCallback
from lightning_memguard.estimate.cuda_kernels import workspace_sizes
from lightning_memguard.guard.oom import free_cached_memory
from lightning_memguard.mitigations.checkpointing import ActivationCheckpointing
from tests.models import BlockStack, trainer_kwargs

pytestmark = pytest.mark.gpu


def big_stack():
    return BlockStack(width=1024, depth=16, batch_size=4096, n_samples=8 * 4096)


def cuda_peak(tmp_path, checkpoint_all):
    model = big_stack()
    if checkpoint_all:
        rung = ActivationCheckpointing(model)
        rung.set_level(rung.max_level)
    guard = MemGuardCallback(mitigations=())
    pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path / str(checkpoint_all)), logger=False,
               **trainer_kwargs(accelerator="cuda", max_steps=3)).fit(model)
    free_cached_memory()
    return int(guard.history["peak_bytes"].max())


@pytest.fixture
def memory_fraction(tmp_path):
    plain, mitigated = cuda_peak(tmp_path, False), cuda_peak(tmp_path, True)
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = (plain + mitigated) / 2 / total
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    try:
        yield fraction * total
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        free_cached_memory()


def test_real_cuda_oom_is_rescued_and_the_snapshot_loads(tmp_path, memory_fraction):
    guard = MemGuardCallback(threshold=1.0, mitigations=("checkpointing",), plan_at_start=False)  # an OOM first
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path / "run"), logger=False,
                         **trainer_kwargs(accelerator="cuda", max_steps=4))
    trainer.fit(big_stack())
    assert trainer.global_step == 4
    rescues = guard.events[guard.events["action"] == "rescue"]
    assert len(rescues) >= 1
    snapshots = sorted((tmp_path / "run").glob("memguard_memory_snapshot_oom_step*.pickle"))
    assert snapshots
    with open(snapshots[0], "rb") as f:  # our own file from this run: trusted
        snapshot = pickle.load(f)
    assert snapshot["segments"]


def test_plain_training_runs_out_of_memory_under_the_same_fraction(tmp_path, memory_fraction):
    guard = MemGuardCallback(threshold=1.0, rescue_oom=False, mitigations=())  # plain: no rung, no plan
    with pytest.raises(torch.OutOfMemoryError):
        pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
                   **trainer_kwargs(accelerator="cuda", max_steps=4)).fit(big_stack())


def test_offload_moves_saved_activations_off_the_gpu(tmp_path):
    from lightning_memguard.mitigations.offload import ActivationOffload

    def allocated_after_forward(offload):
        model = big_stack()
        ActivationOffload(model, "cuda").set_level(int(offload))
        guard = MemGuardCallback(mitigations=())
        pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path / str(offload)), logger=False,
                   **trainer_kwargs(accelerator="cuda", max_steps=3)).fit(model)
        rows = guard.history[guard.history["step"] == 2].set_index("phase")
        free_cached_memory()
        return rows.loc["after_forward", "allocated_bytes"]

    # plain: parameters, optimizer state and ~2.6 GB of saved activations; offloaded: the activations are on the host
    assert allocated_after_forward(True) < 0.7 * allocated_after_forward(False)


def test_micro_batches_under_16_bit_mixed_precision_train_like_whole_batches(tmp_path):
    """On CUDA, 16-mixed has a GradScaler: every micro-batch's loss is scaled, the gradients unscaled once."""
    import copy

    torch.manual_seed(0)
    reference = BlockStack(width=256, depth=4, batch_size=512, lr=1e-3)
    split = copy.deepcopy(reference)
    probe = MemGuardCallback(mitigations=())
    pl.Trainer(callbacks=[probe], default_root_dir=str(tmp_path / "whole"), logger=False,
               **trainer_kwargs(accelerator="cuda", max_steps=4, precision="16-mixed")).fit(reference)
    last = probe.history[probe.history["step"] == 3].set_index("phase")
    static, peak = int(last.loc["batch_start", "allocated_bytes"]), int(last["peak_bytes"].max())
    # a limit 60 % of the way from what persists across steps to the whole batch's peak: the whole batch runs over
    # it, two micro-batches fit. (The micro-batch rung climbs when a step does not fit - a peak over the capacity or
    # an OOM - not at a mere threshold crossing, so the limit must be under the whole batch's peak itself.)
    guard = MemGuardCallback(budget=int(static + 0.6 * (peak - static)), mitigations=("microbatch",), min_gain=0.0)
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path / "split"), logger=False,
                         **trainer_kwargs(accelerator="cuda", max_steps=4, precision="16-mixed"))
    trainer.fit(split)
    assert guard.levels["microbatch"] >= 1
    assert trainer.strategy.precision_plugin.scaler is not None
    for (name, p), (_, q) in zip(split.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-3, rtol=1e-2, msg=name)


def test_a_cuda_rescue_frees_what_the_failed_attempt_allocated(tmp_path, memory_fraction):
    guard = MemGuardCallback(threshold=1.0, mitigations=("microbatch",), plan_at_start=False)  # an OOM first
    releases = []
    engine = guard.engine
    on_oom = engine.attempts.on_oom

    def watched(failure):  # at every rescue: live memory after the failed attempt was released, and at batch start
        releases.append((engine.recorder.pending_allocated("batch_start"), torch.cuda.memory_allocated()))
        return on_oom(failure)

    engine.attempts.on_oom = watched
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
                         **trainer_kwargs(accelerator="cuda", max_steps=3))
    trainer.fit(big_stack())
    assert trainer.global_step == 3 and releases
    # The failed forward/backward is gone. What may stay is what CUDA keeps for the process's life: the first matmul
    # of the failed attempt gives the thread's cuBLAS handle its workspaces (32 MiB + 1 MiB cuBLASLt on an H100; a
    # memory snapshot taken there attributed exactly those 33 MiB to the first Linear's forward), plus 1 MiB of slack.
    kept_for_the_process = sum(workspace_sizes())
    for start, after_release in releases:
        assert after_release <= start + kept_for_the_process + 2**20


def test_plan_at_start_on_cuda_estimates_without_touching_gpu_memory(tmp_path):
    """The plan runs a meta-device copy through the CUDA kernel model: no copy of the model on the GPU."""
    model = big_stack()
    total = torch.cuda.get_device_properties(0).total_memory
    guard = MemGuardCallback(budget=total, plan_at_start=True)
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
                         **trainer_kwargs(accelerator="cuda", max_steps=2))
    trainer.fit(model)
    plan = guard.events[guard.events["action"] == "plan"]
    assert len(plan) == 1 and "no change" in plan["reason"].iloc[0]
    first = guard.history[guard.history["step"] == 0].set_index("phase")
    # the batch-start peak covers the plan: no more than the model, its batch and the allocator's slack
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert first.loc["batch_start", "peak_bytes"] < 1.2 * params + 2**28
