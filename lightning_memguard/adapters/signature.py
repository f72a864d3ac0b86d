"""How a front door declares the guard's settings as its own keyword arguments, while they stay declared once in
:class:`~lightning_memguard.guard.settings.GuardSettings` (and
:class:`~lightning_memguard.monitor.settings.MonitorSettings`, which it extends): what ``inspect.signature``,
``help`` and LightningCLI (jsonargparse) read."""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import fields
from typing import Callable, TypeVar

from ..guard.settings import GuardSettings
from ..monitor.settings import MonitorSettings

__all__ = ["takes_guard_settings"]


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
