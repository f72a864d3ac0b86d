"""EvaluationAlone: an evaluation batch that ran out of memory on one rank of a DistributedDataParallel run runs again
in more parts on that rank alone, the other ranks unaware.

An evaluation batch reduces no gradients: what the ranks do together in it is only what the step issues of its own
(a value logged with ``sync_dist=True`` on_step, ``self.all_gather``, a torchmetrics metric synced on each step) and
DDP's broadcast of the module's buffers in the first forward after a training step. A rank may split its batch alone
where neither differs from the others':

- the step's own collectives are counted (:class:`~lightning_memguard.adapters.own_collectives.CollectiveCount`, one
  count per loop): the failed attempt must have issued none, nor any completed batch of that loop on this rank.
  Before any batch of the loop completed (the first batch of ``trainer.test``, of a validation with no sanity check)
  that is not known: the batch runs in parts alone all the same, each collective its parts try raising instead of
  being issued (:class:`~lightning_memguard.adapters.own_collectives.CollectiveRefused`; the others would never meet
  it), which ends the run with the report (:meth:`EvaluationAlone.refusal`) as where one is known; the batch that
  completes so tells that the step issues none;
- the buffers' broadcast: DDP issues it when its forward begins, and marks it done when the forward ends. A plain
  loop calls the DDP module once a part: an attempt that failed inside the module's forward had broadcast, so before
  the batch runs again the mark is set as the forward's end would have set it (the others broadcast once, so must
  this rank). Under Lightning the whole step, every part, runs inside one DDP forward (Lightning's forward
  redirection): nothing to mark.

The front doors hand one to the guard for a fit (whatever its optimization: an evaluation batch has no gradients) and
for an evaluation of its own (:meth:`EvaluationAlone.of`). Outside a fit (Lightning's ``validate``, ``test`` and
``predict`` under ``ddp``, which run the module unwrapped; a plain loop that evaluates before it trains) the same holds
with no broadcast to mind. FSDP2's
forward gathers the parameters in every part, on every rank: its evaluation batches are not split alone, nor those of
a module whose parameters are not plain tensors (DTensor shards, FSDP's flat parameters). Torch only, no Lightning.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch.distributed as dist
from torch import nn

from ..base.sharding import fsdp2_modules
from .own_collectives import CollectiveCount, CollectiveRefused

__all__ = ["EvaluationAlone"]

#: why a batch is not split alone, in the report
ISSUES_COLLECTIVES = ("the run has several processes, and the {phase} step issues collectives of its own (a value "
                      "logged with sync_dist=True and on_step=True, all_gather, a metric synced on each step): its "
                      "parts on this rank alone would issue them again where the other ranks do not. Give the "
                      "evaluation loop smaller batches (its DataLoader's batch_size), or log the value on_epoch only")


class EvaluationAlone:
    """What the evaluation batches of one DistributedDataParallel module (``ddp``; ``None``: a module evaluated
    unwrapped) issue, per loop, and whether a batch that ran out of memory on this rank may run again in more parts
    here alone (see the module docstring). The guard's attempt loop calls :meth:`begin` before each attempt,
    :meth:`end` after it, and :meth:`why_not` after an OOM."""

    def __init__(self, ddp: Optional[nn.parallel.DistributedDataParallel] = None) -> None:
        # weakly: the module holds its recovery, which holds this
        self._ddp = weakref.ref(ddp) if ddp is not None else lambda: None
        self._counts: dict[str, CollectiveCount] = {}
        self._hook = None
        self._tentative: set[str] = set()  # loops whose batch runs in parts alone before one is known to issue none
        self._broadcasts = False  # the attempt's first forward through DDP broadcasts the buffers
        self._entered = False  # the attempt's forward reached the module inside DDP (the broadcast had run)

    @classmethod
    def of(cls, module: Optional[nn.Module]) -> Optional["EvaluationAlone"]:
        """For ``module`` (a DistributedDataParallel module, or one evaluated unwrapped) in a process group of several
        ranks; ``None`` where it is sharded (FSDP2, or parameters of a tensor subclass: DTensor shards, FSDP's flat
        parameters) or there is no such group (nothing to split alone from)."""
        if not isinstance(module, nn.Module) or not dist.is_available() or not dist.is_initialized() \
                or dist.get_world_size() < 2 or fsdp2_modules(module) \
                or any(type(p) is not nn.Parameter for p in module.parameters()):
            return None
        return cls(module if isinstance(module, nn.parallel.DistributedDataParallel) else None)

    def begin(self, phase: str) -> None:
        """An attempt of a ``phase`` batch begins: its collectives are counted from zero."""
        count = self._counts.get(phase)
        if count is None:
            count = self._counts[phase] = CollectiveCount()
        count.watch()
        count.refusing = phase in self._tentative
        self._remove_hook()
        ddp = self._ddp()
        self._entered = False
        self._broadcasts = ddp is not None and ddp.will_sync_module_buffers()
        if self._broadcasts:  # once a loop after training: a hook for the attempt only
            self._hook = ddp.module.register_forward_pre_hook(self._forward_entered)

    def end(self, phase: str, complete: bool) -> None:
        """The attempt of a ``phase`` batch ended: ``complete`` (every part ran), or failed."""
        count = self._counts.get(phase)
        if count is not None:
            count.refusing = False
            if complete:
                count.complete(0)
                self._tentative.discard(phase)  # known now: it issued none
            else:
                count.stop()
        self._remove_hook()

    def why_not(self, phase: str) -> Optional[str]:
        """After an out-of-memory error in this rank's attempt of a ``phase`` batch: ``None`` where the batch may run
        again in more parts on this rank alone (DDP's broadcast then marked done where the attempt had issued it;
        before a batch of the loop completed, its parts refusing any collective), else why not (the report's
        reason)."""
        count = self._counts.get(phase)
        if count is not None and count.seen:
            return ISSUES_COLLECTIVES.format(phase=phase)
        if count is None or not count.known:
            self._tentative.add(phase)
        ddp = self._ddp()
        if ddp is not None and self._broadcasts and self._entered:
            ddp.require_forward_param_sync = False  # as the failed forward's end would have: the others broadcast once
        return None

    def refusal(self, phase: str, error: BaseException) -> Optional[str]:
        """Where ``error`` ended an attempt of a ``phase`` batch: why the batch could not run on this rank alone (the
        report's reason) where its parts tried a collective, which was refused (:meth:`why_not`), also where the
        refusal was raised again as another error (a library that wraps what its collective raised); else ``None``."""
        seen: set[int] = set()
        while error is not None and id(error) not in seen:
            if isinstance(error, CollectiveRefused):
                return ISSUES_COLLECTIVES.format(phase=phase)
            seen.add(id(error))
            error = error.__cause__ or error.__context__
        return None

    def _forward_entered(self, module: nn.Module, args: tuple) -> None:
        self._entered = True

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
