"""What MemGuard's CUDA reading costs on the training thread, call by call, and in a guarded step.

1. Each call a boundary makes (and the alternatives), microseconds of this thread's CPU time, best of five batches.
2. The plain-loop step of a one-layer model on the GPU, bare, under MemGuard with the allocator's calls stubbed
   (``overhead.py``'s StubCudaSource) and under MemGuard reading the real allocator: thread CPU time a step (median
   step, paired rounds), so the real reading's share of MemGuard's cost shows.

    python benchmarks/cuda_calls.py [--rounds 5] [--steps 1200]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from overhead import StubCudaSource, loop_step_seconds, stub_cuda_reading
from lightning_memguard.sources.cuda import CudaAllocatorSource


def microseconds(call, number: int = 2000) -> float:
    """This thread's CPU time per call, the best of five batches of ``number``."""
    best = float("inf")
    for _ in range(5):
        start = time.thread_time()
        for _ in range(number):
            call()
        best = min(best, (time.thread_time() - start) / number)
    return best * 1e6


def call_costs() -> dict[str, float]:
    index = torch.cuda.current_device()
    kept = [torch.randn(256, 256, device="cuda") for _ in range(64)]  # a few live blocks, as in a run
    (kept[0] @ kept[1]).sum().item()
    source = CudaAllocatorSource(index)
    stub = StubCudaSource()
    calls = {
        "torch.cuda.memory_stats_as_nested_dict": lambda: torch.cuda.memory_stats_as_nested_dict(index),
        "torch._C._cuda_memoryStats": lambda: torch._C._cuda_memoryStats(index),
        "torch.cuda.memory_stats (flat)": lambda: torch.cuda.memory_stats(index),
        "torch.cuda.memory_allocated": lambda: torch.cuda.memory_allocated(index),
        "torch.cuda.reset_peak_memory_stats": lambda: torch.cuda.reset_peak_memory_stats(index),
        "torch._C._cuda_resetPeakMemoryStats": lambda: torch._C._cuda_resetPeakMemoryStats(index),
        "torch.cuda.get_per_process_memory_fraction": lambda: torch.cuda.get_per_process_memory_fraction(index),
        "CudaAllocatorSource.read(reset_peak=True)": lambda: source.read(reset_peak=True),
        "CudaAllocatorSource.read(reset_peak=False)": lambda: source.read(reset_peak=False),
        "CudaAllocatorSource.capacity_bytes": source.capacity_bytes,
        "StubCudaSource.read(reset_peak=True)": lambda: stub.read(reset_peak=True),
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        calls["pynvml.nvmlDeviceGetMemoryInfo"] = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle)
        calls["pynvml.nvmlDeviceGetComputeRunningProcesses"] = (
            lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    except Exception as error:  # noqa: BLE001 - a benchmark: say it and go on
        print(f"NVML not timed: {error}")
    costs = {name: microseconds(call, 200 if "nvml" in name else 2000) for name, call in calls.items()}
    del kept
    return costs


def cuda_loop_step_seconds(mode: str, steps: int, log_dir: str) -> float:
    """``loop_step_seconds`` on the GPU: bare, guarded with the stub, or guarded reading the real allocator."""
    default = torch.get_default_device() if hasattr(torch, "get_default_device") else torch.device("cpu")
    torch.set_default_device("cuda")
    try:
        if mode == "stub":
            with stub_cuda_reading():
                return loop_step_seconds(True, steps, log_dir)
        return loop_step_seconds(mode == "real", steps, log_dir)
    finally:
        torch.set_default_device(default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_calls.py needs a CUDA device")
    torch.set_num_threads(1)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(f"{'call':<48}{'us':>8}")
    for name, cost in call_costs().items():
        print(f"{name:<48}{cost:>8.1f}")
    seconds: dict[str, list[float]] = {"bare": [], "stub": [], "real": []}
    with tempfile.TemporaryDirectory() as log_dir:
        for round_index in range(args.rounds):
            order = list(seconds) if round_index % 2 == 0 else list(reversed(seconds))
            for mode in order:
                seconds[mode].append(cuda_loop_step_seconds(mode, args.steps, f"{log_dir}/{round_index}"))
    bare = statistics.median(seconds["bare"])
    print(f"\nplain-loop step on the GPU (1 layer), thread CPU time, median step, median of {args.rounds} rounds")
    for mode, values in seconds.items():
        value = statistics.median(values)
        print(f"{mode:<8}{value * 1e6:>10.0f} us{(value - bare) * 1e6:>10.0f} us over bare")


if __name__ == "__main__":
    main()
