"""Every GPU check of the project in one command, on a machine with a CUDA device, in about 22 minutes:

1. ``pytest -m gpu`` (the tests that need CUDA),
2. ``cuda_reference.py``: the CUDA measurement of the reference models and the zoo models, rewriting
   benchmarks/cuda_reference.json (``--keep-reference`` writes it to the results directory instead),
3. ``estimate_accuracy.py`` against that reference,
4. ``mitigation.py`` with a budget of 0.8x, 0.5x and 0.33x plain training's peak,
5. ``overhead.py``, and ``cuda_calls.py``: what each CUDA call a boundary makes costs, and the real reading's share of
   MemGuard's cost a step,
6. ``per_rank.py`` on one GPU under FSDP2: the per-rank estimate against what the guard measures there,
7. ``plan_time.py --first-batch``: the first batch's plan, its seconds on the GPU host's CPU.

Each step runs in its own process (the checkout's package first on the path), its output streamed to
``OUT/<step>.log``; a step still running after twice its expected minutes is stopped, and when the time is up the
steps left are not started. The results — device, versions, commit, date, and per step its command, result,
minutes and the end of its output — are written to ``OUT/gpu_check.md`` (for benchmarks/RESULTS.md) and
``OUT/gpu_check.json``.

    .venv/bin/python benchmarks/gpu_check.py [--out DIR] [--only STEP ...] [--skip STEP ...] [--minutes 22]
    .venv/bin/python benchmarks/gpu_check.py --dry-run     # the steps and their commands; no GPU needed

Exit code: 0 when every step passed, 1 when one did not or there is no CUDA device, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REFERENCE = HERE / "cuda_reference.json"
TAIL_LINES = 60  # lines of each step's output in the markdown (the whole output is in its log)


@dataclass
class Step:
    """One check: a name, the command (run from the checkout's root) and the minutes it should need (it is stopped
    after twice that, or when the time of all steps is up)."""

    name: str
    command: list[str]
    minutes: float

    @property
    def script(self) -> Optional[Path]:
        """The benchmark script the step runs (``None`` for pytest)."""
        scripts = [ROOT / part for part in self.command if part.endswith(".py")]
        return scripts[0] if scripts else None


def build_steps(reference: Path, python: str = sys.executable) -> list[Step]:
    """The checks in the order they run; ``reference`` is where the measured reference is written and read."""
    steps = [
        Step("pytest-gpu", [python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"], 5),
        Step("cuda-reference", [python, "benchmarks/cuda_reference.py", "--out", str(reference)], 4),
        Step("estimate-accuracy", [python, "benchmarks/estimate_accuracy.py", "--reference", str(reference)], 3),
    ]
    for share, minutes in (("0.8", 2), ("0.5", 3), ("0.33", 3)):  # below 0.7 also the accumulation configs
        steps.append(Step(f"mitigation-{share}", [python, "benchmarks/mitigation.py", "--budget-share", share,
                                                  "--steps", "8", "--rounds", "1"], minutes))
    # the CPU figure (stubbed CUDA reading) first, then a short and a longer step on the GPU
    steps.append(Step("overhead", [python, "benchmarks/overhead.py", "--out", "OUT/overhead_runs"], 4))
    # the allocator's calls a boundary makes, each timed, and the guard's step with the real reading and the stub
    steps.append(Step("cuda-calls", [python, "benchmarks/cuda_calls.py", "--rounds", "3", "--steps", "800"], 1))
    # FSDP2 on a real device: one rank (NCCL), measured against the per-rank estimate
    steps.append(Step("per-rank-fsdp", [python, "benchmarks/per_rank.py", "--device", "cuda", "--world-sizes", "1",
                                        "--strategies", "fsdp"], 2))
    # the first batch's plan as the guard makes it, its seconds on the GPU host's CPU (the goal: at most one for any
    # zoo model): the zoo's tiny models and its reference sizes, forced to plan and not, each with the estimates'
    # measured steps replayed and run again (twice the plans of one column)
    steps.append(Step("plan-time", [python, "benchmarks/plan_time.py", "--first-batch", "--sizes", "tiny,reference",
                                    "--threads", "1", "--rounds", "1"], 5))
    return steps


STEP_NAMES = [step.name for step in build_steps(REFERENCE)]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help="results directory (default: ./memguard_gpu_check/<date-time>)")
    # several names after one flag, or the flag repeated: both add up
    parser.add_argument("--only", action="extend", nargs="+", choices=STEP_NAMES, default=None, metavar="STEP",
                        help="run only these steps")
    parser.add_argument("--skip", action="extend", nargs="+", choices=STEP_NAMES, default=[], metavar="STEP",
                        help="leave these steps out")
    parser.add_argument("--minutes", type=float, default=22.0, help="time for all steps together (default 22)")
    parser.add_argument("--keep-reference", action="store_true",
                        help="write the measured reference to the results directory, not benchmarks/")
    parser.add_argument("--dry-run", action="store_true", help="print the steps and their commands, run nothing")
    args = parser.parse_args(argv)
    if not args.minutes > 0:
        parser.error(f"--minutes {args.minutes}: must be more than 0")
    return args


def cuda_missing() -> Optional[str]:
    """Why the checks cannot run here, or ``None`` when a CUDA device is there."""
    try:
        import torch
    except ImportError as err:
        return f"torch cannot be imported ({err})"
    if not torch.cuda.is_available():
        return f"no CUDA device here (torch {torch.__version__}: torch.cuda.is_available() is False)"
    return None


def environment() -> dict:
    """Device and versions, read in a child process (the parent holds no CUDA context while the steps run)."""
    code = ("import json, platform, torch, lightning; p = torch.cuda.get_device_properties(0)\n"
            "try:\n import transformers; tv = transformers.__version__\nexcept ImportError:\n tv = None\n"
            "print(json.dumps({'device': torch.cuda.get_device_name(0), 'devices': torch.cuda.device_count(), "
            "'memory_gib': round(p.total_memory / 2**30, 1), 'cuda': torch.version.cuda, 'torch': torch.__version__,"
            " 'lightning': lightning.__version__, 'transformers': tv, 'python': platform.python_version()}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    info = json.loads(done.stdout) if done.returncode == 0 else {"device": f"unknown ({done.stderr.strip()[-200:]})"}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True)
    info["commit"] = (commit.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty.stdout.strip()
                                                              else "")
    return info


def run_step(step: Step, out: Path, seconds: float) -> dict:
    """Runs one step with its output streamed to ``out/<name>.log``; stops it (and its children) after
    ``seconds``."""
    log = out / f"{step.name}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    command = [str(out) + part[3:] if part.startswith("OUT/") else part for part in step.command]
    started = time.monotonic()
    with open(log, "w") as sink:
        sink.write("$ " + " ".join(command) + "\n")
        sink.flush()
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=seconds)
            result = "passed" if code == 0 else f"failed (exit code {code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            result = f"stopped after {seconds / 60:.1f} min (time is up)"
    return {"step": step.name, "command": " ".join(command), "result": result,
            "minutes": round((time.monotonic() - started) / 60, 2), "log": log.name}


def write_results(out: Path, info: dict, rows: list[dict], started: datetime.datetime) -> Path:
    """``gpu_check.md`` and ``gpu_check.json`` in ``out``; returns the markdown's path."""
    finished = datetime.datetime.now()
    (out / "gpu_check.json").write_text(json.dumps({"environment": info, "started": started.isoformat(
        timespec="seconds"), "finished": finished.isoformat(timespec="seconds"), "steps": rows}, indent=1) + "\n")
    lines = [f"# GPU check: {info.get('device')}, {started:%Y-%m-%d}", "",
             f"- device: {info.get('device')} ({info.get('devices', '?')} visible, {info.get('memory_gib', '?')} GiB)"
             f", CUDA {info.get('cuda')}",
             f"- torch {info.get('torch')}, lightning {info.get('lightning')}, transformers {info.get('transformers')}"
             f", Python {info.get('python')}",
             f"- commit {info.get('commit')}; {started:%Y-%m-%d %H:%M} to {finished:%H:%M} "
             f"({(finished - started).total_seconds() / 60:.1f} min)", "",
             "| step | command | result | minutes |", "|---|---|---|---:|"]
    lines += [f"| {r['step']} | `{r['command'].replace(sys.executable, 'python')}` | {r['result']} | "
              f"{r['minutes']} |" for r in rows]
    for row in rows:
        log = out / row["log"]
        tail = log.read_text(errors="replace").splitlines()[-TAIL_LINES:] if log.exists() else ["(no output)"]
        lines += ["", f"## {row['step']}: {row['result']}", "", "```text", *tail, "```"]
    path = out / "gpu_check.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now()
    out = (args.out or Path("memguard_gpu_check") / f"{started:%Y%m%d-%H%M%S}").resolve()
    reference = out / "cuda_reference.json" if args.keep_reference else REFERENCE
    steps = [s for s in build_steps(reference) if (args.only is None or s.name in args.only)
             and s.name not in args.skip]
    if args.dry_run:
        for step in steps:
            print(f"{step.name:<18} ~{step.minutes:g} min  {' '.join(step.command)}")
        print(f"results would go to {out}")
        return 0
    missing = cuda_missing()
    if missing:
        print(f"gpu_check: {missing}; run it on a machine with a GPU (--dry-run lists the steps)", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    info = environment()
    print(f"gpu_check on {info.get('device')}: {len(steps)} steps, results in {out}", flush=True)
    deadline = time.monotonic() + args.minutes * 60
    rows = []
    for step in steps:
        left = deadline - time.monotonic()
        if left <= 0:
            rows.append({"step": step.name, "command": " ".join(step.command), "result": "not run (time is up)",
                         "minutes": 0, "log": f"{step.name}.log"})
        else:
            rows.append(run_step(step, out, min(left, 2 * step.minutes * 60)))
        print(f"  {step.name}: {rows[-1]['result']} ({rows[-1]['minutes']} min)", flush=True)
    if reference.exists() and reference.parent != out:
        shutil.copy(reference, out / reference.name)
    path = write_results(out, info, rows, started)
    print(f"results: {path}")
    if not args.keep_reference and any(r["step"] == "cuda-reference" for r in rows):
        print(f"the reference was rewritten: git diff {REFERENCE.relative_to(ROOT)}")
    return 0 if all(r["result"] == "passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
