"""A memo of meta-device kernels: what an op does on meta, worked out once per distinct call.

On the meta path of the estimate almost all the time went into torch's own meta kernels: most are Python
(``torch._refs``, ``torch._prims_common``: broadcasting and strides checked symbolically), a few hundred microseconds
an op, while all the estimate needs from them is the outputs' metadata. A model repeats the same ops on the same shapes
in every block, in both steps an estimate runs and in every estimate a plan makes (plain, checkpointed, each
precision), so :func:`call_meta` keeps, per op and per description of its arguments (each tensor's dtype, sizes,
strides, storage offset and which tensors share a storage; every other argument's value), what the call did:

* an op whose schema declares no alias (its outputs are new tensors): each output's dtype, sizes and strides, where
  its storage is what ``empty_strided`` makes of them; a later call gets fresh meta tensors made so, and the
  accounting modes above this one see the same allocations;
* an op that only writes into its arguments and returns them (in-place, ``out=`` and in-place ``_foreach_`` ops):
  on meta there are no values to write, so where the first call changed no argument's metadata or storage size the
  kernel only checked the call; a later call returns the same arguments without running it.

Views, ops that change a tensor's metadata in place (``resize_``, ``transpose_``), ops whose output shapes depend on
values, outputs that alias an input the schema does not declare, and arguments the description cannot capture
exactly (symbolic sizes, generators, tensor subclasses) run as they are, every time. Random ops qualify: on meta they
draw no numbers and advance no generator. An op that raises is not kept, so it raises again. A foreach op the memo
has not seen runs on one item of each distinct kind among its lists' items (an optimizer's: the same parameter shapes
block after block), the others given what theirs got. The estimates are byte-identical with the memo on and off
(``tests/unit/test_meta_cache.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

__all__ = ["aten_tensors", "call_meta", "meta_cache_enabled", "meta_cache_stats"]

_META = torch.device("meta")
_SIMPLE = (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
# ops whose outputs' shapes depend on values, or that change a tensor's metadata in place
_EXCLUDED_TAGS = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.inplace_view}
#: entries kept before the memo starts afresh (a few hundred bytes each; a plan makes one per distinct call: hundreds)
MAX_ENTRIES = 50_000
_UNCACHEABLE = object()
_NOT_RUN = object()
_FRESH, _IN_PLACE = "fresh", "in place"


class _Uncacheable(Exception):
    """An argument or output the memo cannot describe exactly: the op runs as it is."""


class _State:
    enabled = True
    entries: dict = {}
    kinds: dict = {}  # op -> _FRESH, _IN_PLACE or None (never kept)
    foreach: dict = {}  # op -> whether it is a foreach op run on its distinct items (_foreach_kind)
    calls = 0
    hits = 0
    misses = 0


def call_meta(func: Callable, args: Sequence, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` for an aten op whose tensor arguments are on meta: from the memo where this call was
    seen before, else run and (where it qualifies, see the module's docstring) kept."""
    _State.calls += 1
    kind = _kind_of(func) if _State.enabled else None
    if kind is None:
        return func(*args, **kwargs)
    try:
        key = (func, torch.get_default_dtype(), _describe_arguments(args, kwargs))
    except _Uncacheable:
        return func(*args, **kwargs)
    entry = _State.entries.get(key)
    if entry is _UNCACHEABLE:
        return func(*args, **kwargs)
    if entry is not None:
        _State.hits += 1
        return _build(entry) if kind is _FRESH else _written_result(entry, args, kwargs)
    sizes_before = _storage_sizes(args, kwargs) if kind is _IN_PLACE else None
    out = _NOT_RUN
    if _foreach_kind(func, kind):
        try:
            out = _foreach_on_distinct_items(func, args, kwargs, kind)
        except _Uncacheable:
            pass
    if out is _NOT_RUN:
        out = func(*args, **kwargs)
    _State.misses += 1
    if len(_State.entries) >= MAX_ENTRIES:
        _State.entries.clear()
    try:
        if kind is _FRESH:
            _State.entries[key] = _record(out, args, kwargs)
        else:
            _State.entries[key] = _record_in_place(out, args, kwargs, key[2], sizes_before)
    except _Uncacheable:
        _State.entries[key] = _UNCACHEABLE
    return out


@contextlib.contextmanager
def meta_cache_enabled(enabled: bool) -> Iterator[None]:
    """Inside, the memo is used (``True``, the default outside) or every meta kernel runs (``False``), starting
    empty either way; for the benchmark and the tests that compare the two."""
    before = _State.enabled
    _State.enabled = enabled
    _clear()
    try:
        yield
    finally:
        _State.enabled = before
        _clear()


def meta_cache_stats() -> dict[str, int]:
    """Since the memo was last switched: ``calls`` (meta ops seen), ``hits`` (answered from the memo), ``misses``
    (run and kept, or found not to qualify), ``entries`` (kept)."""
    return {"calls": _State.calls, "hits": _State.hits, "misses": _State.misses, "entries": len(_State.entries)}


def _clear() -> None:
    _State.entries = {}
    _State.calls = _State.hits = _State.misses = 0


def _kind_of(func) -> Optional[str]:
    """:data:`_FRESH` for an op whose schema declares no alias at all (its outputs are new tensors),
    :data:`_IN_PLACE` for one that only writes into arguments and returns those (in-place, ``out=`` and in-place
    ``_foreach_`` ops), ``None`` for any other (views, ops that change a tensor's metadata, values-dependent shapes)."""
    try:
        return _State.kinds[func]
    except KeyError:
        pass
    kind = None
    if isinstance(func, torch._ops.OpOverload) and not _EXCLUDED_TAGS.intersection(func.tags):
        schema = func._schema
        arguments = [a.alias_info for a in schema.arguments]
        returns = [r.alias_info for r in schema.returns]
        if not schema.is_mutable and returns and all(a is None for a in arguments + returns):
            kind = _FRESH
        elif (schema.is_mutable and any(a is not None for a in arguments)
              and all(a is None or a.is_write for a in arguments)
              and all(r is not None and r.is_write for r in returns)):
            kind = _IN_PLACE
    _State.kinds[func] = kind
    return kind


def _foreach_kind(func, kind: str) -> bool:
    """Whether ``func`` is a foreach op that :func:`_foreach_on_distinct_items` may run: one that makes new tensors,
    or writes into its arguments and returns nothing (not an ``out=`` one)."""
    known = _State.foreach.get(func)
    if known is None:
        schema = func._schema
        known = _State.foreach[func] = schema.name.startswith("aten::_foreach_") and "out" not in func._overloadname \
            and (kind is _FRESH or not schema.returns)
    return known


def _foreach_on_distinct_items(func, args: Sequence, kwargs: dict, kind: str) -> Any:
    """A foreach op (one call of the per-item op for each index of its lists) run on one index of each distinct kind:
    an optimizer's lists repeat the same parameter shapes block after block, and on meta each item runs torch's Python
    kernel of the per-item op (a few hundred of them in an optimizer step). A distinct kind is the items' description
    at that index (as the memo's, with the scalars of a scalar list); the other indices get what theirs got: nothing
    (in place), or fresh tensors like its outputs. :data:`_NOT_RUN` where there is nothing to share or the lists do
    not line up (then the op runs as it is); :class:`_Uncacheable` where an item is not described exactly."""
    lists = [i for i, value in enumerate(args) if isinstance(value, (list, tuple))]
    if not lists or any(isinstance(value, (list, tuple)) for value in kwargs.values()):
        return _NOT_RUN
    n = len(args[lists[0]])
    if n < 2 or any(len(args[i]) != n for i in lists):
        return _NOT_RUN
    first: dict[tuple, int] = {}  # description -> the first index of that kind
    kind_of: list[int] = []
    owner: dict[int, int] = {}  # storage -> the index whose items use it
    for index in range(n):
        items = [args[i][index] for i in lists]
        for item in items:
            if isinstance(item, torch.Tensor) and owner.setdefault(item.untyped_storage()._cdata, index) != index:
                return _NOT_RUN  # a storage shared across indices: the items are not independent
        kind_of.append(first.setdefault(tuple(_describe(item, {}) for item in items), index))
    picked = sorted(first.values())
    if len(picked) == n:
        return _NOT_RUN
    sub_args = list(args)
    for i in lists:
        sub_args[i] = type(args[i])(args[i][index] for index in picked)
    out = func(*sub_args, **kwargs)
    if kind is _IN_PLACE:
        return out  # nothing (the op returns nothing): the other items are written as their kind's was
    if type(out) not in (tuple, list) or len(out) != len(picked):
        return _NOT_RUN
    made = dict(zip(picked, out))
    for tensor in out:  # outputs rebuilt only where empty_strided makes the same tensor (as the memo's)
        if (type(tensor) is not torch.Tensor or tensor.device.type != "meta" or tensor.layout is not torch.strided
                or tensor.requires_grad or tensor.storage_offset() or tensor.untyped_storage().nbytes()
                != torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                       device=_META).untyped_storage().nbytes()):
            return _NOT_RUN
    return type(out)(made[index] if index in made else _like(made[kind_of[index]]) for index in range(n))


def _like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=_META)


def _describe_arguments(args: Sequence, kwargs: dict) -> tuple:
    """What of the arguments a meta kernel's result can depend on, hashable: each tensor's metadata and which
    tensors share a storage; every other value as it is."""
    storages: dict[int, int] = {}
    described = [_describe(value, storages) for value in args]
    if kwargs:
        described.append(tuple((name, _describe(value, storages)) for name, value in kwargs.items()))
    return tuple(described)


_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


def _describe(value: Any, storages: dict) -> Any:
    """:class:`_Uncacheable` where the description would not be all a kernel's result depends on."""
    kind = type(value)
    if kind in _PLAIN_TENSORS:
        if not value.is_meta or value.layout is not torch.strided or value.is_conj() or value.is_neg():
            raise _Uncacheable
        shared = storages.setdefault(value.untyped_storage()._cdata, len(storages))
        return (value.dtype, value.shape, value.stride(), value.storage_offset(), shared)
    if value is None:
        return None
    if kind in _SIMPLE:  # exact types: a subclass (an IntEnum) runs as it is
        return (kind, value)  # 1, 1.0 and True are equal keys otherwise
    if kind is list or kind is tuple:
        return (kind, tuple(_describe(v, storages) for v in value))
    raise _Uncacheable  # symbolic sizes, generators, tensor subclasses, anything else


def _record(out: Any, args: Sequence, kwargs: dict) -> tuple:
    """How to build ``out`` of a fresh op again: ``(container type or None, one description per output)``."""
    if type(out) not in (tuple, list, torch.Tensor):
        raise _Uncacheable
    outputs = [out] if isinstance(out, torch.Tensor) else list(out)
    inputs = {t.untyped_storage()._cdata for t in aten_tensors(args) + aten_tensors(kwargs.values())}
    seen: set[int] = set()
    described = []
    for tensor in outputs:
        if tensor is None:
            described.append(None)
            continue
        if (type(tensor) is not torch.Tensor or tensor.device.type != "meta" or tensor.layout is not torch.strided
                or tensor.requires_grad or tensor.is_conj() or tensor.is_neg()):
            raise _Uncacheable
        storage = tensor.untyped_storage()
        if storage._cdata in inputs or storage._cdata in seen:  # an alias the schema does not declare
            raise _Uncacheable
        seen.add(storage._cdata)
        size, stride = tensor.shape, tensor.stride()
        # rebuilt by empty_strided: kept where that gives the same storage (every op of the zoo's models does)
        if tensor.storage_offset() or storage.nbytes() != torch.empty_strided(
                size, stride, dtype=tensor.dtype, device=_META).untyped_storage().nbytes():
            raise _Uncacheable
        described.append((size, stride, tensor.dtype))
    return (None if isinstance(out, torch.Tensor) else type(out), tuple(described))


def _build(entry: tuple) -> Any:
    container, described = entry
    outputs = [None if d is None else torch.empty_strided(d[0], d[1], dtype=d[2], device=_META) for d in described]
    return outputs[0] if container is None else container(outputs)


def _storage_sizes(args: Sequence, kwargs: dict) -> list[int]:
    return [t.untyped_storage().nbytes() for t in aten_tensors(args) + aten_tensors(kwargs.values())]


def _record_in_place(out: Any, args: Sequence, kwargs: dict, before: tuple, sizes_before: list[int]) -> tuple:
    """Where the results of an in-place op are among its arguments: ``(container, paths)``, a path being
    ``(position or name, index in a list or None)``. Kept only where the call changed no argument's metadata or
    storage size (on meta there are no values to change: the kernel then only checked the call)."""
    if _describe_arguments(args, kwargs) != before or _storage_sizes(args, kwargs) != sizes_before:
        raise _Uncacheable
    if out is None:
        return (None, None)
    if type(out) not in (tuple, list, torch.Tensor):
        raise _Uncacheable
    places = [*enumerate(args), *kwargs.items()]
    paths = []
    for tensor in [out] if isinstance(out, torch.Tensor) else out:
        path = next(((where, None) for where, value in places if value is tensor), None) or next(
            ((where, i) for where, value in places if isinstance(value, (list, tuple))
             for i, item in enumerate(value) if item is tensor), None)
        if path is None:
            raise _Uncacheable
        paths.append(path)
    return (torch.Tensor if isinstance(out, torch.Tensor) else type(out), tuple(paths))


def _written_result(entry: tuple, args: Sequence, kwargs: dict) -> Any:
    container, paths = entry
    if container is None:
        return None
    found = []
    for where, index in paths:
        value = args[where] if isinstance(where, int) else kwargs[where]
        found.append(value if index is None else value[index])
    return found[0] if container is torch.Tensor else container(found)


def aten_tensors(values) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments or outputs (they nest at most one level: Tensor[], Tensor?[])."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found
