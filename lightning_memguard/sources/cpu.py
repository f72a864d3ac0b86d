"""Live tensor-storage accounting on CPU: the CPU twin of ``memory_allocated`` / ``max_memory_allocated``.

Process RSS cannot serve here: the C allocator keeps freed pages, so RSS does not fall when tensors die. Instead a
``TorchDispatchMode`` sees the output of every aten op, counts each storage the first time it appears and takes it
off again when the storage is freed (a weak reference's callback). Views and in-place results share their base's
storage and are counted once.

A storage can also change size outside the dispatcher: ``untyped_storage().resize_(n)`` goes straight to the
allocator. FSDP2 frees each unit's gathered parameters that way (``resize_(0)`` after its forward and backward) and
re-gathers into the same storages (``resize_(n)``), so while an accountant is started ``UntypedStorage.resize_`` is
wrapped to tell it the new size (:func:`_counted_resize`); without that every rank counted the whole model unsharded
on top of its shard.

Compiled code (``torch.compile``): dynamo skips a frame that starts while a dispatch mode is active, runs it
uncompiled, and remembers the skip for that code object until ``torch._dynamo.reset()`` — so a plain mode on during
training would leave the model, and every later compile of the same classes in the process, uncompiled. The mode
here says ``ignore_compile_internals``: dynamo compiles under it (with the mode off while compiling) and runs the
compiled code under it. It then sees every aten op the compiled code dispatches (exact with the ``eager`` and
``aot_eager`` backends), but not the buffers inductor's generated kernels allocate directly: measured on a 4-block
MLP, 13.0 of a 23.5 MiB step peak. A model that holds compiled code is therefore not counted at all
(:func:`~lightning_memguard.base.compiled.compiled_code`, :meth:`CpuTensorAccountant.switch_off`) rather than
counted short. (A function compiled inside an uncompiled ``forward`` cannot be found: it stays compiled, and under
inductor it is counted short.)
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Callable, Hashable, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from ..base.compiled import compiled_methods
from ..base.optimizer_step import state_holder
from .base import AllocatorReading


def optimizer_state_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    """Every tensor the optimizers keep per parameter (momentum, Adam's moments and step counters, ...), also in
    the lists, tuples and dicts of a state: LBFGS keeps its history there (``old_dirs``, ``old_stps``: two vectors
    of every parameter per remembered step, most of its memory)."""
    for optimizer in optimizers:
        for state in state_holder(optimizer).state.values():  # ZeroRedundancyOptimizer: its local optimizer's
            yield from _tensors_in(state.values())


def _tensors_in(values: Iterable) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors_in(value)
        elif isinstance(value, dict):
            yield from _tensors_in(value.values())


def dense_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storages hold ``tensor``'s memory: itself, or for a wrapper subclass its inner tensors (a
    ``DTensor``: its local shard). A wrapper's own ``untyped_storage()`` is a placeholder sized by the *global* shape:
    counting it counted every FSDP2 parameter, gradient and optimizer state unsharded. A sparse tensor (an
    ``nn.Embedding(sparse=True)``'s gradient, SparseAdam's) has no storage of its own: its index and value tensors
    hold its memory (``untyped_storage()`` and ``nbytes`` raise on it)."""
    layout = tensor.layout
    if layout == torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inners = (getattr(tensor, name) for name in names)  # a DTensor names its device mesh too
    return [dense for inner in inners if isinstance(inner, torch.Tensor) for dense in dense_tensors(inner)]


def storage_bytes(tensors: Iterable) -> int:
    """Bytes of the storages behind the tensors (each storage once; views and shared storages are not doubled; a
    DTensor's local shard)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            for dense in dense_tensors(tensor):
                storage = dense.untyped_storage()
                seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def unbind_from_original(copy: nn.Module) -> None:
    """After ``copy.deepcopy``, compiled code that ``torch.compile`` put on a module instance still calls the
    original module: ``module.compile()``'s compiled call, and methods replaced by compiled functions (Lightning's
    compiled LightningModule: ``forward``, ``training_step``, ...). On ``copy`` the class's own (uncompiled) methods
    take their place again. (A ``torch.compile(module)`` wrapper copies itself onto the copied module.)"""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return
    for sub in copy.modules():
        if isinstance(sub, eval_frame.OptimizedModule):
            continue
        if getattr(sub, "_compiled_call_impl", None) is not None:
            sub._compiled_call_impl = None
        for attr, _ in list(compiled_methods(sub)):
            if callable(getattr(type(sub), attr, None)):
                delattr(sub, attr)


@contextlib.contextmanager
def compiled_code_runs_eagerly() -> Iterator[None]:
    """Inside, compiled code runs uncompiled and dynamo compiles nothing and remembers nothing (its "force_eager"
    stance). For a copy of a model run to be measured (the estimate): a dispatch mode then counts every op, and a
    later compile of the real model is not changed by it."""
    if "torch._dynamo.eval_frame" not in sys.modules:  # nothing was compiled
        yield
        return
    stance = torch.compiler.set_stance("force_eager")  # takes effect at once; its __exit__ puts the previous back
    try:
        yield
    finally:
        stance.__exit__(None, None, None)


def compiled_code_warning(places: list[str]) -> str:
    """The one warning a guard gives when it does not count CPU memory because the model holds compiled code."""
    shown = ", ".join(places[:3]) + (f" and {len(places) - 3} more" if len(places) > 3 else "")
    return ("lightning-memguard: the model holds torch.compile'd code (" + shown + "). Its kernels allocate memory "
            "that live CPU tensor counting cannot see, so CPU memory is not counted in this run, and the model stays "
            "compiled. The history keeps its rows (step, phase, time, capacity) without allocated or peak values, so "
            "the budget's threshold, the rungs it would trigger and cpu_hard_limit do not act; an out-of-memory "
            "error from the CPU allocator is still rescued, and plan_at_start still plans from the estimate. "
            "To measure, run the model uncompiled (or on CUDA, whose allocator sees compiled kernels).")


class CpuTensorAccountant:
    """Counts the bytes of live tensor storages on one device type (``"cpu"`` by default).

    Tensors that exist before :meth:`start` (parameters, gradients, optimizer state) are counted with :meth:`track`;
    everything created while the accountant is started is counted automatically.

    Args:
        budget_bytes: the capacity to guard (the CPU has no natural one). ``None``: monitor only.
        limit_bytes: a hard limit. When live bytes pass it the op that allocated raises ``torch.OutOfMemoryError``,
            the way the CUDA allocator does under ``set_per_process_memory_fraction``. ``None``: no limit.
        device_type: which storages to count.
        granularity: count each storage rounded up to a multiple of this many bytes (512 reproduces the CUDA
            caching allocator's rounding when estimating for CUDA on the meta device).

    Example::

        acc = CpuTensorAccountant()
        with acc:
            x = torch.empty(1024, 1024)  # 4 MiB
        acc.read().peak_bytes  # 4194304
    """

    def __init__(
        self, budget_bytes: Optional[int] = None, limit_bytes: Optional[int] = None, device_type: str = "cpu",
        granularity: int = 1,
    ) -> None:
        for name, value in (("budget_bytes", budget_bytes), ("limit_bytes", limit_bytes)):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}={value!r} must be a positive int or None")
        self.device = device_type
        self.budget_bytes = budget_bytes
        self.limit_bytes = limit_bytes
        self._device_type = device_type
        self._granularity = granularity
        # storage key -> (nbytes, weakref keeping the free-callback alive; None for a replayed storage)
        self._live: dict[Hashable, tuple[int, Optional[weakref.ref]]] = {}
        # bytes -> keys of what :meth:`hold` counts until it is seen, oldest first (DDP's buckets can be of one size)
        self._held: dict[int, list[Hashable]] = {}
        self._current = 0
        self._peak = 0
        self._num_ooms = 0
        self._mode: Optional[NewTensorMode] = None
        self.counting = True
        self._paused = False  # inside :func:`counting_paused`: what the guard runs that is not training

    # --- counting -------------------------------------------------------------------------------------------------
    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Counts tensors that already exist (each storage once). Storages that existed before :meth:`start` and
        are not tracked are not counted, even when a view of them or an in-place op on them runs later."""
        if not self.counting:
            return
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor, check_limit=False)

    def hold(self, key: Hashable, nbytes: int) -> None:
        """Counts ``nbytes`` that no tensor has shown this accountant yet (DistributedDataParallel's first gradient
        buckets: ddp_buckets.py) as live under ``key`` until :meth:`release`, or until a storage of exactly
        ``nbytes`` is counted for the first time: the held memory itself, seen at last (an op writing into it), whose
        own count then stands for it."""
        if self.counting:
            self._count(key, nbytes, None, check_limit=False)
            self._held.setdefault(nbytes, []).append(key)

    def release(self, key: Hashable, peak_before: Optional[int] = None) -> None:
        """Takes what :meth:`hold` counted under ``key`` off the count. ``peak_before``: the peak read before the
        memory it stood for was freed, where that came before what was counted since (DDP frees its first buckets,
        then makes the new ones): the peak is put back to it, or to what is live now where that is more, as it was
        in memory."""
        entry = self._live.get(key)
        held = self._held.get(entry[0], []) if entry is not None else []
        if key in held:
            held.remove(key)
            if not held:
                del self._held[entry[0]]
        self._free(key)
        if entry is not None and peak_before is not None:
            self._peak = max(peak_before, self._current)

    def knows(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory is counted already, or is not this accountant's to count (another device)."""
        try:
            return all(not self.counts(dense) or dense.untyped_storage()._cdata in self._live
                       for dense in dense_tensors(tensor))
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a real storage
            return True

    def counts(self, tensor: torch.Tensor) -> bool:
        """Whether a tensor's storage is counted: a dense tensor on this accountant's device type."""
        return tensor.device.type == self._device_type and not tensor.is_sparse

    def _add(self, tensor: torch.Tensor, check_limit: bool = True) -> None:
        if self._paused:
            return
        if is_traceable_wrapper_subclass(tensor):  # a DTensor's memory is its local shard's
            for inner in dense_tensors(tensor):
                self._add(inner, check_limit)
            return
        if not self.counts(tensor):
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a real storage
            return
        self._count_storage(storage, check_limit)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """A storage changed size outside the dispatcher (``resize_``): a known one is counted at its new size, an
        unknown one that grew is new memory (one that existed before :meth:`start` unseen and now holds data)."""
        if self._paused or storage.device.type != self._device_type or (
                storage._cdata not in self._live and not storage.nbytes()):
            return
        self._count_storage(storage, check_limit=True)

    def _count_storage(self, storage: torch.UntypedStorage, check_limit: bool) -> None:
        self._count(storage._cdata, storage.nbytes(), storage, check_limit)

    def _count(self, key: Hashable, nbytes: int, storage: Optional[torch.UntypedStorage], check_limit: bool) -> None:
        """Counts storage ``key`` at ``nbytes``: new, or a known one at another size. Where ``storage`` is given its
        death frees it; without one (a storage replayed, not alive) only :meth:`_free` does."""
        entry = self._live.get(key)
        if self._granularity > 1:  # a device's allocator's blocks (the estimate's); the CPU guard counts bytes
            nbytes = self._counted_bytes(key, nbytes)
        if entry is not None:
            if nbytes == entry[0]:
                return
            # a known storage that an out= or resize_ op grew (or shrank) in place
            self._live[key] = (nbytes, entry[1])
            self._current += nbytes - entry[0]
        else:
            if self._held and storage is not None and nbytes in self._held:  # held memory, seen: counted as itself
                self.release(self._held[nbytes][0])
            # torch keeps one Python object per storage alive as long as the storage lives, so the callback fires
            # at the real free. The weakref itself must be kept, or its callback is dropped with it.
            self._live[key] = (nbytes, self._death_watch(key, storage) if storage is not None else None)
            self._current += nbytes
        if self._current > self._peak:
            self._peak = self._current
        if check_limit and self.limit_bytes is not None and self._current > self.limit_bytes:
            self._num_ooms += 1
            # worded as the CPU allocator words its own failure, which is what tools that sniff the message for an
            # OOM look for (Lightning's is_oom_error, and so its BatchSizeFinder)
            raise torch.OutOfMemoryError(
                f"DefaultCPUAllocator: can't allocate memory: CPU tensor memory limit exceeded: {self._current} bytes "
                f"live after allocating {nbytes} bytes, limit {self.limit_bytes} bytes (lightning-memguard "
                "CpuTensorAccountant)"
            )

    def _death_watch(self, key: Hashable, storage: torch.UntypedStorage) -> weakref.ref:
        """A weak reference whose callback frees ``key`` when ``storage`` dies (keep it: dropped, so is the
        callback)."""
        return weakref.ref(storage, lambda _ref, key=key: self._free(key))

    def _counted_bytes(self, key: Hashable, nbytes: int) -> int:
        """The bytes counted for storage ``key`` of ``nbytes`` where the granularity is above one byte: rounded up to
        it."""
        return -(-nbytes // self._granularity) * self._granularity

    def _free(self, key: Hashable) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._current -= entry[0]

    # --- the source contract --------------------------------------------------------------------------------------
    def read(self, reset_peak: bool = True) -> AllocatorReading:
        if not self.counting:
            return _NOT_COUNTED
        reading = AllocatorReading(
            allocated_bytes=self._current, peak_bytes=self._peak, num_ooms=self._num_ooms
        )
        if reset_peak:
            self._peak = self._current
        return reading

    def capacity_bytes(self) -> Optional[int]:
        return self.budget_bytes if self.budget_bytes is not None else self.limit_bytes

    @property
    def started(self) -> bool:
        return self._mode is not None

    def switch_off(self) -> None:
        """Stops counting for good: reads then carry no allocated or peak bytes (``None``), and :meth:`start` and
        :meth:`track` do nothing. For a model whose compiled kernels allocate outside the count."""
        self.stop()
        self.counting = False
        self._live.clear()
        self._current = self._peak = 0

    def start(self) -> None:
        """Starts counting every new storage on this thread (and in autograd's backward, which inherits it), and
        every storage resized on any thread."""
        if self._mode is None and self.counting:
            self._mode = self._new_tensor_mode()
            self._mode.__enter__()
            _watch_resizes(self)
            _counting.add(self)

    def _new_tensor_mode(self) -> NewTensorMode:
        return NewTensorMode(self._add)

    def stop(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            _counting.discard(self)
            _unwatch_resizes(self)
            mode.__exit__(None, None, None)

    def __enter__(self) -> "CpuTensorAccountant":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_NOT_COUNTED = AllocatorReading(allocated_bytes=None, peak_bytes=None)

#: the accountants counting now (started, not stopped)
_counting: "weakref.WeakSet[CpuTensorAccountant]" = weakref.WeakSet()


@contextlib.contextmanager
def counting_paused() -> Iterator[None]:
    """The accountants counting when it begins count nothing inside, so none raises at its limit either; those
    started inside count as usual. For what the guards run that is not training: an estimate's step on CPU (its
    copies of the model and its activations are MemGuard's, gone when it ends, and a CUDA guard would never see them
    on the device). Made mid-fit (a plan waiting for the first batch it can see, a rung's levels estimated when first
    asked), the guard's own accountant had counted it into the next step's batch-start peak — over the budget, and
    not the training's doing — and another guard's (a GAN's other network) had raised at its hard limit."""
    paused = [accountant for accountant in list(_counting) if not accountant._paused]
    for accountant in paused:
        accountant._paused = True
    try:
        yield
    finally:
        for accountant in paused:
            accountant._paused = False


# --- storage resizes, which the dispatcher does not see -------------------------------------------------------------
_RESIZE = torch.UntypedStorage.resize_  # the allocator's own (inherited from the C storage base)
_resize_watchers: list[CpuTensorAccountant] = []


def _counted_resize(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
    """``UntypedStorage.resize_`` while an accountant is started: resizes, then tells every started accountant.
    (``TypedStorage.resize_`` resizes its untyped storage through this too.)"""
    result = _RESIZE(storage, size)
    for watcher in tuple(_resize_watchers):
        watcher._resized(storage)
    return result


def _watch_resizes(accountant: CpuTensorAccountant) -> None:
    if not _resize_watchers:
        torch.UntypedStorage.resize_ = _counted_resize
    _resize_watchers.append(accountant)


def _unwatch_resizes(accountant: CpuTensorAccountant) -> None:
    if accountant in _resize_watchers:
        _resize_watchers.remove(accountant)
    # put the allocator's own back when the last accountant stops (and only if nothing else replaced ours since)
    if not _resize_watchers and torch.UntypedStorage.__dict__.get("resize_") is _counted_resize:
        del torch.UntypedStorage.resize_
_FRESH: dict = {}


def new_tensors(func, out) -> Iterator[torch.Tensor]:
    """The outputs of an aten op that may own new memory. Outputs that alias an input (views, in-place and out=
    results) are skipped: their storage existed before the op, and counting it then would count, say, a whole
    dataset table the first time a sample is sliced out of it."""
    fresh = _FRESH.get(func)
    if fresh is None:
        # torch.tensor(data) builds its tensor outside the dispatcher and hands it over through lift_fresh, whose
        # schema says "alias": that is the tensor's first appearance, so it counts. out= and resize_ ops write into
        # an existing tensor but may grow its storage: they are looked at too (a known storage is only resized).
        lifted = func in (torch.ops.aten.lift_fresh.default,)
        may_grow = func._overloadname.startswith("out") or func._schema.name in ("aten::resize_", "aten::resize_as_")
        fresh = _FRESH[func] = tuple(lifted or may_grow or r.alias_info is None for r in func._schema.returns)
    if isinstance(out, torch.Tensor):
        if fresh and fresh[0]:
            yield out
    elif isinstance(out, (tuple, list)):
        for index, item in enumerate(out):
            # a list return (Tensor[]) is one schema entry for all its items
            if isinstance(item, torch.Tensor) and fresh[min(index, len(fresh) - 1)]:
                yield item


def dispatch_new_tensors(mode: NewTensorMode, func, types, args=(), kwargs=None):
    """:class:`NewTensorMode`'s ``__torch_dispatch__``, for a subclass that sets it itself (torch wraps the one a mode
    class defines: the estimate's counting mode sets this one)."""
    out = func(*args, **(kwargs or {})) if mode._run is None else mode._run(func, args, kwargs or {})
    for tensor in new_tensors(func, out):
        mode._on_new(tensor)
    return out


class NewTensorMode(TorchDispatchMode):
    """Hands every tensor an aten op newly creates to ``on_new``. Kept minimal: this runs for every op.

    ``run(func, args, kwargs)``, where given, runs each op instead of the op itself: what would otherwise be a dispatch
    mode of its own just below this one, without the cost of a second dispatch layer on every op (tens of
    microseconds on a slow machine; the estimate's meta execution runs so)."""

    def __init__(self, on_new: Callable[[torch.Tensor], None],
                 run: Optional[Callable[[Callable, tuple, dict], object]] = None) -> None:
        super().__init__()
        self._on_new = on_new
        self._run = run

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Without this, dynamo skips every frame that starts under the mode and keeps skipping its code object for
        # the rest of the process (see the module docstring); with it, compiled code compiles and runs under the
        # mode, which is switched off while dynamo compiles.
        return True

    __torch_dispatch__ = dispatch_new_tensors
