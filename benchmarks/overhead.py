"""How much does MemGuardCallback add to a training step? Compared with no callback and Lightning's
DeviceStatsMonitor, interleaved in one run (this machine is noisy: only ratios from one run mean anything).

    .venv/bin/python benchmarks/overhead.py [--steps 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics

import lightning.pytorch as pl
import torch
from _common import StepTimer, quiet
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.loggers import CSVLogger

from lightning_memguard import MemGuardCallback
from lightning_memguard.commands.demo import DemoTransformer

WARMUP_STEPS = 5


def run(config: str, steps: int, accelerator: str, model_kwargs: dict, log_dir: str) -> float:
    timer = StepTimer()
    callbacks = {
        "none": [],
        "memguard": [MemGuardCallback()],
        "memguard_every_step": [MemGuardCallback(cpu_sample_every=1)],  # the CPU cost when guarding a budget
        "device_stats": [DeviceStatsMonitor()],
    }[config]
    trainer = pl.Trainer(max_steps=steps + WARMUP_STEPS, accelerator=accelerator, devices=1,
                         callbacks=[timer, *callbacks], logger=CSVLogger(log_dir, name=config),
                         log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    pl.seed_everything(0, verbose=False)
    trainer.fit(DemoTransformer(**model_kwargs))
    # the mean, not the median: with sampled CPU counting most steps are uncounted and a median would hide the rest
    return timer.mean(skip=WARMUP_STEPS)


def history_write_seconds(log_dir: str, steps: int = 2000) -> float:
    """Seconds per optimizer step to stream its four history rows to CSV and hand them to the OS (every step, so a
    run killed hard loses at most the step in progress)."""
    import os
    import time

    from lightning_memguard.base.snapshot import PHASES, MemorySnapshot
    from lightning_memguard.monitor.history import MemoryHistory

    history = MemoryHistory()
    history.attach_csv(os.path.join(log_dir, "flush_bench.csv"))
    rows = [MemorySnapshot(0, phase, "cpu", 123_456_789, 234_567_890, capacity_bytes=10**9, time=time.time())
            for phase in PHASES]
    start = time.perf_counter()
    for _ in range(steps):
        for row in rows:
            history.add(row)
        history.flush()
    elapsed = (time.perf_counter() - start) / steps
    history.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="/tmp/memguard_bench_overhead")
    args = parser.parse_args()
    quiet()
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    # on GPU a step of >= 10 ms, as the target asks; on CPU the demo model
    model_kwargs = dict(batch_size=64, seq_len=256, d_model=512, d_ff=2048, nlayers=6) if accelerator == "cuda" else {}
    configs = ["none", "memguard", "device_stats"]
    if accelerator == "cpu":
        configs.insert(2, "memguard_every_step")
    medians: dict[str, list[float]] = {c: [] for c in configs}
    for round_index in range(args.rounds):
        shift = round_index % len(configs)
        order = configs[shift:] + configs[:shift]  # rotate so no config always goes first
        for config in order:
            medians[config].append(run(config, args.steps, accelerator, model_kwargs, args.out))
    base = statistics.median(medians["none"])
    device = torch.cuda.get_device_name() if accelerator == "cuda" else "cpu"
    print(f"\ndevice: {device}; torch {torch.__version__}; lightning {pl.__version__}; "
          f"{args.rounds} rounds x {args.steps} steps, mean step time per run, median over runs")
    print(f"{'config':<22}{'step ms':>10}{'vs none':>10}{'overhead':>10}")
    for config in configs:
        value = statistics.median(medians[config])
        print(f"{config:<22}{value * 1e3:>10.2f}{value / base:>10.3f}{(value / base - 1) * 100:>9.1f}%")
    flush = history_write_seconds(args.out)
    print(f"history rows written and flushed every step: {flush * 1e6:.1f} us per step = "
          f"{flush / base * 100:.3f} % of the plain step")
    memguard_extra = statistics.median(medians["memguard"]) - base
    stats_extra = statistics.median(medians["device_stats"]) - base
    if stats_extra > 0:
        print(f"memguard overhead / device_stats overhead = {memguard_extra / stats_extra:.2f}")


if __name__ == "__main__":
    main()
