"""MemGuardCallback: the Lightning front door. It translates the Trainer's hooks into the engine's boundary calls,
switches precision through the trainer's precision plugin and runs batches through Lightning's own closures
(:mod:`~lightning_memguard.adapters.lightning_loop`). Works with ``lightning.pytorch`` and ``pytorch_lightning``."""

from __future__ import annotations

import gc
from multiprocessing.context import get_spawning_popen
from typing import Any, Optional

import pandas as pd
from lightning.pytorch.callbacks import Callback

from ..base.checks import check_bool
from ..base.host import Host
from ..guard.engine import MemGuardEngine
from ..guard.settings import GuardSettings
from ._lightning_trainer import (
    LightningPrecision,
    callbacks_held_tensors,
    memguard_warn,
    warner_of,
    namespace_of,
    optimizer_step_index,
    reduce_max,
    run_dir,
)
from .lightning_eval import EvaluationSteps
from .ddp_evaluation import EvaluationAlone
from .ddp_recovery import DDPRecovery
from .fsdp_recovery import FSDPRecovery
from .lightning_loop import BatchRunner
from .lightning_step_copy import training_step_of_copy
from .lightning_trials import budget_searches, learning_rate_searches, undo_searches
from .results import GuardResults
from .signature import takes_guard_settings
from .rank_exceptions import hand_errors_to
from .spawned_results import SpawnedResults
from .tensorboard import TensorBoardText

__all__ = ["MemGuardCallback"]


class MemGuardCallback(GuardResults, Callback):
    r"""Measures memory in every phase of every training step, logs it, and acts before an out-of-memory error.

    At four boundaries of every optimizer step it reads the memory source: ``batch_start``, ``after_forward``
    (``on_before_backward``), ``after_backward`` (``on_after_backward``) and ``after_optimizer_step``
    (``on_train_batch_end`` of a batch that stepped). On CUDA the source is the caching allocator (one
    allocator-statistics read per boundary, peaks reset per phase) plus NVML sampled on a background thread; on CPU it
    is live tensor-storage accounting (:class:`~lightning_memguard.sources.CpuTensorAccountant`).

    Logged to every logger in ``trainer.loggers`` every ``log_every_n_steps`` optimizer steps, on the step axis of
    the module's own ``self.log`` metrics (``<phase>`` is one of the four boundaries; ``<evaluation>`` one of
    ``validation``, ``test``, ``predict``, logged at every batch of that loop, counted from 0 in the run):

    =======================================  ========================================================================
    key                                      meaning
    =======================================  ========================================================================
    ``memguard/<phase>/allocated_GiB``       allocated at the boundary
    ``memguard/<phase>/peak_GiB``            peak of the phase ending there, max over the logging interval
    ``memguard/reserved_GiB``                allocator reserved (CUDA)
    ``memguard/reserved_free_GiB``           reserved minus allocated: cached, no tensor in it (CUDA)
    ``memguard/inactive_split_GiB``          of that, free blocks split off partly used segments (CUDA)
    ``memguard/nvml_used_GiB``               device used per NVML (CUDA)
    ``memguard/nvml_process_GiB``            this process per NVML (where the driver reports it)
    ``memguard/capacity_GiB``                capacity guarded (device total, memory fraction or budget)
    ``memguard/peak_share``                  highest phase peak of the step / capacity (``mem%`` in the progress bar)
    ``memguard/alloc_retries``               cumulative allocator retries (CUDA)
    ``memguard/num_ooms``                    cumulative out-of-memory errors
    ``memguard/<evaluation>/peak_GiB``       peak of one validation, test or predict batch (its own axis)
    ``memguard/<evaluation>/allocated_GiB``  allocated after that batch
    ``memguard/rung/<name>``                 a rung's level, at each event
    =======================================  ========================================================================

    With TensorBoard, the custom-scalars layout "memguard" puts the GiB curves on one chart.

    After each optimizer step the step's peaks go to the ladder: at ``threshold × capacity`` it applies the next
    rung (``amp``, then ``checkpointing`` of as many repeated blocks as the estimate predicts are needed, then
    ``microbatch``), judges it on the next full step, keeps or reverts it, and says so once when activation remedies
    cannot help. An OOM in forward or backward is rescued by running the same batch again one rung higher; an OOM in
    the optimizer step is explained (and retried once with ``foreach=False`` when nothing was updated yet).
    Validation (also inside a fit and its sanity check), test and predict batches are measured (one history row a
    batch, phase ``validation``, ``test`` or ``predict``; not in the sanity check, which runs before the fit's
    sources open) and rescued: a batch that runs out of memory runs again in 2, 4, ... parts without gradients, its
    outputs and ``on_epoch`` metrics combined as an unsplit run's, and the loop's later batches run in as many parts
    (an ``eval_split`` event). The step methods are wrapped on the module instance for the length of their loop only.
    :attr:`history` and :attr:`events` are pandas DataFrames of the latest fit, streamed to ``memguard_history.csv``
    and ``memguard_events.csv`` in ``trainer.log_dir`` (every step reaches the OS as it ends); after a fit under
    ``strategy="ddp_spawn"``, ``"ddp_fork"`` or ``"ddp_notebook"`` the launching process's callback shows rank 0's,
    read back from its files.

    Args:
        progress_bar: show the last logged step's peak as a share of capacity (``mem%``) in Lightning's progress
            bar, through Lightning's own progress-bar metrics (only when there is a capacity, and a progress bar:
            ``self.log`` is not free).
        settings: the guard's settings as one :class:`~lightning_memguard.GuardSettings`, instead of by keyword
            (not both). The settings by keyword (``threshold``, ``budget``, ``mitigations``, ...) are the
            constructor's keyword arguments, typed and documented there (``help(MemGuardCallback.__init__)``), the
            same for every front door, and LightningCLI reads them from its ``init_args``. ``rescue_oom`` under
            manual optimization acts in one process only, before an optimizer stepped.
    Raises:
        ValueError: on a bad argument, naming it and what is allowed.

    Example::

        guard = MemGuardCallback(budget="2GiB")
        trainer = Trainer(callbacks=[guard])
        trainer.fit(model)
        guard.history, guard.events  # pandas DataFrames

    With LightningCLI, in the configuration file::

        trainer:
          callbacks:
            - class_path: lightning_memguard.MemGuardCallback
              init_args: {budget: 8GiB, threshold: 0.8, mitigations: [checkpointing, microbatch]}
    """

    @takes_guard_settings
    def __init__(self, *, progress_bar: bool = True, settings: Optional[GuardSettings] = None,
                 **keywords: Any) -> None:
        settings = GuardSettings.from_keywords(settings, **keywords)
        self.progress_bar = check_bool("progress_bar", progress_bar)
        self._engine = MemGuardEngine(settings, name="the Trainer")
        self._runner = BatchRunner(self._engine)
        self._evaluation = EvaluationSteps(self._engine)
        self._stepped = False
        self._searches: list = []  # the finders' searches, wrapped (lightning_trials.py)
        self._searching = False  # a learning-rate search is running
        # this fit's on_fit_start / on_train_start work is done (a search before the fit may do it first)
        self._fit_begun = self._train_begun = False
        self._spawned = SpawnedResults()  # what a spawned or forked launch's rank 0 hands back (spawned_results.py)

    def __getstate__(self) -> dict:
        """What is pickled for the processes a ``ddp_spawn`` Trainer starts: the guard as made with these settings,
        with a checkpoint's state given to it and this guard's hand-off of results (:class:`SpawnedResults`) — not
        what a fit in this process left (its sources watch this process's storages, its closures hold this
        process's Trainer): a callback fitted once, then handed to a Trainer that spawns its ranks, failed to start
        them. A subclass's own attributes are kept. Any other pickle or copy: the guard as it is."""
        if get_spawning_popen() is None:
            return self.__dict__
        fresh = object.__new__(MemGuardCallback)
        MemGuardCallback.__init__(fresh, progress_bar=self.progress_bar, settings=self.settings)
        fresh._engine._restored = self._engine._restored
        return {**self.__dict__, **fresh.__dict__, "_spawned": self._spawned}

    @property
    def history(self) -> pd.DataFrame:
        """The latest run's rows, one per phase per optimizer step and one per evaluation batch (see
        :class:`~lightning_memguard.adapters.results.GuardResults`).

        After a fit under ``strategy="ddp_spawn"``, ``"ddp_fork"`` or ``"ddp_notebook"`` (the fit ran in spawned or
        forked processes, none of it in this one) they are rank 0's rows, read back from its ``memguard_history.csv``
        (its last ``history_max_rows``; an empty cell reads back as NaN): what this process would hold under
        ``strategy="ddp"``, where it is rank 0, and the rank whose weights and ``callback_metrics`` Lightning brings
        back. Every rank takes the same rungs at the same steps; each rank's own measurements stay in its
        ``memguard_history.rank<N>.csv``, and the loggers got the maximum over ranks."""
        spawned = self._spawned.read(self.settings.history_max_rows)
        return super().history if spawned is None else spawned[0]

    @property
    def events(self) -> pd.DataFrame:
        """The latest run's actions and notices (see :class:`~lightning_memguard.adapters.results.GuardResults`);
        after a fit under ``strategy="ddp_spawn"`` (or ``ddp_fork``, ``ddp_notebook``), rank 0's, read back from its
        ``memguard_events.csv`` (as :attr:`history`)."""
        spawned = self._spawned.read(self.settings.history_max_rows)
        return super().events if spawned is None else spawned[1]

    @property
    def history_csv(self) -> Optional[str]:
        """Where the latest run's history is streamed (see
        :attr:`~lightning_memguard.adapters.results.GuardResults.history_csv`); after a spawned or forked fit, rank
        0's."""
        handed_off = self._spawned.handed_off_history()
        return super().history_csv if handed_off is None else handed_off

    # --- Lightning hooks: one line each -----------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        _one_guard_per_trainer(trainer)
        if self._spawned.rank_copy:  # Lightning calls on_exception only in the launching process (rank_exceptions.py)
            hand_errors_to(trainer, lambda error: self.on_exception(trainer, trainer.lightning_module, error))
        ns = namespace_of(trainer)
        self._searches = (budget_searches(trainer, self.settings, ns.BatchSizeFinder)
                          + learning_rate_searches(trainer, ns.LearningRateFinder, self._begin_search,
                                                   self._end_search))

    def on_fit_start(self, trainer, pl_module) -> None:
        if self._fit_begun:  # begun by a learning-rate search that ran first (_begin_search)
            return
        self._fit_begun = True
        # One fit, one set of results: a reused callback (a second fit, another Trainer) starts clean tables, at the
        # rung levels the last fit of the same model ended at (a "resume" event says which)
        self._spawned.begin_run()
        host, automatic = self._host(trainer), pl_module.automatic_optimization
        rescue, model = self.settings.rescue_oom and automatic, trainer.strategy.model
        recovery = DDPRecovery.install(model, host.warn, rescue) or FSDPRecovery.install(model, host.warn, rescue)
        self._engine.begin_fit(pl_module, trainer.strategy.root_device, LightningPrecision(trainer), host,
                               automatic_optimization=automatic, recovery=recovery, data_parallel=model,
                               alone=lambda: EvaluationAlone.of(model))
        # micro-batching, OOM rescue and optimizer-step reports under automatic optimization; a rung that broke a
        # manual step put back and the step run again
        self._runner.install(trainer, buffers=self._engine.running_buffers())

    def state_dict(self) -> dict[str, Any]:
        """The rungs' levels and the policy's state, for a checkpoint; after a fit under ``strategy="ddp_spawn"`` (or
        ``ddp_fork``, ``ddp_notebook``), rank 0's where that fit ended (read back: the fit ran in other processes)."""
        handed = self._spawned.read_state()
        return handed if handed is not None else self._engine.state_dict()

    @property
    def levels(self) -> dict[str, int]:
        """The level of each rung now (after a ``ddp_spawn``, ``ddp_fork`` or ``ddp_notebook`` fit: where it ended,
        as :meth:`state_dict`)."""
        handed = self._spawned.read_state()
        levels = handed.get("ladder", {}).get("levels") if handed is not None else None
        return dict(levels) if isinstance(levels, dict) else self._engine.levels

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Usually called before on_fit_start, which applies it: after the strategy set up the model, before Lightning
        # restores the scaler state. Strategies that restore after setup (FSDP, DeepSpeed) call it after
        # on_fit_start: the engine then applies it at once, still before the first step.
        if self._searching:  # a learning-rate search restoring the checkpoint it saved: this guard's own state
            return
        self._engine.load_state_dict(state_dict)

    def _begin_search(self, trainer, pl_module) -> None:
        """A learning-rate search starts. Lightning calls the tuner's callbacks first, so a search in their
        ``on_fit_start`` (``Tuner.lr_find``, a ``LearningRateFinder`` callback) runs before this guard's: the fit is
        begun and started here, so that the trial steps, whole batches of the fit's size, run through the guard's
        closures (an out-of-memory error rescued, the batch split) instead of ending the run before its first step.
        One process only: ranks agree on a rescue in the step hooks a search takes off the Trainer, so a rank's OOM
        in a trial would leave the others waiting in its collectives (as the search does without the guard, the
        error then ends the run)."""
        self._searching = True
        if trainer.state.fn == "fit" and trainer.world_size == 1:
            self.on_fit_start(trainer, pl_module)
            self.on_train_start(trainer, pl_module)

    def _end_search(self) -> None:
        self._searching = False
        self._engine.outside_steps_ended()  # the trials' peaks are not the next step's
        self._runner.trials_ended()

    def on_train_start(self, trainer, pl_module) -> None:
        if self._train_begun:  # started by a learning-rate search that ran first (_begin_search)
            return
        self._train_begun = True
        # the step the fit starts at, now that a checkpoint's loops are restored (a further fit of this Trainer goes
        # on from the last one's)
        self._engine.start(lambda: trainer.optimizers, None if trainer.fast_dev_run else run_dir(trainer),
                           first_step=optimizer_step_index(trainer))
        self._hand_off(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._stepped = False
        # the estimates run the step on a copy of the module, without its Trainer: self.all_gather is stood in for
        # there (and a manual step's optimizers and backward: estimate/manual_step.py)
        self._engine.batch_start(optimizer_step_index(trainer), batch, training_step_of_copy)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._runner.mark_backward()
        self._engine.boundary("after_forward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._engine.boundary("after_backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._stepped = True
        self._runner.mark_stepped()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._stepped:  # accumulating: the step goes on with the next batch
            return
        metrics = self._engine.step_end(stopping=trainer.should_stop)
        share = metrics.get("memguard/peak_share") if metrics else None
        if self.progress_bar and share is not None and trainer.progress_bar_callback is not None:
            # Lightning's own progress-bar metrics; once per logging interval, as self.log costs ~0.2 ms a call
            pl_module.log("mem%", round(100 * share, 1), prog_bar=True, logger=False, on_step=True, on_epoch=False)

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop()
        self._hand_off_state(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._evaluation_start(trainer, pl_module, "validation")

    def on_validation_end(self, trainer, pl_module) -> None:
        self._evaluation_end("validation")

    def on_test_start(self, trainer, pl_module) -> None:
        self._evaluation_start(trainer, pl_module, "test")

    def on_test_end(self, trainer, pl_module) -> None:
        self._evaluation_end("test")

    def on_predict_start(self, trainer, pl_module) -> None:
        self._evaluation_start(trainer, pl_module, "predict")

    def on_predict_end(self, trainer, pl_module) -> None:
        self._evaluation_end("predict")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._engine.on_exception(exception)
        self._stop()
        self._hand_off_state(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._stop()
        self._fit_begun = self._train_begun = False
        undo_searches(self._searches)
        self._searches = []
        if trainer.world_size > 1:
            # what the ranks' steps left in reference cycles (graphs, FSDP2's collectives' work objects) goes while
            # the process group is alive: left to interpreter exit, gloo aborted a rank ("terminate called without
            # an active exception") in about one two-rank fit in ten here
            gc.collect()

    # --- translating ------------------------------------------------------------------------------------------------
    def _host(self, trainer) -> Host:
        ns = namespace_of(trainer)
        tensorboards = [logger for logger in trainer.loggers if isinstance(logger, ns.TensorBoardLogger)]

        def log_metrics(metrics: dict, step: int) -> None:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

        text = TensorBoardText(lambda: [logger.experiment for logger in tensorboards])
        return Host(log_metrics=log_metrics, log_text=text.log_text, add_layout=text.add_layout,
                    warn=warner_of(trainer), info=ns.rank_zero_info,
                    reduce_max=lambda values: reduce_max(trainer, values), rank=trainer.global_rank,
                    world_size=trainer.world_size, has_logger=bool(trainer.loggers),
                    # a Trainer builds a logger unless told logger=False: without one, the user chose so
                    logger_off_by_choice=not trainer.loggers, log_every_n_steps=trainer.log_every_n_steps,
                    held_elsewhere=lambda: callbacks_held_tensors(trainer, self))

    def _evaluation_start(self, trainer, pl_module, phase: str) -> None:
        """A loop of ``phase`` starts: with no fit in progress the guard starts measuring (its own files), then the
        loop's step is wrapped on the instance."""
        self._spawned.begin_run()  # in this process (an evaluation of its own fit: already begun)
        self._engine.begin_evaluation(phase, pl_module, trainer.strategy.root_device, self._host(trainer),
                                      None if trainer.fast_dev_run else run_dir(trainer),
                                      alone=lambda: EvaluationAlone.of(trainer.strategy.model))
        self._hand_off(trainer)
        self._evaluation.wrap(trainer, pl_module, phase)

    def _hand_off(self, trainer) -> None:
        """In a rank spawned or forked by the launching process: tells it where this run's files are."""
        files = self._engine.monitor.files
        self._spawned.hand_off(files.history.path, files.events.path, trainer.local_rank,
                               lambda message: memguard_warn(message, trainer))

    def _hand_off_state(self, trainer) -> None:
        """In a rank spawned or forked by the launching process: tells it where the fit left the rungs."""
        self._spawned.hand_off_state(self._engine.state_dict(), trainer.local_rank,
                                     lambda message: memguard_warn(message, trainer))

    def _evaluation_end(self, phase: str) -> None:
        self._evaluation.unwrap(phase)
        self._engine.end_evaluation()  # only what begin_evaluation began: a fit goes on

    def _stop(self) -> None:
        """Idempotent: flushes everything and releases the sources (end of training, exception or teardown)."""
        self._evaluation.unwrap()
        self._engine.end_evaluation()
        self._runner.uninstall()
        self._engine.stop()


def _one_guard_per_trainer(trainer) -> None:
    """Raises ValueError when the Trainer has more than one MemGuardCallback: each would measure, log under the same
    keys, write the same files and change the same training step (precision, checkpointed blocks, micro-batches)."""
    guards = [callback for callback in trainer.callbacks if isinstance(callback, MemGuardCallback)]
    if len(guards) > 1:
        keys = ", ".join(repr(guard.state_key) for guard in guards)
        raise ValueError(f"the Trainer has {len(guards)} MemGuardCallback instances (state keys {keys}); one guards "
                         "the whole training step (its precision, checkpointed blocks and micro-batches) and writes "
                         "the run's memguard_* files: pass one MemGuardCallback with all its settings")
