"""The loss of one training step when none is given: what "the loss" of a model's output is (framework-free).

The estimate runs a step of any model: a LightningModule through its ``training_step``; anything else through its
forward, called the way the batch asks (a dict batch as keyword arguments, a tuple as positional ones). The loss is
then what the output says it is: a transformers ``ModelOutput.loss``, a ``"loss"`` key, or plain tensors.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..base.fetched_batches import iterator_over
from ..base.step_signature import fetches_own_batches, takes_batch_index

__all__ = ["LossNotFound", "OutputAttributeLoss", "call_model", "default_loss", "loss_of_output",
           "run_training_step"]


class LossNotFound(ValueError):
    """A step's output holds no loss where one was looked for (the message says what the output holds)."""


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a dict batch whose keys the forward takes as keywords (transformers models, tokenizer
    output), ``model(*batch)`` for a tuple or list, else ``model(batch)``."""
    if isinstance(batch, Mapping) and _takes_keywords(model, batch):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _takes_keywords(model: nn.Module, batch: Mapping) -> bool:
    # a forward(self, batch) that wants the dict itself is called with it, not with its keys
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a C extension): keywords are the common case
        return True
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return any(p.kind is p.VAR_KEYWORD for p in parameters) or all(key in names for key in batch)


def run_training_step(model: nn.Module, batch: Any) -> Any:
    """``model.training_step`` run on ``batch`` as batch 0, as Lightning's loop calls it: ``(batch, 0)``, or
    ``(batch)`` for a step that takes no batch index, or, for a step that fetches its own batches (it takes
    ``dataloader_iter``), an iterator handing it ``(batch, 0, 0)``."""
    step = model.training_step
    if fetches_own_batches(step):
        return step(iterator_over(batch))
    return step(batch, 0) if takes_batch_index(step) else step(batch)


def loss_of_output(output: Any) -> Any:
    """The loss in what a forward or a training step returned: a tensor as it is; a mapping's ``"loss"`` (a dict,
    a transformers ``ModelOutput``) or an object's ``.loss`` where it is a tensor. Anything else is returned
    unchanged (``None`` for a skipped batch): the caller decides what it means."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if isinstance(getattr(output, "loss", None), torch.Tensor):
        return output.loss
    return output


def default_loss(model: nn.Module, batch: Any) -> Any:
    """The loss of one step when none is given: a LightningModule's ``training_step(batch, 0)`` (its loss, or its
    dict's ``"loss"``); otherwise the forward's loss (``ModelOutput.loss``, a ``"loss"`` key, a scalar tensor) and,
    where the output holds none (a transformers model given no labels), the sum of its tensors as a stand-in whose
    backward reaches every output."""
    if callable(getattr(model, "training_step", None)):
        return loss_of_output(run_training_step(model, batch))
    output = call_model(model, batch)
    loss = loss_of_output(output)
    if isinstance(loss, torch.Tensor) and (loss is not output or loss.numel() == 1):
        return loss
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) \
        else (output,)
    tensors = [t for t in values if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]
    if not tensors:
        raise LossNotFound(f"{type(model).__name__}'s output ({_describe(output)}) holds no loss and no floating "
                           "tensor to stand in for one")
    return sum(t.float().sum() for t in tensors)


class OutputAttributeLoss:
    """``(model, batch) -> loss``: the attribute or key ``name`` of the step's output (``training_step`` of a
    LightningModule, else the forward called as :func:`call_model` does), e.g. ``OutputAttributeLoss("loss")`` for
    a transformers model given labels.

    Raises:
        ValueError: at construction, a ``name`` that is not an identifier.
        LossNotFound: when called, an output without a tensor under ``name`` (the message lists what it has).
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"name={name!r} must be the name of an attribute or key of the output, e.g. 'loss'")
        self.name = name

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        step = getattr(model, "training_step", None)
        output = run_training_step(model, batch) if callable(step) else call_model(model, batch)
        value = output.get(self.name) if isinstance(output, Mapping) else getattr(output, self.name, None)
        if not isinstance(value, torch.Tensor):
            held = f" (it holds {type(value).__name__})" if value is not None else ""
            raise LossNotFound(f"{type(model).__name__}'s output ({_describe(output)}) has no tensor under "
                               f"{self.name!r}{held}")
        return value

    def __repr__(self) -> str:
        return f"OutputAttributeLoss({self.name!r})"


def _describe(output: Any) -> str:
    """A short description of an output, never its repr (a model's repr runs to hundreds of lines)."""
    if isinstance(output, torch.Tensor):
        return f"a {tuple(output.shape)} tensor"
    if isinstance(output, Mapping):
        return f"{type(output).__name__} with keys {', '.join(map(str, output)) or 'none'}"
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of {len(output)}: {', '.join(type(v).__name__ for v in output[:6])}"
    return f"a {type(output).__name__}"
