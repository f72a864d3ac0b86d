"""Argument checks shared by every public entry point, and the package's warning category (framework-free).

Every check raises ``ValueError`` naming the argument, the value and what is allowed, so bad input fails at the
door and not deep inside training.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
from typing import Any, Optional

__all__ = ["MemGuardWarning", "install_warning_format", "warn", "caller_stacklevel", "check_int", "check_number",
           "check_bool", "check_size"]

#: the package's folder, and the files whose frames stand between a caller and the package (a decorator's)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_BETWEEN = {contextlib.__file__}


class MemGuardWarning(UserWarning):
    """A warning from lightning-memguard. Printed as its sentence alone, without the source line it came from."""


def _format_warning(previous):
    def format_warning(message, category, filename, lineno, line=None):
        if isinstance(category, type) and issubclass(category, MemGuardWarning):
            return f"{message}\n"
        return previous(message, category, filename, lineno, line)

    format_warning._memguard = True
    return format_warning


def install_warning_format() -> None:
    """Puts the sentence-alone format in front of ``warnings.formatwarning``, chained, not replaced. Lightning's
    packages (``lightning`` and the standalone ``pytorch_lightning``/``lightning_fabric``) install their own at import,
    in any order, so it is checked again before every warning."""
    if not getattr(warnings.formatwarning, "_memguard", False):
        warnings.formatwarning = _format_warning(warnings.formatwarning)


install_warning_format()


def warn(message: str) -> None:
    """Warns with :class:`MemGuardWarning` (shown once per message by Python's default filter)."""
    install_warning_format()
    warnings.warn(message, MemGuardWarning, stacklevel=2)


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised by the function calling this at the first caller outside the
    package (a user's line, not the package's own or a decorator's frame): however deep the package called itself."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                 or frame.f_code.co_filename in _BETWEEN):
        frame, level = frame.f_back, level + 1
    return level


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")
    return value


def check_int(name: str, value: Any, minimum: int = 1, none_means: Optional[str] = None) -> Optional[int]:
    """An int ``>= minimum`` (bools refused); ``None`` too when ``none_means`` says what it means."""
    if value is None and none_means is not None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        if none_means is not None:
            allowed += f" or None ({none_means})"
        raise ValueError(f"{name}={value!r} must be {allowed}")
    return value


def check_number(name: str, value: Any, low: float, high: float, low_open: bool = False,
                 high_open: bool = False) -> float:
    """A finite real number in the interval; ``low_open``/``high_open`` exclude that end."""
    interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (value > low if low_open else value >= low) and (value < high if high_open else value <= high))
    if not ok:
        raise ValueError(f"{name}={value!r} must be a number in {interval}")
    return float(value)


def check_size(name: str, value: Any, none_means: Optional[str] = None) -> Optional[int]:
    """A size in bytes (see :func:`~lightning_memguard.base.snapshot.parse_bytes`); ``None`` when ``none_means``."""
    from .snapshot import parse_bytes

    if value is None and none_means is not None:
        return None
    return parse_bytes(value, name)
