"""What the ranks' recovery costs on a quiet step (no OOM anywhere): two CPU ranks (gloo) train the same
DistributedDataParallel model side by side, one with DDP's built-in all-reduce, one through the recovery's hook
(torch's allreduce_hook plus the mark kept from each reduced bucket) with the mark read after every backward, as the
guard does. Steps alternate between the two in one run; the table gives the median step time of each and their
ratio. The recovery adds no collective to a quiet step: its hook runs the same one all-reduce a bucket as DDP's,
and the mark travels inside it (the agreement's one small all-reduce runs only after an OOM).

    python benchmarks/rank_agreement.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import _common  # noqa: F401  (puts this checkout first on sys.path)
import torch
import torch.multiprocessing as mp
from torch import nn

from lightning_memguard.adapters.ddp_recovery import DDPRecovery
from tests.helpers import gloo_group, mse
from tests.models import Stack, regression_batches

WIDTH, DEPTH, BATCH, STEPS = 256, 8, 64, 60


def _step(model: nn.Module, optimizer, batch, recovery) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    if recovery is not None:
        recovery.begin_attempt()
    mse(model, batch).backward()
    if recovery is not None and recovery.peer_failed():
        raise AssertionError("a quiet step read a mark")
    optimizer.step()
    return time.perf_counter() - start


def _worker(rank: int, root: str) -> None:
    torch.set_num_threads(1)  # two ranks on a small machine: one thread each, or they fight over the cores
    with gloo_group(rank, root):
        torch.manual_seed(0)
        plain = nn.parallel.DistributedDataParallel(Stack(width=WIDTH, depth=DEPTH))
        torch.manual_seed(0)
        marked = nn.parallel.DistributedDataParallel(Stack(width=WIDTH, depth=DEPTH))
        recovery = DDPRecovery.install(marked, print)
        optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in (("plain", plain),
                                                                                     ("marked", marked))}
        batches = regression_batches(STEPS, size=BATCH)
        times: dict[str, list[float]] = {"plain": [], "marked": []}
        for i, batch in enumerate(batches):  # alternating, so that both see the same machine
            for name, model, rec in (("plain", plain, None), ("marked", marked, recovery))[:: 1 if i % 2 else -1]:
                seconds = _step(model, optimizers[name], batch, rec)
                if i >= 5:  # after DDP's bucket rebuild and the first steps' allocations
                    times[name].append(seconds)
        with open(os.path.join(root, f"times.{rank}.json"), "w") as file:
            json.dump({"times": times}, file)


def main() -> None:
    _common.quiet()
    root = tempfile.mkdtemp()
    mp.spawn(_worker, args=(root,), nprocs=2, join=True)
    ranks = [json.load(open(os.path.join(root, f"times.{rank}.json"))) for rank in range(2)]
    print(f"Stack(width={WIDTH}, depth={DEPTH}), SGD, {BATCH} samples a rank, 2 CPU ranks (gloo), "
          f"{STEPS - 5} timed steps each, alternating, one thread a rank")
    print(f"{'variant':<28} {'median ms':>10} {'ratio':>7}")
    plain = statistics.median(t for r in ranks for t in r["times"]["plain"])
    marked = statistics.median(t for r in ranks for t in r["times"]["marked"])
    print(f"{'DDP all-reduce':<28} {plain * 1e3:>10.2f} {1.0:>7.3f}")
    print(f"{'with the recovery mark':<28} {marked * 1e3:>10.2f} {marked / plain:>7.3f}")


if __name__ == "__main__":
    sys.exit(main())
