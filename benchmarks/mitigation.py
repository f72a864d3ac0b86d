"""Peak memory and step time of a GPT-style model: plain, AMP, checkpointing of k of N blocks (alone and with AMP),
the same effective batch as gradient accumulation over smaller batches, and MemGuard under a budget at which plain
training runs out of memory. Configurations interleaved in one run.

On CPU the budget is made real by the accountant's hard limit, and every configuration runs with the same CPU
accounting (it is how peaks are measured there, and MemGuard needs it to guard), so step times compare like with
like. On CUDA the budget is a per-process memory fraction, and every configuration but plain (whose peak sets the
budget) runs under it: a cap makes the caching allocator flush its cache and retry where it would otherwise grow, so a
static configuration timed on the whole card would be timed under easier conditions than MemGuard. A configuration
whose step does not fit under the cap there is "no", as one over the budget.

    .venv/bin/python benchmarks/mitigation.py [--steps 12] [--rounds 2] [--budget-share 0.8]

At --budget-share 0.5 no single-batch configuration fits: only smaller micro-batches do (MemGuard's micro-batch rung,
or statically, accumulate_grad_batches over a smaller batch size).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile

import lightning.pytorch as pl
import torch
from _common import StepTimer, quiet

from lightning_memguard import MemGuardCallback
from lightning_memguard.commands.demo import TinyGPT
from lightning_memguard.mitigations.checkpointing import ActivationCheckpointing

BUDGET_SHARE = 0.8  # default budget, as a share of plain training's peak: plain training runs out of memory
FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # checkpointed share of the blocks
SKIP = 2  # steps left out of the timing: step 0 has no optimizer state, step 1 may still be adapting
CPU_MODEL = dict(d_model=256, nhead=4, nlayers=8, seq_len=128, batch_size=16)
CUDA_MODEL = dict(d_model=1024, nhead=16, nlayers=16, seq_len=1024, batch_size=16, vocab_size=32000)


def static_configs(n_blocks: int, accumulate: bool, amp_options=(False, True)) -> list[tuple[str, bool, int, int]]:
    """(name, amp, checkpointed blocks, accumulated micro-batches per optimizer step)."""
    configs = [("plain", False, 0, 1)] + ([("amp", True, 0, 1)] if True in amp_options else [])
    for amp in amp_options:
        for fraction in FRACTIONS:
            k = max(1, round(fraction * n_blocks))
            configs.append((f"{'amp + ' if amp else ''}ckpt {k}/{n_blocks}", amp, k, 1))
    for acc in (2, 4) if accumulate else ():
        for amp in amp_options:
            for k in (0, n_blocks):
                name = " + ".join([f"accumulate {acc}"] + (["amp"] if amp else []) + ([f"ckpt {k}/{n_blocks}"]
                                                                                      if k else []))
                configs.append((name, amp, k, acc))
    return configs


def fit(model, callbacks, accelerator, steps, precision="32-true", accumulate=1):
    timer = StepTimer()
    # the run files go to a temporary directory, not wherever the script was started
    trainer = pl.Trainer(max_steps=steps, accelerator=accelerator, devices=1, precision=precision,
                         default_root_dir=tempfile.mkdtemp(prefix="memguard_bench_"),
                         accumulate_grad_batches=accumulate,
                         callbacks=[timer, *callbacks], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(model)
    return timer


def peak_after_warmup(guard: MemGuardCallback) -> int:
    history = guard.history
    return int(history[history["step"] >= 1]["peak_bytes"].max())


def run_static(name, amp, k, acc, accelerator, steps, model_kwargs, budget=None):
    """(peak, step time) of a static configuration; on CUDA under the budget's memory fraction when ``budget`` is
    given, and (None, None) where it runs out of memory there."""
    pl.seed_everything(0, verbose=False)
    # the same effective batch: acc batches of batch_size / acc per optimizer step
    model = TinyGPT(**{**model_kwargs, "batch_size": model_kwargs["batch_size"] // acc})
    if k:
        ActivationCheckpointing(model).set_level(k)
    guard = MemGuardCallback(mitigations=(), cpu_sample_every=1, rescue_oom=False, explain=False)
    try:
        with memory_cap(budget if accelerator == "cuda" else None):
            timer = fit(model, [guard], accelerator, steps, "bf16-mixed" if amp else "32-true", acc)
    except torch.OutOfMemoryError:
        return None, None
    # the timer sees every batch: an optimizer step is acc of them
    return peak_after_warmup(guard), timer.mean(SKIP * acc) * acc


@contextlib.contextmanager
def memory_cap(budget):
    """On CUDA, the per-process memory fraction of ``budget`` bytes inside (``None``: the whole card), on a clean
    cache and fresh peak statistics."""
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if budget is None:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        yield
        return
    torch.cuda.set_per_process_memory_fraction(budget / torch.cuda.get_device_properties(0).total_memory)
    torch.cuda.reset_peak_memory_stats()
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


#: steps MemGuard's run has beyond the static configurations': room for its speed trial (a few steps of each of two
#: configurations) before the steps that are timed
SETTLING_STEPS = 12


def run_guarded(budget, accelerator, steps, model_kwargs, rescue=True, mitigations=None, threshold=0.9):
    """MemGuard with its default ladder (or ``mitigations``); returns (peak, step time, final levels, events) or
    raises OOM. It runs ``SETTLING_STEPS`` more steps than asked, and its time is the mean of the steps after its
    last change of levels (and one more, which may still build caches), at least ``steps - SKIP`` of them: what a
    long run spends a step once the guard has settled."""
    ladder = {"threshold": threshold} if mitigations is None else {"mitigations": mitigations, "threshold": threshold}
    pl.seed_everything(0, verbose=False)
    if accelerator == "cuda":
        guard = MemGuardCallback(rescue_oom=rescue, explain=False, **ladder)
    else:
        guard = MemGuardCallback(budget=budget, cpu_hard_limit=budget, rescue_oom=rescue, explain=False, **ladder)
    total = steps + SETTLING_STEPS if rescue else steps
    with memory_cap(budget if accelerator == "cuda" else None):
        timer = fit(TinyGPT(**model_kwargs), [guard], accelerator, total)
    events = guard.events
    changed = events[events["action"].isin(["apply", "revert", "rescue", "speed_trial"])]["step"]
    settled = max(SKIP, int(changed.max()) + 2 if len(changed) else 0)
    skip = min(settled, total - max(1, steps - SKIP))
    return peak_after_warmup(guard), timer.mean(skip), guard.levels, events, allocator_counts(guard.history)


def allocator_counts(history):
    """(out-of-memory errors in the guarded run, allocator retries in its timed steps), where the source counts them
    (CUDA): a retry flushes the cache and synchronises the device, time no static configuration on a free card
    spends. torch's counters are the process's, since its start: the static configurations that ran out of memory
    before are in them, so the run's own are what they grew by from its first row."""
    if "num_ooms" not in history or history["num_ooms"].isna().all():
        return None, None
    ooms = history["num_ooms"].dropna()
    timed = history[history["step"] >= SKIP]["alloc_retries"]
    before = history[history["step"] < SKIP]["alloc_retries"]
    if timed.isna().all():  # the CPU accounting counts its hard limit's OOMs, and has no allocator to retry
        return int(ooms.max() - ooms.iloc[0]), 0
    retries = int(timed.max() - (before.max() if len(before) else 0)) if len(timed) else 0
    return int(ooms.max() - ooms.iloc[0]), retries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget-share", type=float, default=BUDGET_SHARE,
                        help="the budget as a share of plain training's peak (0.5: only micro-batches fit)")
    parser.add_argument("--threshold", type=float, default=0.9, help="MemGuard's threshold (default 0.9)")
    args = parser.parse_args()
    quiet()
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    model_kwargs = CUDA_MODEL if accelerator == "cuda" else CPU_MODEL
    # A CPU without native bf16 (no AVX512-BF16/AMX) emulates bf16 matmuls hundreds of times slower than fp32: there
    # AMP is left out of both the static configurations and MemGuard's ladder, or the comparison says nothing.
    native_bf16 = accelerator == "cuda" or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    amp_options = (False, True) if native_bf16 else (False,)
    ladder = None if native_bf16 else ("checkpointing", "microbatch")
    configs = static_configs(model_kwargs["nlayers"], args.budget_share < 0.7, amp_options)
    peaks: dict[str, int] = {}
    times: dict[str, list[float]] = {name: [] for name, *_ in configs}
    times["memguard"] = []
    budget = None
    guarded = None
    for round_index in range(args.rounds):
        for name, amp, k, acc in configs:
            peak, step_time = run_static(name, amp, k, acc, accelerator, args.steps, model_kwargs,
                                         budget if name != "plain" else None)
            if peak is None:  # out of memory under the cap (CUDA)
                print(f"  {name}: out of memory under the budget's memory fraction", flush=True)
                peaks[name] = float("inf")
                times[name].append(float("inf"))
                continue
            print(f"  {name}: peak {peak / 2**20:.1f} MiB, {step_time * 1e3:.0f} ms/step", flush=True)
            peaks[name] = max(peaks.get(name, 0), peak)
            times[name].append(step_time)
            if budget is None and name == "plain":
                budget = int(args.budget_share * peak)
        guarded = run_guarded(budget, accelerator, args.steps, model_kwargs, mitigations=ladder,
                              threshold=args.threshold)
        print(f"  memguard: peak {guarded[0] / 2**20:.1f} MiB, {guarded[1] * 1e3:.0f} ms/step, {guarded[2]}",
              flush=True)
        times["memguard"].append(guarded[1])
    try:
        run_guarded(budget, accelerator, 3, model_kwargs, rescue=False, mitigations=())  # monitor only
        plain_under_budget = "fits (unexpected)"
    except torch.OutOfMemoryError:
        plain_under_budget = "out of memory"

    device = torch.cuda.get_device_name() if accelerator == "cuda" else "cpu"
    median = {name: statistics.median(values) for name, values in times.items()}
    fitting = [name for name, *_ in configs if peaks[name] <= budget]
    best = min(fitting, key=lambda n: median[n]) if fitting else None
    # MemGuard keeps peaks under threshold x budget (0.9 by default), so also compare with the best configuration
    # that does the same
    under_threshold = [name for name in fitting if peaks[name] <= args.threshold * budget]
    best_under = min(under_threshold, key=lambda n: median[n]) if under_threshold else None
    print(f"\ndevice: {device}; torch {torch.__version__}; TinyGPT {model_kwargs}; budget {budget / 2**20:.1f} MiB "
          f"({args.budget_share:.0%} of plain's peak); {args.rounds} rounds x {args.steps} steps, mean step time after "
          f"{SKIP} steps (MemGuard: {SETTLING_STEPS} steps more, timed after its last change of levels), median over "
          "rounds")
    if not native_bf16:
        print("this CPU has no native bf16: AMP left out of the static configurations and of MemGuard's ladder")
    print(f"{'config':<32}{'peak MiB':>10}{'of budget':>11}{'fits':>6}{'step ms':>10}{'vs best fit':>13}")
    for name, *_ in configs:
        relative = f"{median[best] / median[name]:.3f}" if best else "-"
        fits = "yes" if name in fitting else "no"
        print(f"{name:<32}{peaks[name] / 2**20:>10.1f}{peaks[name] / budget:>10.0%} {fits:>5}"
              f"{median[name] * 1e3:>10.1f}{relative:>13}")
    peak, _, levels, events, (num_ooms, retries) = guarded
    relative = f"{median[best] / median['memguard']:.3f}" if best else "-"
    print(f"{'memguard':<32}{peak / 2**20:>10.1f}{peak / budget:>10.0%} {'yes':>5}{median['memguard'] * 1e3:>10.1f}"
          f"{relative:>13}")
    print(f"\nplain training under the budget: {plain_under_budget}")
    print(f"best static configuration that fits: {best}; memguard throughput / its throughput = {relative}")
    if best_under:
        print(f"best static configuration under the {args.threshold:.0%} threshold: {best_under}; memguard "
              f"throughput / its throughput = {median[best_under] / median['memguard']:.3f}")
    ooms = sum("retrying the batch" in reason for reason in events[events["action"] == "rescue"]["reason"])
    print(f"memguard: {ooms} out-of-memory error(s) rescued in the last round"
          + (f" (num_ooms {num_ooms}); allocator retries in the timed steps: {retries}" if num_ooms is not None
             else ""))
    print(f"memguard ended at {levels}; events: "
          + ", ".join(f"{r.action} {r.rung}@{r.step}" for r in events.itertuples() if r.action != "explain"))


if __name__ == "__main__":
    main()
