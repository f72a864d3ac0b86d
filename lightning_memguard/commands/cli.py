"""The command line, ``python -m lightning_memguard demo | report | estimate`` (or ``memguard ...``)."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Optional, Sequence

from ..base.snapshot import parse_bytes
from .estimate_command import EXAMPLES as ESTIMATE_EXAMPLES
from .estimate_command import add_arguments as add_estimate_arguments
from .estimate_command import one_line, parse_tensor_spec

__all__ = ["PROG", "EXAMPLES", "build_parser", "main", "parse_tensor_spec"]

PROG = "python -m lightning_memguard"

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
    from ..monitor.summary import format_table, phase_summary
    from .demo import DemoTransformer

    pl.seed_everything(0, verbose=False)
    warnings.filterwarnings("ignore", message=".*(litlogger|litmodels|LeafSpec|does not have many workers).*")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = DemoTransformer(batch_size=args.batch_size, seq_len=args.seq_len, nlayers=args.layers)
    guard = MemGuardCallback(**({"budget": args.budget} if args.budget else {}))
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
        print(events[["step", "action", "rung", "reason"]].to_string(index=False))
    print(f"\nHistory CSV: {os.path.join(trainer.log_dir, 'memguard_history.csv')}")
    # the running interpreter: the commands work as printed whether or not the virtual environment is activated
    print(f"{sys.executable} -m lightning_memguard report {trainer.log_dir}")
    print(f"{sys.executable} -m tensorboard.main --logdir {os.path.abspath(args.out)}")
    return 0


def _report(args: argparse.Namespace) -> int:
    import pandas as pd

    from ..monitor.summary import format_table, phase_summary
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
        table = events[["step", "action", "rung", "level", "reason"]].fillna({"rung": ""})
        table["level"] = pd.to_numeric(table["level"], errors="coerce").astype("Int64")
        print(table.to_string(index=False))
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
    demo.add_argument("--budget", type=_size, default=None,
                      help="capacity to guard, e.g. 300MiB (needed on CPU for mitigation to engage)")
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
