"""DDPRecovery: the ranks of a DistributedDataParallel run recover an out-of-memory error together, as DDP's own
``Join`` lets ranks with fewer inputs shadow the others.

Every gradient bucket is all-reduced as torch's own ``allreduce_hook`` does (averaged), through DDP's communication
hook.
A rank that runs out of memory frees what its attempt held, then shadows the buckets its backward had not reduced
yet — zeros, with a NaN as the first element — so the other ranks' backward completes instead of waiting on a
connection that closes, and it resets its reducer. A rank whose backward completed finds the NaN in the first element
of a bucket it received (one local read, no collective). Then, and only then, the ranks agree in one small collective
(with a timeout) on the worst numbers, take the same rung and run the batch again (the guard's attempt loop,
:class:`~lightning_memguard.guard.attempts.Attempts`). A quiet step costs no collective: the mark travels inside the
gradients' own all-reduce.

News between steps travels the same way: the smallest bucket (of the last backward since DDP rebuilt its buckets: the
same one on every rank) is all-reduced with two elements more, the first 1 on a rank that has news for the others
(:meth:`DDPRecovery.say`), else 0; after the backward every rank reads whether any rank had (its ``heard``), in the
same read as the marks, so the ranks need a collective of their own only on a step that has news
(:class:`~lightning_memguard.guard.ranks.Ranks`), and until a backward ran after the rebuild.
The second is 1 on a rank that ran a batch of a gradient-accumulation window again alone since the last reduction
(:meth:`DDPRecovery.say_rescued`; every rank reads it as ``rescued``), so that the ranks raise their ladders together
at the window's last batch, the one that reduces.
Torch only, no Lightning: the plain loop and the Lightning callback both train through a ``DistributedDataParallel``
module.
"""

from __future__ import annotations

import math
import weakref
from datetime import timedelta
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from .own_collectives import CollectiveCount, CountsOwnCollectives, uncounted
from .worker_release import handed_to_workers, numbers_for_collective

__all__ = ["DDPRecovery"]


class DDPRecovery(CountsOwnCollectives):
    """The recovery of one DistributedDataParallel module (see the module docstring); the guard's ``Ranks.recovery``.

    Args:
        ddp: the DistributedDataParallel module the front door trains through.
        timeout_s: how long the agreement waits for the other ranks.
    """

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, timeout_s: float = 600.0) -> None:
        # weakly: the module holds this recovery (its communication hook's state, and the table of installed ones),
        # and a strong reference back would keep every DDP module, its buckets and its process group alive to the end
        # of the process
        self._ddp = weakref.ref(ddp)
        self.timeout = timedelta(seconds=timeout_s)
        self._issued: set[int] = set()  # buckets this attempt's backward reduced
        self._marks: list[torch.Tensor] = []  # each reduced bucket's first element
        self._shadowing = False
        self._sizes: dict[int, _Layout] = {}  # each bucket this backward reduced, by index
        self._known: dict[int, _Layout] = {}  # every bucket of the last complete backward
        self._known_final = False  # whether that backward ran after DDP rebuilt its buckets (or it never does)
        self._carrier: Optional[int] = None  # the bucket that carries the news element
        self._saying = False  # this rank's news element: 1 while it has news
        self._news: list[torch.Tensor] = []  # the carried element as reduced (a sum over ranks, scaled)
        #: after a backward that reduced gradients: whether any rank had news (``None``: no bucket carried it)
        self.heard: Optional[bool] = None
        #: whether the attempt in progress reduces gradients: not one that began under ``no_sync`` (a batch of an
        #: accumulation window before its last), whose rank cannot carry the others through anything after an OOM
        self.reduces = True
        self._rescued = False  # this rank ran a batch again alone since its last reduction carried the flag
        self._rescues: list[torch.Tensor] = []  # the carried rescue flag as reduced
        #: after a backward that reduced gradients: whether any rank ran a batch again alone since the last one
        #: (``None``: no bucket carried it)
        self.rescued: Optional[bool] = None
        self._alone_safe = False  # at the attempt's start: a forward of this rank alone issues no collective
        self._forward_sync = False  # DDP's require_forward_param_sync at the attempt's start
        #: the collectives each attempt issues of its own (an ``all_gather`` in the training step, SyncBatchNorm's):
        #: a rank that ran out of memory before issuing one the others wait in cannot stand in for it
        self.own = CollectiveCount()
        ddp.register_comm_hook(self, _reduce_and_mark)

    @classmethod
    def install(cls, module: Optional[nn.Module], warn: Callable[[str], None],
                rescue: bool = True) -> Optional["DDPRecovery"]:
        """The recovery of ``module`` where it is a DistributedDataParallel module of several processes and OOMs are
        rescued (``rescue``: the guard's ``rescue_oom``, under automatic optimization), installed once per module;
        else ``None``. A module that already has a communication hook keeps it, and an OOM then ends the run (one
        warning)."""
        if (not rescue or not isinstance(module, nn.parallel.DistributedDataParallel) or not dist.is_initialized()
                or dist.get_world_size() < 2):
            return None
        installed = _INSTALLED.get(module)
        if installed is None:
            try:
                installed = _INSTALLED[module] = cls(module)
            except Exception as err:  # DDP takes one hook: the user's own (say, compression) stays
                warn(f"lightning-memguard: the ranks cannot recover an OOM together: DistributedDataParallel's "
                     f"communication hook is taken ({type(err).__name__}: {str(err)[:160]}).")
                return None
        return installed

    @property
    def ddp(self) -> nn.parallel.DistributedDataParallel:
        return self._ddp()

    def begin_attempt(self) -> None:
        ddp = self.ddp
        self.reduces = ddp is None or ddp.require_backward_grad_sync
        self._issued.clear()
        self._marks.clear()
        self._news.clear()
        self._rescues.clear()
        self.heard = self.rescued = None
        self.own.watch()
        if ddp is not None:
            # DDP's forward issues a collective of its own where it broadcasts buffers (the first forward after a
            # reduction, a model with buffers) or rebuilds its buckets (once, early; never where it looks for unused
            # parameters or the graph is static): a rank that ran such a forward cannot run it again alone
            self._forward_sync = ddp.require_forward_param_sync
            self._alone_safe = self.settled and not ddp.will_sync_module_buffers()
        if self._sizes:  # a backward reduced every bucket since: the smallest carries from now on, on every rank alike
            self._known, self._sizes = self._sizes, {}
            self._known_final = ddp is not None and _buckets_final(ddp)
            # not before a backward ran after DDP's rebuild (at the second forward): the index would name a rebuilt
            # bucket, maybe the largest, copied whole to carry two elements; until then the ranks agree as they do
            # where no bucket carried the news
            self._carrier = (min(self._known, key=lambda index: (self._known[index].numel, index))
                             if self._known_final else None)

    def say(self, news: bool) -> None:
        """Whether this rank's next backward tells the others it has news (until said otherwise)."""
        self._saying = news

    def say_rescued(self) -> None:
        """This rank ran a batch again alone: its next backward that reduces tells every rank (``rescued``)."""
        self._rescued = True

    @property
    def can_run_alone(self) -> bool:
        """After an OOM in this rank's attempt (released): whether this rank may run the batch again alone, the
        others unaware, with no collective of its own — where its attempt issued none. An attempt under ``no_sync``
        reduces nothing; one that reduces must have issued no gradient bucket and not finished its DDP forward (which
        readies the reducer for the backward): the others then wait in that backward's first reduction, whose sum has
        not begun, for this rank to join it with the attempt that runs again. Not before DDP rebuilt its buckets (see
        :attr:`settled`), nor where the forward broadcast buffers."""
        ddp = self.ddp
        if ddp is None or not self._alone_safe:
            return False
        if not self.reduces:
            return True
        return not self._issued and not self._forward_sync and not ddp.require_forward_param_sync

    def shadow(self) -> None:
        """On the rank that ran out of memory (its attempt released): reduces the buckets its backward had not, with
        the mark, so every rank's backward completes, and resets its reducer for the next attempt."""
        reducer = self.ddp.reducer
        self._shadowing = True
        try:
            if self._known_final:
                # one bucket of zeros at a time, in DDP's order: after an OOM, all of them at once (a copy of every
                # gradient) may not fit where one does
                for index in sorted(self._known):
                    if index not in self._issued:
                        layout = self._known[index]
                        zeros = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
                        _reduce_and_mark(self, _ShadowBucket(index, zeros)).wait()  # registered by the hook
                        # freed now: the process group's work object holds the tensor until its own thread lets
                        # go of it, and a second bucket would be allocated beside it (on CUDA once the reduction,
                        # which the stream only waits for, has run: an OOM's rescue can afford the wait)
                        if zeros.is_cuda:
                            torch.cuda.current_stream(zeros.device).synchronize()
                        zeros.untyped_storage().resize_(0)
                        del zeros
            else:  # no backward has shown the buckets as they are now: DDP's own zero buckets, all at once
                for bucket in reducer._get_zeros_like_grad_buckets():
                    if bucket.index() not in self._issued:
                        reducer._run_comm_hook(bucket).wait()
            if self.ddp.find_unused_parameters:
                self.ddp._match_unused_params_allreduce()
            reducer._reset_state()
        finally:
            self._shadowing = False
        self.begin_attempt()

    @property
    def settled(self) -> bool:
        """Whether a batch may run again: DDP rebuilds its gradient buckets once, in the order the first backward
        made them ready, at the second forward — a first backward that failed on one rank would rebuild them
        differently there. Until then the ranks stop together, with the report (unless the buckets are never rebuilt:
        ``find_unused_parameters`` without a static graph; a static graph starts from one bucket and is rebuilt)."""
        return _buckets_final(self.ddp)

    def reset(self) -> None:
        """On a rank whose backward completed, when another rank's failed: its reducer is reset as the failed rank's
        was, so that every rank's reducer is in the same state when the batch runs again (a reset reducer rebuilds
        its buckets at the next forward, on every rank alike)."""
        self.ddp.reducer._reset_state()
        self.begin_attempt()

    def peer_failed(self) -> bool:
        """After a backward that reduced gradients: whether a bucket came back marked by a rank that ran out of
        memory (a genuine NaN gradient reads the same; the agreement then finds no OOM and nothing changes)."""
        if not self._marks:
            return False
        # one read: marks, news and rescues together
        values = torch.cat(self._marks + self._news + self._rescues).tolist()
        marks, flags = values[:len(self._marks)], values[len(self._marks):]
        news, rescues = flags[:len(self._news)], flags[len(self._news):]
        self.heard = any(value > 0 for value in news) if news else None
        if rescues:  # read once: the agreement that follows is made once
            self.rescued = any(value > 0 for value in rescues)
            self._rescues.clear()
            self._rescued = False  # said
        return any(math.isnan(value) for value in marks)

    def agree(self, numbers: list[int]) -> list[int]:
        """The element-wise maximum of ``numbers`` over the ranks, in one collective that waits at most the timeout.

        Raises:
            RuntimeError: a rank did not answer within the timeout.
        """
        tensor = numbers_for_collective(numbers, self.ddp.device if dist.get_backend() == "nccl" else "cpu")
        with uncounted():
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
        work.wait(self.timeout)
        return [int(v) for v in tensor.tolist()]


def _buckets_final(ddp: nn.parallel.DistributedDataParallel) -> bool:
    """Whether DDP's gradient buckets are the ones it keeps: rebuilt once, early (at the second forward by default,
    later under a static graph, which starts from one bucket of every parameter), in the order a backward made the
    gradients ready — never where it looks for unused parameters without a static graph (torch's
    ``should_rebuild_buckets``)."""
    return ddp._has_rebuilt_buckets or (ddp.find_unused_parameters and not ddp.static_graph)


class _Layout(NamedTuple):
    """What a gradient bucket's flat buffer is: enough to reduce zeros in its place."""
    numel: int
    dtype: torch.dtype
    device: torch.device


class _ShadowBucket:
    """A bucket of zeros in a bucket's place, for the communication hook (which reads only these two)."""

    def __init__(self, index: int, buffer: torch.Tensor) -> None:
        self._index, self._buffer = index, buffer

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer


#: the recovery of each DDP module (its communication hook is registered once)
_INSTALLED: "weakref.WeakKeyDictionary[nn.Module, DDPRecovery]" = weakref.WeakKeyDictionary()


def _reduce_and_mark(recovery, bucket):  # no annotations: DDP checks them, and these would be strings
    """DDP's communication hook: the average over ranks (torch's ``allreduce_hook``), with the shadowing rank's mark,
    keeping each reduced bucket's first element for :meth:`DDPRecovery.peer_failed`; the carrier bucket takes the news
    element along."""
    index, buffer = bucket.index(), bucket.buffer()
    recovery._sizes[index] = _Layout(buffer.numel(), buffer.dtype, buffer.device)
    if recovery._shadowing:  # a bucket of zeros made for the shadow, let go of once reduced
        handed_to_workers(buffer)[:1].fill_(float("nan"))
    else:
        recovery._issued.add(index)
    if index == recovery._carrier:
        return _carry(recovery, bucket.buffer(), recovery._saying or recovery._shadowing, recovery._rescued)
    if recovery._shadowing:
        return _averaged(bucket.buffer(), handed_to_workers(lambda future: future.value()[0]))

    def keep_mark(future: torch.futures.Future) -> torch.Tensor:
        reduced = future.value()[0]
        recovery._marks.append(reduced[:1])
        return reduced

    return _averaged(bucket.buffer(), handed_to_workers(keep_mark))


def _averaged(buffer: torch.Tensor, then: Callable) -> torch.futures.Future:
    """``buffer`` divided by the number of ranks and all-reduced in place (torch's ``allreduce_hook``), ``then`` run on
    the reduction's future (the worker thread that ran it holds ``then`` until it lets go: registered)."""
    group = dist.group.WORLD
    buffer.div_(dist.get_world_size(group))
    with uncounted():
        work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(then)


def _carry(recovery, buffer: torch.Tensor, news: bool, rescued: bool) -> torch.futures.Future:
    """All-reduces ``buffer`` with the news and rescue elements after it, as ``allreduce_hook`` does (divided by the
    number of ranks, then summed: the gradients come out bit for bit the same); each element comes back positive where
    any rank had news, or ran a batch again alone."""
    group = dist.group.WORLD
    flags = buffer.new_zeros(2)  # set by fills: no copy from the host on a step's path
    if news:
        flags[:1].fill_(1)
    if rescued:
        flags[1:].fill_(1)
    carried = handed_to_workers(torch.cat([buffer, flags]).div_(dist.get_world_size(group)))
    shadowing = recovery._shadowing

    def unpack(future: torch.futures.Future) -> torch.Tensor:
        reduced = future.value()[0]
        buffer.copy_(reduced[:-2])
        if not shadowing:
            recovery._marks.append(buffer[:1])
            flags = reduced[-2:].clone()  # views would keep ``carried`` from being let go of (worker_release)
            recovery._news.append(flags[:1])
            recovery._rescues.append(flags[1:])
        if reduced.device.type == "cpu":
            # the copy let go of as its reduction ends, not when gloo's worker thread drops the work (at random,
            # often after the backward: the gradients' copy showed in the next phase's peak). On CUDA the memory
            # is the stream's until the reduction has run there, which this callback does not wait for
            reduced.untyped_storage().resize_(0)
        return buffer

    with uncounted():
        work = dist.all_reduce(carried, group=group, async_op=True)
    return work.get_future().then(handed_to_workers(unpack))
