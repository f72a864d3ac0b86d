"""How long does the plan before the first step take? (issue 27: at most a second for any zoo model on a fast host)

The plan is :func:`~lightning_memguard.estimate.plan.ladder_predictions` with AMP allowed, as the callback makes it at
the first batch: up to six estimates (no block, one and all blocks checkpointed, in fp32 and bf16-mixed). Each case
is planned with the meta kernels' memo off (every torch meta kernel runs, as before the memo) and on (a fresh memo),
interleaved, best of ``--rounds``; both plans must give the same peak model, or the script fails. Cases: the zoo's
tiny models and the reference sizes of the demo and zoo models (benchmarks/reference_models.py) for a CUDA target
(the meta path), and the ``demo`` command's model for a CPU target (fp32 runs on CPU, bf16-mixed on meta).

    .venv/bin/python benchmarks/plan_time.py [--rounds 2] [--only zoo:t5] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from _common import quiet
from reference_models import DEMO_SIZES, ZOO_SIZES, build_case

from lightning_memguard.estimate.meta_cache import meta_cache_enabled, meta_cache_stats
from lightning_memguard.estimate.plan import ladder_predictions

#: the demo command's model (``demo --layers 2 --batch-size 16 --seq-len 32``), planned for the CPU it trains on
DEMO_COMMAND = ("DemoTransformer", {"nlayers": 2, "batch_size": 16, "seq_len": 32}, "cpu", "demo command")


def _cases() -> list[tuple[str, dict, str, str]]:
    """(model, kwargs, target, size): the zoo's tiny models, the reference's sizes (each demo model small and large,
    each zoo model at its reference size), and the demo command's model for a CPU target."""
    tiny = [(name, kwargs, "cuda", "tiny") for name, kwargs in ZOO_SIZES if not kwargs] + [
        ("zoo:mixtral", {}, "cuda", "tiny")]
    seen: set[str] = set()
    demo = []
    for name, kwargs in DEMO_SIZES:
        demo.append((name, kwargs, "cuda", "large" if name in seen else "small"))
        seen.add(name)
    zoo = [(name, kwargs, "cuda", "reference") for name, kwargs in ZOO_SIZES if kwargs]
    return tiny + demo + zoo + [DEMO_COMMAND]


def plan_once(model, batch, target: str, memo: bool) -> tuple[float, dict, object]:
    with meta_cache_enabled(memo):
        start = time.perf_counter()
        predictions = ladder_predictions(model, batch, target=target, amp=True)
        seconds = time.perf_counter() - start
        return seconds, meta_cache_stats(), predictions


def runs_of(predictions) -> int:
    """The estimates a plan made: per precision, no block, one and all blocks checkpointed (fewer where they
    coincide)."""
    n_blocks = len(predictions.model.by_amp[0].forward) - 1
    return len(predictions.model.by_amp) * len({0, min(1, n_blocks), n_blocks})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default=None, help="one model name (e.g. zoo:t5)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's intra-op threads (default: torch's); 1 keeps what the batch computes for real "
                             "on CPU from waiting on busy cores")
    args = parser.parse_args()
    quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds (best of)")
    print("| model | size | target | runs | meta ops | memo hits | memo off s | memo on s | off / on |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for name, kwargs, target, size in _cases():
        if args.only and name != args.only:
            continue
        model = build_case({"model": name, "kwargs": kwargs})
        batch = next(iter(model.train_dataloader()))
        plan_once(model, batch, target, memo=False)  # lazy imports and first-call costs, in neither column
        best = {False: float("inf"), True: float("inf")}
        peaks = {}
        for _ in range(args.rounds):
            for memo in (False, True):
                seconds, stats, predictions = plan_once(model, batch, target, memo)
                best[memo] = min(best[memo], seconds)
                peaks[memo] = predictions.model
                if memo:
                    on_stats = stats
        if repr(peaks[False]) != repr(peaks[True]):
            raise SystemExit(f"{name}: the plans differ with and without the memo")
        print(f"| {name} | {size} | {target} | {runs_of(predictions)} | {on_stats['calls']} | "
              f"{on_stats['hits']} | {best[False]:.2f} | {best[True]:.2f} | {best[False] / best[True]:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
