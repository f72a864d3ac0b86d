"""``python -m lightning_memguard estimate``: one training step's memory for any model a factory builds — a
LightningModule, a plain module, a transformers model — with a batch from ``--batch``, from the factory or from the
model's ``train_dataloader``. Every failure is a ``ValueError`` whose message gives the reason on one line."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import re
import warnings
from typing import Any, Callable, Optional

_INT_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "bool")
_MAX_BATCH_ELEMENTS = 2**26  # 256 MiB of float32: far beyond any example batch, well within this machine
_MAX_MESSAGE = 600  # characters of a model's own error message shown on the one line
_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum")
_FACTORY = "lightning_memguard.commands.demo:TinyGPT"

#: The examples ``estimate --help`` shows (after ``python -m lightning_memguard``): each runs as printed, in seconds,
#: on any machine (the CUDA target runs on the meta device). tests/unit/test_cli.py runs them from the help text.
EXAMPLES = (
    f"estimate {_FACTORY} --target cuda --variants",
    f"estimate {_FACTORY} --batch 4x128:int64:1000 --batch 4x128:int64:1000 --precision bf16-mixed --target cuda",
)


def parse_tensor_spec(spec: str, name: Optional[str] = None):
    """``16x64:int64:1000`` -> a random int64 tensor of shape (16, 64) in [0, 1000); ``8x3x32x32`` -> float32.

    ``name`` is what messages call the spec (default: the spec itself).

    Raises:
        ValueError: naming the spec and the form allowed, for anything that is not SHAPE[:DTYPE[:HIGH]] with
            positive sizes, a floating, integer or bool dtype and HIGH >= 1.
    """
    import torch

    shown = f"--batch {spec if name is None else name!r}"
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
        raise ValueError(f"{shown}: {form}") from None
    if not (dtype.is_floating_point or str(dtype).replace("torch.", "") in _INT_DTYPES):
        raise ValueError(f"{shown}: dtype {parts[1]!r} is not a floating, integer or bool dtype")
    if math.prod(shape) > _MAX_BATCH_ELEMENTS:
        raise ValueError(f"{shown}: {math.prod(shape)} elements; an example batch may have at most "
                         f"{_MAX_BATCH_ELEMENTS}")
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    return torch.randint(0, 2 if dtype == torch.bool else high, shape, dtype=dtype)


def parse_batch(specs: list[str]) -> Any:
    """``--batch`` values -> the example batch: ``KEY=SPEC`` each gives a dict (a transformers model's keyword
    arguments); plain specs give one tensor, or a tuple of several; no spec gives ``None``.

    Raises:
        ValueError: a bad spec, a key that is not a keyword name, a key given twice, or keyed and plain specs mixed.
    """
    if not specs:
        return None
    keyed = ["=" in spec for spec in specs]
    if any(keyed) and not all(keyed):
        raise ValueError("--batch: give every tensor as KEY=SHAPE[:DTYPE[:HIGH]] (a dict batch) or none of them "
                         f"(one tensor or a tuple), not both: {' '.join(specs)}")
    if not any(keyed):
        tensors = [parse_tensor_spec(spec) for spec in specs]
        return tensors[0] if len(tensors) == 1 else tuple(tensors)
    batch = {}
    for spec in specs:
        key, _, tensor_spec = spec.partition("=")
        if not key.isidentifier():
            raise ValueError(f"--batch {spec!r}: {key!r} is not a keyword name; expected KEY=SHAPE[:DTYPE[:HIGH]], "
                             "e.g. input_ids=8x1024:int64:50257")
        if key in batch:
            raise ValueError(f"--batch {spec!r}: the key {key!r} is given twice")
        batch[key] = parse_tensor_spec(tensor_spec, name=spec)
    return batch


def load_callable(target: str, what: str, dotted: bool = False) -> Callable:
    """``module:name`` (or, with ``dotted``, ``package.module.name``) -> the callable it names.

    Raises:
        ValueError: naming ``what`` and the target: not of that form, not importable, no such attribute, not
            callable.
    """
    example = "my_pkg.losses:lm_loss" if dotted else _FACTORY
    form = f"expected an importable 'module:callable'{' or module.callable' if dotted else ''}, e.g. {example}"
    module_name, _, attribute = target.partition(":")
    if dotted and not attribute:
        module_name, _, attribute = target.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"{what} {target!r}: {form}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{what} {target!r}: cannot import {module_name!r} ({one_line(err)}); {form}") from None
    except Exception as err:  # the module itself failed while importing
        raise ValueError(f"{what} {target!r}: importing {module_name!r} failed ({one_line(err)})") from None
    found = getattr(module, attribute, None)
    if found is None:
        raise ValueError(f"{what} {target!r}: {module_name!r} has no attribute {attribute!r}; {form}")
    if not callable(found):
        raise ValueError(f"{what} {target!r}: {attribute!r} is a {type(found).__name__}, not a callable; {form}")
    return found


def loss_function(text: Optional[str]) -> Callable:
    """``--loss``: none -> the default loss; a name -> that attribute or key of the output; a dotted path -> the
    ``(model, batch) -> loss`` callable it names."""
    from ..estimate.losses import OutputAttributeLoss, default_loss

    if text is None:
        return default_loss
    if text.isidentifier():
        return OutputAttributeLoss(text)
    return load_callable(text, "--loss", dotted=True)


def build_model(factory: Callable, target: str, on_meta: bool) -> tuple[Any, Any]:
    """Calls the factory once (on the meta device with ``on_meta``) -> ``(model, batch or None)``."""
    import torch
    from torch import nn

    try:
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            made = factory()
    except Exception as err:
        raise ValueError(f"model {target!r}: calling it failed ({one_line(err)})") from None
    if isinstance(made, nn.Module):
        return made, None
    if isinstance(made, (tuple, list)) and len(made) == 2 and isinstance(made[0], nn.Module):
        return made[0], made[1]
    raise ValueError(f"model {target!r} returned {describe(made)}; expected an nn.Module (a LightningModule, a "
                     "transformers model) or a (model, batch) pair")


def batch_from_dataloader(model: Any) -> Any:
    """The first batch of the model's ``train_dataloader()``."""
    name = type(model).__name__
    hint = ("give --batch SHAPE[:DTYPE[:HIGH]] (KEY=SHAPE... for a dict batch), or a factory that returns "
            "(model, batch)")
    loader = getattr(model, "train_dataloader", None)
    if not callable(loader):
        raise ValueError(f"{name} has no train_dataloader to take a batch from: {hint}")
    try:
        return next(iter(loader()))
    except Exception as err:  # a LightningModule without its own train_dataloader raises Lightning's error here
        raise ValueError(f"{name}.train_dataloader() gave no batch ({one_line(err)}): {hint}") from None


def run_estimate(args: argparse.Namespace) -> int:
    """The ``estimate`` command."""
    import torch

    from ..estimate.losses import LossNotFound
    from ..estimate.memory import estimate_memory

    batch = parse_batch(args.batch)
    loss_fn = loss_function(args.loss)
    factory = load_callable(args.model, "model")
    model, made_batch = build_model(factory, args.model, args.meta)
    if batch is None:
        batch = made_batch if made_batch is not None else batch_from_dataloader(model)
    optimizers = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
                  "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            estimate = estimate_memory(model, batch, optimizer=optimizers.get(args.optimizer), precision=args.precision,
                                       loss_fn=loss_fn, variants=args.variants, target=args.target,
                                       strategy=args.strategy, world_size=args.world_size)
    except ValueError as err:
        cause = err.__cause__
        if isinstance(cause, LossNotFound):  # the estimate wraps it as a batch that does not fit: say what it is
            hint = ("give --loss NAME (an attribute of the output) or --loss module:function" if args.loss is None
                    else "give another --loss, or a batch the loss is computed from (a transformers model returns "
                         ".loss only when the batch has labels)")
            raise ValueError(f"{one_line(str(cause))}: {hint}") from None
        raise ValueError(one_line(str(err))) from None
    except Exception as err:
        raise ValueError(f"estimating {type(model).__name__} failed ({one_line(err)})") from None
    print(estimate)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``estimate`` command's arguments."""
    parser.add_argument("model", help=f"an importable factory, module:callable (e.g. {_FACTORY}), called once; it "
                                      "returns a model, or a (model, batch) pair")
    parser.add_argument("--batch", action="append", default=[],
                        help="a batch tensor SHAPE[:DTYPE[:HIGH]], e.g. 16x64:int64:1000; repeat for a tuple. "
                             "KEY=SHAPE[:DTYPE[:HIGH]] for a dict batch (keyword arguments), e.g. "
                             "--batch input_ids=8x1024:int64:50257 --batch labels=8x1024:int64:50257. Replaces a "
                             "batch the factory returns (default: that batch, else the first batch of the model's "
                             "train_dataloader)")
    parser.add_argument("--loss", default=None,
                        help="NAME: the loss is that attribute or key of the output (e.g. loss); module:function or "
                             "module.function: a (model, batch) -> loss callable. Default: a LightningModule's "
                             "training_step; else the output's .loss or 'loss' key, a scalar tensor, or (no loss in "
                             "the output) the sum of its tensors")
    parser.add_argument("--optimizer", choices=_OPTIMIZERS, default=None,
                        help="default: the model's configure_optimizers, else none")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed"])
    parser.add_argument("--target", choices=["cuda", "cpu"], default=None,
                        help="the device the run will train on (default: cuda where it is available, else cpu); "
                             "cuda needs no GPU: the step runs on the meta device with CUDA's kernels modelled")
    parser.add_argument("--meta", action="store_true", help="build the model on the meta device (no memory)")
    parser.add_argument("--variants", action="store_true", help="also AMP and checkpointing k of N blocks")
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default=None,
                        help="estimate one rank of a data-parallel run (the batch is the per-rank batch): ddp (a "
                             "replica plus gradient buckets) or fsdp (FSDP2, fully_shard on every block and the root)")
    parser.add_argument("--world-size", type=int, default=None, help="the number of ranks, with --strategy")
    parser.set_defaults(func=run_estimate)


# A module's repr: "Name(" at the end of a line, then indented "(child): ..." lines, closed by ")" at the start of a
# line (children close indented, so the first unindented ")" closes the outermost module).
_MODULE_REPR = re.compile(r"([A-Za-z_][\w.]*)\(\n[ \t]+\([\s\S]*?\n\)")


def one_line(error: Any, limit: int = _MAX_MESSAGE) -> str:
    """An exception (``Type: message``) or a message on one line: module reprs shortened to ``Name(...)``, lines
    joined, at most ``limit`` characters — the reason stays, a model's 200-line repr does not."""
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    text = _MODULE_REPR.sub(r"\1(...)", text)
    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe(value: Any) -> str:
    """What a value is, in a few words (never its repr)."""
    if isinstance(value, (tuple, list)):
        kinds = ", ".join(type(v).__name__ for v in value[:6]) + (", ..." if len(value) > 6 else "")
        return f"a {type(value).__name__} of {len(value)} ({kinds})"
    return f"a {type(value).__name__}"
