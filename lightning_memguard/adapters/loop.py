"""MemGuard, the guard of a training loop: one call per optimizer step runs forward, backward and the optimizer step
of a batch under the guard — measured at every boundary, in mixed precision when the AMP rung is on, split into
micro-batches when the micro-batch rung is on, and run again one rung higher when it runs out of memory. What a
framework does its own way (precision, backward, gradient sync, logging) is a :class:`LoopBackend`'s: plain PyTorch
here (:class:`~lightning_memguard.adapters.torch_backend.TorchBackend`), Lightning Fabric in
:class:`~lightning_memguard.adapters.fabric.FabricMemGuard`. Imports no Lightning."""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional, Protocol

import torch
from torch import nn

from ..base.host import Host
from ..base.metric_states import metric_modules, save_metrics
from ..base.optimizer_step import step_needs_closure
from ..base.snapshot import EVALUATION_PHASES
from ..guard.attempts import BatchState
from ..guard.engine import MemGuardEngine
from ..guard.oom import step_optimizer
from ..guard.settings import GuardSettings
from ..mitigations.amp import PrecisionSwitch
from .ddp_evaluation import EvaluationAlone
from .ddp_recovery import DDPRecovery
from .fsdp_recovery import FSDPRecovery
from .results import GuardResults
from .signature import takes_guard_settings
from .torch_backend import AutocastSwitch, TorchBackend

__all__ = ["MemGuard", "LoopBackend", "AutocastSwitch"]

#: ``(model, batch) -> loss``: the model is passed in, so the pre-flight estimate can run the same step on a copy
LossFn = Callable[[nn.Module, Any], torch.Tensor]
#: ``(model, batch) -> outputs``: one evaluation batch's (or part's) outputs
EvalFn = Callable[[nn.Module, Any], Any]
#: ``(model, optimizer) -> None``: what runs on the whole batch's gradients before the optimizer step (clipping)
BeforeStepFn = Callable[[nn.Module, Any], None]


class LoopBackend(Protocol):
    """How a loop runs the parts of a step that a framework does its own way; the guard does the rest.
    :class:`~lightning_memguard.adapters.torch_backend.TorchBackend` is plain PyTorch,
    :class:`~lightning_memguard.adapters.fabric.FabricBackend` Lightning Fabric."""

    #: how messages call the run (``"the loop"``, ``"Fabric"``)
    name: str
    #: the model the rungs change (a framework's wrapper unwrapped)
    module: nn.Module
    #: the model the loss function is given, where it wraps ``module`` (searched for compiled code)
    called_module: nn.Module
    #: the optimizer the estimate builds a like one of (a framework's wrapper unwrapped)
    estimate_optimizer: torch.optim.Optimizer
    #: the module whose gradients are all-reduced, where it is a DistributedDataParallel, or that FSDP2 shards (the
    #: ranks then recover an OOM together, :class:`~lightning_memguard.adapters.ddp_recovery.DDPRecovery`,
    #: :class:`~lightning_memguard.adapters.fsdp_recovery.FSDPRecovery`)
    data_parallel: nn.Module

    @property
    def device(self) -> torch.device:
        """Where the model trains."""

    def precision_switch(self) -> PrecisionSwitch:
        """The AMP rung's switch for this run (called once a fit)."""

    def forward_context(self) -> ContextManager:
        """Entered around each call of the loss function (autocast, where the backend enters it itself)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one (micro-)batch's loss."""

    def unscale_gradients(self) -> None:
        """Before :meth:`optimizer_step`, the gradients in their true scale where the backend scales the loss itself
        (fp16's GradScaler), for the user's code that reads them (clipping); the step then does not unscale again."""

    def optimizer_step(self) -> None:
        """The optimizer step (unscaling and skipping inf steps under fp16)."""

    def no_sync(self, last: bool) -> ContextManager:
        """Entered around a micro-batch's backward: gradient synchronisation between processes only when ``last``."""

    def host(self) -> Host:
        """Where metrics and events go and how the processes agree (called at the start of a fit)."""

    def flush(self) -> None:
        """Writes what the loggers hold (at :meth:`MemGuard.close`)."""


class MemGuard(GuardResults):
    r"""Guards a plain PyTorch training loop: the same measuring, logging, ladder and OOM rescue as
    :class:`~lightning_memguard.MemGuardCallback`, in a loop you write.

    Example::

        guard = MemGuard(model, optimizer, budget="2GiB", log_dir="runs/exp1")
        for inputs, target in loader:
            loss = guard.step((inputs, target), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        guard.close()

    Each :meth:`step` is one optimizer step: it zeroes the gradients, runs ``loss_fn(model, batch)`` (forward, inside
    autocast when the AMP rung is on), backward and ``optimizer.step()``, reading memory at the four boundaries. When
    the micro-batch rung is on, ``loss_fn`` is called on each part of the batch (every tensor with the batch's leading
    size is split, in any nesting of mappings, ``BatchEncoding``, dataclasses and sequences), and each loss is weighted
    by its share of what the loss averages over (labels not -100 when the batch has ``labels``, else samples, or
    ``microbatch_weight=``). When forward or backward runs out of memory, the failed
    attempt is freed, the next rung applied and the same batch run again;
    :class:`~lightning_memguard.MemGuardOutOfMemoryError` says why when nothing is left to try.

    :meth:`evaluate` is the same for an evaluation, test or predict batch: measured, and run again in parts after an
    out-of-memory error.

    Logged with ``torch.utils.tensorboard`` to ``log_dir`` (or to ``writer``), the history and events also as CSV
    there; :attr:`history` and :attr:`events` are pandas DataFrames.

    Args:
        model: the module being trained (the checkpointing rung finds its repeated blocks).
        optimizer: its optimizer.
        log_dir: where the run's files and TensorBoard events go; ``None``: nothing is written.
        writer: a ``SummaryWriter`` to log to instead of one opened in ``log_dir``.
        tensorboard: open a ``SummaryWriter`` in ``log_dir`` when no ``writer`` is given.
        scheduler: an LR scheduler stepped after every optimizer step (optional).
        settings: the guard's settings as one :class:`~lightning_memguard.guard.settings.GuardSettings`, instead
            of by keyword (not both). The settings by keyword (``threshold``, ``budget``, ``mitigations``, ...) are
            the constructor's keyword arguments, typed and documented there, the same for every front door.

    Raises:
        ValueError: on a bad argument or an unknown setting, naming it and what is allowed.
    """

    @takes_guard_settings
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, log_dir: Optional[str] = None,
                 writer: Any = None, tensorboard: bool = True, scheduler: Any = None,
                 settings: Optional[GuardSettings] = None, **keywords: Any) -> None:
        check_model_and_optimizer(model, optimizer)
        self._compose(TorchBackend(model, optimizer, log_dir, writer, tensorboard), model, optimizer, log_dir,
                      scheduler, GuardSettings.from_keywords(settings, **keywords))

    def _compose(self, backend: LoopBackend, model: nn.Module, optimizer: Any, log_dir: Optional[str],
                 scheduler: Any, settings: GuardSettings) -> None:
        """The guard of a loop whose framework-specific parts ``backend`` runs (every front door's constructor)."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.log_dir = log_dir
        self._backend = backend
        self._engine = MemGuardEngine(settings, name=backend.name)
        self._engine.monitor.metrics_without_logger = False  # step() does not return them
        self._state = BatchState()
        self._started = False
        self.global_step = 0  # optimizer steps done (restored on resume)
        self._steps_done = 0  # optimizer steps done in this process: the first creates the optimizer state

    # --- the loop's calls -------------------------------------------------------------------------------------------
    def step(self, batch: Any, loss_fn: LossFn, before_optimizer_step: Optional[BeforeStepFn] = None) -> torch.Tensor:
        """Runs one optimizer step on ``batch``: returns the loss (detached; with micro-batches, their weighted sum).

        ``before_optimizer_step(model, optimizer)`` runs once, after the backward of the whole batch (of every
        micro-batch) and before the optimizer step: where a loop clips its gradients
        (``torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)``; under Fabric ``fabric.clip_gradients(m, o, 1.0)``).
        The plain loop unscales the gradients first where the AMP rung runs fp16 with its GradScaler; Fabric's
        ``clip_gradients`` unscales them itself.

        Raises:
            MemGuardOutOfMemoryError: the batch cannot fit whatever the ladder does; its message is the report.
            ValueError: ``loss_fn`` (or ``before_optimizer_step``) is not callable — the batch comes first — or
                returned something other than a scalar tensor.
        """
        _check_callable("loss_fn", loss_fn, "step(batch, loss_fn)", "(model, batch) -> loss")
        if before_optimizer_step is not None:
            _check_callable("before_optimizer_step", before_optimizer_step,
                            "step(batch, loss_fn, before_optimizer_step)", "(model, optimizer) -> None")
        if not self._started:
            self._engine.end_evaluation()  # evaluated before training: that run's files are done, the fit begins
            self._start()
        engine, backend = self._engine, self._backend
        try:
            # zeroed before the batch-start read: memory held across steps is then parameters and optimizer state
            # only, in every step (gradients exist from the first backward on), as the policy compares steps
            self.optimizer.zero_grad(set_to_none=True)
            engine.batch_start(self.global_step, batch, loss_fn)
            loss = engine.train_batch(lambda: self._forward_backward(batch, loss_fn), self._state,
                                      release=lambda: self.optimizer.zero_grad(set_to_none=True))
            if before_optimizer_step is not None:
                # on the whole batch's gradients, once: not per micro-batch, and not again if the step is retried
                backend.unscale_gradients()
                before_optimizer_step(self.model, self.optimizer)
            step_optimizer(self.optimizer, lambda retry: backend.optimizer_step(), self._steps_done == 0,
                           engine.attempts.on_optimizer_oom)
            self._steps_done += 1
            if self.scheduler is not None:
                self.scheduler.step()
            engine.step_end()
        except BaseException as error:
            engine.on_exception(error)  # the rows of this step and the memory now; the files stay open
            raise
        self.global_step += 1
        return loss

    def evaluate(self, batch: Any, fn: EvalFn, phase: str = "validation") -> Any:
        """Runs ``fn(model, batch)`` for an evaluation batch and returns its outputs: without gradients, in the
        backend's forward context (the AMP rung's autocast where the guard enters it), measured (one history row, phase
        ``phase``; ``memguard/<phase>/peak_GiB`` logged at the loop's count of batches) and rescued. The batch runs
        in as many parts as this loop's batches needed so far; after an out-of-memory error it runs again in twice as
        many (an ``eval_split`` event), kept for the loop's later batches. The parts' outputs are combined into the
        whole batch's (:func:`~lightning_memguard.base.outputs.combine_outputs`: per-sample tensors and lists
        concatenated, scalars weighted by what the loss averages over, as training's micro-batches are: labelled tokens
        when the batch has transformers-style labels, else samples, or ``microbatch_weight=``).

        ``fn`` may run again, on parts of the batch, after an out-of-memory error: it should have no side effects.
        Accumulate metrics from the outputs it returns, not inside it. Called before any :meth:`step`, the guard
        measures this evaluation on its own (files named after ``phase``, e.g. ``memguard_validation_history.csv``)
        until the first step begins the fit. With several processes a rank splits its batch alone where its parts
        issue no collective the others do not: once a batch of ``phase`` completed on it without one (a model under
        DistributedDataParallel or unsharded; see :mod:`~lightning_memguard.adapters.ddp_evaluation`).

        Args:
            batch: the batch (a tensor or any nesting of mappings, dataclasses and sequences, split like a training
                batch).
            fn: ``(model, part) -> outputs``.
            phase: ``"validation"``, ``"test"`` or ``"predict"``.

        Raises:
            MemGuardOutOfMemoryError: a part of one sample does not fit, or with several processes this rank may
                not split its batch alone (its report says why).
            ValueError: ``phase`` is not one of the three, or ``fn`` is not callable (the batch comes first).
        """
        if phase not in EVALUATION_PHASES:
            raise ValueError(f"phase={phase!r}; allowed: {', '.join(map(repr, EVALUATION_PHASES))}")
        _check_callable("fn", fn, "evaluate(batch, fn)", "(model, part) -> outputs")
        backend, engine = self._backend, self._engine
        if not self._started:
            engine.begin_evaluation(phase, backend.module, backend.device, backend.host(), self.log_dir,
                                    called_module=backend.called_module,
                                    alone=lambda: EvaluationAlone.of(backend.data_parallel))

        def call(part: Any, share: float) -> Any:
            with backend.forward_context():
                return fn(self.model, part)

        try:
            return engine.evaluation_batch(phase, batch, call)
        except BaseException as error:
            engine.on_exception(error)
            raise

    def close(self) -> None:
        """Flushes and closes the files and sources; the results stay readable. Idempotent."""
        self._engine.end_evaluation()
        self._engine.stop()
        self._backend.flush()
        self._started = False

    def __enter__(self) -> "MemGuard":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """The ladder's levels, the parts evaluation batches run in and the step counter, to save with a
        checkpoint."""
        return {**self._engine.state_dict(), "global_step": self.global_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` before the first :meth:`step` of a resumed run."""
        self.global_step = int(state.get("global_step", 0))
        self._engine.load_state_dict({"ladder": state.get("ladder"), "evaluation": state.get("evaluation")})

    # --- the work ---------------------------------------------------------------------------------------------------
    def _start(self) -> None:
        backend = self._backend
        host = backend.host()
        rescue = self._engine.settings.rescue_oom
        recovery = (DDPRecovery.install(backend.data_parallel, host.warn, rescue)
                    or FSDPRecovery.install(backend.data_parallel, host.warn, rescue))
        self._engine.begin_fit(backend.module, backend.device, backend.precision_switch(), host,
                               estimate_optimizer=backend.estimate_optimizer, called_module=backend.called_module,
                               first_step=self.global_step, recovery=recovery, data_parallel=backend.data_parallel,
                               alone=lambda: EvaluationAlone.of(backend.data_parallel))
        self._engine.start(lambda: [self.optimizer], self.log_dir)
        # the model's metric modules, updated in the loss function, count each batch once, also where it ran again
        metrics = metric_modules(backend.module)
        self._state = BatchState(self._engine.running_buffers(), (lambda: save_metrics(metrics)) if metrics else None)
        self._started = True

    def _forward_backward(self, batch: Any, loss_fn: LossFn) -> torch.Tensor:
        # no zero_grad here: step() zeroed the gradients before the first attempt, and the attempt loop's release zeroes
        # them after a failed one (a second call every step cost as much as the rest of the guard's Python)
        chunks = self._engine.split_batch(batch)
        total = None
        for i, (chunk, weight) in enumerate(chunks):
            self._state.in_backward = False
            # gradients synchronised once, with the last part: DDP decides at the forward whether its backward syncs
            with self._backend.no_sync(last=i == len(chunks) - 1):
                with self._backend.forward_context():
                    loss = loss_fn(self.model, chunk)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(f"loss_fn returned {type(loss).__name__}"
                                     f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; it must "
                                     "return the batch's loss as a scalar tensor")
                self._engine.boundary("after_forward")
                self._state.in_backward = True
                if len(chunks) == 1:
                    self._backend.backward(loss)
                elif i < len(chunks) - 1:
                    self._backend.backward(loss * weight)
                else:
                    self._backend.backward(self._engine.last_part_loss(loss * weight))
            self._state.partial_gradients = True
            self._engine.boundary("after_backward")
            if len(chunks) == 1:  # the whole batch: its loss as it is, no multiplication by 1 on the device
                return loss.detach()
            part = loss.detach() * weight
            total = part if total is None else total + part
            del loss
        return total


def _check_callable(name: str, value: Any, call: str, signature: str) -> None:
    """Raises ValueError where ``value`` (argument ``name`` of ``call``) is not callable: arguments given in the
    wrong order fail here, naming the order, not deep inside the step."""
    if not callable(value):
        raise ValueError(f"{name}={type(value).__name__} is not callable: {call} takes {name} as a "
                         f"{signature} function")


def check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    """Raises ValueError naming the model or optimizer a loop guard cannot take."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} must be a torch.nn.Module")
    if not isinstance(getattr(optimizer, "param_groups", None), list):
        raise ValueError(f"optimizer={type(optimizer).__name__} must be a torch.optim.Optimizer")
    if step_needs_closure(optimizer):  # it would fail at the first step, after a forward and backward
        raise ValueError(f"optimizer={type(optimizer).__name__} evaluates the loss again inside its step (step("
                         "closure)), and a loop guard's step() runs forward and backward once, then "
                         "optimizer.step(): train it under a Lightning Trainer with MemGuardCallback, whose closure "
                         "it calls, or with an optimizer whose closure is optional")
