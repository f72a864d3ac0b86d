"""Small files the guard writes: a file it cannot write is one warning, never the end of a run."""

from __future__ import annotations

from typing import Callable

from .checks import warn as default_warn

__all__ = ["write_text"]


def write_text(path: str, text: str, warn: Callable[[str], None] = default_warn) -> None:
    """Writes a small file; if it cannot be written, one warning and training goes on."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as err:
        warn(f"lightning-memguard: cannot write {path} ({err.strerror or err}); training goes on.")
