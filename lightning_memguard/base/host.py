"""What a front door tells the guard about its framework (framework-free: plain callables)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .checks import warn as default_warn

__all__ = ["Host"]

_log = logging.getLogger("lightning_memguard")


def _ignore(*args: Any) -> None:
    return None


@dataclass
class Host:
    """What a front door tells the engine about its framework: where metrics and event texts go, how to warn, and,
    with several processes, how to take the maximum over ranks.

    Attributes:
        log_metrics: ``(metrics, step)`` to every logger.
        log_text: ``(sentence, step)`` of an event, for TensorBoard's text tab (rank zero).
        add_layout: the custom-scalars layout (a TensorBoard layout dict), once at start (rank zero).
        warn: a warning to the user (rank zero).
        info: a notice (rank zero).
        reduce_max: the element-wise maximum over ranks of a list of ints; ``None`` in one process.
        rank: this process's rank (its files get a ``.rank<N>`` suffix unless 0).
        world_size: the number of processes.
        has_logger: whether metrics go anywhere (else one warning says where the files are).
        logger_off_by_choice: without a logger, whether the user turned logging off (``Trainer(logger=False)``,
            ``tensorboard=False``): where the files are is then a notice, not a warning.
        log_every_n_steps: the front door's logging interval when the settings leave it to the front door; 0: the
            front door logs nothing (``Trainer(log_every_n_steps=0)``, as ``barebones=True`` sets it).
        held_elsewhere: the tensors the run holds outside the module, its optimizers and the batch (a callback's
            averaged copy of the model), made before a CPU accountant starts counting: it learns of them then.
    """

    log_metrics: Callable[[dict, int], None] = _ignore
    log_text: Callable[[str, int], None] = _ignore
    add_layout: Callable[[dict], None] = _ignore
    warn: Callable[[str], None] = default_warn
    info: Callable[[str], None] = _log.info
    reduce_max: Optional[Callable[[list[int]], list[int]]] = None
    rank: int = 0
    world_size: int = 1
    has_logger: bool = True
    logger_off_by_choice: bool = False
    log_every_n_steps: int = 1
    held_elsewhere: Callable[[], list] = list
