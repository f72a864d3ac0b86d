"""Measures the CUDA reference (benchmarks/cuda_reference.json): per-phase peaks of real Lightning training steps of
the reference models on this GPU, and the CUDA kernel facts the estimate models. Needs a CUDA device.

The probe is torch's own counters, nothing of MemGuard's (neither its engine nor the estimate): a small callback
resets the peak at ``on_train_batch_start`` and reads ``torch.cuda.max_memory_allocated()`` at
``on_before_backward`` (after the forward), ``on_after_backward`` (after the backward) and ``on_train_batch_end``
(after the optimizer step), resetting the peak after each read, so each phase has its own peak. A case trains 5
steps (accelerator cuda, devices 1, logger off); its value per phase is the median over steps 2-4 (steps 0 and 1
create gradients and optimizer state). Every case runs in its own process, so the CUDA runtime's allocations
(cuBLAS workspaces) are the case's own.

    .venv/bin/python benchmarks/cuda_reference.py [--only demo|zoo|kernels] [--out benchmarks/cuda_reference.json]

The cases are reference_models.reference_cases(): this project's demo models at two sizes and the transformers
models of the test zoo (``"model": "zoo:NAME"``, in ``zoo_models``). Each measured case records the device, torch
version and date; with ``--only`` the other sections of an existing file are kept as they are.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "cuda_reference.json"
STEPS = 5
MEDIAN_STEPS = (2, 3, 4)
PHASES = ("after_forward", "after_backward", "after_optimizer_step")
HOW = ("median over steps 2-4 of 5 of torch.cuda.max_memory_allocated, peak reset at on_train_batch_start and "
       "after each read; read at on_before_backward (after_forward), on_after_backward (after_backward), "
       "on_train_batch_end (after_optimizer_step); accelerator cuda, devices 1, logger False; one process per case; "
       "peak = max of the three (benchmarks/cuda_reference.py)")


def phase_peak_probe():
    """A Lightning callback recording each step's per-phase ``max_memory_allocated`` (rows of step and phases)."""
    import torch
    from lightning.pytorch.callbacks import Callback

    class PhasePeakProbe(Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, int]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            torch.cuda.reset_peak_memory_stats()
            self.rows.append({"step": trainer.global_step})

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self._read("after_forward")

        def on_after_backward(self, trainer, pl_module) -> None:
            self._read("after_backward")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self._read("after_optimizer_step")

        def _read(self, phase: str) -> None:
            self.rows[-1][phase] = torch.cuda.max_memory_allocated()
            # what the tensors asked for, before the allocator's rounding and its unsplit blocks (a block whose
            # remainder is 1 MiB or less is handed out whole): the part of the gap that is the allocator's
            self.rows[-1][f"{phase}_requested"] = torch.cuda.memory_stats().get("requested_bytes.all.peak", 0)
            torch.cuda.reset_peak_memory_stats()

    return PhasePeakProbe()


def summarise(rows: list[dict[str, int]]) -> dict[str, int]:
    """Per phase the median over steps 2-4, and ``peak``, the largest of them (and the medians of the requested
    bytes, ``PHASE_requested``, where the rows have them).

    Raises:
        ValueError: a row of steps 2-4 is missing or lacks a phase (the run stopped early).
    """
    chosen = [row for row in rows if row.get("step") in MEDIAN_STEPS]
    if len(chosen) != len(MEDIAN_STEPS) or any(phase not in row for row in chosen for phase in PHASES):
        raise ValueError(f"steps {MEDIAN_STEPS} with all of {PHASES} are needed, got {rows}")
    result = {phase: int(statistics.median(row[phase] for row in chosen)) for phase in PHASES}
    result["peak"] = max(result.values())
    for phase in PHASES:  # the requested bytes, where the probe read them
        if all(f"{phase}_requested" in row for row in chosen):
            result[f"{phase}_requested"] = int(statistics.median(row[f"{phase}_requested"] for row in chosen))
    return result


def environment() -> dict[str, str]:
    """The device, torch's and transformers' versions and the date: a zoo model's kernels follow transformers'
    version (transformers 5.17 hands T5's position bias to SDPA as a permuted view, which takes CUDA's math path)."""
    import torch

    try:
        import transformers

        library = transformers.__version__
    except ImportError:
        library = None
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": library,
            "date": datetime.date.today().isoformat()}


def measure_case(case: dict) -> dict:
    """One case, in this process: real Lightning steps on CUDA under the probe."""
    import lightning.pytorch as pl
    import torch
    from _common import quiet
    from reference_models import build_case

    quiet()
    model = build_case(case)
    probe = phase_peak_probe()
    gc.collect()
    torch.cuda.empty_cache()
    pl.Trainer(max_steps=STEPS, accelerator="cuda", devices=1, precision=case["precision"], callbacks=[probe],
               logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               default_root_dir=tempfile.mkdtemp(prefix="memguard_reference_")).fit(model)
    return {**case, **summarise(probe.rows), **environment()}


def measure_kernels() -> dict:
    """What single CUDA kernels keep and allocate (in a fresh process: the first matmul creates the workspace)."""
    import torch
    import torch.nn.functional as F

    facts: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(1024, 1024, device="cuda", dtype=dtype)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = a @ a
        torch.cuda.synchronize()
        del out
        facts[f"held_after_first_matmul_{dtype}"] = torch.cuda.memory_allocated() - before
    facts["cublas_workspace_config_env"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    b, h, s, d = 8, 8, 1024, 64
    for dtype in (torch.float32, torch.bfloat16):
        for dropout in (0.0, 0.1):
            for mask in ("causal", "bool_mask", "none"):
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
                attn_mask = torch.ones(s, s, device="cuda", dtype=torch.bool).tril() if mask == "bool_mask" else None
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout,
                                                     is_causal=mask == "causal")
                torch.cuda.synchronize()
                facts[f"sdpa_{str(dtype).replace('torch.', '')}_drop{dropout}_{mask}"] = {
                    "kept_bytes": torch.cuda.memory_allocated() - before,
                    "out_bytes": out.numel() * out.element_size(),
                    "fwd_peak_extra": torch.cuda.max_memory_allocated() - before,
                    "qkv_each_bytes": q.numel() * q.element_size(),
                    "bhsd": [b, h, s, d],
                    "grad_fn": type(out.grad_fn).__name__,
                }
                del q, k, v, attn_mask, out
                torch.cuda.empty_cache()
    return {**facts, **environment()}


def _in_child(argument: str, value: str, timeout: float) -> dict:
    """Runs this script with ``argument value`` in a new process and returns the JSON it prints last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), argument, value], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=str(HERE))
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit code {done.returncode}: {tail[0][:300]}"}
    return json.loads(lines[-1])


def measure(cases: list[dict], jobs: int, timeout: float) -> list[dict]:
    """Every case in its own process, ``jobs`` at a time (peaks are per process: parallel cases do not mix)."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda case: _in_child("--case", json.dumps(case), timeout), cases))
    measured = []
    for case, result in zip(cases, results):
        if "error" in result:
            print(f"  {case['model']} {case['kwargs']} {case['precision']}: FAILED ({result['error']})", flush=True)
            continue
        print(f"  {case['model']} {case['kwargs']} {case['precision']}: peak {result['peak'] / 2**20:.1f} MiB",
              flush=True)
        measured.append(result)
    return measured


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["demo", "zoo", "kernels"], action="append", default=None,
                        help="measure only these sections (repeatable); the file's other sections are kept")
    parser.add_argument("--out", type=Path, default=REFERENCE, help=f"the reference to write (default {REFERENCE})")
    parser.add_argument("--jobs", type=int, default=4, help="cases measured at once, each in its own process")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one case may take")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # a child process: one case as JSON
    parser.add_argument("--kernels", help=argparse.SUPPRESS)  # a child process: the kernel facts
    args = parser.parse_args(argv)
    if args.case or args.kernels:
        print(json.dumps(measure_case(json.loads(args.case)) if args.case else measure_kernels()))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("cuda_reference.py: no CUDA device here (torch.cuda.is_available() is False): the reference is measured "
              "on a GPU", file=sys.stderr)
        return 1
    from reference_models import reference_cases

    sections = args.only or ["demo", "zoo", "kernels"]
    reference = json.loads(args.out.read_text()) if args.out.exists() and args.only else {}
    reference["how"] = HOW
    failed = False
    for section, key in (("demo", "models"), ("zoo", "zoo_models")):
        if section in sections:
            cases = reference_cases(section)
            print(f"{section}: {len(cases)} cases", flush=True)
            reference[key] = measure(cases, args.jobs, args.timeout)
            failed |= len(reference[key]) != len(cases)
    if "kernels" in sections:
        kernels = _in_child("--kernels", "1", args.timeout)
        failed |= "error" in kernels
        reference["kernels"] = kernels if "error" not in kernels else reference.get("kernels", {})
    reference.setdefault("models", [])
    reference.setdefault("zoo_models", [])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"reference written: {args.out}" + (" (some cases FAILED, see above)" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
