"""How long does the plan before the first step take? (issue 27: at most a second for any zoo model on a fast host)

The plan is :func:`~lightning_memguard.estimate.plan.ladder_predictions` with AMP allowed, as the callback makes it at
the first batch: up to six estimates (no block, one and all blocks checkpointed, in fp32 and bf16-mixed). Each case
is planned with the meta kernels' memo off (every torch meta kernel runs, as before the memo) and on (a fresh memo),
interleaved, best of ``--rounds``; both plans must give the same peak model, or the script fails. Cases: the zoo's
tiny models and the reference sizes of the demo and zoo models (benchmarks/reference_models.py) for a CUDA target
(the meta path), and the ``demo`` command's model for a CPU target (fp32 runs on CPU, bf16-mixed on meta).

``--first-batch`` times what the guard does at the first batch instead (a ladder of AMP, checkpointing and
micro-batches, the estimate for a CUDA target, ``needs_plan`` and, where it says so, ``plan_at_start``), where the step
fits (a capacity 4× its peak) and where the capacity forces a plan (midway between what no rung lowers and the step's
peak: over the 95 % line, so the guard plans at the first batch; and where AMP's step fits under the plan's line),
with how many estimates each made (a fresh memo each) and a digest of the decisions (levels and reasons), to compare
checkouts by; each with the estimates' measured steps replayed from their warm-up steps and run again, side by
side. ``--sweep`` prints the levels that plan sets, and the estimates it makes, at six capacities between what no
rung lowers and the step's peak, with and without a cap on reserved memory (to compare checkouts by).

    .venv/bin/python benchmarks/plan_time.py [--rounds 2] [--only zoo:t5,zoo:gpt2] [--sizes tiny,small]
        [--threads 1] [--first-batch | --sweep]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import time

import torch
from _common import quiet
from reference_models import DEMO_SIZES, ZOO_SIZES, build_case

import lightning_memguard.estimate.plan as plan_module
from lightning_memguard.adapters.torch_backend import AutocastSwitch
from lightning_memguard.base.collection import collection_paused
from lightning_memguard.base.prediction import floor_bytes
from lightning_memguard.estimate.meta_cache import meta_cache_enabled, meta_cache_stats
from lightning_memguard.estimate.plan import ladder_predictions
from lightning_memguard.estimate.step_replay import replay_enabled
from lightning_memguard.guard.ladder import Ladder
from lightning_memguard.guard.planning import needs_plan, plan_at_start

#: the demo command's model (``demo --layers 2 --batch-size 16 --seq-len 32``), planned for the CPU it trains on
DEMO_COMMAND = ("DemoTransformer", {"nlayers": 2, "batch_size": 16, "seq_len": 32}, "cpu", "demo command")


def _cases() -> list[tuple[str, dict, str, str]]:
    """(model, kwargs, target, size): the zoo's tiny models (its mixtures of experts and its further families,
    Whisper, a LoRA on Llama, Qwen2 and Mistral, too), the reference's sizes (each demo model small and large,
    each zoo model at its reference size), and the demo command's model for a CPU target."""
    from tests.zoo.models import MOE, MORE_FAMILIES  # the test zoo's lists (it loads transformers)
    tiny = [(name, kwargs, "cuda", "tiny") for name, kwargs in ZOO_SIZES if not kwargs] + [
        (f"zoo:{name}", {}, "cuda", "tiny") for name in (*MOE, *MORE_FAMILIES)]
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


def first_batch_once(model, batch, capacity: int, capped: bool = False) -> tuple[float, int, str, str, dict]:
    """The guard's work at the first batch under ``capacity`` (CUDA target; ``capped``: a cap on what the caching
    allocator reserves, as the card or a memory fraction): seconds, estimates made, what was decided (``fits``,
    ``plan``, ``cannot_help``), a digest of the levels and the decisions' reasons, and the levels."""
    made, estimate_memory = [], plan_module.estimate_memory

    def counted(*args, **kwargs):
        made.append(1)
        return estimate_memory(*args, **kwargs)

    said: list[str] = []
    ladder = Ladder(("amp", "checkpointing", "microbatch"), 0.9, None, 0.03, warn=said.append)
    ladder.setup(model, torch.device("cpu"), AutocastSwitch(torch.device("cpu")), guarding=True)
    plan_module.estimate_memory = counted
    try:
        # a fresh memo, and the garbage collector held off, as at a fit's first batch (the guard's engine)
        with meta_cache_enabled(True), collection_paused():
            start = time.perf_counter()
            ladder.note_batch(batch, model, "cuda")
            decisions = plan_at_start(ladder, model, batch, capacity, 0, cuda=True, warn=said.append, asked=False,
                                      capped=capped) if needs_plan(ladder, capacity, capped) else []
            seconds = time.perf_counter() - start
    finally:
        plan_module.estimate_memory = estimate_memory
    what = ",".join(d.action for d in decisions) or "fits"
    text = repr((ladder.levels, [(d.action, d.reason, d.peak_before_bytes) for d in decisions], said))
    levels = dict(ladder.levels)
    ladder.apply_plan({name: 0 for name in ladder.levels})  # the model as it was, for the next plan
    return seconds, len(made), what, hashlib.sha1(text.encode()).hexdigest()[:8], levels


def planned_case(name: str, kwargs: dict):
    """A case's model and first batch, its peak model (CUDA target, AMP covered; a warm-up too), the step's peak and
    what no rung lowers."""
    model = build_case({"model": name, "kwargs": kwargs})
    batch = next(iter(model.train_dataloader()))
    peaks = ladder_predictions(model, batch, target="cuda", amp=True).model
    return model, batch, peaks, peaks.peak({}), floor_bytes(peaks)


def first_batch_table(cases, rounds: int) -> None:
    """Each case's first batch, with the estimates' measured steps replayed (``s``) and run again (``s run again``,
    as before the replay), interleaved, best of ``rounds``: both must decide the same, or the script fails."""
    print("| model | size | capacity | decided | estimates | s | s run again | digest |")
    print("|---|---|---|---|---:|---:|---:|---|")
    for name, kwargs, _, size in cases:
        model, batch, peaks, peak, floor = planned_case(name, kwargs)
        capacities = [("4× peak", 4 * peak), ("floor–peak midway", (floor + peak) // 2)]
        amp = int(peaks.peak({"amp": 1}) / 0.89)  # AMP's peak under the plan's line (0.9×), the step's over 95 %
        if peaks.peak({}) > 0.95 * amp and floor < amp:
            capacities.append(("AMP fits", amp))
        for label, capacity in capacities:
            best = {True: float("inf"), False: float("inf")}
            digests = set()
            for _ in range(rounds):
                for replay in (True, False):
                    with replay_enabled(replay):
                        seconds, runs, what, digest, _ = first_batch_once(model, batch, capacity)
                    best[replay] = min(best[replay], seconds)
                    digests.add(digest)
            if len(digests) != 1:
                raise SystemExit(f"{name} {size} {label}: replayed and run-again steps decided differently: {digests}")
            print(f"| {name} | {size} | {label} | {what} | {runs} | {best[True]:.2f} | {best[False]:.2f} | {digest} |",
                  flush=True)


#: where the sweep puts the capacity, between what no rung lowers (0) and the step's peak (1)
SWEEP_SHARES = (0.15, 0.3, 0.45, 0.6, 0.75, 0.9)


def sweep_table(cases) -> None:
    """The levels the first batch's plan sets and the estimates it makes, at capacities across the range the rungs
    cover (:data:`SWEEP_SHARES`), capping reserved memory or not: to compare checkouts by (levels as AMP, blocks,
    micro-batch level)."""
    print("| model | size | " + " | ".join(f"{share} / capped" for share in SWEEP_SHARES) + " | estimates |")
    print("|---|---|" + "---|" * (len(SWEEP_SHARES) + 1))
    for name, kwargs, _, size in cases:
        model, batch, _, peak, floor = planned_case(name, kwargs)
        cells, total = [], 0
        for share in SWEEP_SHARES:
            cell = []
            for capped in (False, True):
                _, runs, _, _, levels = first_batch_once(model, batch, int(floor + share * (peak - floor)), capped)
                total += runs
                cell.append("".join(str(levels.get(rung, 0)) for rung in ("amp", "checkpointing", "microbatch"))
                            + f" ({runs})")
            cells.append(" / ".join(cell))
        print(f"| {name} | {size} | " + " | ".join(cells) + f" | {total} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default=None, help="model names, comma-separated (e.g. zoo:t5,zoo:gpt2)")
    parser.add_argument("--sizes", default=None, help="sizes, comma-separated (tiny, small, large, reference)")
    parser.add_argument("--first-batch", action="store_true",
                        help="time the guard's first batch (fits / forced plan) instead of the whole peak model")
    parser.add_argument("--sweep", action="store_true",
                        help="the levels and estimates of the first batch's plan across capacities, to compare "
                             "checkouts by")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's intra-op threads (default: torch's); 1 keeps what the batch computes for real "
                             "on CPU from waiting on busy cores")
    args = parser.parse_args()
    quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds (best of)")
    cases = [case for case in _cases() if (not args.only or case[0] in args.only.split(","))
             and (not args.sizes or case[3] in args.sizes.split(","))]
    if args.sweep:
        sweep_table([case for case in cases if case[2] == "cuda"])
        return
    if args.first_batch:
        first_batch_table([case for case in cases if case[2] == "cuda"], args.rounds)
        return
    print("| model | size | target | runs | meta ops | memo hits | memo off s | memo on s | off / on |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for name, kwargs, target, size in cases:
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
