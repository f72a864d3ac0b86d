"""The outputs of a batch that ran in parts, combined into the whole batch's outputs (framework-free).

An evaluation or predict step runs without gradients, so running its batch in parts changes no number; what must be
put back together is what the step returns. :func:`combine_outputs` walks the parts' outputs side by side, as
:mod:`~lightning_memguard.base.batches` walks a batch, and combines each leaf by what it is:

- a tensor whose leading size is its part's number of samples, in every part: the parts concatenated (predictions,
  per-sample losses, embeddings) where the rest of their shapes match; rows of integers (token ids) that differ only
  in length (generated sequences: each part stops when its own rows end, or at its own longest) are first padded on
  the right with ``pad_value`` to the longest part's, as ``generate`` pads the rows of a whole batch that ended
  early; else (no ``pad_value``, other shapes) the list of the parts' tensors, and ``on_listed`` is told why;
- a floating-point 0-dim tensor, or a floating-point number that differs between parts: the parts weighted by their
  shares and summed — by default their share of the samples, so a mean over the batch stays the mean over the batch;
  given shares of what the mean is over (labelled tokens, say), a mean over those (a loss that sums over the samples
  becomes their mean: say so where it matters);
- a ``list`` whose length is its part's number of samples, in every part: the parts concatenated (predictions as
  lists of strings or per-sample records);
- mappings, dataclasses, named tuples, lists and tuples with the same keys or length in every part: combined key by
  key (field by field, item by item) into a container of the first part's type; so is an object of a class
  registered with torch's pytree whose parts flatten alike (the same context), rebuilt by its ``unflatten_fn``;
- ``None`` in every part: ``None``;
- lists and tuples of different lengths (not one item a sample: one a generation step, say): the list of the parts'
  values, and ``on_listed`` is told;
- anything else (strings, integer or boolean scalars and numbers, tensors of another shape, objects): the value when
  every part holds an equal one, else the list of the parts' values, in order (for tensors, ``on_listed`` is told).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from .batches import (_is_dataclass_instance, _rebuilt_dataclass, _rebuilt_mapping, _rebuilt_sequence,
                      _registered_node)

__all__ = ["combine_outputs"]


def combine_outputs(outputs: list, sizes: list[int], shares: Optional[list[float]] = None, *,
                    pad_value: Optional[int] = None, on_listed: Optional[Callable[[str], None]] = None) -> Any:
    """The whole batch's outputs from those of its parts: part ``i`` had ``sizes[i]`` samples and returned
    ``outputs[i]`` (see the module docstring for how each kind of value combines). ``shares``: what each part's
    scalars are weighted by (``None``: its share of the samples). ``pad_value``: what rows of token ids of different
    lengths are padded with on the right (``None``: such rows are listed). ``on_listed(why)``: called where the parts'
    rows of a tensor could not be put into one (the whole batch's would be one tensor; it gets a list). One part: its
    outputs as they are.

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
    how = _How(list(sizes), list(shares) if shares is not None else [n / total for n in sizes], pad_value, on_listed)
    return _combine(list(outputs), how)


@dataclasses.dataclass
class _How:
    """How the parts' leaves combine: their samples, their shares, the pad of token rows, whom to tell of a list."""

    sizes: list[int]
    shares: list[float]
    pad_value: Optional[int]
    on_listed: Optional[Callable[[str], None]]


def _combine(values: list, how: _How) -> Any:
    first, sizes, shares = values[0], how.sizes, how.shares
    if all(v is None for v in values):
        return None
    if all(isinstance(v, torch.Tensor) for v in values):
        return _combine_tensors(values, how)
    if all(_is_number(v) for v in values):
        if all(v == first for v in values):
            return first
        return sum(v * share for v, share in zip(values, shares))
    if all(isinstance(v, Mapping) for v in values) and all(list(v.keys()) == list(first.keys()) for v in values):
        return _rebuilt_mapping(first, {key: _combine([v[key] for v in values], how) for key in first})
    if _is_dataclass_instance(first) and all(type(v) is type(first) for v in values):
        fields = [f.name for f in dataclasses.fields(first)]
        return _rebuilt_dataclass(first, {name: _combine([getattr(v, name, None) for v in values], how)
                                          for name in fields})
    node = _registered_node(first)
    if node is not None and all(type(v) is type(first) for v in values):
        flat = [node.flatten_fn(v) for v in values]
        if all(context == flat[0][1] and len(children) == len(flat[0][0]) for children, context in flat):
            return node.unflatten_fn([_combine([children[i] for children, _ in flat], how)
                                      for i in range(len(flat[0][0]))], flat[0][1])
    if type(first) is list and all(type(v) is list for v in values) and [len(v) for v in values] == sizes:
        return [item for v in values for item in v]  # one item a sample
    if (isinstance(first, (list, tuple)) and all(type(v) is type(first) and len(v) == len(first) for v in values)):
        items = [_combine([v[i] for v in values], how) for i in range(len(first))]
        return _rebuilt_sequence(first, items)
    if isinstance(first, (list, tuple)) and all(type(v) is type(first) for v in values):
        # one item a step of something each part did for as long as it needed (generate's scores): listed, and said
        return _listed(values, how, f"{type(first).__name__}s of different lengths "
                       f"({', '.join(str(len(v)) for v in values)})")
    return first if all(_equal(v, first) for v in values) else list(values)


def _combine_tensors(values: list[torch.Tensor], how: _How) -> Any:
    first = values[0]
    if all(v.dim() > 0 and v.shape[0] == n for v, n in zip(values, how.sizes)):
        if not all(v.dtype == first.dtype and v.device == first.device for v in values):
            return _listed(values, how, "rows of different dtypes or devices")
        if all(v.shape[1:] == first.shape[1:] for v in values):
            return torch.cat(values)
        if _token_rows_of_lengths(values):
            if how.pad_value is None:
                return _listed(values, how, "rows of token ids of different lengths "
                               f"({', '.join(str(v.shape[1]) for v in values)}) and no pad id to bring them to one")
            # generate() pads a whole batch's rows that ended before its longest with the pad id, on the right
            longest = max(v.shape[1] for v in values)
            return torch.cat([F.pad(v, (0, 0) * (v.dim() - 2) + (0, longest - v.shape[1]), value=how.pad_value)
                              for v in values])
        return _listed(values, how, f"rows of shapes {', '.join(str(tuple(v.shape)) for v in values)}")
    if all(v.dim() == 0 and v.is_floating_point() for v in values):
        return sum((v * share for v, share in zip(values, how.shares)), torch.zeros((), dtype=values[0].dtype,
                                                                                     device=values[0].device))
    same = all(v.shape == first.shape and v.dtype == first.dtype and v.device == first.device
               and bool(torch.equal(v, first)) for v in values)
    if same:
        return first
    # not one row a sample (a confusion matrix, a count, generate(num_return_sequences=k)'s k rows a sample): the
    # whole batch's is one tensor that cannot be rebuilt from the parts'
    return _listed(values, how, f"tensors of shapes {', '.join(str(tuple(v.shape)) for v in values)} that differ "
                   "and are not one row a sample")


def _token_rows_of_lengths(values: list[torch.Tensor]) -> bool:
    """Rows of integers (token ids) that differ between the parts in their length (dimension 1) only."""
    first = values[0]
    return (first.dim() >= 2 and not first.is_floating_point() and not first.is_complex()
            and first.dtype != torch.bool and all(v.shape[2:] == first.shape[2:] for v in values))


def _listed(values: list, how: _How, why: str) -> list:
    """The parts' values as a list, in order (the whole batch's would be one tensor or sequence): ``on_listed`` is
    told."""
    if how.on_listed is not None:
        how.on_listed(why)
    return list(values)


def _is_number(value: Any) -> bool:
    """A real number a mean is taken of: not a bool or an integer (a count, an index), which is kept or listed."""
    return isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)


def _equal(value: Any, other: Any) -> bool:
    try:
        return bool(value == other)
    except Exception:  # a comparison that is not a truth value (arrays) or fails: not equal
        return False
