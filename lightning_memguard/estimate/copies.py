"""The working copy an estimate steps: the model copied (to the meta device, or whole on CPU) and an optimizer like
the user's built on the copy. The user's model and optimizer are never changed."""

from __future__ import annotations

import copy
import inspect
import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ..base.optimizer_step import is_zero_redundancy, state_holder
from ..base.sharding import fsdp2_class, sharding_of

__all__ = ["OptimizerSpec", "copy_without_trainer", "device_of", "estimation_device", "is_own_copy", "make_optimizer",
           "meta_copy", "optimizer_like", "optimizer_on", "own_copy", "sharding_of", "unsharded",
           "unsharded_meta_copy", "unwrap_parallel"]

OptimizerSpec = Union[None, type, torch.optim.Optimizer, Callable[[Any], torch.optim.Optimizer]]


#: the meta copies the estimator made and keeps for later estimates (a plan's): an estimate steps such a copy itself,
#: where a model it is given is the caller's and is copied first (a copy per estimate was up to a fifth of a plan)
_OWN_COPIES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def own_copy(module: nn.Module) -> nn.Module:
    """``module``, a meta copy the estimator made, marked as its own: estimates step it without copying it again."""
    _OWN_COPIES.add(module)
    return module


def is_own_copy(module: nn.Module) -> bool:
    """Whether ``module`` is a copy marked by :func:`own_copy`."""
    return module in _OWN_COPIES


def device_of(model: nn.Module) -> torch.device:
    """Where the model's parameters are (CPU for a model without any)."""
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def estimation_device(model: nn.Module) -> torch.device:
    """Where a CPU-target estimate runs: the model's device, which must be CPU or meta."""
    device = device_of(model)
    if device.type not in ("cpu", "meta"):
        raise ValueError(f"the model is on {device}; estimate a copy on CPU or one built on the meta device "
                         "(with torch.device('meta'): model = ...)")
    return device


def unwrap_parallel(model: nn.Module) -> nn.Module:
    """The module inside torch's data-parallel wrappers: a copy of a ``DistributedDataParallel`` would run its
    collectives (buffer broadcasts, gradient all-reduces) in the estimate, on one rank only."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


#: A plain tensor a module holds (not a parameter or buffer) of at least this many bytes — a dataset, cached
#: batches — is shared with the copy rather than copied: a step reads such tensors, and every estimate would copy them
#: again (a plan makes up to six). Smaller ones (a step counter a forward may bump in place) are copied.
SHARED_TENSOR_BYTES = 1 << 20


def copy_without_trainer(model: nn.Module) -> nn.Module:
    """A deep copy of ``model``, not of the Trainer a LightningModule is attached to (which it would drag along), nor
    of the large plain tensors its modules hold (:data:`SHARED_TENSOR_BYTES`)."""
    memo = {id(getattr(model, "_trainer")): None} if getattr(model, "_trainer", None) is not None else {}
    return _view_trainer(copy.deepcopy(model, _share_large_tensors(model, memo)), model)


class TrainerView:
    """What an estimate's copy of a LightningModule reads as ``self.trainer``: the Trainer its original is attached
    to, read only — a write is dropped (the estimate must not stop the fit, nor change it), and a copy of the view is
    the view (never a copy of the Trainer). The copy's ``_trainer`` stays ``None``, so its ``self.log``, and the
    stand-ins for what it asks the Trainer to do (its optimizers, ``manual_backward``, ``self.all_gather``), take it as
    Trainer-less. Without it, ``configure_optimizers`` sizing a schedule by ``self.trainer.estimated_stepping_batches``
    or a step reading ``self.trainer.current_epoch`` raised "not attached to a Trainer": no estimate, no plan."""

    def __init__(self, trainer: Any) -> None:
        object.__setattr__(self, "_viewed", trainer)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_viewed"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        return None

    def __deepcopy__(self, memo: dict) -> "TrainerView":
        return self


#: a LightningModule class -> its subclass whose ``trainer`` is the instance's :class:`TrainerView`
_VIEWING: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def _view_trainer(copy_: nn.Module, original: nn.Module) -> nn.Module:
    """``copy_``, reading the Trainer of ``original`` (or the view ``original`` reads, a copy's) as ``self.trainer``
    (:class:`TrainerView`), where the class has such a property: its class becomes a subclass of its own of the same
    name whose ``trainer`` is the view."""
    trainer = original.__dict__.get("_trainer_view") or getattr(original, "_trainer", None)
    cls = type(copy_)
    if trainer is None or not isinstance(getattr(cls, "trainer", None), property):
        return copy_
    if not cls.__dict__.get("_views_trainer", False):
        viewing = _VIEWING.get(cls)
        if viewing is None:
            viewing = _VIEWING[cls] = type(cls.__name__, (cls,), {
                "trainer": property(lambda self: self.__dict__["_trainer_view"]), "_views_trainer": True,
                "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        copy_.__class__ = viewing
    copy_.__dict__["_trainer_view"] = trainer if isinstance(trainer, TrainerView) else TrainerView(trainer)
    return copy_


def _share_large_tensors(model: nn.Module, memo: dict) -> dict:
    """``memo`` with each large plain tensor the modules of ``model`` hold as attributes (directly, or in lists,
    tuples and dicts) mapped to itself, where the memo does not already map it."""
    def walk(value: Any, depth: int):
        if isinstance(value, torch.Tensor):
            yield value
        elif depth and isinstance(value, (list, tuple)):
            for item in value:
                yield from walk(item, depth - 1)
        elif depth and isinstance(value, dict):
            for item in value.values():
                yield from walk(item, depth - 1)

    for module in model.modules():
        for name, value in vars(module).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            for tensor in walk(value, 4):
                if type(tensor) is torch.Tensor and id(tensor) not in memo \
                        and tensor.untyped_storage().nbytes() >= SHARED_TENSOR_BYTES:
                    memo[id(tensor)] = tensor
    return memo


def make_optimizer(model: nn.Module, optimizer: OptimizerSpec,
                   original: nn.Module) -> Optional[torch.optim.Optimizer]:
    """The optimizer the estimate steps on ``model`` (a copy of ``original``): built from ``optimizer`` as
    :func:`~lightning_memguard.estimate.estimate_memory` takes it, or the LightningModule's
    ``configure_optimizers``; ``None`` without either. Of a ``ZeroRedundancyOptimizer``, the local optimizer of this
    rank's partition."""
    if optimizer is None:
        configure = getattr(model, "configure_optimizers", None)
        if configure is None:
            return None
        configured = configure()
        while not isinstance(configured, torch.optim.Optimizer):  # dict, list or tuple forms
            if isinstance(configured, dict):
                configured = configured["optimizer"]
            elif isinstance(configured, (list, tuple)) and configured:
                configured = configured[0]
            else:
                raise ValueError(f"cannot find an optimizer in configure_optimizers() -> {configured!r}")
        if not is_zero_redundancy(configured):
            return configured
        return _local_partition(state_holder(configured),
                                [p for group in configured.param_groups for p in group["params"]])
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer_like(optimizer, original, model)
    return optimizer(model.parameters())


def optimizer_like(optimizer: torch.optim.Optimizer, original: nn.Module, copy_: nn.Module) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class and per-group hyperparameters as ``optimizer`` (built on ``original``'s
    parameters), on the matching parameters of ``copy_``. The given optimizer and its state are not touched."""
    return optimizer_on(optimizer, original, list(copy_.parameters()))


def optimizer_on(optimizer: torch.optim.Optimizer, original: nn.Module,
                 parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    """:func:`optimizer_like` on ``parameters``, which match ``original.parameters()`` one for one (a copy's). Of a
    ``ZeroRedundancyOptimizer``, its local optimizer is built, on this rank's partition alone: the state this rank
    keeps."""
    wrapper, optimizer = optimizer, state_holder(optimizer)
    counterpart = {id(p): q for p, q in zip(original.parameters(), parameters)}
    groups = []
    for group in optimizer.param_groups:
        if any(id(p) not in counterpart for p in group["params"]):
            raise ValueError(f"optimizer={type(optimizer).__name__}(...) holds parameters that are not the model's; "
                             "build it on model.parameters(), or pass its class")
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [counterpart[id(p)] for p in group["params"]]})
    # the groups carry every hyperparameter; the defaults go only where the constructor takes them (AdamW keeps a
    # default its constructor does not accept)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    like = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    if not is_zero_redundancy(wrapper):
        return like
    return _local_partition(like, [counterpart[id(p)] for group in wrapper.param_groups for p in group["params"]
                                   if id(p) in counterpart])


def _local_partition(optimizer: torch.optim.Optimizer, every: list[nn.Parameter]) -> torch.optim.Optimizer:
    """A ``ZeroRedundancyOptimizer``'s step as the estimate runs it: ``optimizer`` (its local optimizer, or a like one)
    updates this rank's partition and keeps its state — the wrapper's broadcast of the other ranks' shards, in place,
    adds no memory and would issue collectives from inside the estimate — while its ``zero_grad`` empties the
    gradients of ``every`` parameter the wrapper was given, as the wrapper's does (the local optimizer's own would
    leave the other partitions' gradients alive)."""
    def zero_grad(set_to_none: bool = True) -> None:
        for param in every:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    optimizer.zero_grad = zero_grad  # this instance only: it is the estimate's own
    return optimizer


def unsharded(model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any, Optional[tuple[str, int]]]:
    """For an FSDP2-sharded ``model``: its :func:`unsharded_meta_copy`, the optimizer as a factory of a like one
    on the copy's parameters (an instance holds the sharded ones), and ``(strategy, ranks)``; any other model and
    optimizer come back as they are, with ``None``."""
    sharding = sharding_of(model)
    if sharding is None:
        return model, optimizer, None
    if isinstance(optimizer, torch.optim.Optimizer):
        given, sharded = optimizer, model
        optimizer = lambda params: optimizer_on(given, sharded, list(params))  # noqa: E731
    return unsharded_meta_copy(model), optimizer, sharding


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy whose parameters and floating-point buffers live on the meta device: no memory, no copy of the
    weights, and not the Trainer a LightningModule is attached to. Integer and boolean buffers (position ids, causal
    masks, BatchNorm's batch counter) are copied to the CPU with their values, which a model may read; large plain
    tensors the modules hold are shared (:data:`SHARED_TENSOR_BYTES`)."""
    memo: dict = {}
    if getattr(module, "_trainer", None) is not None:
        memo[id(module._trainer)] = None
    for param in module.parameters():
        memo[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
    for buffer in module.buffers():
        real = not (buffer.is_floating_point() or buffer.is_complex() or buffer.is_meta)
        memo[id(buffer)] = buffer.to("cpu", copy=True) if real else torch.empty_like(buffer, device="meta")
    return _view_trainer(copy.deepcopy(module, _share_large_tensors(module, memo)), module)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


_FSDP_MARKERS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def unsharded_meta_copy(module: nn.Module) -> nn.Module:
    """The unsharded structure of an FSDP2-sharded ``module`` on the meta device: each module rebuilt as its own
    class (not FSDP's subclass, which refuses ``deepcopy``), parameters at their full shapes on meta, buffers as
    :func:`meta_copy` makes them, and no hooks (FSDP's gather and reshard are hooks; the user's go too). Other
    attributes are deep copies, as :func:`meta_copy` makes them (not the Trainer, nor large plain tensors), so that
    what the estimate's step does to them (a list it appends to, a metric's states) stays in the copy; one that cannot
    be copied is shared. Never touches the sharded module or its process group."""
    fsdp_module = fsdp2_class()
    memo: dict = {}
    if getattr(module, "_trainer", None) is not None:
        memo[id(module._trainer)] = None
    _share_large_tensors(module, memo)

    def meta_parameter(p: nn.Parameter) -> nn.Parameter:
        if id(p) not in memo:  # a parameter two modules share stays one parameter
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
        return memo[id(p)]

    def copied(value):
        try:
            return copy.deepcopy(value, memo)
        except Exception:  # an object that refuses to be copied (a lock, a handle): shared, as it was
            return value

    def rebuild(sub: nn.Module) -> nn.Module:
        if id(sub) in memo:
            return memo[id(sub)]
        cls = type(sub)
        if fsdp_module is not None and isinstance(sub, fsdp_module):
            cls = next(c for c in cls.__mro__ if not issubclass(c, fsdp_module))
        copy_ = memo[id(sub)] = cls.__new__(cls)
        # FSDP's state lives under the composable API's keys; its markers are for dynamo
        state = {key: value for key, value in sub.__dict__.items()
                 if not key.startswith("__composable_api_state_key") and key not in _FSDP_MARKERS}
        for name in _HOOK_DICTS:
            if name in state:
                state[name] = OrderedDict()
        state["_parameters"] = {name: None if p is None else meta_parameter(p) for name, p in sub._parameters.items()}
        state["_buffers"] = {
            name: None if b is None else (b.to("cpu", copy=True) if not (b.is_floating_point() or b.is_complex())
                                          else torch.empty(b.shape, dtype=b.dtype, device="meta"))
            for name, b in sub._buffers.items()}
        for name, b in sub._buffers.items():
            if b is not None:
                memo[id(b)] = state["_buffers"][name]
        state["_modules"] = {name: None if child is None else rebuild(child) for name, child in sub._modules.items()}
        kept = {"_parameters", "_buffers", "_modules", *_HOOK_DICTS}
        state.update({key: copied(value) for key, value in state.items() if key not in kept})
        copy_.__dict__.update(state)
        return copy_

    return _view_trainer(rebuild(module), module)
