"""Which size of a batch a model reads as time steps, for the micro-batch rung (framework-free).

A batch whose every tensor has the same leading size looks batch-major, and the rung splits that size. But torch's
recurrent and attention layers read their input time-major by default (``batch_first=False``: ``[T, B, F]``), and a
model fed ``x`` of ``[T, B, F]`` and ``y`` of ``[T, B]`` hands them the batch's leading size as its time steps: split,
every micro-batch would hold all the samples and a part of each sequence — wrong gradients, no error. The batch's
shapes cannot tell, the model's layers can: :func:`time_axis_layers` names the layers that mix their inputs along
the leading size, and :func:`time_major_text` reads the input each received in one forward (the estimator runs it on
the meta device: :func:`~lightning_memguard.estimate.probe.first_inputs`).
"""

from __future__ import annotations

from typing import Mapping, Optional

from torch import nn

__all__ = ["time_axis_layers", "time_major_text"]

#: torch's layers that mix their input along its leading size when ``batch_first`` is ``False`` (their default);
#: a Transformer's encoder and decoder layers hold a MultiheadAttention each
_SEQUENCE_LAYERS = (nn.RNNBase, nn.MultiheadAttention, nn.Transformer)


def time_axis_layers(module: nn.Module) -> list[str]:
    """The names of ``module``'s layers that read the leading size of their input as time steps (torch's recurrent
    and attention layers with ``batch_first=False``), outermost first; ``[]`` for most models."""
    return [name for name, layer in module.named_modules()
            if isinstance(layer, _SEQUENCE_LAYERS) and getattr(layer, "batch_first", True) is False]


def time_major_text(inputs: Mapping[str, tuple[int, ...]], size: int) -> Optional[str]:
    """Why splitting the batch's leading size ``size`` would cut sequences, from the shapes of the inputs the
    :func:`time_axis_layers` received (layer name -> shape), else ``None``: a layer whose input leads with ``size``
    and has another size next reads the batch's leading size as time steps (a model that transposes its batch first
    hands them the samples second, and one whose two sizes are equal cannot be told: both are split as before)."""
    for name, shape in inputs.items():
        if len(shape) >= 2 and shape[0] == size and shape[1] != size:
            return (f"the model's layer {name!r} reads its input time-major (batch_first=False) and receives the "
                    f"batch's leading size {size} as its time steps (an input of shape {list(shape)}): splitting it "
                    "would cut every sequence instead of the batch: wrong gradients. Put the samples first in the "
                    "batch and build the layer with batch_first=True (or transpose in forward)")
    return None
