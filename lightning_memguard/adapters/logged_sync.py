"""Whether a Lightning training step has collectives of its own: a value it logs each step reduced across the ranks
as it is logged (``self.log(name, value, on_step=True, sync_dist=True)``: Lightning all-reduces a tensor logged
on_step at the log call itself, in ``_ResultMetric.forward``). A rank that ran such a step, or a part of one, again
alone would issue that all-reduce alone, and the other ranks would never match it
(:attr:`~lightning_memguard.guard.ranks.Ranks.step_collectives`). A value logged with ``on_step=False`` is reduced
once, at the epoch's end, by every rank alike: no concern.

Read from the fit loop's result collection (``trainer.fit_loop.epoch_loop._results``, Lightning 2.x), which keeps
an entry per key logged; looked through again only when its number of keys changed (a length, each batch). A
Lightning whose collection reads otherwise says nothing: the step is taken to have no collectives of its own.

Before the first batch has logged anything, the collection is empty on every rank, and a rank that runs out of memory
in the first step's forward, before its log call, would stand in for a gradient reduction while the others wait in the
log's all-reduce (a hang). So until then the answer comes from the source of the module's hooks that run inside the
batch: a call that passes ``sync_dist`` anything but ``False``, or a ``log``/``log_dict`` call given ``**options``
(and not ``on_step=False`` or ``rank_zero_only=True``), counts. What the collection shows after the first batch
replaces that guess (a call the batch did not make, one under an ``if`` say, counts no longer)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, Iterator, Optional

import torch

__all__ = ["LoggedSync", "collectives_in_source", "synced_in_source"]

#: the hooks Lightning runs inside a training batch's closure (what a batch that runs again runs again); a value logged
#: elsewhere (``on_train_batch_end``, say) is logged once a batch, whatever ran again
_IN_CLOSURE = frozenset({"training_step", "on_before_zero_grad", "optimizer_zero_grad", "on_before_backward",
                         "backward", "on_after_backward"})


class LoggedSync:
    """Watches one fit's training results for a value reduced across the ranks as it is logged.

    Args:
        trainer: the Lightning Trainer whose fit loop logs.
    """

    def __init__(self, trainer: Any) -> None:
        try:
            self._results = trainer.fit_loop.epoch_loop._results
            len(self._results)
        except Exception:  # another Lightning: unknown, taken as none (nothing said: nothing the user can do)
            self._results = None
        self._keys = -1  # the first batch's keys are always looked through: they replace the source's guess
        #: whether a value logged inside the training batch is reduced across the ranks at each log call (before a
        #: batch has logged: whether the hooks' source says so)
        self.found = synced_in_source(getattr(trainer, "lightning_module", None))

    def changed(self) -> bool:
        """After a training batch ran: whether :attr:`found` was read again (the logged keys changed since)."""
        results = self._results
        if results is None or len(results) == self._keys:
            return False
        self._keys = len(results)
        self.found = bool(_synced_on_step(results))
        return True


def _synced_on_step(results: Any) -> Optional[str]:
    """The key of the first tensor logged inside the closure on_step with ``sync_dist`` (not rank zero only), else
    ``None`` (also where an entry does not read as Lightning 2.6's)."""
    try:
        for key, metric in list(results.items()):
            meta = metric.meta
            sync = meta.sync
            if (meta.on_step and sync.should and not sync.rank_zero_only and metric.is_tensor
                    and meta.fx.split(".")[0] in _IN_CLOSURE):
                return key
    except Exception:
        return None
    return None


def synced_in_source(module: Any) -> bool:
    """Whether a hook of ``module``'s class that runs inside the training batch's closure calls something with
    ``sync_dist`` given (not the constant ``False``), ``on_step`` not the constant ``False`` and ``rank_zero_only``
    not the constant ``True``: ``self.log(..., sync_dist=True)`` in ``training_step``, say. A hook whose source cannot
    be read counts as not."""
    return any(_synced_call(call) for call in _calls_in_closure(module))


def collectives_in_source(module: Any) -> bool:
    """Whether ``module``'s training step issues collectives of its own, as far as can be told before it ran: a hook
    that runs inside the closure calls one by name (``self.all_gather(embeddings)``, ``dist.all_reduce(x)``), or the
    module holds SyncBatchNorm layers or a torchmetrics metric synced at each step (``dist_sync_on_step=True``). What
    a helper function calls is not seen: the recovery counts the collectives of the steps that ran
    (:mod:`~lightning_memguard.adapters.own_collectives`)."""
    if any(_called_name(call) in _COLLECTIVE_NAMES for call in _calls_in_closure(module)):
        return True
    modules = module.modules() if isinstance(module, torch.nn.Module) else ()
    return any(isinstance(m, torch.nn.SyncBatchNorm) or getattr(m, "dist_sync_on_step", False) is True
               for m in modules)


#: what a collective is called (unambiguous names only: ``gather``, ``reduce`` and ``scatter`` are torch's tensor ops)
_COLLECTIVE_NAMES = frozenset({"all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce",
                               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                               "barrier", "broadcast", "broadcast_object_list"})


def _calls_in_closure(module: Any) -> Iterator[ast.Call]:
    """Every call in the source of ``module``'s own hooks that run inside the training batch's closure (Lightning's
    own hooks call nothing of the user's; a hook whose source cannot be read, a compiled or generated one, shows
    none)."""
    for name in _IN_CLOSURE:
        hook = getattr(type(module), name, None)
        if hook is None or getattr(hook, "__module__", "").startswith(("lightning.", "pytorch_lightning.")):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(hook)))
        except Exception:
            continue
        yield from (node for node in ast.walk(tree) if isinstance(node, ast.Call))


def _synced_call(call: ast.Call) -> bool:
    given = {keyword.arg: keyword.value for keyword in call.keywords if keyword.arg is not None}

    def constant(name: str, value: bool) -> bool:
        node = given.get(name)
        return isinstance(node, ast.Constant) and node.value is value

    # ``self.log(name, value, **options)`` may pass sync_dist: counted (at the first step a wrong "yes" costs nothing,
    # an OOM there stops every rank anyway; a wrong "no" leaves the other ranks waiting in the log's all-reduce)
    splat = _called_name(call) in ("log", "log_dict") and any(keyword.arg is None for keyword in call.keywords)
    return ("sync_dist" in given or splat) and not constant("sync_dist", False) and not constant("on_step", False) \
        and not constant("rank_zero_only", True)


def _called_name(call: ast.Call) -> Optional[str]:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
