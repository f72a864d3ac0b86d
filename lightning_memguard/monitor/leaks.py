"""Memory that grows every step: a rule on batch-start readings that suspects it for the cost of two integer
comparisons per measured step, and a one-time search that names what grows and which Python object holds it.

The rule (:class:`LeakRule`). At the start of a step nothing of the step is alive, only what the run keeps (weights,
gradients, optimizer state, the batch, and whatever the user's code keeps). After ``warmup`` measured steps (the
optimizer state and the gradients appear after the first step: not a leak) each measured batch-start reading is
compared with the one before: a strict rise extends a streak, anything else ends it. Measured steps are the ones the
monitor reads (on CPU every ``cpu_sample_every``-th), so a sampled run is judged on its sampled steps. Normal
training reads the same bytes at every batch start; variable-size batches go up and down; a leak rises every time.

The search (:class:`LeakSearch`), run at most twice per suspicion:

1. ``suspect`` rises in a row: the live tensors the garbage collector knows are counted by kind (shape, dtype,
   device, ``grad_fn``), leaving out the run's training state and the batch. Only the counts are kept.
2. ``confirm`` rises in a row (the streak went on): counted again. The kinds whose count grew by at least two are
   what grows — a transient that the run holds from one step to the next (the last output, a logged value) is
   replaced, not added to, so its count stays the same. Each kind is named with the model's module nearest to it in
   its autograd graph (the graph keeps its nodes after backward; the nearest parameter's owner is the last module
   applied on the way to the tensor). For those tensors the holder is found through
   ``gc.get_referrers``: the container that holds most of them and, up from it, the attribute of the model
   (``model.kept_losses``), of another object (``Tracker.outputs``), a closure's or a function's local variable.
   Tensors that nothing holds directly are what autograd graphs saved: the graphs of the other growing tensors are
   walked (bounded), and the holder of the ones whose graphs saved them is named — a loss kept with its graph.

A confirmed leak is said once per fit (an event ``leak`` and a warning). A suspicion the search does not confirm
(memory rose but no tensor kind grew: a run of longer batches, an allocator's workspace) says nothing, and the next
suspicion needs twice as many rises, so a run pays for at most a handful of searches. The rise is said per optimizer
step too, shared among all the steps since the streak began, measured or not: the CPU accountant counts, when it
resumes, what the steps it skipped left in the model
(:func:`~lightning_memguard.monitor.source_choice.resume_counting`), so the rise is the whole of what they kept. Not
named: a single tensor grown by concatenation (its count does not grow).
"""

from __future__ import annotations

import gc
import os
import sys
import time
import types
import warnings
from collections import Counter
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..base.batches import batch_tensors
from ..base.snapshot import Event, format_bytes
from ..sources.kept import graph_saved_tensors
from ..sources.training_state import training_state_tensors

__all__ = ["LeakRule", "LeakSearch", "LeakWatch", "GrowingKind"]

#: (shape, dtype, device, grad_fn name or "")
Kind = tuple[tuple, str, str, str]


class LeakRule:
    """When batch-start memory is suspected of growing every step (plain numbers; no torch).

    Args:
        warmup: measured steps whose rise is expected (the first optimizer step creates the optimizer state).
        suspect: rises in a row after which the tensors are counted once.
        confirm: rises in a row after which they are counted again and compared.

    :meth:`observe` returns ``"suspect"``, ``"confirm"`` or ``None``; after a confirm that found nothing, call
    :meth:`back_off`.
    """

    def __init__(self, warmup: int = 3, suspect: int = 4, confirm: int = 8) -> None:
        if not 0 < suspect < confirm:
            raise ValueError(f"suspect={suspect!r} and confirm={confirm!r} must satisfy 0 < suspect < confirm")
        self.warmup, self.suspect, self.confirm = warmup, suspect, confirm
        self._seen = 0
        self._last = -1
        self._last_step: Optional[int] = None
        self.streak = 0
        #: the reading when the streak began (the memory the leak added is measured from it), and its step
        self.streak_start = 0
        self.streak_start_step: Optional[int] = None
        self.done = False

    def observe(self, allocated: Optional[int], step: Optional[int] = None) -> Optional[str]:
        """A measured step's batch-start reading (``step``: its optimizer step, for :meth:`per_step`)."""
        if allocated is None or self.done:
            return None
        if self._seen < self.warmup:
            self._seen += 1
            self._last, self._last_step = allocated, step
            return None
        if allocated > self._last:
            if self.streak == 0:
                self.streak_start, self.streak_start_step = self._last, self._last_step
            self.streak += 1
            self._last, self._last_step = allocated, step
            if self.streak == self.suspect:
                return "suspect"
            if self.streak == self.confirm:
                return "confirm"
            return None
        self._last, self._last_step = allocated, step
        self.streak = 0
        return None

    def per_step(self, allocated: int, step: int) -> Optional[tuple[int, int]]:
        """``(bytes added per optimizer step, steps)`` since the streak began, ``None`` where the steps are unknown.
        Measured steps may be ``cpu_sample_every`` apart: the rise is shared among all the steps, counted or not."""
        if self.streak_start_step is None or step <= self.streak_start_step:
            return None
        steps = step - self.streak_start_step
        return (allocated - self.streak_start) // steps, steps

    def back_off(self) -> None:
        """The search found nothing that grows: the next suspicion needs twice the rises."""
        self.suspect, self.confirm = self.suspect * 2, self.confirm * 2
        self.streak = 0


class GrowingKind:
    """Tensors of one kind whose count grew: ``count`` alive now, ``added`` since the first count."""

    def __init__(self, kind: Kind, count: int, added: int, nbytes: int, tensors: list) -> None:
        self.shape, self.dtype, self.device, self.grad_fn = kind
        self.count, self.added, self.nbytes = count, added, nbytes
        self.tensors = tensors  # a few of them, to find their holder
        self.module: Optional[str] = None  # the model's module nearest to them in their autograd graph

    def describe(self) -> str:
        made = f", grad_fn={self.grad_fn}" if self.grad_fn else ""
        made += f", made from the output of module {self.module}" if self.module else ""
        return (f"{self.count} x {list(self.shape)} {self.dtype} on {self.device}{made} "
                f"(+{self.added} since the first count, {format_bytes(self.nbytes)})")


class LeakSearch:
    """The tensors that grow between two counts, and who holds them (the expensive part; run once or twice)."""

    def __init__(self, model: Optional[nn.Module], optimizers: Callable[[], list]) -> None:
        self.model, self.optimizers = model, optimizers
        self.baseline: Counter = Counter()
        self._counted_ids: set[int] = set()
        self.counted_at: Optional[int] = None

    def _kept_storages(self, batch: Any) -> set[int]:
        kept = list(training_state_tensors(self.model, self.optimizers())) if self.model is not None else []
        return {_storage_key(t) for t in (*kept, *batch_tensors(batch))}

    def _live_tensors(self, batch: Any) -> list[torch.Tensor]:
        kept = self._kept_storages(batch)
        found = []
        with warnings.catch_warnings():  # isinstance on some objects of other libraries warns of deprecations
            warnings.simplefilter("ignore")
            objects = gc.get_objects()
            tensors = [obj for obj in objects if _is_tensor(obj)]
            del objects
        for obj in tensors:
            try:
                if not isinstance(obj, nn.Parameter) and obj.device.type != "meta" and _storage_key(obj) not in kept:
                    _kind(obj)  # a tensor subclass without a shape or storage is left out here
                    found.append(obj)
            except Exception:
                continue
        return found

    def count(self, batch: Any, step: Optional[int] = None) -> None:
        """The first count, at ``step``: tensors by kind (only the counts are kept)."""
        self.counted_at = step
        tensors = self._live_tensors(batch)
        self.baseline = Counter(_kind(t) for t in tensors)
        # which were there (ids, no references): the holder is looked for from tensors born since, not from older
        # ones of the same kind that something else holds (a previous run's model not yet collected)
        self._counted_ids = {id(t) for t in tensors}

    def growing(self, batch: Any) -> list[GrowingKind]:
        """Kinds whose count grew by two or more since :meth:`count`, most bytes first."""
        by_kind: dict[Kind, list[torch.Tensor]] = {}
        for tensor in self._live_tensors(batch):
            by_kind.setdefault(_kind(tensor), []).append(tensor)
        grown = []
        for kind, tensors in by_kind.items():
            added = len(tensors) - self.baseline.get(kind, 0)
            if added >= 2:
                nbytes = sum({_storage_key(t): _storage_nbytes(t) for t in tensors}.values())
                new = [t for t in tensors if id(t) not in self._counted_ids] or tensors
                grown.append(GrowingKind(kind, len(tensors), added, nbytes, new[-8:]))
        self.baseline, self._counted_ids = Counter(), set()
        for kind in grown:
            kind.module = self.module_of(kind.tensors[-1])
        return sorted(grown, key=lambda g: g.nbytes, reverse=True)

    def module_of(self, tensor: torch.Tensor, max_nodes: int = 10_000) -> Optional[str]:
        """The module whose parameters are nearest to ``tensor`` in its autograd graph (the last one applied on the
        way to it), by a breadth-first walk back from its ``grad_fn`` (the graph keeps its nodes after backward);
        ``None`` without a graph or a model."""
        if self.model is None or tensor.grad_fn is None:
            return None
        owner = {id(p): name for name, module in self.model.named_modules() for p in module.parameters(recurse=False)}
        queue, seen = [tensor.grad_fn], set()
        while queue and len(seen) < max_nodes:
            node = queue.pop(0)
            if node is None or node in seen:
                continue
            seen.add(node)
            name = owner.get(id(getattr(node, "variable", None)))
            if name is not None:
                return name or type(self.model).__name__
            queue.extend(next_node for next_node, _ in node.next_functions)
        return None

    def holder(self, tensors: list) -> Optional[str]:
        """The name of the Python object that holds these tensors (``model.kept_losses``), or ``None``."""
        ignore = {id(tensors), id(sys._getframe())}
        containers: Counter = Counter()
        objects: dict[int, Any] = {}
        for ref in gc.get_referrers(*tensors):
            if id(ref) in ignore or isinstance(ref, types.FrameType):
                continue
            if isinstance(ref, (list, dict, tuple, set)) or hasattr(ref, "__dict__"):
                containers[id(ref)] += 1
                objects[id(ref)] = ref
        if not containers:
            return None
        container = objects[containers.most_common(1)[0][0]]
        del objects
        return self._name(container, depth=3)

    def graph_holder(self, grown: list[GrowingKind], candidates: int = 8,
                     max_nodes: int = 5_000) -> tuple[Optional[str], Optional[GrowingKind]]:
        """Where the largest growing tensors have no holder of their own: they may be what autograd graphs saved,
        kept alive by the graph's output (a loss kept with its graph). The graphs of the other growing kinds that
        carry one are walked (at most ``candidates`` kinds, ``max_nodes`` nodes each); the first whose graphs saved
        tensors of the largest kinds, and whose holder is found, is returned with that holder."""
        wanted = {(g.shape, g.dtype, g.device, g.grad_fn) for g in grown[:3]}
        tried = 0
        for kind in grown:
            if not kind.grad_fn or tried >= candidates:
                continue
            tried += 1
            own = (kind.shape, kind.dtype, kind.device, kind.grad_fn)
            roots = [tensor.grad_fn for tensor in kind.tensors]
            saved = {_kind(t) for t in graph_saved_tensors(roots, set(), max_nodes)} - {own}
            if saved & wanted:
                holder = self.holder(kind.tensors)
                if holder is not None:
                    return holder, kind
        return None, None

    def _name(self, obj: Any, depth: int) -> Optional[str]:
        kind = f"a {type(obj).__name__}" + (f" of {len(obj)}" if isinstance(obj, (list, dict, tuple, set)) else "")
        if self.model is not None:  # the model's own attributes first: the usual place, and the clearest name
            for path, module in self.model.named_modules():
                for attr, value in vars(module).items():
                    if value is obj:
                        return f"model.{path + '.' if path else ''}{attr} ({kind})"
        if depth == 0:
            return None
        for ref in gc.get_referrers(obj):
            if isinstance(ref, types.FrameType) and ref.f_code.co_filename == __file__:
                continue  # this search's own frames hold it too
            if isinstance(ref, types.FrameType):
                for name, value in ref.f_locals.items():
                    if value is obj:
                        where = f"{os.path.basename(ref.f_code.co_filename)}:{ref.f_lineno}"
                        return f"the local variable {name} of {ref.f_code.co_name}() at {where} ({kind})"
            elif isinstance(ref, types.CellType):
                for func in gc.get_referrers(ref):
                    if isinstance(func, tuple):
                        for f in gc.get_referrers(func):
                            if isinstance(f, types.FunctionType) and f.__closure__ is func:
                                name = f.__code__.co_freevars[func.index(ref)]
                                where = f"{os.path.basename(f.__code__.co_filename)}:{f.__code__.co_firstlineno}"
                                return f"the variable {name} in the closure of {f.__name__}() at {where} ({kind})"
            elif isinstance(ref, dict):
                for owner in gc.get_referrers(ref):
                    if isinstance(owner, types.ModuleType) and vars(owner) is ref:
                        key = next((k for k, v in ref.items() if v is obj), "?")
                        return f"{owner.__name__}.{key} ({kind})"
                    if getattr(owner, "__dict__", None) is ref and not isinstance(owner, type):
                        key = next((k for k, v in ref.items() if v is obj), "?")
                        return f"{type(owner).__name__}.{key} ({kind})"
                key = next((k for k, v in ref.items() if v is obj), None)
                if key is not None:
                    inner = self._name(ref, depth - 1)
                    if inner is not None:
                        return f"{inner.rsplit(' (', 1)[0]}[{key!r}] ({kind})"
            elif isinstance(ref, (list, tuple)) and depth > 1:
                inner = self._name(ref, depth - 1)
                if inner is not None:
                    return f"an item of {inner} ({kind})"
        return None


class LeakWatch:
    """What the monitor feeds at each measured batch start: the rule, the search when it suspects, and the one event
    when it confirms."""

    def __init__(self, rule: Optional[LeakRule] = None) -> None:
        self.rule = rule if rule is not None else LeakRule()
        self._search: Optional[LeakSearch] = None

    def observe(self, step: int, allocated: Optional[int], monitor: Any, batch: Any) -> None:
        """A measured step's batch-start ``allocated`` bytes (``None``: not counted). ``monitor`` is the
        :class:`~lightning_memguard.monitor.monitor.MemoryMonitor` (its model, optimizers, events and host);
        ``batch`` is left out of the count."""
        verdict = self.rule.observe(allocated, step)
        if verdict is None:
            return
        try:
            if verdict == "suspect":
                self._search = LeakSearch(monitor._module, monitor.optimizers)
                self._search.count(batch, step)
            elif self._search is not None:
                self._declare(step, allocated, monitor, batch)
        except Exception as error:  # naming a leak must never be why a run dies
            self.rule.done = True
            monitor.host.warn(f"lightning-memguard: could not look for what grows in memory ({error!r}).")

    def _declare(self, step: int, allocated: int, monitor: Any, batch: Any) -> None:
        search, self._search = self._search, None
        grown = search.growing(batch)
        if not grown:
            self.rule.back_off()
            return
        self.rule.done = True
        # the largest kind may be held inside autograd graphs (the inputs they saved): ask for the next ones too,
        # then for the tensors whose graphs saved them
        holder = next(filter(None, (search.holder(kind.tensors) for kind in grown[:3])), None)
        keeper = None
        if holder is None:
            holder, keeper = search.graph_holder(grown)
        rule = self.rule
        rise = allocated - rule.streak_start
        per_step = rule.per_step(allocated, step)
        reason = (f"memory at the start of a step rose on each of the last {rule.streak} measured steps, by "
                  f"{format_bytes(rise)} ({format_bytes(rule.streak_start)} -> {format_bytes(allocated)}"
                  + (f", {format_bytes(per_step[0])} per step over the {per_step[1]} steps since step "
                     f"{rule.streak_start_step}" if per_step else "")
                  + f"): something keeps tensors from every step. Growing (counted at steps {search.counted_at} and "
                  f"{step}): "
                  + "; ".join(g.describe() for g in grown[:3])
                  + (f". Held by {holder}" if holder else ". Their holder was not found")
                  + (f", through the autograd graphs of the tensors it keeps ({keeper.describe()})" if keeper else "")
                  + _advice(grown[:3], keeper))
        event = Event(step=step, action="leak", rung="", reason=reason, peak_before_bytes=rule.streak_start,
                      peak_after_bytes=allocated, capacity_bytes=monitor.capacity_bytes(), phase="batch_start",
                      time=time.time())
        monitor.record(event, warn=True)


def _advice(grown: list[GrowingKind], keeper: Optional[GrowingKind] = None) -> str:
    """What to do: keep detached values where the growing tensors carry autograd graphs (each holds its step's saved
    activations) or are kept by tensors that do (``keeper``: a loss kept with its graph); where none does, detaching
    changes nothing — something appends values every step (a metric that concatenates them, a list of outputs) and
    must be reset or summarised."""
    if keeper is not None:
        return (". Each of those keeps its step's autograd graph and the activations the graph saved for backward: "
                "keep loss.detach() or loss.item() instead (or clear the container each epoch).")
    if any(kind.grad_fn for kind in grown):
        return ". Keep detached values (loss.detach() or loss.item()) or clear the container each epoch."
    return (". They carry no autograd graph, so detaching would not help: something appends values every step (a "
            "metric that concatenates them, such as torchmetrics' CatMetric, or a list of outputs); reset it each "
            "epoch (metric.reset(), list.clear()) or keep a running summary instead.")


def _is_tensor(obj: Any) -> bool:
    try:
        return isinstance(obj, torch.Tensor)
    except Exception:  # an object whose __class__ raises: not a tensor
        return False


def _kind(tensor: torch.Tensor) -> Kind:
    grad_fn = tensor.grad_fn
    return (tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""), str(tensor.device),
            type(grad_fn).__name__ if grad_fn is not None else "")


def _storage_key(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage()._cdata
    except Exception:  # tensor subclasses without a real storage
        return id(tensor)


def _storage_nbytes(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().nbytes()
    except Exception:
        return 0
