"""Running buffers (BatchNorm's running mean, variance and batch count, and any buffer a forward updates in place)
saved before an attempt of a batch and put back when the attempt fails, so that a retried batch updates them once,
as unguarded training does. Framework-free."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["RunningBuffers"]


class RunningBuffers:
    """Saves and restores the buffers of ``module`` that training updates in place.

    Which buffers: those of modules that track running statistics (BatchNorm, InstanceNorm with
    ``track_running_stats``), and any other buffer whose version counter moved during an attempt (learned: saved from
    the next attempt on; BatchNorm's kernel does not bump the version of the running statistics it updates, so those
    are known by their module). Nothing is copied for a model without such buffers; the others are copied into
    tensors kept for the fit with one ``_foreach_copy_`` per attempt. Constant buffers (causal masks, rotary tables)
    are never copied: only their version counters are read, which costs no device synchronisation.

    Args:
        module: the model being trained.
        warn: says once that a buffer changed by a failed attempt could not be put back (it was not known yet).
    """

    def __init__(self, module: nn.Module, warn: Callable[[str], None]) -> None:
        self.warn = warn
        self._buffers = dict(_named_buffers(module))
        self._running = {name for name, mod in _buffer_owners(module)
                         if getattr(mod, "track_running_stats", False)}
        self._copies: dict[str, torch.Tensor] = {}
        self._versions: dict[str, int] = {}
        self._saved: list[str] = []
        self._warned = False

    def save(self) -> None:
        """Before an attempt: remembers every buffer's version and copies the running ones."""
        self._versions = {name: buf._version for name, buf in self._buffers.items()}
        names = self._saved = [name for name in self._running if name in self._buffers]
        if not names:
            return
        for name in names:
            if name not in self._copies or self._copies[name].shape != self._buffers[name].shape:
                self._copies[name] = torch.empty_like(self._buffers[name])
        with torch.no_grad():
            torch._foreach_copy_([self._copies[n] for n in names], [self._buffers[n] for n in names])

    def changed(self) -> list[str]:
        """Buffers updated since :meth:`save`."""
        return [name for name, buf in self._buffers.items() if buf._version != self._versions.get(name, buf._version)]

    def restore(self) -> None:
        """After a failed attempt: puts back the buffers it updated (and learns to save those it could not)."""
        # every saved buffer goes back, changed or not: BatchNorm's kernel updates its running statistics without
        # bumping their version counters (only num_batches_tracked's moves)
        back = self._saved
        if back:
            with torch.no_grad():
                torch._foreach_copy_([self._buffers[n] for n in back], [self._copies[n] for n in back])
        lost = [name for name in self.changed() if name not in set(back)]
        if lost:
            self._running.update(lost)
            if not self._warned:
                self._warned = True
                self.warn(f"lightning-memguard: the failed attempt updated buffers that were not saved before it "
                          f"({', '.join(lost[:5])}{', ...' if len(lost) > 5 else ''}); the retry starts from their "
                          "updated values. They are saved before every attempt from now on.")
        self._versions = {name: buf._version for name, buf in self._buffers.items()}


def _named_buffers(module: nn.Module):
    return ((name, buf) for name, buf in module.named_buffers() if isinstance(buf, torch.Tensor))


def _buffer_owners(module: nn.Module):
    """``(buffer name, owning module)`` for every buffer."""
    for prefix, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None:
                yield (f"{prefix}.{name}" if prefix else name), mod

