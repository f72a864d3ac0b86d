"""How Lightning's evaluation loops run a batch under MemGuard: ``validation_step``, ``test_step`` and ``predict_step``
measured, and run again in parts after an out-of-memory error, with the metrics a failed attempt logged put back.

Lightning calls these steps through the strategy, which looks them up on the module instance (also under DDP, whose
forward redirection calls ``getattr(module, "validation_step")``). So for the length of a loop the step is wrapped on
the instance — never on the class — and unwrapped when the loop ends, fails or the trainer tears down: a checkpoint
or a pickled module never holds the wrapper.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional


from ..base.batches import batch_size_of
from ..base.metric_states import has_metric_state, metric_modules, save_list_lengths, save_metrics
from ..base.wrapping import unwrap_method, wrap_method
from ..guard.engine import MemGuardEngine
from .logged_steps import SplitLogs

__all__ = ["EvaluationSteps", "attach_batch", "savepoint"]

#: each evaluation loop's step method
STEP_METHODS: dict[str, str] = {"validation": "validation_step", "test": "test_step", "predict": "predict_step"}
KIND = "evaluation"  # the kind of wrapper on a step method (base/wrapping.py)


class EvaluationSteps:
    """Wraps the step method of one evaluation loop at a time on a LightningModule instance.

    Args:
        engine: the guard's engine (:meth:`~lightning_memguard.guard.engine.MemGuardEngine.evaluation_batch` runs
            each batch).
    """

    def __init__(self, engine: MemGuardEngine) -> None:
        self.engine = engine
        self._wrapped: dict[str, Any] = {}  # phase -> the module whose step is wrapped

    def wrap(self, trainer: Any, module: Any, phase: str) -> None:
        """Wraps ``module``'s step of loop ``phase`` (where its class has one) for the length of the loop."""
        name = STEP_METHODS[phase]
        if phase in self._wrapped or not callable(getattr(type(module), name, None)):
            return
        if wrap_method(module, name, KIND, functools.partial(_guarded_step, self.engine, trainer, module, phase)):
            self._wrapped[phase] = module

    def unwrap(self, phase: Optional[str] = None) -> None:
        """Puts back the step of loop ``phase`` (``None``: every loop's). Idempotent."""
        for name in [phase] if phase is not None else list(self._wrapped):
            module = self._wrapped.pop(name, None)
            if module is not None:
                unwrap_method(module, STEP_METHODS[name], KIND)


def _guarded_step(engine: MemGuardEngine, trainer: Any, module: Any, phase: str, original: Callable) -> Callable:
    """``original`` (the class's step, or one Lightning compiled onto the instance) run by
    :meth:`~lightning_memguard.guard.engine.MemGuardEngine.evaluation_batch`: measured, and in parts after an OOM."""

    @functools.wraps(original)  # Lightning reads the step's signature (does it take batch_idx?)
    def step(batch: Any, *args: Any, **kwargs: Any) -> Any:
        results = getattr(trainer, "_results", None)
        size = batch_size_of(batch)
        found: list[list[Any]] = []  # the module's metrics, found where an attempt needs them (a walk of its modules)
        split: list[SplitLogs] = []  # what the parts log, made the whole batch's (once the batch runs in parts)

        def metrics() -> list[Any]:
            if not found:
                found.append(metric_modules(module))
            return found[0]

        def call(part: Any, share: float) -> Any:
            if part is batch:
                return original(part, *args, **kwargs)
            # self.log(on_epoch=True) weighs a value by the batch size Lightning reads: the part's share of the
            # whole batch's, so that its parts weigh what the batch weighs, split by what the loss averages over
            # (a part with more labelled tokens weighs more)
            attached = share * size if size else None
            attach_batch(results, part, attached)
            if not split:  # a part that fails is put back by its savepoint; the parts that ran do not run again
                split.append(SplitLogs(results, metrics(), STEP_METHODS[phase]))
            output = original(part, *args, **kwargs)
            split[0].part_done(share, attached, batch_size_of(part))
            return output

        try:
            output = engine.evaluation_batch(phase, batch, call, lambda: savepoint(results, metrics(), module))
        except BaseException:
            if split:
                split[0].abandon()
            raise
        finally:
            if split:  # the hooks after the step see the whole batch, as Lightning attached it
                attach_batch(results, batch)
        if split:
            split[0].finish()
        return output

    return step


def attach_batch(results: Any, batch: Any, batch_size: Optional[float] = None) -> None:
    """Lightning weighs an ``on_epoch`` mean by ``batch_size`` or, when ``None``, the size of the batch its results
    are attached to (a training batch's micro-batches are attached so too, by the lightning loop)."""
    if results is not None:
        results.batch = batch
        results.batch_size = batch_size


def savepoint(results: Any, metrics: list[Any], module: Any = None, connector: Any = None) -> Callable[[], None]:
    """Saves the state of every metric an attempt can update — the trainer's logged results and ``metrics``, the
    module's metric modules (:func:`~lightning_memguard.base.metric_states.metric_modules`) — and the lengths of the
    lists ``module`` holds (:func:`~lightning_memguard.base.metric_states.save_list_lengths`), and returns what puts
    them back, forgetting the keys the failed attempt logged first.

    ``connector``: the trainer's logger connector, whose hook last logged from (``_current_fx``) is put back too. In
    an epoch's first batch Lightning clears the values ``training_step`` logged in the epoch before at its first
    ``self.log`` (where that hook differs from ``training_step``): a failed attempt there cleared them, and its
    savepoint puts them back, so the batch run again must clear them again."""
    keys = set(results.keys()) if isinstance(results, dict) else None
    logged_from = getattr(connector, "_current_fx", None)
    restore_lists = save_list_lengths(module) if module is not None else None
    # Lightning's holders of logged values assign new tensors at each update: kept by reference, no copy a step
    restore_metrics = save_metrics(metrics, reassigned=_result_metrics(results))

    def restore() -> None:
        if keys is not None:
            for key in set(results.keys()) - keys:  # logged for the first time by the failed attempt
                del results[key]
        restore_metrics()
        if restore_lists is not None:
            restore_lists()
        if connector is not None and hasattr(connector, "_current_fx"):
            connector._current_fx = logged_from

    return restore


def _result_metrics(results: Any):
    if not isinstance(results, dict):
        return
    for value in results.values():
        if isinstance(value, dict):  # a dict logged with self.log_dict's nesting
            yield from _result_metrics(value)
        elif has_metric_state(value):
            yield value
