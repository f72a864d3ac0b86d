"""Per-rank estimate vs measured, on CPU ranks (gloo): for DDP and FSDP2 (fully_shard on every block and the root),
the estimate of one rank from the unsharded model in one process (``estimate_memory(..., strategy=, world_size=)``)
next to what the plain-loop guard measures on each rank, per phase; the single-process estimate as the baseline; and
the time of the per-rank estimate next to the single-process one.

The loop zeroes gradients before the forward and the estimate follows Lightning's order (the previous step's
gradients alive in the forward), so the forward is shown both ways: measured, and measured plus the gradients a rank
holds (its shard's under FSDP2).

    .venv/bin/python benchmarks/per_rank.py            # DDP and FSDP2, 2 and 4 CPU ranks
    .venv/bin/python benchmarks/per_rank.py --device cuda --world-sizes 1 --strategies fsdp   # gpu_check's row

On CUDA the ranks use NCCL, one GPU each, and the estimate is the CUDA one (``target="cuda"``): with one rank, FSDP2's
own gathering and resharding on a real device, against the estimate of one rank of one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager

import _common  # noqa: F401  (puts this checkout first on sys.path)
import torch
import torch.multiprocessing as mp

from lightning_memguard import MemGuard, estimate_memory
from tests.helpers import mse
from tests.models import Stack, regression_batches
from tests.ranks import gloo_group, wrap_for

WIDTH, DEPTH, BATCH, STEPS = 128, 8, 128, 3
ROWS = {"forward": "after_forward", "backward": "after_backward", "optimizer_step": "after_optimizer_step"}


@contextmanager
def process_group(rank: int, root: str, world_size: int, device: str):
    """gloo on CPU; on CUDA, NCCL with one GPU a rank (met through a file under ``root``)."""
    if device == "cpu":
        with gloo_group(rank, root, world_size=world_size):
            yield
        return
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{os.path.join(root, 'rendezvous')}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _worker(rank: int, root: str, world_size: int, strategy: str, device: str) -> None:
    with process_group(rank, root, world_size, device):
        on = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
        model = wrap_for(Stack(width=WIDTH, depth=DEPTH).to(on), strategy)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        with MemGuard(model, optimizer, tensorboard=False, cpu_sample_every=1, explain=False, mitigations=()) as guard:
            for batch in regression_batches(STEPS, size=BATCH):
                guard.step([t.to(on) for t in batch], mse)
        history = guard.history[guard.history["step"] >= 1]
        peaks = {phase: int(history[history["phase"] == row]["peak_bytes"].max()) for phase, row in ROWS.items()}
        grads = sum(p.grad.to_local().numel() if hasattr(p.grad, "to_local") else p.grad.numel()
                    for p in model.parameters() if p.grad is not None) * 4
        with open(os.path.join(root, f"measured.{rank}.json"), "w") as file:
            json.dump({"peaks": peaks, "grads": grads}, file)


def measure(world_size: int, strategy: str, device: str) -> list[dict]:
    root = tempfile.mkdtemp()
    mp.spawn(_worker, args=(root, world_size, strategy, device), nprocs=world_size, join=True)
    return [json.load(open(os.path.join(root, f"measured.{rank}.json"))) for rank in range(world_size)]


def timed_estimate(target: str, **kwargs):
    start = time.perf_counter()
    estimate = estimate_memory(Stack(width=WIDTH, depth=DEPTH), regression_batches(1, size=BATCH)[0],
                               optimizer=torch.optim.Adam, loss_fn=mse, target=target, **kwargs)
    return estimate, time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", choices=("ddp", "fsdp"), nargs="+", default=["ddp", "fsdp"])
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < max(args.world_sizes):
        parser.error(f"--device cuda needs {max(args.world_sizes)} GPUs; this machine has "
                     f"{torch.cuda.device_count()}")
    _common.quiet()
    one, one_s = timed_estimate(args.device)
    backend = "NCCL, one GPU a rank" if args.device == "cuda" else "gloo"
    print(f"Stack(width={WIDTH}, depth={DEPTH}), Adam, {BATCH} samples a rank, {args.device.upper()} ({backend}); "
          f"MiB; single-process estimate {one.peak_bytes / 2**20:.2f} MiB in {one_s:.2f} s")
    print(f"{'strategy':<8} {'ranks':>5} {'phase':<15} {'estimate':>9} {'measured':>9} {'+grads':>9} "
          f"{'ratio':>6} {'1-proc':>7} {'est. s':>7}")
    for strategy in args.strategies:
        for world_size in args.world_sizes:
            estimate, seconds = timed_estimate(args.device, strategy=strategy, world_size=world_size)
            ranks = measure(world_size, strategy, args.device)
            for phase in ROWS:
                measured = max(rank["peaks"][phase] for rank in ranks)  # the worst rank (all train alike here)
                lightning_order = measured + (max(r["grads"] for r in ranks) if phase == "forward" else 0)
                print(f"{strategy:<8} {world_size:>5} {phase:<15} {estimate.phase_peaks[phase] / 2**20:>9.2f} "
                      f"{measured / 2**20:>9.2f} {lightning_order / 2**20:>9.2f} "
                      f"{estimate.phase_peaks[phase] / lightning_order:>6.3f} "
                      f"{one.phase_peaks[phase] / 2**20:>7.2f} {seconds:>7.2f}")


if __name__ == "__main__":
    sys.exit(main())
