"""Event texts and the custom-scalars layout for TensorBoard writers."""

from __future__ import annotations

from typing import Callable

__all__ = ["TensorBoardText"]


class TensorBoardText:
    r"""A host's ``log_text`` and ``add_layout`` for TensorBoard ``SummaryWriter``\ s (given by a function, as a
    logger opens its writer lazily)."""

    def __init__(self, writers: Callable[[], list]) -> None:
        self.writers = writers

    def log_text(self, message: str, step: int) -> None:
        for writer in self.writers():
            writer.add_text("memguard/events", message, global_step=step)

    def add_layout(self, layout: dict) -> None:
        for writer in self.writers():
            writer.add_custom_scalars(layout)
