"""The rung protocol: what MemGuard climbs. A rung has a ``name``, a number of ``levels`` above 0 (off) and
``apply(module, level)``, which puts the module at that level. The built-in rungs (AMP, activation checkpointing,
offload, micro-batching) follow it, and a user's rung passed in ``mitigations=`` beside their names is climbed,
verified (kept only where it lowers the peak), reverted, saved in ``state_dict``, reported and drawn like them::

    class HFGradientCheckpointing(Rung):
        name, levels = "hf_checkpointing", 1

        def apply(self, module, level):
            if level:
                module.gradient_checkpointing_enable()
            else:
                module.gradient_checkpointing_disable()

    MemGuardCallback(mitigations=("amp", HFGradientCheckpointing(), "microbatch"))

Levels are climbed one at a time from 0, between optimizer steps (or between a failed attempt of a batch and its
retry); ``apply`` must be reversible — level 0 must undo what the higher levels did — and must leave parameters and
their ``state_dict`` keys as they are. An ``apply`` that raises is one warning: the rung goes back to the level it had
and is not climbed again in that run.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from torch import nn

__all__ = ["Rung", "BuiltinRung", "check_rung", "BoundRung"]


class Rung:
    """Base class of a remedy MemGuard can climb; subclass it with ``name``, ``levels`` and :meth:`apply` (see the
    module docstring). ``safe_mid_step`` says whether the rung may change between a failed attempt of a batch and
    its retry inside one optimizer step (True for anything that only changes how the next forward runs)."""

    name: str = ""
    levels: int = 1
    safe_mid_step: bool = True

    def apply(self, module: nn.Module, level: int) -> None:
        """Puts ``module`` at ``level`` (0: as it was before the rung)."""
        raise NotImplementedError(f"{type(self).__name__}.apply(module, level) is not written")

    def unavailable_reason(self) -> Optional[str]:
        """Why this rung cannot act in this run, or ``None``. Override to switch a rung off with one warning."""
        return None

    def __getstate__(self) -> dict:
        # the levels it left models at stay in this process (a spawned DDP worker gets the rung, not those)
        state = dict(self.__dict__)
        state.pop("_memguard_levels", None)
        return state


class BuiltinRung(Rung):
    """The built-in rungs: bound to their model when built, each with ``max_level``, ``level`` and
    ``set_level(level)``; :meth:`apply` is ``set_level`` (the model is the one they were built for)."""

    max_level: int
    level: int

    @property
    def levels(self) -> int:  # type: ignore[override]
        return self.max_level

    def apply(self, module: nn.Module, level: int) -> None:
        self.set_level(level)

    def set_level(self, level: int) -> None:
        raise NotImplementedError


def check_rung(rung: Any) -> "Rung":
    """Checks a user's rung for ``mitigations=``: a :class:`Rung` with a non-empty ``name``, ``levels`` an int of at
    least 1 and its own ``apply`` (names are checked against each other by the ladder).

    Raises:
        ValueError: naming the rung and what is allowed.
    """
    if not isinstance(rung, Rung):
        raise ValueError(f"{rung!r} is neither a rung name (amp, checkpointing, offload, microbatch) nor "
                         "a lightning_memguard.Rung")
    name = rung.name
    if not isinstance(name, str) or not name.strip() or "/" in name:
        raise ValueError(f"the rung {type(rung).__name__} has name={name!r}; give it a non-empty name "
                         "without '/' (it becomes the key memguard/rung/<name>)")
    if isinstance(rung.levels, bool) or not isinstance(rung.levels, int) or rung.levels < 1:
        raise ValueError(f"the rung {name!r} has levels={rung.levels!r}; it must be an int >= 1 "
                         "(the levels above 0, which is off)")
    if type(rung).apply is Rung.apply:
        raise ValueError(f"the rung {name!r} ({type(rung).__name__}) does not define apply(module, level)")
    return rung


class BoundRung:
    """A user's :class:`Rung` bound to the model of one fit, with the level interface the ladder drives
    (``level``, ``max_level``, ``set_level``). The level a rung left a model at is remembered per model, so a second
    fit of the same model starts from it."""

    def __init__(self, rung: Rung, module: nn.Module) -> None:
        self.rung = rung
        self.module = module
        self.name = rung.name
        self.max_level = rung.levels
        self.safe_mid_step = rung.safe_mid_step
        self.level = _left_at(rung).get(module, 0)

    def unavailable_reason(self) -> Optional[str]:
        return self.rung.unavailable_reason()

    def set_level(self, level: int) -> None:
        if not 0 <= level <= self.max_level:
            raise ValueError(f"level={level} must be in [0, {self.max_level}] for the rung {self.name!r}")
        self.rung.apply(self.module, level)
        self.level = level
        _left_at(self.rung)[self.module] = level


def _left_at(rung: Rung) -> "weakref.WeakKeyDictionary[nn.Module, int]":
    # kept on the rung object (not on the model: a rung must leave the model's attributes alone); weak, so a model
    # the user drops is not kept alive by its rung
    levels = rung.__dict__.get("_memguard_levels")
    if levels is None:
        levels = rung.__dict__["_memguard_levels"] = weakref.WeakKeyDictionary()
    return levels
