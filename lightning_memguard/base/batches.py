"""A training batch as every part of MemGuard reads it: its tensors, the same batch with each tensor replaced, its
size in samples and in elements, and its split into parts of fewer samples. Framework-free.

A batch is a tensor or a container of batches, nested to any depth:

- mappings: ``dict`` and its subclasses, ``collections.UserDict`` (transformers' ``BatchEncoding``, what every
  tokenizer returns) and any other ``Mapping``;
- dataclass instances;
- named tuples, lists and tuples;
- instances of a class of your own registered with torch's pytree
  (``torch.utils._pytree.register_pytree_node(Batch, flatten_fn, unflatten_fn)``, as ``torch.compile`` and
  ``torch.export`` ask of such a class): its children are what its ``flatten_fn`` returns, and a part is rebuilt by its
  ``unflatten_fn``.

Anything else (numbers, strings, ``None``, objects of other classes) is a leaf that goes unchanged into every part,
with two exceptions split with the samples: a plain list or tuple of such values as long as the batch (the strings
``default_collate`` gathers into a list, one a sample), and a plain list as long as the batch of one item a sample
(a detection batch's targets, ``[{"boxes": ..., "class_labels": ...}, ...]``; ragged per-sample tensors), whose items
go unchanged to their sample's part.

Two tensors hold their samples in a way ``t[start:stop]`` cannot cut: a ``PackedSequence``
(``pack_padded_sequence``, ``pack_sequence``: its data interleaves the sequences step by step, its indices order them)
is one unit whose samples are its sequences, split by sequence into packed parts of its own kind; a nested tensor
(``torch.nested``, ``layout=torch.jagged``) is split by its leading size, as views of its values.
A rebuilt container keeps its type and its other attributes (a ``BatchEncoding``'s ``encodings``, a ``defaultdict``'s
factory, a dataclass's non-field attributes), copied shallowly; a container in which no tensor changed is returned
as it is.

torch's own pytree sees a ``UserDict`` or a dataclass as one opaque leaf. Registering those types with it would change
the pytree of the user's whole process (``torch.compile``, ``DataParallel``...), so these helpers walk the batch
themselves, reading torch's registry only for the classes it does not otherwise know.
"""

from __future__ import annotations

import copy
import math
import numbers
import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from .frozen import frozen_from_fields

__all__ = ["NO_SAMPLES", "BatchSize", "batch_tensors", "batch_shapes", "item_lists", "map_tensors", "batch_size_of",
           "batch_field", "split_ranges", "per_sample_lists", "slice_batch", "split_batch", "select_packed",
           "batch_elements", "RowGroups"]


#: why a batch without a sample dimension is not split, after its subject ("a batch of type X ")
NO_SAMPLES = ("has no tensor with a sample dimension to split (tensors are looked for in mappings, dataclasses, named "
              "tuples, lists and tuples, and in classes registered with torch.utils._pytree.register_pytree_node: "
              "make the batch one of those)")


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor in the batch, in the batch's order (mapping insertion order, dataclass field order)."""
    found: list[torch.Tensor] = []
    _walk(batch, found)
    return found


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any,
                values: Optional[Callable[[Sequence], Any]] = None,
                packed: Optional[Callable[[PackedSequence], Any]] = None, whole: Collection[int] = ()) -> Any:
    """The batch with every tensor ``t`` replaced by ``fn(t)``, every container of the same type as before.
    ``values``: a plain list or tuple of strings, numbers or ``None`` (no tensor), or one whose ``id`` is in
    ``whole`` (a list of one item a sample: :func:`item_lists`), is replaced by ``values(it)``; ``packed``: a
    ``PackedSequence`` is replaced by ``packed(it)`` (else each of its tensors by ``fn``)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if packed is not None and isinstance(batch, PackedSequence):
        return packed(batch)
    if values is not None and type(batch) in (list, tuple) and (id(batch) in whole or _only_values(batch)):
        return values(batch)
    if isinstance(batch, Mapping):
        items = {key: map_tensors(fn, value, values, packed, whole) for key, value in batch.items()}
        if all(items[key] is value for key, value in batch.items()):
            return batch
        return _rebuilt_mapping(batch, items)
    if _is_dataclass_instance(batch):
        changed = {}
        for f in dataclasses.fields(batch):
            value = getattr(batch, f.name, None)
            new = map_tensors(fn, value, values, packed, whole)
            if new is not value:
                changed[f.name] = new
        return _rebuilt_dataclass(batch, changed) if changed else batch
    if isinstance(batch, (list, tuple)):
        mapped = [map_tensors(fn, value, values, packed, whole) for value in batch]
        if all(new is old for new, old in zip(mapped, batch)):
            return batch
        return _rebuilt_sequence(batch, mapped)
    node = _registered_node(batch)
    if node is not None:
        children, context = node.flatten_fn(batch)
        mapped = [map_tensors(fn, value, values, packed, whole) for value in children]
        return batch if all(new is old for new, old in zip(mapped, children)) else node.unflatten_fn(mapped, context)
    return batch


def _only_values(sequence: Sequence) -> bool:
    """Whether a non-empty sequence holds only strings, bytes, numbers and ``None``: per-sample values a collate
    function gathered (strings: ``default_collate`` makes a list of them), no container and no tensor."""
    return bool(sequence) and all(value is None or isinstance(value, (str, bytes, numbers.Number))
                                  for value in sequence)


def batch_size_of(batch: Any) -> Optional[int]:
    """The number of samples: the leading size of the batch's first tensor with at least one dimension (in the
    batch's order; a ``PackedSequence``'s sequences), or ``None`` when it has none."""
    for shape in batch_shapes(batch):
        return int(shape[0])
    return None


def item_lists(batch: Any, size: int) -> list[tuple[str, Sequence]]:
    """The plain lists and tuples of ``size`` items (``size`` >= 2) that look like one item a sample — mappings,
    dataclasses or instances of a class registered with torch's pytree each (a detection batch's targets:
    ``[{"boxes": ..., "labels": ...}, ...]``), or tensors of different leading sizes (ragged per-sample tensors) —
    as ``(where, the sequence)``, ``where`` the keys and indices that lead to it (``"['targets']"``). A split gives
    each part its samples' items (:func:`slice_batch`), never looking inside them (an image's boxes may number as
    many as the batch's samples). A sequence holding the batch's first tensor (the samples' own) is the batch's
    structure, not such a list."""
    if size < 2:
        return []
    first = next(iter(batch_tensors(batch)), None)
    found: list[tuple[str, Sequence]] = []

    def visit(value: Any, where: str) -> None:
        if isinstance(value, (Tensor, PackedSequence)) or isinstance(value, (str, bytes)):
            return
        if isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, f"{where}[{key!r}]")
        elif _is_dataclass_instance(value):
            for f in dataclasses.fields(value):
                visit(getattr(value, f.name, None), f"{where}.{f.name}")
        elif isinstance(value, (list, tuple)):
            if type(value) in (list, tuple) and len(value) == size and _one_item_a_sample(value, first):
                found.append((where or "the batch", value))
                return
            for at, item in enumerate(value):
                visit(item, f"{where}[{at}]")
        elif (node := _registered_node(value)) is not None:
            for at, item in enumerate(node.flatten_fn(value)[0]):
                visit(item, f"{where}<{at}>")

    visit(batch, "")
    return found


def _one_item_a_sample(items: Sequence, first: Optional[Tensor]) -> bool:
    if any(item is first for item in items):
        return False
    if all(isinstance(item, Mapping) or _is_dataclass_instance(item) or _registered_node(item) is not None
           for item in items):
        return any(batch_tensors(item) for item in items)
    if all(isinstance(item, Tensor) and item.dim() > 0 for item in items):
        return len({item.shape[0] for item in items}) > 1  # ragged: one a sample, not tensors of one batch
    return False


def batch_shapes(batch: Any) -> list[tuple[int, ...]]:
    """The shape of every tensor of the batch with at least one dimension, in the batch's order, a
    ``PackedSequence`` as one tensor of its padded batch-first shape ``[sequences, steps, *features]``: what a split
    reads (the leading size of each is what it would cut)."""
    shapes: list[tuple[int, ...]] = []
    for unit in _units(batch):
        if isinstance(unit, PackedSequence):
            shapes.append((_sequences(unit), len(unit.batch_sizes), *unit.data.shape[1:]))
        elif unit.dim() > 0:
            shapes.append(tuple(unit.shape))
    return shapes


def batch_field(batch: Any, name: str) -> Any:
    """The value the batch holds under ``name``, as a key (a mapping) or an attribute (a dataclass, a named tuple,
    any object); ``None`` when it holds none. Only the top level is looked at: it is what ``model(**batch)`` reads."""
    if isinstance(batch, Mapping):
        return batch.get(name)
    if isinstance(batch, torch.Tensor):
        return None  # a tensor's attributes are not fields of a batch
    return getattr(batch, name, None)


def split_ranges(size: int, k: int) -> list[tuple[int, int]]:
    """``[start, stop)`` sample ranges of ``min(k, size)`` nearly equal parts (the larger ones first, as
    ``torch.tensor_split`` cuts)."""
    k = max(1, min(k, size))
    base, extra = divmod(size, k)
    ranges, start = [], 0
    for i in range(k):
        stop = start + base + (1 if i < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def per_sample_lists(batch: Any, size: int) -> set[int]:
    """The ``id`` of each list of one item a sample in ``batch`` (:func:`item_lists`): what :func:`map_tensors`
    takes as ``whole``, found once for all the parts of one batch."""
    return {id(items) for _, items in item_lists(batch, size)}


#: tensors of a batch whose rows come in runs, one run a sample, back to back (a vision-language batch's image patches
#: of all its samples in one tensor): ``id`` of the tensor -> the row where each sample's run begins, and the end
#: (``size + 1`` offsets); found by whoever knows the batch's model (mitigations/image_rows.py)
RowGroups = Mapping[int, Sequence[int]]


def slice_batch(batch: Any, start: int, stop: int, size: int, per_sample: Optional[set[int]] = None,
                groups: Optional[RowGroups] = None) -> Any:
    """Samples ``[start, stop)`` of the batch: every tensor whose leading size is ``size`` is sliced (a view, no
    copy; a nested tensor by its leading size too), as is a plain list or tuple of ``size`` strings, numbers or
    ``None`` (a collated list of per-sample strings), a list of one item a sample (:func:`item_lists`: a detection
    batch's targets, each kept as it is) and a ``PackedSequence`` of ``size`` sequences (packed again: those
    sequences' steps, copied); a tensor in ``groups`` gives those samples' runs of rows, whatever its leading size
    (``None`` where they have none: a text-only part of a vision-language batch has no images); other tensors without
    that leading dimension go whole, as do the other leaves.
    ``per_sample``: :func:`per_sample_lists` of the batch, where the caller slices it several times."""
    if per_sample is None:
        per_sample = per_sample_lists(batch, size)
    groups = groups or {}

    def tensor(t: Tensor) -> Tensor:
        offsets = groups.get(id(t))
        if offsets is not None:  # samples without rows there: None, as a batch made of them alone has none
            return t[offsets[start]:offsets[stop]] if offsets[stop] > offsets[start] else None
        return _slice_tensor(t, start, stop) if t.dim() > 0 and t.shape[0] == size else t

    return map_tensors(tensor, batch, lambda values: values[start:stop] if len(values) == size else values,
                       lambda ps: _slice_packed(ps, start, stop) if _sequences(ps) == size else ps, per_sample)


def split_batch(batch: Any, k: int, groups: Optional[RowGroups] = None) -> list[tuple[Any, float]]:
    """The batch as ``min(k, batch size)`` nearly equal parts (see :func:`slice_batch`, and ``groups`` there), each
    with its share of the samples; the shares add up to 1.

    Raises:
        ValueError: the batch has no tensor with a sample dimension to split.
    """
    size = batch_size_of(batch)
    if size is None:
        raise ValueError(f"a batch of type {type(batch).__name__} {NO_SAMPLES}")
    per_sample = per_sample_lists(batch, size)
    return [(slice_batch(batch, start, stop, size, per_sample, groups), (stop - start) / size)
            for start, stop in split_ranges(size, k)]


# --- the samples of a nested tensor and of a packed sequence --------------------------------------------------------
def _slice_tensor(tensor: Tensor, start: int, stop: int) -> Tensor:
    if not tensor.is_nested:
        return tensor[start:stop]
    # torch slices no nested tensor along its leading size: a jagged one is cut as a view of its values (its offsets
    # say where each sequence starts); one with holes (lengths) or another ragged dimension is rebuilt from its rows
    if tensor.layout == torch.jagged and tensor._lengths is None and tensor._ragged_idx == 1:
        offsets = tensor.offsets()
        first, last = int(offsets[start]), int(offsets[stop])
        return torch.nested.nested_tensor_from_jagged(tensor.values()[first:last],
                                                      offsets[start:stop + 1] - offsets[start])
    return torch.nested.as_nested_tensor(list(tensor.unbind())[start:stop], layout=tensor.layout)


def _sequences(packed: PackedSequence) -> int:
    """How many sequences (samples) a packed sequence holds: as many as run at its first step."""
    return int(packed.batch_sizes[0]) if packed.batch_sizes.numel() else 0


def _slice_packed(packed: PackedSequence, start: int, stop: int) -> PackedSequence:
    """Sequences ``[start, stop)`` of a packed sequence, packed alone (:func:`select_packed`)."""
    return select_packed(packed, torch.arange(start, stop))


def select_packed(packed: PackedSequence, samples: Tensor) -> PackedSequence:
    """The sequences ``samples`` (indices in the order the sequences were given, which ``unsorted_indices`` keeps;
    repeats allowed) of a packed sequence, packed alone: at each step its data holds the running sequences in sorted
    position order, the longest first, so the new rows are those of the chosen positions, in the same order; its
    ``sorted_indices`` order the chosen sequences as the whole's did (``None`` where the whole's are and the samples
    come in order: given sorted, a slice is too)."""
    batch_sizes = packed.batch_sizes  # on the CPU, as torch keeps them
    samples = samples.cpu()
    positions = samples if packed.unsorted_indices is None else packed.unsorted_indices.cpu()[samples]
    order = positions.argsort(stable=True)
    positions = positions[order]
    running = positions[None, :] < batch_sizes[:, None]  # [steps, chosen sequences]: which run at each step
    step_starts = batch_sizes.cumsum(0) - batch_sizes
    rows = (step_starts[:, None] + positions[None, :])[running]
    sizes = running.sum(1)
    in_order = bool((samples[1:] >= samples[:-1]).all()) and packed.sorted_indices is None
    device = packed.sorted_indices.device if packed.sorted_indices is not None else packed.data.device
    sorted_indices = None if in_order else order.to(device)
    return PackedSequence(packed.data.index_select(0, rows.to(packed.data.device)), sizes[sizes > 0],
                          sorted_indices, None)


# --- walking and rebuilding -------------------------------------------------------------------------------------------
def _units(batch: Any) -> list:
    """The batch's tensors in its order, a ``PackedSequence`` as one unit (its data and indices are one batch)."""
    found: list = []
    _walk(batch, found, units=True)
    return found


def _walk(batch: Any, found: list, units: bool = False) -> None:
    # before every training batch: the usual containers by their exact type first (an isinstance check against the
    # Mapping ABC costs several times one against a type), their tensors without a call each
    kind = type(batch)
    if kind is tuple or kind is list or kind is dict:
        for value in batch.values() if kind is dict else batch:
            if isinstance(value, Tensor):
                found.append(value)
            else:
                _walk(value, found, units)
    elif isinstance(batch, Tensor):
        found.append(batch)
    elif units and isinstance(batch, PackedSequence):
        found.append(batch)
    elif isinstance(batch, Mapping):
        for value in batch.values():
            _walk(value, found, units)
    elif _is_dataclass_instance(batch):
        for f in dataclasses.fields(batch):
            _walk(getattr(batch, f.name, None), found, units)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            _walk(value, found, units)
    elif (node := _registered_node(batch)) is not None:
        for value in node.flatten_fn(batch)[0]:
            _walk(value, found, units)


def _registered_node(value: Any) -> Any:
    """torch's pytree entry (``flatten_fn``, ``unflatten_fn``) for an instance of a class of the user's registered
    with it, else ``None``: torch's own registrations (Python's containers, which the walks here handle themselves;
    its ops' return types) are left out."""
    kind = type(value)
    node = pytree.SUPPORTED_NODES.get(kind)
    return None if node is None or kind.__module__.partition(".")[0] in _NOT_THE_USERS else node


#: the modules whose classes torch registers with its pytree itself
_NOT_THE_USERS = ("builtins", "collections", "torch")


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _rebuilt_mapping(original: Mapping, items: dict) -> Mapping:
    if type(original) is dict:
        return items
    try:
        # a shallow copy keeps the type and every other attribute (UserDict copies its item storage too); then the
        # items are put back through the mapping's own __setitem__
        new = copy.copy(original)
        for key, value in items.items():
            new[key] = value
        return new
    except Exception:  # an immutable or exotic mapping: built from its items, else a plain dict
        try:
            return type(original)(items)
        except Exception:
            return items


def _rebuilt_dataclass(original: Any, changed: dict) -> Any:
    # copy and set, not dataclasses.replace: replace runs __init__ and __post_init__ again, which fails for fields
    # with init=False and may recompute fields; object.__setattr__ also sets fields of a frozen dataclass
    new = copy.copy(original)
    for name, value in changed.items():
        object.__setattr__(new, name, value)
    return new


def _rebuilt_sequence(original: Any, values: list) -> Any:
    cls = type(original)
    if isinstance(original, tuple) and hasattr(cls, "_fields"):  # a named tuple
        return cls._make(values)
    if cls in (list, tuple):
        return cls(values)
    try:  # a subclass of list or tuple that takes an iterable
        return cls(values)
    except Exception:
        return tuple(values) if isinstance(original, tuple) else list(values)


def batch_elements(batch: Any) -> int:
    """The batch's size for scaling memory: the elements of its tensors with the batch's sample dimension (leading
    size :func:`batch_size_of`), summed — samples × tokens for a token batch (``input_ids``, ``attention_mask``,
    ``labels`` each count), samples × channels × pixels for an image batch, the steps × features of a
    ``PackedSequence``'s data. Tensors without the sample dimension and other leaves count for nothing; 0 for a batch
    without a sample dimension."""
    return BatchSize.of(batch).elements


@dataclass(frozen=True)
class BatchSize:
    """A batch's size: ``samples`` (``None`` without a sample dimension), ``elements``
    (:func:`~lightning_memguard.base.batches.batch_elements`) and the ``bytes`` of all its tensors."""

    samples: Optional[int]
    elements: int
    bytes: int

    @classmethod
    def of(cls, batch: Any) -> "BatchSize":
        # one walk of the user's structure, then one pass over its tensors (before every batch, on the training
        # thread): the samples and elements as batch_size_of and batch_elements count them
        samples, elements, nbytes = None, 0, 0
        for unit in _units(batch):
            if isinstance(unit, PackedSequence):  # its sequences are samples; its data's elements their steps'
                nbytes += sum(t.nbytes for t in unit if t is not None)
                leading, tensor = _sequences(unit), unit.data
            else:
                nbytes += unit.nbytes
                leading, tensor = (unit.shape[0] if unit.dim() else None), unit
            if leading is not None:  # the first tensor with a dimension sets the samples; those of as many count
                if samples is None:
                    samples = int(leading)
                if leading == samples:
                    elements += tensor.numel()
        return frozen_from_fields(cls, samples=samples, elements=elements, bytes=nbytes)

    def part_elements(self, parts: int) -> float:
        """The elements of the largest of ``parts`` micro-batches (as ``torch.tensor_split`` cuts the samples)."""
        if not self.samples:
            return float(self.elements)
        return self.elements * math.ceil(self.samples / min(parts, self.samples)) / self.samples
