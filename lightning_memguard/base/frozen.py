"""Building a frozen dataclass on the training thread's path, every step."""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["frozen_from_fields"]

T = TypeVar("T")


def frozen_from_fields(cls: type[T], **fields: Any) -> T:
    """The instance of the frozen dataclass ``cls`` that ``cls(**fields)`` builds, at about half its cost: a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__``. The caller gives every field, and ``cls``
    has no ``__post_init__`` and no ``__slots__``."""
    made = object.__new__(cls)
    made.__dict__.update(fields)
    return made
