"""The random number generators a training step draws from, saved and put back.

A training step may draw random numbers: dropout's masks, a diffusion model's noise and timesteps
(``torch.randn_like(latents)``, ``torch.randint(...)`` in ``training_step``), augmentation (``random``, NumPy). The
guard runs a step, or part of one, where unguarded training does not, in two places:

- an estimate runs the training step on a copy of the model: on the CPU path every draw is real, and on the meta path
  so is what is computed from the batch alone (a real batch's noise). The generators are put back after it, so that a
  guarded run that never acts trains as an unguarded one, draw for draw, and one that acts is not changed by its
  estimates;
- a batch run again after an out-of-memory error: torch's generators are put back where they were when the failed
  attempt began, so the retry draws what the attempt drew (a rescue by checkpointed blocks then trains as an unguarded
  run on a larger device; micro-batches draw per micro-batch, other numbers of the same distribution).

Kept: torch's default CPU generator, the current CUDA device's default generator (where CUDA is initialised: one
device a process, as the guard runs), and for an estimate Python's ``random`` and NumPy's global generator too (where
NumPy is loaded). A ``torch.Generator``, ``random.Random`` or NumPy ``Generator`` object of the user's own is not
reached. Framework-free.
"""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Callable, Iterator

import torch

__all__ = ["random_state_kept", "save_random_state"]


def save_random_state(python: bool = True) -> Callable[[], None]:
    """Reads the generators now; returns the function that puts them back as they were (callable many times).
    ``python=False`` reads torch's only (a microsecond, where Python's and NumPy's take about 60 µs together: before
    every training batch's attempt)."""
    cpu = torch.get_rng_state()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # never initialises CUDA itself
        device = torch.cuda.current_device()
        cuda = device, torch.cuda.get_rng_state(device)
    python_state = random.getstate() if python else None
    numpy = sys.modules.get("numpy") if python else None
    numpy_state: Any = numpy.random.get_state() if numpy is not None else None

    def restore() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda[1], cuda[0])
        if python_state is not None:
            random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)

    return restore


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Inside, draw as you like: after the block (also one that raises) the generators are as they were before it."""
    restore = save_random_state()
    try:
        yield
    finally:
        restore()
