"""The settings every front door takes, checked once at construction (framework-free)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Sequence

from ..base.checks import check_bool, check_int, check_number
from ..mitigations.checkpointing import BlockSpec, validate_block_spec
from ..mitigations.microbatch import MicroBatchWeight, validate_microbatch_weight
from ..monitor.settings import MonitorSettings
from .ladder import DEFAULT_LADDER, Mitigation, validate_ladder

__all__ = ["GuardSettings"]


@dataclass
class GuardSettings(MonitorSettings):
    """The settings of one guard, the same for every front door (:class:`~lightning_memguard.MemGuardCallback`,
    :class:`~lightning_memguard.MemGuard`, :class:`~lightning_memguard.FabricMemGuard`), checked at construction.
    Every front door takes them by keyword or as ``settings=GuardSettings(...)`` (see :meth:`from_keywords`). This
    class is their one declaration: it extends what is measured and logged
    (:class:`~lightning_memguard.monitor.settings.MonitorSettings`: ``budget``, ``explain``, ``log_every_n_steps``,
    ``cpu_sample_every``, ...), which the monitor takes as one object, with what acts on the numbers. Each front door's
    signature and constructor docstring are generated from the fields and the ``Args`` of both
    (:func:`~lightning_memguard.adapters.signature.takes_guard_settings`), so ``inspect.signature``, ``help`` and
    LightningCLI (jsonargparse) see every setting as a typed, documented keyword argument.

    Example::

        settings = GuardSettings(budget="2GiB", mitigations=("amp", "checkpointing"))
        guard = MemGuard(model, optimizer, settings=settings)  # the same as MemGuard(model, optimizer, budget=...)

    Args:
        threshold: act when a phase peak reaches ``threshold × capacity``; in (0, 1].
        mitigations: the ladder, rungs tried in order (``None``: the default ladder): ``"amp"`` (bf16 or fp16
            mixed precision; left out of the default ladder on a CPU without native bf16, where it would be many
            times slower),
            ``"checkpointing"`` (activation checkpointing of repeated blocks) and ``"microbatch"`` (the batch run as
            2, 4, ... micro-batches inside one optimizer step) by default; ``"offload"`` (saved
            activations to pinned host memory, CUDA only) can be added last. A
            :class:`~lightning_memguard.Rung` of your own may stand anywhere among the names. ``()``: warn and log
            only.
        blocks: which modules the checkpointing rung may checkpoint: ``None`` detects repeated blocks (every
            ModuleList/Sequential of same-class children), or module classes, or a ``(name, module) -> bool``.
        min_gain: keep a rung only if the step peak fell by at least this share; otherwise revert it.
        rescue_oom: when the forward or backward of a batch runs out of memory, free the failed attempt, apply the
            next rung and run the same batch again (one process; with several processes the failing rank reports
            and the run stops). When every rung is at its top,
            :class:`~lightning_memguard.MemGuardOutOfMemoryError` is raised with a memory report.
        max_retries: retries of one batch before giving up; ``None`` climbs the ladder to its top (at most 16
            attempts a batch).
        plan_at_start: before the first step, estimate the step from the first batch
            (:func:`~lightning_memguard.plan_configuration`) and start with the cheapest configuration that fits
            (AMP, checkpointed blocks and micro-batches together where that is what fits), so a run that would run
            out of memory starts mitigated. On CUDA the estimate is the CUDA one (a meta-device copy through the
            CUDA kernel model, AMP included). ``None`` (the default): plan where the estimate the guard makes of the
            first batch anyway (to predict its rungs' levels) puts the step over 95 % of the capacity, or what no
            rung lowers (parameters, gradients, optimizer state) over it — then a ``cannot_help`` event says so
            before the first step and no rung is raised; else leave the step to the closed loop. ``True``: always
            plan; ``False``: never.
        microbatch_weight: what the loss of a batch averages over, as a callable ``batch -> number`` (e.g. the
            tokens that count in it, for a loss you compute yourself); the micro-batch rung multiplies each
            micro-batch's loss by its share of the total, so that the summed gradients are the whole batch's, and an
            evaluation batch run in parts weighs their scalars and logged means by it. ``"sum"``: the loss adds up
            its samples (``reduction="sum"``): the micro-losses are added unweighted. ``None``: the labels that are
            not -100 (after the causal-LM shift for a transformers causal LM; a segmentation model's own ignored
            label) when the batch carries ``labels``, or in its one integer tensor that holds -100 (labels padded
            for torch's ``cross_entropy``), a time-series model's observed future points, else the samples; see
            :mod:`lightning_memguard.mitigations.microbatch`.
        speed_trial: once the levels settle on checkpointed blocks and the estimate predicts that one more
            micro-batch halving with fewer checkpointed blocks fits under the same line, time both on real steps (a
            warm-up step, then 3 timed steps each) and keep the faster, saying why with both timings (a
            ``speed_keep`` event). Once per fit, again only where memory changes the levels. One process and
            automatic optimization only (with several ranks, or manual optimization, it is off), and not where
            micro-batches are known to change the numbers (BatchNorm layers, a router load-balancing loss).
            ``False``: keep the fixed order (fewest micro-batches, then fewest blocks).
    Raises:
        ValueError: on a bad argument, naming it, the value and what is allowed.
    """

    threshold: float = 0.9
    mitigations: Optional[Sequence[Mitigation]] = None
    blocks: BlockSpec = None
    min_gain: float = 0.03
    rescue_oom: bool = True
    max_retries: Optional[int] = None
    plan_at_start: Optional[bool] = None
    microbatch_weight: Optional[MicroBatchWeight] = None
    speed_trial: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        # every argument is checked here, so a bad one fails now and not deep inside training
        self.threshold = check_number("threshold", self.threshold, 0, 1, low_open=True)
        self.min_gain = check_number("min_gain", self.min_gain, 0, 1, high_open=True)
        # the default ladder adapts to the hardware; a named one is kept. None, not the tuple itself, says "default":
        # a configuration file (LightningCLI) passes a default back as a list, no longer the same object
        self.default_ladder = self.mitigations is None or self.mitigations is DEFAULT_LADDER
        self.mitigations = DEFAULT_LADDER if self.default_ladder else validate_ladder(self.mitigations)
        validate_block_spec(self.blocks)
        self.rescue_oom = check_bool("rescue_oom", self.rescue_oom)
        if self.plan_at_start is not None and not isinstance(self.plan_at_start, bool):
            raise ValueError(f"plan_at_start={self.plan_at_start!r} must be None (plan where the first batch's "
                             "estimate says the step cannot fit), True (always plan) or False (never)")
        check_int("max_retries", self.max_retries, none_means="climb the ladder to its top, at most 16 attempts")
        validate_microbatch_weight(self.microbatch_weight)
        self.speed_trial = check_bool("speed_trial", self.speed_trial)

    @classmethod
    def from_keywords(cls, settings: Optional["GuardSettings"] = None, /, **keywords: Any) -> "GuardSettings":
        """What a front door builds from its arguments: ``settings`` when given, else the settings named by keyword.

        Raises:
            ValueError: both ``settings`` and keywords are given, ``settings`` is not a :class:`GuardSettings`, a
                keyword is not a setting (naming it and the allowed names), or a value is bad.
        """
        if settings is not None:
            if not isinstance(settings, GuardSettings):
                raise ValueError(f"settings={type(settings).__name__} must be a GuardSettings (or pass the settings "
                                 "by keyword)")
            if keywords:
                raise ValueError(f"settings=GuardSettings(...) and the keyword setting(s) {sorted(keywords)} were "
                                 "both given; pass the settings one way: all in the GuardSettings, or all by keyword")
            return settings
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(keywords) - set(names))
        if unknown:
            raise ValueError(f"unknown setting(s) {unknown}; allowed: {names}")
        return cls(**keywords)
