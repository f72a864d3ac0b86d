"""How much does MemGuard add to a training step?

1. MemGuard's own microseconds per optimizer step, on the CPU, with the CUDA allocator's reading replaced by a stub
   that answers with fixed numbers (:class:`StubCudaSource`): everything MemGuard does around a CUDA step except the
   allocator calls themselves, so it is tracked on any machine. Measured as the thread CPU time per step with the guard
   minus without it, paired rounds interleaved, for the plain-loop guard (``MemGuard.step``) and for the Lightning
   callback, on models small enough that MemGuard's part shows: one 16 x 16 layer (2 parameter tensors), and 100 of
   them (200 tensors: MemGuard's cost per parameter tensor, as a real model has hundreds); a Python yardstick
   (``sum(range(1000))``) says how fast this machine runs Python.
2. On CUDA, the step time with no callback, MemGuardCallback and Lightning's DeviceStatsMonitor side by side: at a
   short step (a GPT-2-like TinyGPT, 2 layers, d_model 256, 8 x 256 tokens) and a longer one (the demo model); on the
   CPU the demo model, with the CPU accountant. On CUDA also MemGuard with NVML sampled once (its driver calls out of
   the step), on the CPU with every step counted. Each mean is printed beside the median and slowest timed step and
   the garbage collections of the oldest generation, so a steady cost can be told from a few slow steps.

Interleaved in one run (machines are noisy: only ratios from one run mean anything).

    .venv/bin/python benchmarks/overhead.py [--steps 30] [--rounds 3] [--cpu-rounds 5] [--cpu-steps 300]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
import timeit

import lightning.pytorch as pl
import torch
from _common import StepTimer, quiet
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_memguard.monitor.monitor as monitor_module
from lightning_memguard import MemGuard, MemGuardCallback
from lightning_memguard.commands.demo import DemoTransformer, TinyGPT
from lightning_memguard.sources.cuda import CudaAllocatorSource

WARMUP_STEPS = 5
CPU_WARMUP_STEPS = 20
#: the short step of the GPU comparison: a GPT-2-like decoder, 2 layers of d_model 256, 8 x 256 tokens, GPT-2's
#: vocabulary (about 9 ms a step on an H100)
SHORT_STEP_MODEL = dict(vocab_size=50257, d_model=256, nhead=4, nlayers=2, seq_len=256, batch_size=8)
#: a longer step (>= 10 ms on a GPU); on the CPU the demo model's defaults
LONG_STEP_MODEL = dict(batch_size=64, seq_len=256, d_model=512, d_ff=2048, nlayers=6)


# --- 1. MemGuard's own time per step on the CPU, the CUDA reading stubbed ---------------------------------------------
def _stats(allocated: int, peak: int, reserved: int) -> dict:
    """Statistics shaped as the CUDA caching allocator returns them (nested, every pool and metric), so that reading
    them costs what it costs on CUDA."""
    def stat(current: int, top: int) -> dict:
        row = {"current": current, "peak": top, "allocated": 10 * top, "freed": 10 * top - current}
        return {"all": row, "large_pool": dict(row), "small_pool": {k: v // 100 for k, v in row.items()}}

    stats = {name: stat(allocated, peak) for name in ("allocated_bytes", "active_bytes", "requested_bytes")}
    stats.update({name: stat(reserved, reserved) for name in ("reserved_bytes", "segment")})
    stats.update({name: stat(100, 200) for name in ("allocation", "active", "inactive_split")})
    stats["inactive_split_bytes"] = stat(2**20, 2**21)
    stats.update(num_alloc_retries=0, num_ooms=0, num_sync_all_streams=0, num_device_alloc=12, num_device_free=3,
                 max_split_size=-1, oversize_allocations=stat(0, 0), oversize_segments=stat(0, 0))
    return stats


class StubCudaSource(CudaAllocatorSource):
    """The CUDA allocator's source with the allocator's two calls answered by fixed numbers (the GPU's part of a read
    is not measured; everything MemGuard does with it is)."""

    STATS = _stats(allocated=300 * 2**20, peak=600 * 2**20, reserved=800 * 2**20)

    def __init__(self) -> None:
        super().__init__("cuda:0", budget_bytes=8 * 2**30)

    def allocator_stats(self) -> dict:
        return self.STATS

    def reset_peak(self) -> None:
        pass


@contextlib.contextmanager
def stub_cuda_reading():
    """Every guard started inside reads :class:`StubCudaSource` instead of the source chosen for its device."""
    open_source = monitor_module.open_source
    monitor_module.open_source = lambda *args, **kwargs: (StubCudaSource(), None, False)
    try:
        yield
    finally:
        monitor_module.open_source = open_source


#: the CPU figure's models: a single layer (MemGuard's fixed cost a step) and a stack of many small layers (what it
#: costs per parameter tensor: a real model has hundreds, each walked for its gradient twice a step)
CPU_MODELS = {"1 layer": 1, "100 layers": 100}


def linear_stack(layers: int) -> nn.Module:
    """``layers`` 16 x 16 linear layers in a row (2 parameter tensors each)."""
    return nn.Linear(16, 16) if layers == 1 else nn.Sequential(*(nn.Linear(16, 16) for _ in range(layers)))


class TinyRegression(pl.LightningModule):
    """16 x 16 linear layers (:func:`linear_stack`) on batches of 8 samples: a step of almost nothing but the loop's
    own work."""

    def __init__(self, layers: int = 1) -> None:
        super().__init__()
        self.layer = linear_stack(layers)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        return nn.functional.mse_loss(self.layer(inputs), target)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        # one epoch longer than any run: an epoch's end is Lightning's work, and it resets what self.log keeps
        samples = 8 * 4096
        data = TensorDataset(torch.randn(samples, 16, generator=generator),
                             torch.randn(samples, 16, generator=generator))
        return DataLoader(data, batch_size=8)


class ThreadTimer(pl.Callback):
    """This thread's CPU time at every batch start (time spent waiting for the CPU is not counted)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.times.append(time.thread_time())


def _median_step(times: list[float]) -> float:
    """The median step: a step the machine's other work slowed down does not count (guard and plain alike)."""
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def loop_step_seconds(guarded: bool, steps: int, log_dir: str, layers: int = 1) -> float:
    """CPU seconds per plain-loop step of :class:`TinyRegression`'s layers, under ``MemGuard.step`` or bare."""
    torch.manual_seed(0)
    model = linear_stack(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = (torch.randn(8, 16), torch.randn(8, 16))

    def loss_fn(m, b):
        return nn.functional.mse_loss(m(b[0]), b[1])

    guard = MemGuard(model, optimizer, budget=8 * 2**30, log_dir=log_dir, tensorboard=False) if guarded else None

    def step():
        if guard is not None:
            guard.step(batch, loss_fn)
        else:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            optimizer.step()

    for _ in range(CPU_WARMUP_STEPS):  # the guard's first step plans; not a step of the run's steady state
        step()
    times = []
    for _ in range(steps):
        times.append(time.thread_time())
        step()
    times.append(time.thread_time())
    if guard is not None:
        guard.close()
    return _median_step(times)


def lightning_step_seconds(guarded: bool, steps: int, log_dir: str, layers: int = 1) -> float:
    """CPU seconds per step of :class:`TinyRegression` under a Trainer, with MemGuardCallback's defaults or none."""
    timer = ThreadTimer()
    callbacks = [timer, MemGuardCallback(budget=8 * 2**30)] if guarded else [timer]
    trainer = pl.Trainer(max_steps=steps + CPU_WARMUP_STEPS, accelerator="cpu", devices=1, callbacks=callbacks,
                         logger=CSVLogger(log_dir, name="guarded" if guarded else "plain"), log_every_n_steps=50,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(TinyRegression(layers))
    return _median_step(timer.times[CPU_WARMUP_STEPS:])


def memguard_cpu_microseconds(rounds: int, steps: int, log_dir: str) -> dict[tuple[str, str], tuple[float, ...]]:
    """Per front door and model (:data:`CPU_MODELS`): (plain step, guarded step, MemGuard's own) in microseconds,
    medians of paired rounds."""
    torch.set_num_threads(1)  # one thread: its CPU time is the step's
    results = {}
    with stub_cuda_reading():
        for name, measure, n in (("plain loop: MemGuard.step", loop_step_seconds, 4 * steps),
                                 ("Lightning: MemGuardCallback", lightning_step_seconds, steps)):
            for model, layers in CPU_MODELS.items():
                plain, guarded = [], []
                for round_index in range(rounds):
                    for is_guarded in ((False, True) if round_index % 2 == 0 else (True, False)):
                        seconds = measure(is_guarded, n, f"{log_dir}/cpu_{round_index}", layers)
                        (guarded if is_guarded else plain).append(seconds)
                own = statistics.median(g - p for g, p in zip(guarded, plain))
                results[name, model] = (statistics.median(plain) * 1e6, statistics.median(guarded) * 1e6, own * 1e6)
    return results


def gradient_count_microseconds(layers: int = 100) -> tuple[float, float]:
    """MemGuard's count of the gradients' bytes (twice a step: at the batch start and after the optimizer step) for
    ``layers`` 16 x 16 layers (2 tensors each), in microseconds a call: the same gradient tensors as at the last
    call (a Lightning step's start), and new ones (each step's end where gradients are set to None)."""
    from lightning_memguard.base.host import Host
    from lightning_memguard.monitor.monitor import MemoryMonitor

    model = linear_stack(layers)
    monitor = MemoryMonitor("the benchmark", source=StubCudaSource())
    monitor.begin(model, torch.device("cpu"), Host())
    model(torch.randn(8, 16)).sum().backward()

    def new_gradients():  # the monitor's memory of the last call's gradients forgotten: as if all were new
        monitor._gradients_seen = ((), 0)
        return monitor.gradient_bytes()

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=500, repeat=5)) / 500 * 1e6

    return best(monitor.gradient_bytes), best(new_gradients)


def python_yardstick_microseconds() -> float:
    """How fast this machine runs Python: the best of five times ``sum(range(1000))``, in microseconds (about 8 on a
    fast server core)."""
    return min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000 * 1e6


# --- 2. the step with no callback, MemGuard and DeviceStatsMonitor ----------------------------------------------------
def run(config: str, steps: int, accelerator: str, model: str, log_dir: str) -> tuple[list[float], int]:
    """The timed steps' wall times (after :data:`WARMUP_STEPS`) and the oldest generation's garbage collections during
    the fit: a mean over 30 steps moves by a millisecond a step with one collection of a few tens of milliseconds."""
    timer = StepTimer()
    callbacks = {
        "none": [],
        "memguard": [MemGuardCallback()],
        "memguard_every_step": [MemGuardCallback(cpu_sample_every=1)],  # the CPU cost when guarding a budget
        # NVML sampled once, at the start: its thread's driver calls (every 0.2 s by default) taken out of the step
        "memguard_nvml_once": [MemGuardCallback(nvml_interval_s=3600)],
        "device_stats": [DeviceStatsMonitor()],
    }[config]
    trainer = pl.Trainer(max_steps=steps + WARMUP_STEPS, accelerator=accelerator, devices=1,
                         callbacks=[timer, *callbacks], logger=CSVLogger(log_dir, name=config),
                         log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    pl.seed_everything(0, verbose=False)
    if model == "short":
        module = TinyGPT(**SHORT_STEP_MODEL)
    else:
        module = DemoTransformer(**(LONG_STEP_MODEL if accelerator == "cuda" else {}))
    collections = gc.get_stats()[2]["collections"]
    trainer.fit(module)
    return timer.times[WARMUP_STEPS:], gc.get_stats()[2]["collections"] - collections


def history_write_seconds(log_dir: str, steps: int = 2000) -> float:
    """Seconds per optimizer step to stream its four history rows to CSV and hand them to the OS (every step, so a
    run killed hard loses at most the step in progress)."""
    import os

    from lightning_memguard.base.snapshot import PHASES, MemorySnapshot
    from lightning_memguard.monitor.history import MemoryHistory

    history = MemoryHistory()
    history.attach_csv(os.path.join(log_dir, "flush_bench.csv"))
    rows = [MemorySnapshot(0, phase, "cpu", 123_456_789, 234_567_890, capacity_bytes=10**9, time=time.time())
            for phase in PHASES]
    start = time.perf_counter()
    for _ in range(steps):
        history.extend(rows)
        history.flush()
    elapsed = (time.perf_counter() - start) / steps
    history.close()
    return elapsed


def compare(models: list[str], accelerator: str, args) -> None:
    """The step time of each configuration at each model size, rounds interleaved, as a table."""
    configs = ["none", "memguard", "device_stats"]
    configs.insert(2, "memguard_every_step" if accelerator == "cpu" else "memguard_nvml_once")
    device = torch.cuda.get_device_name() if accelerator == "cuda" else "cpu"
    print(f"\ndevice: {device}; torch {torch.__version__}; lightning {pl.__version__}; "
          f"{args.rounds} rounds x {args.steps} steps, mean step time per run, median over runs (the mean, not the "
          f"median, counts rare slow steps); beside it the median and slowest of all timed steps and the oldest "
          f"generation's garbage collections, to tell a steady cost from a few slow steps")
    print(f"{'model':<8}{'config':<22}{'step ms':>10}{'vs none':>10}{'overhead':>10}{'median ms':>11}"
          f"{'slowest ms':>12}{'gen-2 gc':>10}")
    for model in models:
        means: dict[str, list[float]] = {c: [] for c in configs}
        steps: dict[str, list[float]] = {c: [] for c in configs}
        collections = dict.fromkeys(configs, 0)
        for round_index in range(args.rounds):
            shift = round_index % len(configs)
            for config in configs[shift:] + configs[:shift]:  # rotated so no config always goes first
                times, collected = run(config, args.steps, accelerator, model, args.out)
                means[config].append(statistics.fmean(times))
                steps[config] += times
                collections[config] += collected
        base = statistics.median(means["none"])
        for config in configs:
            value = statistics.median(means[config])
            print(f"{model:<8}{config:<22}{value * 1e3:>10.2f}{value / base:>10.3f}{(value / base - 1) * 100:>9.1f}%"
                  f"{statistics.median(steps[config]) * 1e3:>11.2f}{max(steps[config]) * 1e3:>12.2f}"
                  f"{collections[config]:>10}")
        memguard_extra = statistics.median(means["memguard"]) - base
        stats_extra = statistics.median(means["device_stats"]) - base
        if stats_extra > 0:
            print(f"{model:<8}memguard overhead / device_stats overhead = {memguard_extra / stats_extra:.2f}")
    flush = history_write_seconds(args.out)
    print(f"history rows written and flushed every step: {flush * 1e6:.1f} us per step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu-rounds", type=int, default=5, help="paired rounds of the CPU figure")
    parser.add_argument("--cpu-steps", type=int, default=300, help="Lightning steps a round (the loop runs 4x)")
    parser.add_argument("--only-cpu", action="store_true", help="the CPU figure only")
    parser.add_argument("--out", default="/tmp/memguard_bench_overhead")
    args = parser.parse_args()
    quiet()
    threads = torch.get_num_threads()
    own = memguard_cpu_microseconds(args.cpu_rounds, args.cpu_steps, args.out)
    torch.set_num_threads(threads)
    print(f"\nMemGuard's own CPU time per optimizer step, CUDA reading stubbed (StubCudaSource): this thread's CPU "
          f"time a step, median step, {args.cpu_rounds} paired rounds; torch {torch.__version__}; Python yardstick "
          f"sum(range(1000)) = {python_yardstick_microseconds():.1f} us")
    print(f"{'front door':<30}{'model':<12}{'plain us':>10}{'guarded us':>12}{'memguard us':>13}")
    for (name, model), (plain, guarded, extra) in own.items():
        print(f"{name:<30}{model:<12}{plain:>10.0f}{guarded:>12.0f}{extra:>13.0f}")
    same, new = gradient_count_microseconds()
    print(f"the gradients' bytes, 200 parameter tensors: {same:.1f} us a call for the gradients of the last call "
          f"(a Lightning step's start), {new:.1f} us for new ones (its end); twice a step")
    if args.only_cpu:
        return
    if torch.cuda.is_available():
        compare(["short", "long"], "cuda", args)
    else:
        compare(["demo"], "cpu", args)


if __name__ == "__main__":
    main()
