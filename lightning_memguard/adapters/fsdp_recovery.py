"""FSDPRecovery: the ranks of a run sharded with FSDP2 (``fully_shard``) recover an out-of-memory error together, as
:class:`~lightning_memguard.adapters.ddp_recovery.DDPRecovery` does under DistributedDataParallel.

FSDP2 issues the same collectives at every forward and backward: its all-gathers of each module's parameters and
reduce-scatters of its gradients, of the same sizes, in the same order (they depend on the parameters, not on the
batch; checkpointing recomputes a block inside the all-gather its backward issued anyway, and each micro-batch is
one more forward and backward of the same sequence, each part reduce-scattering its gradients). Every FSDP module's
all-gather and reduce-scatter go through torch's own (``DefaultAllGather``, ``DefaultReduceScatter``), set as its
custom communication, which count what the forward and backward in progress issued and keep the sequence of the last
complete one.

A rank that runs out of memory frees its attempt, puts FSDP2 back as it is between iterations (torch's
``reset_iter_state``: pending collectives waited on, every module resharded, the iteration's trackers cleared, so
that the retried forward gathers every module again), then issues the rest of the known sequence with zeros — a
reduce-scatter with a NaN at the start of each rank's chunk — so the other ranks' backward completes instead of
waiting on a connection that closes. A rank whose backward completed finds the NaN in the first element of a
reduce-scatter's output (one local read, no collective); the ranks agree in one small collective (with a timeout)
on the worst numbers, take the same rung and run the batch again
(:class:`~lightning_memguard.guard.attempts.Attempts`). A quiet step costs no collective of its own: the mark travels
inside the gradients' reduce-scatters.

Before a forward and backward has completed, after the last reduce-scatter (nothing left to carry the mark), or where
what this attempt issued differs from the known sequence, the rank that ran out stops with the report and the others
at their next collective, as without a recovery.

News between steps rides the same way: the smallest reduce-scatter of the known sequence (the same one on every rank)
carries two elements more in each rank's chunk, reduced with the gradients (each of which comes out as it would have:
the chunks are reduced element by element): 1 on a rank that has news for the others (:meth:`FSDPRecovery.say`), else
0; and 1 where the rank's batch has parts left after this one (:meth:`FSDPRecovery.say_more`), else 0. After the
backward every rank reads whether any rank had news (its ``heard``) and parts left (its ``more``), in the same read as
the marks, so the ranks need a collective of their own only on a step that has news
(:class:`~lightning_memguard.guard.ranks.Ranks`).

A rank may so run its batch in more parts than the others (a rare long batch, split alone): each part is a forward
and backward of FSDP2's collectives, and a rank whose parts have all run while another's have not meets them in a
shadow part (:meth:`FSDPRecovery.shadow_part`): the known sequence issued again by FSDP2's own ``foreach_all_gather``
(this rank's parameter shards, which the others compute with) and ``foreach_reduce`` of zero gradients (this rank's
shard of the others' gradients added to its sharded gradients as after any backward), until no rank has parts left.
Where that cannot be done alike (:attr:`FSDPRecovery.splits_alone`: the first step, a user's
``set_requires_gradient_sync(False)``, HSDP, ...) every rank runs as many parts as the largest count, agreed in one
small collective a batch. Torch only, no Lightning.
"""

from __future__ import annotations

import inspect
import math
import weakref
from datetime import timedelta
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..base.sharding import fsdp2_modules
from .own_collectives import CollectiveCount, CountsOwnCollectives, uncounted
from .worker_release import handed_to_workers, numbers_for_collective

try:  # FSDP2's own collectives and its reset after a failed iteration (torch 2.13 has both)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (DefaultAllGather, DefaultReduceScatter,
                                                                      foreach_all_gather, foreach_reduce)
    _AVAILABLE = hasattr(FSDPModule, "reset_iter_state") and hasattr(FSDPModule, "set_custom_reduce_scatter")
except ImportError:  # an older torch: the ranks stop together, as without a recovery
    FSDPModule, DefaultAllGather, DefaultReduceScatter, _AVAILABLE = None, object, object, False
    foreach_all_gather = foreach_reduce = None

#: FSDP2's gathering and reduction as a shadow part calls them (torch 2.13's arguments); another torch's: every rank
#: runs as many parts as the others (agreed in a collective)
_REDUCE_ARGUMENTS = ("fsdp_params", "unsharded_grads", "reduce_scatter_group", "reduce_scatter_stream",
                     "reduce_scatter_comm", "orig_dtype", "reduce_dtype", "device", "gradient_divide_factor",
                     "all_reduce_group", "all_reduce_stream", "all_reduce_grads", "partial_reduce_output",
                     "all_reduce_hook", "force_sum_reduction_for_comms")
_GATHER_ARGUMENTS = ("fsdp_params", "group", "async_op", "all_gather_copy_in_stream", "all_gather_stream", "device",
                     "all_gather_comm")


def _takes(function: Any, arguments: tuple[str, ...]) -> bool:
    return function is not None and tuple(inspect.signature(function).parameters)[:len(arguments)] == arguments


_SHADOW_PARTS = _AVAILABLE and _takes(foreach_reduce, _REDUCE_ARGUMENTS) and _takes(foreach_all_gather,
                                                                                      _GATHER_ARGUMENTS)

__all__ = ["FSDPRecovery", "holds_fsdp2"]

#: the elements the carrier adds to each rank's chunk: whether a rank has news, whether it has parts left
_CARRIED = 2


class _Collective(NamedTuple):
    """One collective FSDP2 issued: enough to issue zeros of the same sizes in its place."""
    kind: str  # "all_gather" or "reduce_scatter"
    output_numel: int
    input_numel: int
    dtype: torch.dtype
    device: torch.device
    group: Any
    op: Any  # the reduce-scatter's operation (``None`` for an all-gather)
    # (a weak reference to) the FSDP2 module whose parameters it gathered or whose gradients it reduced
    module: Any = None

    def same_as(self, other: "_Collective") -> bool:
        return self[:5] == other[:5] and self.group is other.group


class FSDPRecovery(CountsOwnCollectives):
    """The recovery of the FSDP2 modules inside one module (see the module docstring); the guard's
    ``Ranks.recovery``. Built by :meth:`install`.

    Args:
        fsdp_modules: every ``FSDPModule`` of the trained module, the root included.
        timeout_s: how long the agreement waits for the other ranks.
    """

    #: why a batch that ran out of memory is not run again while :attr:`settled` is False (in the report)
    unsettled_reason = ("out of memory under FSDP2 before a step had shown its collectives (the first step), after "
                        "the backward's last reduce-scatter, or in collectives unlike the last step's: the other ranks "
                        "cannot be carried through it to run it again alike")

    def __init__(self, fsdp_modules: list[nn.Module], timeout_s: float = 600.0) -> None:
        # weakly: each module's communication holds this recovery, and a strong reference back would keep the modules
        # alive to the end of the process
        self._modules = [weakref.ref(module) for module in fsdp_modules]
        self.timeout = timedelta(seconds=timeout_s)
        self._issued: list[_Collective] = []  # the collectives of the forward and backward in progress
        self._known: dict[tuple, list[_Collective]] = {}  # the last complete sequence, by how the modules are set
        self._alone: dict[tuple, bool] = {}  # splits_alone for each setting's known sequence
        self._marks: list[torch.Tensor] = []  # each reduce-scatter's first output element, this backward
        self._carrier: Optional[int] = None  # the index, in the sequence, of the reduce-scatter that carries news
        self._saying = False  # this rank's news element: 1 while it has news
        self._more_after = False  # this rank's second element: 1 where its batch has parts left after this one
        self._news: list[torch.Tensor] = []  # the carried elements as reduced (news, parts left), per carrier
        #: after a backward: whether any rank had news (``None``: no reduce-scatter carried it)
        self.heard: Optional[bool] = None
        #: after a backward: whether any rank has parts of its batch left (``None``: nothing carried it)
        self.more: Optional[bool] = None
        self._shadowing = False
        # whether the last shadow() carried the other ranks through (``None``: no shadow since the last agreement)
        self._replayed: Optional[bool] = None
        #: the collectives each attempt issues of its own, beside FSDP2's (an ``all_gather`` in the training step)
        self.own = CollectiveCount()
        device_types = {param.device.type for module in fsdp_modules for param in module.parameters(recurse=False)}
        self._device = torch.device("cuda", torch.cuda.current_device()) if "cuda" in device_types else None
        for module in fsdp_modules:
            module.set_custom_all_gather(_RecordedAllGather(self, module))
            module.set_custom_reduce_scatter(_RecordedReduceScatter(self, module))

    @classmethod
    def install(cls, module: Optional[nn.Module], warn: Callable[[str], None],
                rescue: bool = True) -> Optional["FSDPRecovery"]:
        """The recovery of ``module`` where FSDP2 shards it (or a module inside it) over several processes and OOMs
        are rescued (``rescue``: the guard's ``rescue_oom``, under automatic optimization), installed once per module;
        else ``None``. A module whose FSDP2 collectives are already custom, or that has several parameter groups,
        keeps them, and an OOM then ends the run (one warning)."""
        if (not rescue or not _AVAILABLE or not isinstance(module, nn.Module) or not dist.is_initialized()
                or dist.get_world_size() < 2):
            return None
        installed = _INSTALLED.get(module)
        if installed is not None:
            return installed
        named = fsdp2_modules(module)
        if not named:
            return None
        try:
            taken = _taken(named)
            if taken is None:
                installed = _INSTALLED[module] = cls([m for _, m in named])
                return installed
        except Exception as err:  # FSDP2's internals moved: the run goes on without a recovery
            taken = f"{type(err).__name__}: {str(err)[:160]}"
        warn(f"lightning-memguard: the ranks cannot recover an OOM together under FSDP2: {taken}.")
        return None

    def _fsdp_modules(self) -> list[nn.Module]:
        return [module for module in (ref() for ref in self._modules) if module is not None]

    def _setting(self) -> tuple:
        """How the modules gather and reduce now (a user's ``set_requires_gradient_sync``, ``reshard_after_forward``):
        a sequence is known for one setting."""
        return tuple((group.reduce_grads, group.post_forward_mesh_info is not None)
                     for module in self._fsdp_modules() for group in module._get_fsdp_state()._fsdp_param_groups)

    @property
    def splits_alone(self) -> bool:
        """Whether a rank may run its batch in as many parts as it needs, whatever the other ranks' counts: where a
        forward and backward with the modules set as now is known, has a reduce-scatter to carry the ranks' flags,
        and each of its all-gathers can be issued again from a module's shards (:meth:`shadow_part`). Else every rank
        runs as many parts as the largest count, agreed in one small collective a batch: the first step, a user's
        ``set_requires_gradient_sync(False)`` (its backward reduces nothing), a module resharded to a smaller mesh
        after its forward, HSDP (its all-reduce is not counted). The same on every rank: they complete the same
        forwards and backwards."""
        setting = self._setting()
        alone = self._alone.get(setting)
        if alone is None:  # once for each sequence known
            known = self._known.get(setting)
            alone = self._alone[setting] = (
                _SHADOW_PARTS and known is not None and any(c.kind == "reduce_scatter" for c in known)
                and all(_issued_again(c) for c in known))
        return alone

    def begin_attempt(self) -> None:
        self.own.watch()
        self._issued.clear()
        self._marks.clear()
        self._news.clear()
        self.heard = self.more = None
        known = self._known.get(self._setting())  # the smallest reduce-scatter carries, on every rank alike
        scatters = [(c.output_numel, index) for index, c in enumerate(known or ()) if c.kind == "reduce_scatter"]
        self._carrier = min(scatters)[1] if scatters else None

    def say(self, news: bool) -> None:
        """Whether this rank's next backward tells the others it has news (until said otherwise)."""
        self._saying = news

    def say_more(self, more: bool) -> None:
        """Whether this rank's batch has parts left after the one whose backward comes next (every rank reads
        whether any had, :attr:`more`, after that backward)."""
        self._more_after = more

    @property
    def settled(self) -> bool:
        """Whether the other ranks can be carried through the forward and backward this rank's attempt failed in: a
        complete one is known with the modules set as now, began as this attempt's did, and has a reduce-scatter left
        (the mark's carrier)."""
        known, issued = self._known.get(self._setting()), self._issued
        return (known is not None and len(issued) < len(known)
                and all(a.same_as(b) for a, b in zip(issued, known))
                and any(c.kind == "reduce_scatter" for c in known[len(issued):]))

    def shadow(self) -> None:
        """On the rank that ran out of memory (its attempt released): FSDP2 put back as between iterations, then —
        where :attr:`settled` — the rest of the known sequence issued with zeros, each reduce-scatter marked, so that
        every rank's backward completes."""
        self._replayed = False
        try:
            settled = self.settled
            start = len(self._issued)
            known = self._known.get(self._setting(), [])[start:]
            modules = self._fsdp_modules()
            for module in modules:
                if module._get_fsdp_state()._is_root:  # a root that never ran (``None``) has nothing to reset
                    module.reset_iter_state()
            for module in modules:
                _drop_unreduced_gradients(module)
            if settled:
                self._shadowing = True
                for index, collective in enumerate(known, start):  # one at a time: all at once may not fit
                    _issue_zeros(collective, carried=index == self._carrier)  # the carrier as the others issue it
                self._replayed = True
        finally:
            self._shadowing = False
            self.begin_attempt()

    def shadow_part(self) -> None:
        """On a rank whose parts of the batch have all run while another rank's have not (:attr:`more`): the
        collectives of one more forward and backward, in the known sequence's order, each issued by FSDP2's own
        functions for the module that issued it — the all-gathers with this rank's parameter shards (the others
        compute with them), the reduce-scatters of zero gradients, whose outputs, this rank's shard of the others'
        gradients, FSDP2 adds to the sharded gradients as after any backward. Counted and carried as a backward's
        (this rank's news, no part left): :meth:`peer_failed` reads it next, and an OOM in it is shadowed from where
        it stopped (:meth:`shadow`). Only where :attr:`splits_alone`."""
        for collective in self._known.get(self._setting(), []):  # one at a time: all at once may not fit
            group = collective.module()._get_fsdp_state()._fsdp_param_groups[0]
            stream = group.device_handle.current_stream()  # all on one stream: each buffer is let go after its use
            if collective.kind == "all_gather":
                foreach_all_gather(group.fsdp_params, collective.group, False, stream, stream, group.device,
                                   group._all_gather_comm)
            else:
                params = _reduced(group)
                foreach_reduce(params, [param.unsharded_zero_grad_data for param in params], collective.group,
                               stream, group._reduce_scatter_comm, group._orig_dtype, group._reduce_dtype,
                               group.device, group.gradient_divide_factor, None, stream, group.all_reduce_grads, None,
                               None, group.force_sum_reduction_for_comms)

    def reset(self) -> None:
        """On a rank whose backward completed, when another rank's failed: FSDP2 finished its iteration as usual;
        the attempt's gradients (marked) are freed by the attempt loop's release before the batch runs again."""
        self.begin_attempt()

    def peer_failed(self) -> bool:
        """After a backward: whether a reduce-scatter came back marked by a rank that ran out of memory (a genuine
        NaN gradient reads the same; the agreement then finds no OOM and nothing changes). A backward that completed
        here makes its sequence the known one."""
        issued, marks, news = self._issued, self._marks, self._news
        if issued:
            setting = self._setting()
            known = self._known.get(setting)
            if known is None or len(known) != len(issued) or not all(map(_Collective.same_as, issued, known)):
                self._known[setting] = list(issued)
                self._alone.pop(setting, None)
            issued.clear()
        self.more = None
        if not marks:
            return False
        values = torch.cat(marks + news).tolist()  # one read (the backward's end waited on its reduce-scatters)
        marked, carried = values[:len(marks)], values[len(marks):]
        self.heard = any(value > 0 for value in carried[0::_CARRIED]) if carried else None
        self.more = any(value > 0 for value in carried[1::_CARRIED]) if carried else None
        marks.clear()
        news.clear()
        return any(math.isnan(value) for value in marked)

    def agree(self, numbers: list[int]) -> list[int]:
        """The element-wise maximum of ``numbers`` over the ranks, in one collective that waits at most the timeout;
        on a rank whose :meth:`shadow` could not carry the others, its own numbers (the others are inside FSDP2's
        collectives: a collective of another kind would meet theirs), marked not to run again.

        Raises:
            RuntimeError: a rank did not answer within the timeout.
        """
        if self._shadowed_alone():
            return numbers[:4] + [1] + numbers[5:]
        tensor = numbers_for_collective(numbers, self._device if dist.get_backend() == "nccl" else "cpu")
        with uncounted():
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
        work.wait(self.timeout)
        return [int(v) for v in tensor.tolist()]

    def _shadowed_alone(self) -> bool:
        replayed, self._replayed = self._replayed, None
        return replayed is False  # None: no shadow since the last agreement (a rank that found a mark)

    def _carries(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor) -> bool:
        """Whether the reduce-scatter just recorded is the one that carries the news element (not while shadowing:
        the marks carry what matters then)."""
        index = len(self._issued) - 1
        if self._shadowing or index != self._carrier or not output_tensor.numel():
            return False
        known = self._known.get(self._setting())
        return known is not None and index < len(known) and self._issued[index].same_as(known[index])

    def _record(self, collective: _Collective) -> None:
        if self._shadowing:
            return
        issued = self._issued
        if len(issued) >= self._cap:  # no guard reads them any more (it ended): what it would read is let go
            issued.clear()
            self._marks.clear()
            self._known.clear()
            self._alone.clear()
        issued.append(collective)

    @property
    def _cap(self) -> int:
        return max(4096, 4 * max(map(len, self._known.values()), default=0))


class _RecordedAllGather(DefaultAllGather):
    """FSDP2's own all-gather of ``module``'s parameters, counted."""

    def __init__(self, recovery: FSDPRecovery, module: nn.Module) -> None:
        super().__init__()
        self._recovery = weakref.ref(recovery)
        self._module = weakref.ref(module)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        recovery = self._recovery()
        if recovery is not None:
            recovery._record(_Collective("all_gather", output_tensor.numel(), input_tensor.numel(),
                                         input_tensor.dtype, input_tensor.device, group, None, self._module))
        with uncounted():
            return super().__call__(output_tensor, input_tensor, group, async_op)


class _RecordedReduceScatter(DefaultReduceScatter):
    """FSDP2's own reduce-scatter of ``module``'s gradients, counted, its output's first element kept for
    :meth:`FSDPRecovery.peer_failed`."""

    def __init__(self, recovery: FSDPRecovery, module: nn.Module) -> None:
        super().__init__()
        self._recovery = weakref.ref(recovery)
        self._module = weakref.ref(module)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        recovery = self._recovery()
        if recovery is not None:
            recovery._record(_Collective("reduce_scatter", output_tensor.numel(), input_tensor.numel(),
                                         input_tensor.dtype, input_tensor.device, group, op, self._module))
            if recovery._carries(output_tensor, input_tensor):
                return self._carry(recovery, output_tensor, input_tensor, group, op, async_op)
        with uncounted():
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        if recovery is not None and not recovery._shadowing:
            # a copy, made on the reduce-scatter's stream after it and read after the backward (FSDP2's root waits on
            # every reduce-scatter at the backward's end): a view would keep the whole reduced buffer alive for as
            # long as the mark is held (after the guard ends, until the list's cap)
            recovery._marks.append(output_tensor[:1].clone())
        return work


    def _carry(self, recovery: FSDPRecovery, output_tensor, input_tensor, group, op, async_op):
        """The reduce-scatter with the two flags after each rank's chunk (news, parts left): ``(ranks, n)`` reduced as
        ``(ranks, n + 2)``, each rank's ``n`` gradients copied back out, element for element as they would have
        come."""
        n = output_tensor.numel()
        chunks = input_tensor.view(-1, n)
        carried = handed_to_workers(torch.empty(chunks.shape[0], n + _CARRIED, dtype=chunks.dtype,
                                                device=chunks.device))
        carried[:, :n] = chunks
        carried[:, n] = 1.0 if recovery._saying else 0.0
        carried[:, n + 1] = 1.0 if recovery._more_after else 0.0
        out = handed_to_workers(torch.empty(n + _CARRIED, dtype=output_tensor.dtype, device=output_tensor.device))
        with uncounted():
            work = super().__call__(out, carried.view(-1), group, op, async_op)
        if work is not None:  # asked to run asynchronously (FSDP2 itself does not): the copies must wait for it
            work.wait()
        output_tensor.copy_(out[:n])
        recovery._marks.append(out[:1].clone())
        recovery._news.append(out[n:].clone())  # both flags
        return None


def _issue_zeros(collective: _Collective, carried: bool = False) -> None:
    """``collective`` with zeros in place of the gradients or parameters; a reduce-scatter's chunk for each rank
    starts with a NaN (every rank's output then does). ``carried``: the reduce-scatter that carries the two flags, two
    more elements in each chunk (the others issue it so), here 1 (the rank that ran out has news) and 0 (no part
    left)."""
    extra = _CARRIED if carried and collective.kind == "reduce_scatter" else 0
    n = collective.output_numel + extra
    output = handed_to_workers(torch.zeros(n, dtype=collective.dtype, device=collective.device))
    inputs = handed_to_workers(torch.zeros(
        collective.input_numel // collective.output_numel * n if extra else collective.input_numel,
        dtype=collective.dtype, device=collective.device))
    with uncounted():
        if collective.kind == "all_gather":
            dist.all_gather_into_tensor(output, inputs, group=collective.group)
        else:
            inputs[::n].fill_(float("nan"))  # the start of each rank's chunk
            if extra:
                inputs[n - _CARRIED::n].fill_(1.0)
            dist.reduce_scatter_tensor(output, inputs, op=collective.op, group=collective.group)


def _reduced(group: Any) -> list:
    """The parameters of an FSDP2 parameter group whose gradients a shadow part reduces: those that take one."""
    return [param for param in group.fsdp_params
            if hasattr(param, "_unsharded_param") and param.sharded_param.requires_grad]


def _issued_again(collective: _Collective) -> bool:
    """Whether :meth:`FSDPRecovery.shadow_part` issues ``collective`` again as its module's FSDP2 did: a live module
    with one parameter group, plain FSDP (not HSDP, no all-reduce hook of the user's), its parameters sharded on
    their first dimension; an all-gather over the group's own shard group (not the smaller mesh of a reshard after
    forward), a reduce-scatter of every parameter that takes a gradient (no parameter left unused by the backward)."""
    module = collective.module() if collective.module is not None else None
    if module is None:
        return False
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) != 1:
        return False
    group = groups[0]
    if group._is_hsdp or group._all_reduce_hook is not None or any(
            param.fsdp_placement.dim != 0 or param.is_dtensor for param in group.fsdp_params):
        return False
    if collective.kind == "all_gather":
        return collective.group is group.mesh_info.shard_process_group
    size = collective.group.size()
    reduced = sum(math.ceil(param._orig_size[0] / size) * size * math.prod(param._orig_size[1:])
                  for param in _reduced(group))
    return collective.group is group._reduce_scatter_process_group and reduced == collective.input_numel


def _drop_unreduced_gradients(module: nn.Module) -> None:
    """Frees the gradients the failed backward computed for ``module``'s gathered parameters but had not reduced yet
    (its reduce-scatter comes once all of them are computed): left there, the retried backward would add to them.
    ``reset_iter_state`` reshards the parameters but keeps these."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            fsdp_param.unsharded_accumulated_grad = None
            if hasattr(fsdp_param, "_unsharded_param"):
                fsdp_param._unsharded_param.grad = None


def holds_fsdp2(module: Any) -> bool:
    """Whether ``module`` is, or holds, a module sharded with FSDP2 (``fully_shard``)."""
    return bool(fsdp2_modules(module))


def _taken(named: list[tuple[str, nn.Module]]) -> Optional[str]:
    """Why FSDP2's collectives cannot be counted in these modules, by name (``None``: they can)."""
    for name, module in named:
        where = f"module {name!r}" if name else "the root module"
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            return f"{where} has {len(groups)} parameter groups"
        for group in groups:
            for comm in (group._all_gather_comm, group._reduce_scatter_comm):
                if type(comm) not in (DefaultAllGather, DefaultReduceScatter, _RecordedAllGather,
                                      _RecordedReduceScatter):
                    return f"{where} already has its own collective ({type(comm).__name__})"
    return None


#: the recovery of each trained module (FSDP2's collectives are counted once)
_INSTALLED: "weakref.WeakKeyDictionary[nn.Module, FSDPRecovery]" = weakref.WeakKeyDictionary()
