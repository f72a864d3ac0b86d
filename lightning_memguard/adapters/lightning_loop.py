"""How Lightning runs a batch, under MemGuard: split into micro-batches when the micro-batch rung asks, retried after
an out-of-memory error in forward or backward, and an optimizer step that runs out of memory explained (and retried
where that is provably safe).

Lightning runs ``training_step``, ``zero_grad`` and ``backward`` of one batch inside a closure object that the
automatic-optimization loop builds per batch (and that the optimizer calls from ``optimizer.step``). Wrapping that
closure is the one place where a retry covers forward *and* backward before the optimizer has touched anything, and
where one batch can run as several micro-batches inside one optimizer step.

Under manual optimization the training step runs forward, backward and its optimizers itself: the manual loop's
``advance`` runs through the same attempt loop, so that a rung that broke the step is put back and the batch runs
again (an OOM is not run again, nor a step after an optimizer stepped or whose backward added to older gradients).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ..base.batches import batch_size_of
from ..base.buffers import RunningBuffers
from ..base.fetched_batches import ReplayedFetches
from ..base.metric_states import metric_modules
from ..base.outputs import combine_outputs
from ..base.wrapping import unwrap_method, wrap_method
from ..guard.attempts import BatchState
from ..guard.oom import step_optimizer
from ._lightning_trainer import namespace_of
from .lightning_eval import attach_batch, savepoint
from .lightning_step_copy import training_step_of_copy
from .logged_steps import EpochsFirstLog, SplitLogs
from .logged_sync import LoggedSync, collectives_in_source

if TYPE_CHECKING:
    from ..guard.engine import MemGuardEngine

__all__ = ["BatchRunner"]

KIND = "batch_runner"  # the kind of wrapper on the loop's _make_closure and on optimizer.step (base/wrapping.py)


class BatchRunner:
    """Wraps the closures and optimizer steps of Lightning's automatic-optimization loop.

    Args:
        engine: the guard's engine: its attempt loop runs each batch
            (:meth:`~lightning_memguard.guard.engine.MemGuardEngine.train_batch`), its
            :meth:`~lightning_memguard.guard.engine.MemGuardEngine.split_batch` says the parts to run a batch as,
            and an ``optimizer.step`` that runs out of memory goes to its
            :meth:`~lightning_memguard.guard.attempts.Attempts.on_optimizer_oom` (retried once with
            ``foreach=False`` where no parameter or state was touched yet, else the report).
    """

    def __init__(self, engine: "MemGuardEngine") -> None:
        self.engine = engine
        self._loop = None
        self._manual = None  # the manual-optimization loop whose advance is wrapped
        self._module: Optional[weakref.ref] = None  # that loop's module, weakly (None between fits: pickled)
        self._state = BatchState()
        self._steps_done = 0
        self._logged: Optional[LoggedSync] = None  # with several processes: whether the step logs with sync_dist
        self._steps: list[OptimizerStep] = []  # the guarded steps of this fit's optimizers (each its optimizer's)
        self._metrics: list = []  # the module's metric modules

    # --- installing -------------------------------------------------------------------------------------------------
    def install(self, trainer, buffers: Optional[RunningBuffers] = None) -> bool:
        """Hooks into the loop. Returns False (no closures or optimizer steps guarded) under manual optimization,
        whose steps run through :meth:`_guarded_advance`. ``buffers``: the model's running buffers, put back after a
        failed attempt."""
        # what the training step logs and its metric modules count each batch once, also where it ran again
        # (and what it appended to its module's lists)
        module = trainer.lightning_module
        metrics = self._metrics = metric_modules(module)

        def saved() -> Callable[[], None]:
            return savepoint(getattr(trainer, "_results", None), metrics, module,
                             getattr(trainer, "_logger_connector", None))

        optimizes_itself = not module.automatic_optimization
        self._state = BatchState(buffers, partial(_with_requires_grad_kept, saved, module) if optimizes_itself
                                 else saved)
        if optimizes_itself:
            self._module = weakref.ref(module)
            manual = trainer.fit_loop.epoch_loop.manual_optimization
            wrap_method(manual, "advance", KIND, self._guarded_advance)
            self._manual = manual
            return False
        self._steps_done = 0
        # with several processes a rank must not run a batch, or a part, alone where the step has collectives of its
        # own; read after each batch (a length), and for the first from the source
        self._logged = LoggedSync(trainer) if trainer.world_size > 1 else None
        if self._logged is not None:  # the first batch's answer, from the hooks' source (nothing logged yet)
            self.engine.ranks.logged_collectives = self._logged.found
            # until a step has run and the recovery counted them
            self.engine.ranks.source_collectives = collectives_in_source(trainer.lightning_module)
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        # once: a second fit reuses the loop (and uninstall takes the wrapper away after each)
        wrap_method(loop, "_make_closure", KIND, partial(self._guarded_make_closure, loop, trainer))
        self._loop = loop
        for optimizer in trainer.optimizers:
            self._guard_optimizer(optimizer)
        return True

    def _guarded_make_closure(self, loop, trainer, make_closure: Callable) -> Callable:
        """The loop's ``_make_closure``, whose closures run their batch through :meth:`_run` (retried, in parts)."""

        def make_guarded_closure(kwargs, optimizer, batch_idx):
            kwargs, fetches = _with_fetches_replayed(kwargs)
            closure = make_closure(kwargs, optimizer, batch_idx)
            # A weak reference: a strong one (or the bound method) from the closure's own attribute would make a
            # reference cycle that keeps the step's loss and outputs alive until the garbage collector runs.
            closure_ref = weakref.ref(closure)
            first_micro_batch = closure._zero_grad_fn is not None

            def guarded(*args, **kw):
                return self._run(lambda: self._run_batch(closure_ref(), loop, kwargs, trainer, fetches),
                                 first_micro_batch, optimizer)

            closure.closure = guarded
            return closure

        return make_guarded_closure

    def trials_ended(self) -> None:
        """A learning-rate search's trial steps ended with its checkpoint restored (the optimizer state as before
        them): the next step is the first again for the optimizer-step retry (a step before a fit creates the state,
        and a retry checks that nothing was updated either way)."""
        self._steps_done = 0

    def uninstall(self) -> None:
        if self._loop is not None:
            unwrap_method(self._loop, "_make_closure", KIND)
            self._loop = None
        if self._manual is not None:
            unwrap_method(self._manual, "advance", KIND)
            self._manual = self._module = None
        for step in self._steps:
            unwrap_method(step.__self__, "step", KIND)  # an LR scheduler's wrapper, say, was there before: it is back
            step.active = False  # one a scheduler built during the fit wraps stays under it, passing calls through
        self._steps = []

    def mark_backward(self) -> None:
        """Called from ``on_before_backward``: an OOM from here on happened in backward. Under manual optimization,
        where the batch may run again, whether the gradients the backward adds to can be emptied again."""
        state = self._state
        state.in_backward = True
        module = self._module() if self._module is not None else None
        if module is not None and state.may_run_again:
            state.backward_begins(module.parameters())

    def mark_stepped(self) -> None:
        """Called from ``on_before_optimizer_step``: under manual optimization an optimizer steps inside the attempt,
        which then cannot run again."""
        self._state.stepped = True

    # --- manual optimization ----------------------------------------------------------------------------------------
    def _guarded_advance(self, advance: Callable) -> Callable:
        """The manual loop's ``advance`` (the training step, run by the module itself) through the engine's attempt
        loop: an error of the first step after rungs changed (an op the AMP rung's autocast cannot run, a checkpointed
        block that fails in the forward or its recomputation in the backward, your rung's ``apply``) puts them back
        and runs the batch again, with the parameters' ``requires_grad`` as they were (``toggle_optimizer`` froze the
        other optimizers' parameters). Not where an optimizer stepped, nor where a backward began on a gradient from
        before the step (one the module sums over batches): copying the gradients to undo that would cost their
        memory in the very step the rungs changed for. Gradients the step's backwards began without are emptied."""

        def guarded(kwargs):
            kwargs, fetches = _with_fetches_replayed(kwargs)

            def attempt():
                if fetches is None:
                    return advance(kwargs)
                fetches.rewind()  # a step run again meets the batches it fetched before
                try:
                    return advance(kwargs)
                except Exception:
                    self._note_fetched(fetches)
                    raise

            return self.engine.train_batch(attempt, self._state, first_micro_batch=False, release=lambda: None)

        return guarded

    # --- forward and backward ---------------------------------------------------------------------------------------
    def _run_batch(self, closure, loop, kwargs: OrderedDict, trainer, fetches: Optional[ReplayedFetches]):
        run_closure = type(closure).closure
        if fetches is not None:  # the step fetches its own batches: run whole (no micro-batch rung), as it fetched
            self.engine.split_batch(None)  # the attempt begins
            fetches.rewind()
            try:
                return run_closure(closure)
            except Exception:
                self._note_fetched(fetches)
                raise
        chunks = self.engine.split_batch(kwargs["batch"])
        if len(chunks) <= 1:
            return run_closure(closure)
        ns = namespace_of(trainer)
        results, size = getattr(trainer, "_results", None), batch_size_of(kwargs["batch"])
        weights = sum(weight for _, weight in chunks) or 1.0  # "sum" weighs every part 1: what each holds is a share
        step_fn, zero_grad_fn = closure._step_fn, closure._zero_grad_fn
        total = None
        extras: list[tuple[dict, int, float]] = []  # what each part that returned a loss returned beside it
        # what the step logs on_step: each part logs it, the whole batch's value goes where Lightning reads it
        logs = SplitLogs(results, self._metrics)
        first_log = EpochsFirstLog(trainer)
        try:
            for i, (chunk, weight) in enumerate(chunks):
                micro_kwargs = OrderedDict(kwargs)
                micro_kwargs["batch"] = chunk
                last = i == len(chunks) - 1
                closure._step_fn = partial(_scaled_step, partial(first_log.step, loop._training_step, micro_kwargs),
                                           weight, self.engine.last_part_loss if last else None)
                closure._zero_grad_fn = zero_grad_fn if i == 0 else None  # zero once, then accumulate
                # self.log(on_epoch=True) weighs a value by the batch size Lightning reads, else the whole batch's for
                # every part (a split step would weigh k batches): the part's share of it, by what the loss averages
                attached = weight / weights * size if size else None
                attach_batch(results, chunk, attached)
                # gradients are synchronised across processes once, with the last micro-batch's backward
                with ns.block_parallel_sync_behavior(trainer.strategy, block=not last):
                    result = run_closure(closure)
                self._state.partial_gradients = True  # this micro-batch's gradients are in the sum now
                self._state.parts_done += 1
                logs.part_done(weight / weights, attached, batch_size_of(chunk))
                if result.loss is not None:
                    total = result.loss if total is None else total + result.loss
                    extras.append((result.extra, batch_size_of(chunk) or 1, weight))
        except BaseException:
            logs.abandon()
            raise
        finally:
            closure._step_fn, closure._zero_grad_fn = step_fn, zero_grad_fn
            attach_batch(results, kwargs["batch"])  # the hooks after the step see the whole batch, as Lightning has it
        logs.finish()
        return ns.ClosureResult(total, extra=_combined_extras(extras))

    def _note_fetched(self, fetches: ReplayedFetches) -> None:
        """After a failed attempt of a step that fetches its own batches: what it fetched, for the rescue's
        prediction where no batch was seen yet
        (:meth:`~lightning_memguard.guard.engine.MemGuardEngine.batch_fetched`)."""
        if fetches.fetched:
            self.engine.batch_fetched(_fetched_batch(fetches.fetched[0]), training_step_of_copy)

    def _run(self, attempt_batch: Callable[[], Any], first_micro_batch: bool, optimizer) -> Any:
        def release() -> None:
            if first_micro_batch:
                # The closure zeroes the gradients before its backward anyway: free them now (the previous step's,
                # or a failed backward's partial ones) so the retry has that memory too.
                optimizer.zero_grad(set_to_none=True)

        # without rescue an OOM stays the caller's to handle; a rung that breaks the model is reverted all the same
        out = self.engine.train_batch(attempt_batch, self._state, first_micro_batch=first_micro_batch,
                                      release=release)
        logged = self._logged
        if logged is not None and logged.changed():  # the same keys on every rank: the ranks agree without a word
            self.engine.ranks.logged_collectives = logged.found
        return out

    # --- the optimizer step -----------------------------------------------------------------------------------------
    def _guard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        # LR schedulers wrap optimizer.step on the instance: wrap whatever is there, and put it back at the end
        wrap_method(optimizer, "step", KIND, partial(self._guarded_step, optimizer))

    def _guarded_step(self, optimizer: torch.optim.Optimizer, original: Callable) -> "OptimizerStep":
        """``optimizer.step`` whose out-of-memory error is explained, and retried where that is safe
        (:func:`~lightning_memguard.guard.oom.step_optimizer`)."""

        def step(closure=None, **kwargs):
            results: list = []
            closure_failed = []  # an error came out of the closure: its forward or backward, not the step's own

            def recording_closure():
                # LBFGS calls the closure again and again inside its step (a line search re-evaluates the loss):
                # an OOM in a later call's forward is the closure's too, though an earlier call returned
                try:
                    results[:] = [closure()]
                except BaseException:
                    closure_failed.append(True)
                    raise
                return results[0]

            def run_step(retry: bool):
                # a retried step must not run forward and backward again: it replays the closure's result
                replay = (lambda: results[0]) if retry else recording_closure
                return original(closure=replay if closure is not None else None, **kwargs)

            # an OOM inside the closure was rescued or reported there; with no closure (a GradScaler step) the
            # closure ran before this call
            out = step_optimizer(optimizer, run_step, first_step=self._steps_done == 0,
                                 on_failure=self.engine.attempts.on_optimizer_oom,
                                 failed_elsewhere=lambda: bool(closure_failed))
            self._steps_done += 1
            return out

        guarded = OptimizerStep(optimizer, original, step)
        self._steps.append(guarded)
        return guarded


class OptimizerStep:
    """The guarded ``optimizer.step``, shaped as a method bound to the optimizer.

    An LR scheduler built while the guard's step is in place — StochasticWeightAveraging builds its SWALR at its
    first epoch, mid-fit — wraps ``optimizer.step`` itself: torch takes the step's ``__func__`` and binds it to the
    optimizer again (a plain function has none: the scheduler's constructor raised AttributeError). Here
    ``__func__`` is a function of the optimizer that calls this object, so the guard stays in the chain under the
    scheduler's wrapper. That wrapper outlives the fit: once the guard is uninstalled (``active`` False) the call goes
    straight to the step that was there before.

    An LR scheduler built before the guard (in ``configure_optimizers``) marked the step it wrapped
    (``_wrapped_by_lr_sched``); at its first ``step`` torch looks for that mark on ``optimizer.step`` and, missing,
    warns that "`optimizer.step()` has been overridden after learning rate scheduler initialization" — a warning
    about the user's code that every fit with a scheduler got. This step calls the marked one, which still records
    that the optimizer stepped, so it carries the mark on (a scheduler built later then sees the step wrapped)."""

    def __init__(self, optimizer: torch.optim.Optimizer, original: Callable, guarded: Callable) -> None:
        self.__self__ = optimizer
        self.original, self.guarded, self.active = original, guarded, True
        if getattr(original, "_wrapped_by_lr_sched", False):
            self._wrapped_by_lr_sched = True
        step = self

        def bound_step(optimizer, *args, **kwargs):  # what a scheduler's wrapper binds to the optimizer and calls
            return step(*args, **kwargs)

        self.__func__ = bound_step

    def __call__(self, *args, **kwargs):
        return (self.guarded if self.active else self.original)(*args, **kwargs)


def _combined_extras(extras: list[tuple[dict, int, float]]) -> dict:
    """The whole batch's extras (what ``training_step`` returned beside ``"loss"``, handed to
    ``on_train_batch_end`` as ``outputs``) from its micro-batches' ``(extra, samples, weight)``: per-sample tensors
    concatenated, float scalars weighted as the loss is
    (:func:`~lightning_memguard.base.outputs.combine_outputs`), as an evaluation batch's parts are. The last part's
    alone would hold its samples only: predictions collected there would miss the others."""
    if not extras:
        return {}
    combined = combine_outputs([extra for extra, _, _ in extras], [n for _, n, _ in extras],
                               [weight for _, _, weight in extras])
    return combined if isinstance(combined, dict) else dict(extras[-1][0])  # keys differing between parts: the last's


def _scaled_step(step_fn: Callable[[], Any], weight: float, last_part: Optional[Callable] = None) -> Any:
    """One micro-batch's training step with its loss multiplied by ``weight``, its share of what the loss averages
    over (the weighted micro-losses then sum to the whole batch's, as with gradient accumulation); the last part's
    loss then goes through ``last_part`` (:meth:`~lightning_memguard.guard.engine.MemGuardEngine.last_part_loss`)."""
    result = step_fn()
    if result.closure_loss is not None:
        loss = result.closure_loss * weight
        result.closure_loss = last_part(loss) if last_part is not None else loss
        result._clone_loss()
    return result


def _fetched_batch(item: Any) -> Any:
    """The batch in what a step's ``next(dataloader_iter)`` returned: Lightning's ``(batch, batch_idx,
    dataloader_idx)``."""
    return item[0] if isinstance(item, tuple) and len(item) == 3 else item


def _with_fetches_replayed(kwargs: OrderedDict) -> tuple[OrderedDict, Optional[ReplayedFetches]]:
    """The step's arguments, and where it fetches its own batches (Lightning hands it an iterator in place of the
    batch, under a key of its own), that iterator as :class:`ReplayedFetches`: every attempt of the batch meets the
    batches the first fetched."""
    if "batch" in kwargs:
        return kwargs, None
    for key, value in kwargs.items():
        if isinstance(value, Iterator):
            replayed = kwargs.copy()
            replayed[key] = fetches = ReplayedFetches(value)
            return replayed, fetches
    return kwargs, None


def _with_requires_grad_kept(saved: Callable[[], Callable[[], None]], module: torch.nn.Module) -> Callable[[], None]:
    """``saved()`` and each parameter's ``requires_grad``, put back together. A manual step that failed between
    ``toggle_optimizer`` and ``untoggle_optimizer`` left the other optimizers' parameters frozen; run again, it toggled
    once more and Lightning recorded them frozen, so untoggling kept them frozen for the rest of the fit."""
    restore_step = saved()
    flags = [(p, p.requires_grad) for p in module.parameters()]

    def restore() -> None:
        restore_step()
        for p, flag in flags:
            p.requires_grad_(flag)

    return restore
