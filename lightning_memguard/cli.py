"""``python -m lightning_memguard demo | report | estimate``."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Optional, Sequence

from lightning_memguard.snapshot import parse_bytes


def _demo(args: argparse.Namespace) -> int:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_memguard.callback import MemGuardCallback
    from lightning_memguard.demo import DemoTransformer
    from lightning_memguard.summary import format_table, phase_summary

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
    print(f"tensorboard --logdir {os.path.abspath(args.out)}")
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
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
