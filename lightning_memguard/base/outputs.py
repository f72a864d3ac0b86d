"""The outputs of a batch that ran in parts, combined into the whole batch's outputs (framework-free).

An evaluation or predict step runs without gradients, so running its batch in parts changes no number; what must be
put back together is what the step returns. :func:`combine_outputs` walks the parts' outputs side by side, as
:mod:`~lightning_memguard.base.batches` walks a batch, and combines each leaf by what it is:

- a tensor whose leading size is its part's number of samples, in every part: the parts concatenated (predictions,
  per-sample losses, embeddings) where the rest of their shapes match, else the list of the parts' tensors (rows of
  generated tokens, as long in each part as that part's longest);
- a floating-point 0-dim tensor, or a floating-point number that differs between parts: the parts weighted by their
  shares and summed — by default their share of the samples, so a mean over the batch stays the mean over the batch;
  given shares of what the mean is over (labelled tokens, say), a mean over those (a loss that sums over the samples
  becomes their mean: say so where it matters);
- a ``list`` whose length is its part's number of samples, in every part: the parts concatenated (predictions as
  lists of strings or per-sample records);
- mappings, dataclasses, named tuples, lists and tuples with the same keys or length in every part: combined key by
  key (field by field, item by item) into a container of the first part's type;
- ``None`` in every part: ``None``;
- anything else (strings, integer or boolean scalars and numbers, tensors of another shape, objects): the value when
  every part holds an equal one, else the list of the parts' values, in order.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any, Optional

import torch

from .batches import _is_dataclass_instance, _rebuilt_dataclass, _rebuilt_mapping, _rebuilt_sequence

__all__ = ["combine_outputs"]


def combine_outputs(outputs: list, sizes: list[int], shares: Optional[list[float]] = None) -> Any:
    """The whole batch's outputs from those of its parts: part ``i`` had ``sizes[i]`` samples and returned
    ``outputs[i]`` (see the module docstring for how each kind of value combines). ``shares``: what each part's
    scalars are weighted by (``None``: its share of the samples). One part: its outputs as they are.

    Raises:
        ValueError: ``outputs``, ``sizes`` and ``shares`` differ in length, or are empty, or a size is not positive.
    """
    if len(outputs) != len(sizes) or not outputs or (shares is not None and len(shares) != len(sizes)):
        raise ValueError(f"outputs of {len(outputs)} parts, sizes={sizes!r} and shares={shares!r}: one size (and "
                         "share) per part, at least one part")
    if any(not isinstance(n, int) or n <= 0 for n in sizes):
        raise ValueError(f"sizes={sizes!r} must be positive ints (the samples of each part)")
    if len(outputs) == 1:
        return outputs[0]
    total = sum(sizes)
    return _combine(list(outputs), list(sizes), list(shares) if shares is not None else [n / total for n in sizes])


def _combine(values: list, sizes: list[int], shares: list[float]) -> Any:
    first = values[0]
    if all(v is None for v in values):
        return None
    if all(isinstance(v, torch.Tensor) for v in values):
        return _combine_tensors(values, sizes, shares)
    if all(_is_number(v) for v in values):
        if all(v == first for v in values):
            return first
        return sum(v * share for v, share in zip(values, shares))
    if all(isinstance(v, Mapping) for v in values) and all(list(v.keys()) == list(first.keys()) for v in values):
        return _rebuilt_mapping(first, {key: _combine([v[key] for v in values], sizes, shares) for key in first})
    if _is_dataclass_instance(first) and all(type(v) is type(first) for v in values):
        fields = [f.name for f in dataclasses.fields(first)]
        return _rebuilt_dataclass(first, {name: _combine([getattr(v, name, None) for v in values], sizes, shares)
                                          for name in fields})
    if type(first) is list and all(type(v) is list for v in values) and [len(v) for v in values] == sizes:
        return [item for v in values for item in v]  # one item a sample
    if (isinstance(first, (list, tuple)) and all(type(v) is type(first) and len(v) == len(first) for v in values)):
        items = [_combine([v[i] for v in values], sizes, shares) for i in range(len(first))]
        return _rebuilt_sequence(first, items)
    return first if all(_equal(v, first) for v in values) else list(values)


def _combine_tensors(values: list[torch.Tensor], sizes: list[int], shares: list[float]) -> Any:
    first = values[0]
    if all(v.dim() > 0 and v.shape[0] == n for v, n in zip(values, sizes)):
        # per-sample rows; rows of another length in each part (generated tokens) cannot be put together: listed
        if all(v.shape[1:] == first.shape[1:] and v.dtype == first.dtype and v.device == first.device
               for v in values):
            return torch.cat(values)
        return list(values)
    if all(v.dim() == 0 and v.is_floating_point() for v in values):
        return sum((v * share for v, share in zip(values, shares)), torch.zeros((), dtype=values[0].dtype,
                                                                                 device=values[0].device))
    same = all(v.shape == first.shape and v.dtype == first.dtype and v.device == first.device
               and bool(torch.equal(v, first)) for v in values)
    return first if same else list(values)


def _is_number(value: Any) -> bool:
    """A real number a mean is taken of: not a bool or an integer (a count, an index), which is kept or listed."""
    return isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)


def _equal(value: Any, other: Any) -> bool:
    try:
        return bool(value == other)
    except Exception:  # a comparison that is not a truth value (arrays) or fails: not equal
        return False
