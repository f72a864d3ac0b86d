"""What the ranks' recovery costs on a quiet step (no OOM anywhere): CPU ranks (gloo) train copies of the same model
side by side, steps alternating between them in one run (the variants' order turns each step, so that every one sees
the same machine); the table gives the median step time of each, its ratio to the plain run of its kind, the
quartiles of the step-by-step ratios (each step against the plain run's same step: how far noise spreads them) and,
under FSDP2, the collectives a step issues.

- DDP: DistributedDataParallel with its built-in all-reduce, against the recovery's hook (torch's ``allreduce_hook``
  plus the mark kept from each reduced bucket) with the mark read after every backward, as the guard does.
- FSDP2 (``fully_shard`` on every block and the root): plain, against the same with
  :class:`~lightning_memguard.adapters.fsdp_recovery.FSDPRecovery` installed (FSDP2's own all-gathers and
  reduce-scatters, recorded; the news and parts-left flags in the smallest reduce-scatter) with the marks read after
  every backward, as the guard does; and against the whole plain-loop guard (``MemGuard.step``, the default ladder, a
  budget no step crosses, CSV files written, no TensorBoard).

The recovery adds no collective to a quiet step: under DDP the mark travels inside the buckets' all-reduces, under
FSDP2 inside the gradients' reduce-scatters. Every ``torch.distributed`` collective called from Python is counted
during each FSDP2 step: the guard's own are the guard's count less the plain run's.

    python benchmarks/rank_agreement.py [--ranks 2] [--steps 60]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

import _common  # noqa: F401  (puts this checkout first on sys.path)
import torch
import torch.distributed as dist
from torch import nn

from lightning_memguard import MemGuard
from lightning_memguard.adapters.ddp_recovery import DDPRecovery
from lightning_memguard.adapters.fsdp_recovery import FSDPRecovery
from tests.helpers import mse
from tests.models import Stack, regression_batches
from tests.ranks import gloo_group, wrap_for
from tests.spawn import spawn_ranks

WIDTH, DEPTH, BATCH = 256, 8, 64
WARMUP = 5  # steps not timed: DDP's bucket rebuild, FSDP2's first iteration (its sequence not yet known), allocations
BUDGET = "1GiB"  # a step of this model peaks at a few MB: nothing crosses the threshold
#: (label, kind, plain run of its kind) in the table's order
VARIANTS = (("DDP all-reduce", "ddp", "DDP all-reduce"),
            ("DDP with the recovery mark", "ddp", "DDP all-reduce"),
            ("FSDP2", "fsdp", "FSDP2"),
            ("FSDP2 with FSDPRecovery", "fsdp", "FSDP2"),
            ("FSDP2 under MemGuard", "fsdp", "FSDP2"))
#: the collectives FSDP2, the recovery and the guard may call (those a rank calls from Python)
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "reduce",
               "barrier", "all_to_all_single", "gather", "scatter")


class CollectiveCounter:
    """Counts the ``torch.distributed`` collectives called while :attr:`counting` is set (the outermost call only:
    one collective that calls another is one)."""

    def __init__(self) -> None:
        self.counting = False
        self.count = 0
        self._inside = False
        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._counted(getattr(dist, name)))

    def _counted(self, collective: Callable) -> Callable:
        @functools.wraps(collective)
        def counted(*args, **kwargs):
            if self._inside:
                return collective(*args, **kwargs)
            self._inside = True
            try:
                self.count += self.counting
                return collective(*args, **kwargs)
            finally:
                self._inside = False
        return counted

    def run(self, step: Callable[[], None]) -> tuple[float, int]:
        """``step``'s wall time and the collectives it called."""
        self.count, self.counting = 0, True
        start = time.perf_counter()
        try:
            step()
        finally:
            self.counting = False
        return time.perf_counter() - start, self.count


def _plain_step(model: nn.Module, optimizer, batch, recovery) -> None:
    """One optimizer step; with a recovery, its marks read after the backward, as the guard reads them."""
    optimizer.zero_grad(set_to_none=True)
    if recovery is not None:
        recovery.begin_attempt()
    mse(model, batch).backward()
    if recovery is not None and recovery.peer_failed():
        raise AssertionError("a quiet step read a mark")
    optimizer.step()


def _steppers(root: str) -> tuple[dict[str, Callable], MemGuard]:
    """Each variant's step on a batch (five copies of the same seeded model), and the guard (to close)."""
    steppers, guard = {}, None
    for label, kind, _ in VARIANTS:
        model = wrap_for(Stack(width=WIDTH, depth=DEPTH), kind)  # seeded: the same parameters in every copy
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        if label == "FSDP2 under MemGuard":
            guard = MemGuard(model, optimizer, budget=BUDGET, log_dir=os.path.join(root, "guard"), tensorboard=False)
            steppers[label] = functools.partial(guard.step, loss_fn=mse)
            continue
        recovery = None
        if "recovery" in label.lower():
            install = DDPRecovery.install if kind == "ddp" else FSDPRecovery.install
            recovery = install(model, print)
            assert recovery is not None, label
        steppers[label] = functools.partial(_plain_step, model, optimizer, recovery=recovery)
    return steppers, guard


def _worker(rank: int, root: str, ranks: int, steps: int) -> None:
    torch.set_num_threads(1)  # several ranks on a small machine: one thread each, or they fight over the cores
    _common.quiet()
    counter = CollectiveCounter()
    with gloo_group(rank, root, world_size=ranks):
        steppers, guard = _steppers(root)
        labels = [label for label, _, _ in VARIANTS]
        times: dict[str, list[float]] = {label: [] for label in labels}
        counts: dict[str, list[int]] = {label: [] for label in labels}
        for i, batch in enumerate(regression_batches(steps, size=BATCH)):
            turn = i % len(labels)
            for label in labels[turn:] + labels[:turn]:
                seconds, count = counter.run(lambda: steppers[label](batch=batch))
                counts[label].append(count)
                if i >= WARMUP:
                    times[label].append(seconds)
        guard.close()
        actions = set(guard.events["action"]) if len(guard.events) else set()
        # the guard's steps must have been quiet ones: no rung applied, planned or tried, no OOM rescued
        if actions & {"apply", "rescue", "rescue_split", "plan", "predicted_split", "speed_trial"}:
            raise AssertionError(f"the guard acted: {sorted(actions)}")
        peak = int(guard.history["peak_bytes"].max())
        with open(os.path.join(root, f"times.{rank}.json"), "w") as file:
            json.dump({"times": times, "counts": counts, "guard_peak": peak,
                       "guard_events": sorted(actions)}, file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="CPU processes (gloo), one thread each")
    parser.add_argument("--steps", type=int, default=60, help=f"steps of each variant, the first {WARMUP} untimed")
    args = parser.parse_args()
    _common.quiet()
    root = tempfile.mkdtemp()
    spawn_ranks(_worker, (root, args.ranks, args.steps), nprocs=args.ranks, timeout_s=1800)
    results = [json.load(open(os.path.join(root, f"times.{rank}.json"))) for rank in range(args.ranks)]
    print(f"Stack(width={WIDTH}, depth={DEPTH}), SGD, {BATCH} samples a rank, {args.ranks} CPU ranks (gloo), "
          f"{args.steps - WARMUP} timed steps each, variants alternating, one thread a rank; torch {torch.__version__}")
    print()
    print("| variant | median ms | ratio | paired ratio: quartiles | collectives a step (first step) "
          "| the guard's own a quiet step |")
    print("|---|---:|---:|---:|---:|---:|")
    median = {label: statistics.median(t for r in results for t in r["times"][label]) for label, _, _ in VARIANTS}
    for label, kind, plain in VARIANTS:
        counted = "—"
        own = "—"
        if kind == "fsdp":  # DDP's built-in all-reduce is issued from C++: not counted
            quiet = {c for r in results for c in r["counts"][label][1:]}
            first = {r["counts"][label][0] for r in results}
            counted = f"{'/'.join(map(str, sorted(quiet)))} ({'/'.join(map(str, sorted(first)))})"
            if label != plain:
                extra = {c - p for r in results for c, p in zip(r["counts"][label][1:], r["counts"][plain][1:])}
                own = "/".join(map(str, sorted(extra)))
        # each step's time over the plain run's at the same step on the same rank (run back to back): how far the
        # machine's noise spreads a ratio
        paired = [t / p for r in results for t, p in zip(r["times"][label], r["times"][plain])]
        low, _, high = statistics.quantiles(paired, n=4)
        print(f"| {label} | {median[label] * 1e3:.2f} | {median[label] / median[plain]:.3f} | {low:.2f}-{high:.2f} "
              f"| {counted} | {own} |")
    print()
    print(f"The guard's budget {BUDGET}; its steps peaked at {max(r['guard_peak'] for r in results) / 2**20:.1f} MiB "
          f"(no rung applied, no OOM); its events: {sorted(set().union(*(r['guard_events'] for r in results)))}")


if __name__ == "__main__":
    sys.exit(main())
