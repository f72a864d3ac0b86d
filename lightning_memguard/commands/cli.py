"""``python -m lightning_memguard demo | report | estimate``."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import warnings
from typing import Optional, Sequence

from ..core.snapshot import parse_bytes


def _demo(args: argparse.Namespace) -> int:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    from ..adapters.lightning_callback import MemGuardCallback
    from ..core.summary import format_table, phase_summary
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


_INT_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "bool")
_MAX_BATCH_ELEMENTS = 2**26  # 256 MiB of float32: far beyond any example batch, well within this machine


def parse_tensor_spec(spec: str):
    """``16x64:int64:1000`` -> a random int64 tensor of shape (16, 64) in [0, 1000); ``8x3x32x32`` -> float32.

    Raises:
        ValueError: naming the spec and the form allowed, for anything that is not SHAPE[:DTYPE[:HIGH]] with
            positive sizes, a floating, integer or bool dtype and HIGH >= 1.
    """
    import torch

    form = "expected SHAPE[:DTYPE[:HIGH]] with positive sizes, e.g. 16x64:int64:1000 or 8x3x32x32:float32"
    parts = spec.split(":") if isinstance(spec, str) else []
    try:
        if not 1 <= len(parts) <= 3:
            raise ValueError
        shape = tuple(int(n) for n in parts[0].lower().split("x"))
        dtype = getattr(torch, parts[1]) if len(parts) > 1 else torch.float32
        high = int(parts[2]) if len(parts) > 2 else 2
        if not isinstance(dtype, torch.dtype) or min(shape) < 1 or high < 1:
            raise ValueError
    except (ValueError, AttributeError):
        raise ValueError(f"--batch {spec!r}: {form}") from None
    if not (dtype.is_floating_point or str(dtype).replace("torch.", "") in _INT_DTYPES):
        raise ValueError(f"--batch {spec!r}: dtype {parts[1]!r} is not a floating, integer or bool dtype")
    if math.prod(shape) > _MAX_BATCH_ELEMENTS:
        raise ValueError(f"--batch {spec!r}: {math.prod(shape)} elements; an example batch may have at most "
                         f"{_MAX_BATCH_ELEMENTS}")
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    return torch.randint(0, 2 if dtype == torch.bool else high, shape, dtype=dtype)


def _load_factory(target: str):
    import importlib

    module_name, _, attribute = target.partition(":")
    form = "expected an importable 'module:callable', e.g. lightning_memguard.demo:TinyGPT"
    if not module_name or not attribute:
        raise ValueError(f"model {target!r}: {form}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"model {target!r}: cannot import {module_name!r} ({err}); {form}") from None
    factory = getattr(module, attribute, None)
    if factory is None:
        raise ValueError(f"model {target!r}: {module_name!r} has no attribute {attribute!r}; {form}")
    if not callable(factory):
        raise ValueError(f"model {target!r}: {attribute!r} is a {type(factory).__name__}, not a callable; {form}")
    return factory


def _estimate(args: argparse.Namespace) -> int:
    import torch

    from ..estimate.memory import estimate_memory

    tensors = [parse_tensor_spec(spec) for spec in args.batch]
    factory = _load_factory(args.model)
    if tensors:
        batch = tensors[0] if len(tensors) == 1 else tuple(tensors)
    else:
        loader = getattr(factory(), "train_dataloader", None)
        if loader is None:
            raise ValueError("give --batch SHAPE[:DTYPE[:HIGH]] (the model has no train_dataloader to take one from)")
        batch = next(iter(loader()))
    optimizers = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
                  "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}
    try:
        with torch.device("meta") if args.meta else contextlib.nullcontext():
            model = factory()
    except Exception as err:
        raise ValueError(f"model {args.model!r}: calling it failed ({type(err).__name__}: {err})") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimate = estimate_memory(model, batch, optimizer=optimizers.get(args.optimizer), precision=args.precision,
                                   variants=args.variants, target=args.target)
    print(estimate)
    return 0


def _report(args: argparse.Namespace) -> int:
    import pandas as pd

    from ..core.summary import format_table, phase_summary
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m lightning_memguard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a small transformer on random tokens with MemGuardCallback")
    demo.add_argument("--steps", type=_positive_int, default=40, help="optimizer steps (default 40)")
    demo.add_argument("--batch-size", type=_positive_int, default=16)
    demo.add_argument("--seq-len", type=_positive_int, default=64)
    demo.add_argument("--layers", type=_positive_int, default=4, help="encoder and decoder layers each")
    demo.add_argument("--budget", type=_size, default=None,
                      help="capacity to guard, e.g. 300MiB (needed on CPU for mitigation to engage)")
    demo.add_argument("--out", default="memguard_runs", help="log directory (default ./memguard_runs)")
    demo.set_defaults(func=_demo)

    report = commands.add_parser("report", help="summarise a run and plot its memory (PNG)")
    report.add_argument("run", help="a run's log directory or its memguard_history.csv")
    report.add_argument("--out", default=None, help="PNG path (default: memguard_report.png beside the CSV)")
    report.set_defaults(func=_report)

    estimate = commands.add_parser("estimate", help="estimate one training step's memory, without a GPU")
    estimate.add_argument("model", help="an importable factory, module:callable (e.g. lightning_memguard.demo:TinyGPT)")
    estimate.add_argument("--batch", action="append", default=[],
                          help="a batch tensor SHAPE[:DTYPE[:HIGH]], e.g. 16x64:int64:1000; repeat for a tuple "
                               "(default: the first batch of the model's train_dataloader)")
    estimate.add_argument("--optimizer", choices=["adamw", "adam", "sgd", "sgd-momentum"], default=None,
                          help="default: the model's configure_optimizers, else none")
    estimate.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed"])
    estimate.add_argument("--target", choices=["cuda", "cpu"], default=None,
                          help="the device the run will train on (default: cuda where it is available, else cpu); "
                               "cuda needs no GPU: the step runs on the meta device with CUDA's kernels modelled")
    estimate.add_argument("--meta", action="store_true", help="build the model on the meta device (no memory)")
    estimate.add_argument("--variants", action="store_true", help="also AMP and checkpointing k of N blocks")
    estimate.set_defaults(func=_estimate)
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
    """Runs a command. Bad input is one line on stderr and exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        parser.exit(2, f"{parser.prog} {args.command}: error: {str(err).splitlines()[0]}\n")


if __name__ == "__main__":
    sys.exit(main())
