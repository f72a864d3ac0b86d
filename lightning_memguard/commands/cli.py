"""The command line, ``python -m lightning_memguard demo | report | estimate`` (or ``memguard ...``)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import warnings
from typing import Optional, Sequence

from ..base.snapshot import parse_bytes
from .estimate_command import EXAMPLES as ESTIMATE_EXAMPLES
from .estimate_command import add_arguments as add_estimate_arguments
from .estimate_command import one_line, parse_tensor_spec

__all__ = ["PROG", "EXAMPLES", "build_parser", "main", "parse_tensor_spec"]



def _python() -> str:
    """The interpreter as the reader should type it: ``python`` where that is this one (an activated environment),
    else its path — relative from here when it lies below (``.venv/bin/python`` in the checkout), else absolute — so
    that every example the help prints runs as printed."""
    found = shutil.which("python")
    if found and os.path.realpath(found) == os.path.realpath(sys.executable):
        return "python"
    relative = os.path.relpath(sys.executable)
    return relative if not relative.startswith("..") else sys.executable


PROG = f"{_python()} -m lightning_memguard"

#: The examples ``--help`` shows, by command (after ``python -m lightning_memguard``). Each runs as printed, in
#: this order, together in under a minute on a CPU; the report reads the demo's run. test_cli.py runs them from --help.
EXAMPLES: dict[str, tuple[str, ...]] = {
    # a budget the small demo crosses at step 1, so the ladder acts within three steps
    "demo": ("demo --steps 3 --layers 2 --batch-size 16 --seq-len 32 --budget 40MiB",),
    "report": ("report memguard_runs/demo/version_0",),
    "estimate": ESTIMATE_EXAMPLES,
}


def _demo(args: argparse.Namespace) -> int:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    from ..adapters.lightning_callback import MemGuardCallback
    from ..monitor.summary import format_events, format_table, phase_summary
    from .demo import DemoTransformer

    pl.seed_everything(0, verbose=False)
    warnings.filterwarnings("ignore", message=".*(litlogger|litmodels|LeafSpec|does not have many workers).*")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = DemoTransformer(batch_size=args.batch_size, seq_len=args.seq_len, nlayers=args.layers)
    budget = args.budget
    if budget is None and not args.monitor_only:
        budget = _demo_budget(model, "cuda" if torch.cuda.is_available() else "cpu")
    guard = MemGuardCallback(**({"budget": budget} if budget else {}))
    logger = TensorBoardLogger(args.out, name="demo")
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="auto",
        devices=1,
        callbacks=[guard],
        logger=logger,
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(model)
    print("\nPer-phase memory (MiB):")
    print(format_table(phase_summary(guard.history)))
    events = guard.events
    if not events.empty:
        print("\nMemGuard events:")
        print(format_events(events))
    print(f"\nHistory CSV: {guard.history_csv}")
    # the running interpreter: the commands work as printed whether or not the virtual environment is activated
    print(f"{sys.executable} -m lightning_memguard report {trainer.log_dir}")
    print(f"{sys.executable} -m tensorboard.main --logdir {os.path.abspath(args.out)}")
    return 0


#: The demo's default budget leaves the activations half the room a plain step needs under the default threshold, so
#: the ladder has to act on any device; what persists (weights, gradients, AdamW's state, CUDA's workspaces) fits.
DEMO_ACTIVATION_SHARE = 0.5


def _demo_budget(model, target: str) -> Optional[int]:
    """A budget the demo's plain step does not fit but a mitigated one does, from the estimate of its first batch
    (printed with the reason); ``None`` (monitoring only, said so) where the estimate cannot be made. Without it the
    demo on an 80 GB GPU would train a 180 MiB model and draw flat lines."""
    from ..base.snapshot import format_bytes
    from ..estimate import estimate_memory
    from ..guard.settings import GuardSettings

    try:
        estimate = estimate_memory(model, next(iter(model.train_dataloader())), target=target)
    except Exception as err:  # the demo still trains, monitored only
        print(f"demo: no --budget, and the estimate failed ({err!r}): training monitored only")
        return None
    persistent = (estimate.parameters_bytes + estimate.gradients_bytes + estimate.optimizer_state_bytes
                  + estimate.batch_bytes + estimate.runtime_bytes)
    activation_peak = max(estimate.phase_peaks.get("forward", 0), estimate.phase_peaks.get("backward", 0))
    transient = max(activation_peak - persistent, 0)
    # the optimizer step's own peak (AdamW's temporaries) fits: no activation remedy could lower that one
    needed = max(persistent + DEMO_ACTIVATION_SHARE * transient, estimate.phase_peaks.get("optimizer_step", 0))
    threshold = GuardSettings.threshold  # the demo's guard keeps the default
    budget = int(needed / threshold)
    print(f"demo: no --budget given; the plain step is estimated at {format_bytes(estimate.peak_bytes)} on {target} "
          f"({format_bytes(persistent)} of it weights, gradients, optimizer state and runtime), so the demo guards "
          f"{format_bytes(budget)}: at the {threshold:.0%} threshold the activations get half the room they need, "
          "and MemGuard has to act. Give --budget SIZE to choose, or --monitor-only to train unguarded.")
    return budget


def _report(args: argparse.Namespace) -> int:
    from ..monitor.summary import format_events, format_table, phase_summary
    from .plot import load_run, plot_run

    run = load_run(args.run)
    for note in run.notes:
        print(f"note: {note}")
    history = run.history
    print(f"run: {run.directory}")
    if history.empty:
        print("no steps recorded yet (the run stopped, or is still in its first step)")
        return 0
    steps = history["step"]
    print(f"device: {history['device'].iloc[0]}; steps {steps.min()}-{steps.max()} ({steps.nunique()} measured); "
          f"threshold {run.threshold if run.threshold else 'n/a'}")
    print("\nPer-phase peaks (MiB):")
    print(format_table(phase_summary(history), "{:.2f}"))
    events = run.events[run.events["action"] != "explain"] if not run.events.empty else run.events
    if not events.empty:
        print("\nEvents:")
        print(format_events(events))
    out = args.out or os.path.join(run.directory, "memguard_report.png")
    try:
        print(f"\nplot: {plot_run(run, out)}")
    except OSError as err:
        raise ValueError(f"cannot write the plot to {out} ({err.strerror or err}); give --out PATH") from None
    return 0


_DESCRIPTION = "Train the demo under MemGuard, summarise a run's memory, or estimate a training step's memory."


def _examples(commands: Sequence[str]) -> str:
    lines = [example for command in commands for example in EXAMPLES[command]]
    if len(commands) > 1:
        header = "examples (in this order, from an empty directory: the report reads the demo's run)"
    elif commands[0] == "report":
        header = "example (after the demo's example, whose run it reads)"
    else:
        header = "examples"
    return f"{header}:\n" + "\n".join(f"  {PROG} {line}" for line in lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``demo``, ``report`` and ``estimate``, each ``--help`` ending in examples that run."""
    parser = _Parser(prog=PROG, description=_DESCRIPTION, epilog=_examples(list(EXAMPLES)),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def add_command(name: str, summary: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=summary, epilog=_examples([name]),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)

    demo = add_command("demo", "train a small transformer on random tokens with MemGuardCallback")
    demo.add_argument("--steps", type=_positive_int, default=40, help="optimizer steps (default 40)")
    demo.add_argument("--batch-size", type=_positive_int, default=16)
    demo.add_argument("--seq-len", type=_positive_int, default=64)
    demo.add_argument("--layers", type=_positive_int, default=4, help="encoder and decoder layers each")
    guarded = demo.add_mutually_exclusive_group()
    guarded.add_argument("--budget", type=_size, default=None,
                         help="capacity to guard, e.g. 300MiB (default: derived from the estimate of the first "
                              "batch, so that the plain step does not fit and MemGuard acts)")
    guarded.add_argument("--monitor-only", action="store_true",
                         help="no budget: measure and log only (on a GPU the device's memory is the capacity)")
    demo.add_argument("--out", default="memguard_runs", help="log directory (default ./memguard_runs)")
    demo.set_defaults(func=_demo)

    report = add_command("report", "summarise a run and plot its memory (PNG)")
    report.add_argument("run", help="a run's log directory or its memguard_history.csv")
    report.add_argument("--out", default=None, help="PNG path (default: memguard_report.png beside the CSV)")
    report.set_defaults(func=_report)

    estimate = add_command("estimate", "estimate one training step's memory, without a GPU")
    add_estimate_arguments(estimate)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive int")
    return value


def _size(text: str) -> int:
    try:
        return parse_bytes(text, "--budget")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the usage block: the message says what is allowed
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs a command. Bad input is one line on stderr that gives the reason, and exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        parser.exit(2, f"{parser.prog} {args.command}: error: {one_line(str(err))}\n")


if __name__ == "__main__":
    sys.exit(main())
