"""One way to put a wrapper in place of a method of one object for a while, and to take it away again.

The wrapper becomes an instance attribute: the class is never touched, so other instances are not affected and
taking the wrapper away is deleting an attribute. It remembers what the instance had under that name before — an
attribute someone set there (the user's own ``forward``, a step Lightning compiled, an LR scheduler's wrapper of
``optimizer.step``), else nothing — and :func:`unwrap_method` puts that back, or deletes the attribute so that the
class's method shows again. Each wrapper says what kind it is: a method is wrapped once per kind however often that
is asked, and only a wrapper of the kind asked for is taken away.

What to put back is kept on the wrapper itself, not in a table beside it: a deep copy or a pickle of the object
carries its wrapper together with what to put back. (A wrapper that must then run the copy rather than the original
is an object holding the instance, as :class:`~lightning_memguard.mitigations.checkpointed_call.CheckpointedForward`
is; a closure runs the original.) Framework-free.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["wrap_method", "unwrap_method", "wrapper_of"]

_KIND = "_memguard_wrapper_kind"  # on a wrapper: the kind given to wrap_method
_PREVIOUS = "_memguard_previous"  # on a wrapper: the instance attribute it replaced, or None


def wrapper_of(obj: Any, name: str, kind: str) -> Optional[Callable]:
    """The wrapper of ``kind`` that ``obj`` has as its instance attribute ``name``, or ``None``."""
    current = vars(obj).get(name)
    return current if getattr(current, _KIND, None) == kind else None


def wrap_method(obj: Any, name: str, kind: str, make_wrapper: Callable[[Callable], Callable]) -> bool:
    """Makes ``obj.<name>`` the wrapper ``make_wrapper(method)`` returns, ``method`` being what ``obj.<name>`` is now:
    an instance attribute, or the class's method bound to ``obj``.

    Args:
        obj: the object (a module, an optimizer, a Lightning loop); it needs a ``__dict__``.
        name: the method's name.
        kind: what the wrapper is for (``"checkpointing"``, ``"offload"``, ...): while ``obj`` has a wrapper of this
            kind under ``name``, nothing is done.
        make_wrapper: builds the wrapper around the method; the wrapper must take attributes (a function or an
            object with a ``__dict__``).

    Returns:
        Whether it wrapped (False: a wrapper of ``kind`` was there already).
    """
    if wrapper_of(obj, name, kind) is not None:
        return False
    previous = vars(obj).get(name)
    wrapper = make_wrapper(getattr(obj, name))
    setattr(wrapper, _KIND, kind)
    setattr(wrapper, _PREVIOUS, previous)
    # straight into the instance's __dict__, where wrapper_of looks (nn.Module's __setattr__ adds nothing here)
    object.__setattr__(obj, name, wrapper)
    return True


def unwrap_method(obj: Any, name: str, kind: str) -> bool:
    """Undoes :func:`wrap_method`: puts back the instance attribute the wrapper of ``kind`` replaced, or deletes the
    wrapper so that the class's method shows again. Returns whether there was such a wrapper (a method without one,
    or with somebody else's wrapper on top, is left as it is)."""
    wrapper = wrapper_of(obj, name, kind)
    if wrapper is None:
        return False
    previous = getattr(wrapper, _PREVIOUS, None)
    if previous is None:
        object.__delattr__(obj, name)
    else:
        object.__setattr__(obj, name, previous)
    return True
