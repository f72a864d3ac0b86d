"""What a model's layers receive in a forward of a batch, seen on the meta device (framework-free): shapes only, no
FLOPs, no memory, the model never changed — for questions the batch's shapes cannot answer (which of its sizes a
layer reads as time steps: :mod:`~lightning_memguard.mitigations.sequence_layout`)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from ..base.batches import batch_tensors, map_tensors
from ..base.collection import collection_paused
from ..base.randomness import random_state_kept
from ..sources.cpu import compiled_code_runs_eagerly
from .copies import unsharded, unwrap_parallel
from .mixed import NeedsValues
from .step import StepSpec, prepare_step, run_forward

__all__ = ["first_inputs"]


@collection_paused()
def first_inputs(model: nn.Module, batch: Any, names: Iterable[str],
                 loss_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None) -> dict[str, tuple[int, ...]]:
    """The shape of the first tensor each named submodule of ``model`` received at its first call, in one forward of
    the training step (``loss_fn``, default the LightningModule's ``training_step``, as
    :func:`~lightning_memguard.estimate.estimate_memory` runs it) on ``batch``, run on a meta copy. The batch keeps
    its values, as an estimate's does (a model's questions about its inputs are answered); where a layer refuses
    them beside meta weights (torch's recurrent layers check that input and weights share a device), it runs
    again with the batch on meta too. A layer not called is missing.

    Raises:
        ValueError: the batch does not fit the training step, or the step reads a value computed from the weights
            (which the meta device has not).
    """
    inner = unwrap_parallel(model)
    # the names as the module inside a data-parallel wrapper names them ("module.rnn" -> "rnn"), and back
    prefix = next((name + "." for name, module in model.named_modules() if module is inner and name), "")
    given = {name[len(prefix):] if prefix and name.startswith(prefix) else name: name for name in names}
    spec = StepSpec(model=unsharded(inner, None)[0],  # an FSDP2-sharded model: its unsharded structure on meta
                    batch=batch, optimizer=None, precision="32-true", loss_fn=loss_fn, blocks=None,
                    checkpointed_blocks=0, device=torch.device("meta"), target="cuda")
    try:
        return {given[name]: shape for name, shape in _first_inputs(spec, list(given), batch_on_meta=False).items()}
    except (NeedsValues, ValueError) as err:
        first = err
    try:
        return {given[name]: shape for name, shape in _first_inputs(spec, list(given), batch_on_meta=True).items()}
    except Exception:
        if isinstance(first, ValueError):
            raise first from None
        raise ValueError(f"{type(model).__name__}'s training step reads a value the meta device has not: "
                         f"{first.operation}") from None


@random_state_kept()  # the forward's draws are not the training's
def _first_inputs(spec: StepSpec, names: list[str], batch_on_meta: bool) -> dict[str, tuple[int, ...]]:
    step = prepare_step(spec)
    if batch_on_meta:
        step.batch = map_tensors(lambda t: torch.empty_like(t, device="meta"), step.batch)
    layers = dict(step.work.named_modules())
    seen: dict[str, tuple[int, ...]] = {}

    def noting(name: str):
        def note(module, args, kwargs):
            tensors = batch_tensors((args, kwargs))
            if tensors and name not in seen:
                seen[name] = tuple(tensors[0].shape)
        return note

    handles = [layers[name].register_forward_pre_hook(noting(name), with_kwargs=True)
               for name in names if name in layers]
    try:
        # with the batch on meta too, nothing has a value: no mixed execution (the accountant's mode runs it)
        counting = contextlib.nullcontext() if batch_on_meta else step.accountant
        with warnings.catch_warnings(), counting, compiled_code_runs_eagerly():
            warnings.simplefilter("ignore")  # self.log without a Trainer, and the like
            run_forward(spec, step, contextlib.nullcontext(), contextlib.nullcontext())
    finally:
        for handle in handles:
            handle.remove()
    return seen
