"""``python -m lightning_memguard demo | report | estimate``."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Optional, Sequence

from .snapshot import parse_bytes


def _demo(args: argparse.Namespace) -> int:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    from .callback import MemGuardCallback
    from .demo import DemoTransformer
    from .summary import format_table, phase_summary

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
    print(f"python -m lightning_memguard report {trainer.log_dir}")
    print(f"tensorboard --logdir {os.path.abspath(args.out)}")
    return 0


def _parse_tensor_spec(spec: str):
    """``16x64:int64:1000`` -> a random int64 tensor of shape (16, 64) in [0, 1000); ``8x3x32x32`` -> float32."""
    import torch

    parts = spec.split(":")
    try:
        shape = tuple(int(n) for n in parts[0].lower().split("x"))
        dtype = getattr(torch, parts[1]) if len(parts) > 1 else torch.float32
        high = int(parts[2]) if len(parts) > 2 else 2
    except (ValueError, AttributeError):
        raise argparse.ArgumentTypeError(f"batch tensor {spec!r}: expected SHAPE[:DTYPE[:HIGH]], e.g. 16x64:int64:1000")
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    return torch.randint(0, high, shape, dtype=dtype)


def _load_factory(target: str):
    import importlib

    module_name, _, attribute = target.partition(":")
    if not attribute:
        raise SystemExit(f"model {target!r}: expected an importable 'module:factory', "
                         "e.g. lightning_memguard.demo:TinyGPT")
    return getattr(importlib.import_module(module_name), attribute)


def _estimate(args: argparse.Namespace) -> int:
    import torch

    from .estimate import estimate_memory

    factory = _load_factory(args.model)
    if args.batch:
        tensors = list(args.batch)
        batch = tensors[0] if len(tensors) == 1 else tuple(tensors)
    else:
        loader = getattr(factory(), "train_dataloader", None)
        if loader is None:
            raise SystemExit("give --batch SHAPE[:DTYPE[:HIGH]] (the model has no train_dataloader to take one from)")
        batch = next(iter(loader()))
    optimizers = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
                  "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}
    if args.meta:
        with torch.device("meta"):
            model = factory()
    else:
        model = factory()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimate = estimate_memory(model, batch, optimizer=optimizers.get(args.optimizer), precision=args.precision,
                                   variants=args.variants)
    print(estimate)
    return 0


def _report(args: argparse.Namespace) -> int:
    from .plot import load_run, plot_run
    from .summary import format_table, phase_summary

    try:
        run = load_run(args.run)
    except FileNotFoundError as err:
        raise SystemExit(str(err))
    history = run.history
    steps = history["step"]
    print(f"run: {run.directory}")
    print(f"device: {history['device'].iloc[0] if len(history) else 'n/a'}; steps {steps.min()}-{steps.max()} "
          f"({steps.nunique()} measured); threshold {run.threshold if run.threshold else 'n/a'}")
    print("\nPer-phase peaks (MiB):")
    print(format_table(phase_summary(history), "{:.2f}"))
    events = run.events[run.events["action"] != "explain"] if not run.events.empty else run.events
    if not events.empty:
        print("\nEvents:")
        table = events[["step", "action", "rung", "level", "reason"]].fillna({"rung": ""})
        table["level"] = table["level"].astype("Int64")
        print(table.to_string(index=False))
    out = args.out or os.path.join(run.directory, "memguard_report.png")
    print(f"\nplot: {plot_run(run, out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_memguard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a small transformer on random tokens with MemGuardCallback")
    demo.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    demo.add_argument("--batch-size", type=int, default=16)
    demo.add_argument("--seq-len", type=int, default=64)
    demo.add_argument("--layers", type=int, default=4, help="encoder and decoder layers each")
    demo.add_argument("--budget", type=parse_bytes, default=None,
                      help="capacity to guard, e.g. 300MiB (needed on CPU for mitigation to engage)")
    demo.add_argument("--out", default="memguard_runs", help="log directory (default ./memguard_runs)")
    demo.set_defaults(func=_demo)

    report = commands.add_parser("report", help="summarise a run and plot its memory (PNG)")
    report.add_argument("run", help="a run's log directory or its memguard_history.csv")
    report.add_argument("--out", default=None, help="PNG path (default: memguard_report.png beside the CSV)")
    report.set_defaults(func=_report)

    estimate = commands.add_parser("estimate", help="estimate one training step's memory, without a GPU")
    estimate.add_argument("model", help="an importable factory, module:callable (e.g. lightning_memguard.demo:TinyGPT)")
    estimate.add_argument("--batch", type=_parse_tensor_spec, action="append",
                          help="a batch tensor SHAPE[:DTYPE[:HIGH]], e.g. 16x64:int64:1000; repeat for a tuple "
                               "(default: the first batch of the model's train_dataloader)")
    estimate.add_argument("--optimizer", choices=["adamw", "adam", "sgd", "sgd-momentum"], default=None,
                          help="default: the model's configure_optimizers, else none")
    estimate.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed"])
    estimate.add_argument("--meta", action="store_true", help="build the model on the meta device (no memory)")
    estimate.add_argument("--variants", action="store_true", help="also AMP and checkpointing k of N blocks")
    estimate.set_defaults(func=_estimate)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
