"""The settings every front door takes, checked once at construction (framework-free)."""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Sequence, TypeVar

from ..base.checks import check_bool, check_int, check_number
from ..mitigations.checkpointing import BlockSpec, validate_block_spec
from ..mitigations.microbatch import MicroBatchWeight, validate_microbatch_weight
from ..monitor.settings import MonitorSettings
from .ladder import DEFAULT_LADDER, Mitigation, validate_ladder

__all__ = ["GuardSettings", "takes_guard_settings"]


@dataclass
class GuardSettings(MonitorSettings):
    """The settings of one guard, the same for every front door (:class:`~lightning_memguard.MemGuardCallback`,
    :class:`~lightning_memguard.MemGuard`, :class:`~lightning_memguard.FabricMemGuard`), checked at construction.
    Every front door takes them by keyword or as ``settings=GuardSettings(...)`` (see :meth:`from_keywords`). This
    class is their one declaration: it extends what is measured and logged
    (:class:`~lightning_memguard.monitor.settings.MonitorSettings`: ``budget``, ``explain``, ``log_every_n_steps``,
    ``cpu_sample_every``, ...), which the monitor takes as one object, with what acts on the numbers. Each front door's
    signature and constructor docstring are generated from the fields and the ``Args`` of both
    (:func:`takes_guard_settings`), so ``inspect.signature``, ``help`` and
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
            evaluation batch run in parts weighs their scalars and logged means by it. ``None``: the labels that are
            not -100 (after the causal-LM shift for a transformers causal LM) when the batch carries ``labels``, else
            the samples; see :mod:`lightning_memguard.mitigations.microbatch`.
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


_Init = TypeVar("_Init", bound=Callable[..., None])


def takes_guard_settings(init: _Init) -> _Init:
    """Declares a front door's ``__init__(self, ..., settings=None, **keywords)`` as taking every setting of
    :class:`GuardSettings` as a typed keyword argument: its ``__signature__`` lists the settings in place of
    ``settings`` and ``**keywords`` (type and default from the dataclass fields) and its docstring documents them
    (from the ``Args`` of :class:`GuardSettings` and of what it extends). ``inspect.signature``, ``help`` and
    jsonargparse (LightningCLI's ``init_args``, its ``--print_config`` and its check of unknown keys) then read them
    as parameters of the front door, while they stay declared once. The call itself still goes through
    ``**keywords`` and :meth:`GuardSettings.from_keywords`."""
    signature = inspect.signature(init)
    hints = typing.get_type_hints(init)
    # ``settings=`` stays a Python convenience outside the declared signature: a configuration file names each
    # setting, and jsonargparse passes every parameter (defaults included), which next to ``settings`` would read as
    # both given
    own = [parameter.replace(annotation=hints.get(parameter.name, parameter.annotation))
           for parameter in signature.parameters.values()
           if parameter.kind is not inspect.Parameter.VAR_KEYWORD and parameter.name != "settings"]
    settings_hints = typing.get_type_hints(GuardSettings)
    settings = [inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default,
                                  annotation=settings_hints[field.name]) for field in _fields()]
    init.__signature__ = signature.replace(parameters=own + settings, return_annotation=None)
    docs = _settings_docs()
    entries = "\n".join(f"    {name}: {docs.get(name, '')}" for name in (field.name for field in _fields()))
    init.__doc__ = ((inspect.cleandoc(init.__doc__) + "\n\n") if init.__doc__ else "") + (
        "The guard's settings, by keyword (or all as one ``settings=GuardSettings(...)``; not both); declared in "
        ":class:`~lightning_memguard.GuardSettings`.\n\nArgs:\n" + entries)
    return init


def _fields() -> list:
    """The settings in the order a reader meets them: what acts first (``threshold``), then what is measured."""
    own = [field for field in fields(GuardSettings) if field.name not in MonitorSettings.__dataclass_fields__]
    return own + list(fields(MonitorSettings))


def _settings_docs() -> dict[str, str]:
    """Each setting's description, read from the ``Args`` sections of :class:`GuardSettings`'s and
    :class:`MonitorSettings`'s docstrings (Google style: ``name: text`` one indent in, continuation lines deeper), one
    line each."""
    docs: dict[str, str] = {}
    for owner in (GuardSettings, MonitorSettings):
        lines = inspect.cleandoc(owner.__doc__ or "").splitlines()  # no docstrings under python -OO
        name = None
        for line in lines[lines.index("Args:") + 1:] if "Args:" in lines else []:
            if line and not line.startswith(" "):  # the next section (Raises:)
                break
            entry = re.match(r"^    (\w+): (.*)$", line)
            if entry:
                name = entry.group(1)
                docs[name] = entry.group(2)
            elif name is not None and line.strip():
                docs[name] += " " + line.strip()
    return docs  # a field missing here is found by tests/unit/test_front_doors.py
