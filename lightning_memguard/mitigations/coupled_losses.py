"""Transformers losses that are not a mean over labelled tokens, read from the model: what micro-batching must weight
them by, or why it cannot keep them exact. Framework-free: a transformers model is recognised by its attributes, and
transformers is only read when it is loaded.
"""

from __future__ import annotations

import inspect
import sys
from typing import Mapping, Optional

from torch import nn

__all__ = ["ctc_reduction", "contrastive_loss_text", "forward_parameters"]


def ctc_reduction(model: Optional[nn.Module]) -> Optional[str]:
    """``"mean"`` or ``"sum"`` where the transformers model ``model`` takes transformers' CTC loss (Wav2Vec2, HuBERT,
    WavLM... ``ForCTC`` models), with the reduction its config names (``config.ctc_loss_reduction``, ``"sum"`` by
    default); else ``None``. Neither is a mean over labelled tokens: ``"mean"`` divides each sample's loss by its
    target length and averages the samples (a mean over samples), ``"sum"`` adds the samples' losses."""
    losses = sys.modules.get("transformers.loss.loss_utils")
    if losses is None or model is None or not hasattr(losses, "ForCTCLoss"):
        return None
    loss_fn = getattr(model, "_loss_function", None)
    if loss_fn is None:
        loss_fn = losses.LOSS_MAPPING.get(getattr(model, "loss_type", None))
    reduction = getattr(getattr(model, "config", None), "ctc_loss_reduction", None)
    if loss_fn is not losses.ForCTCLoss or reduction not in ("mean", "sum"):
        return None
    return reduction


def forward_parameters(model: Optional[nn.Module]) -> Mapping[str, inspect.Parameter]:
    """The parameters of ``model``'s forward by name (a transformers model's flags: ``return_loss``,
    ``output_router_logits``, ``future_observed_mask``...); empty where it has none or they cannot be read."""
    forward = getattr(model, "forward", None)
    try:
        return inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        return {}


def contrastive_loss_text(model: Optional[nn.Module]) -> Optional[str]:
    """What to say where the transformers model ``model`` is a two-tower contrastive model (CLIP, SigLIP, CLAP...:
    its forward takes ``return_loss``, transformers' flag for the loss that scores every sample of the batch against
    every other), else ``None``. That loss, and any contrastive loss a training step computes from such a model's
    outputs, couples the samples: over a micro-batch each sample meets only that micro-batch's others."""
    if "return_loss" not in forward_parameters(model):
        return None
    return (f"{type(model).__name__} is trained with a contrastive loss (its forward takes return_loss): each sample "
            "is scored against every other sample of the batch the forward sees, so with micro-batches only against "
            "those of its micro-batch: the loss and the gradients are no longer the whole batch's, whatever the "
            "weights. Micro-batching is used only where nothing exact fits (AMP and checkpointing come first); to "
            "keep the step exact, give a larger budget")
