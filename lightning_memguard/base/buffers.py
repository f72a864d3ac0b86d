"""Buffers that a forward changes in place — BatchNorm's running mean, variance and batch count, and any buffer whose
version counter a forward moves — found once (:class:`BufferSlots`) for the two things done with them:

- :class:`RunningBuffers`: saved before an attempt of a batch and put back when the attempt fails, so that a retried
  batch updates them once, as unguarded training does;
- :class:`~lightning_memguard.mitigations.checkpointed_call.RecomputationBuffers`: a checkpointed block's
  recomputation in backward starts from what its forward saw and leaves them as the forward left them.

Framework-free."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm as SpectralNormHook

__all__ = ["BufferSlots", "RunningBuffers"]


def _keeps_running_state(owner: nn.Module) -> bool:
    """Whether ``owner``'s buffers are updated by every training forward: running statistics, or a spectral norm's
    power iteration (its parametrization module, or the module its pre-hook normalises)."""
    if getattr(owner, "track_running_stats", False) is True or isinstance(owner, _SpectralNorm):
        return True
    return any(isinstance(hook, SpectralNormHook) for hook in owner._forward_pre_hooks.values())


class BufferSlots:
    """The buffers of ``module``, read through their owning modules, and which of them a forward changes.

    Which: the buffers of modules keeping running statistics (``track_running_stats``: BatchNorm, InstanceNorm) —
    known by their module, because the batch-norm kernel updates the running mean and variance without moving their
    version counters (only ``num_batches_tracked``'s moves) — and a spectral norm's power-iteration vectors (both of
    torch's: the parametrization's ``_u``/``_v``, the hook's ``weight_u``/``weight_v``), which every training forward
    reads and moves: known by their module too, so the first recomputation of a checkpointed block, and a batch run
    again, see what the forward saw; and any other buffer that a forward replaced or whose
    version counter it moved (:meth:`moved`). Reading counters costs no device synchronisation, so constant buffers
    (causal masks, rotary tables) are watched for nothing and never copied.

    Attributes:
        slots: each buffer as ``(owning module, attribute)``; a buffer is read through its owner at every call (one
            replaced by assignment is the new one).
        names: the buffers' qualified names, in the order of ``slots``.
        statistics: the indices of the buffers of modules keeping running statistics.
    """

    def __init__(self, module: nn.Module) -> None:
        modules = list(module.named_modules())
        self.slots = [(owner, key) for _, owner in modules for key in owner._buffers]
        self.names = [f"{prefix}.{key}" if prefix else key for prefix, owner in modules for key in owner._buffers]
        self.statistics = [i for i, (owner, _) in enumerate(self.slots) if _keeps_running_state(owner)]

    def tensors(self) -> list[Optional[torch.Tensor]]:
        """The buffers now (``None`` where a module holds ``None``)."""
        return [owner._buffers.get(key) for owner, key in self.slots]

    @staticmethod
    def versions(tensors: list[Optional[torch.Tensor]]) -> list[Optional[int]]:
        """Their version counters (in-place updates move them)."""
        return [None if t is None else t._version for t in tensors]

    def moved(self, tensors: list[Optional[torch.Tensor]], versions: list[Optional[int]]) -> list[int]:
        """The indices of the buffers replaced, or updated in place, since ``tensors`` and ``versions`` were read."""
        return [i for i, t in enumerate(self.tensors())
                if t is not None and (t is not tensors[i] or t._version != versions[i])]

    def with_their_modules(self, indices: Iterable[int]) -> set[int]:
        """``indices`` and the other buffers of the same modules: a kernel may update a buffer without moving its
        counter when it moves a sibling's (``batch_norm`` moves only ``num_batches_tracked``'s)."""
        owners = {id(self.slots[i][0]) for i in indices}
        return {i for i, (owner, _) in enumerate(self.slots) if id(owner) in owners}


class RunningBuffers:
    """Saves and restores the buffers of ``module`` that training updates in place.

    Which buffers: those of modules that track running statistics, and any other buffer a failed attempt updated
    (learned: saved from the next attempt on) — :class:`BufferSlots`. Nothing is copied for a model without such
    buffers; the others are copied into tensors kept for the fit with one ``_foreach_copy_`` per attempt.

    Args:
        module: the model being trained.
        warn: says once that a buffer changed by a failed attempt could not be put back (it was not known yet).
    """

    def __init__(self, module: nn.Module, warn: Callable[[str], None]) -> None:
        self.warn = warn
        self._slots = BufferSlots(module)
        self._running = sorted(self._slots.statistics)  # saved before every attempt
        self._copies: dict[int, torch.Tensor] = {}
        self._tensors: list[Optional[torch.Tensor]] = self._slots.tensors()  # as the last save() read them
        self._versions = BufferSlots.versions(self._tensors)
        self._saved: list[int] = []
        self._warned = False

    @property
    def copied(self) -> frozenset[str]:
        """The names of the buffers a copy is kept of: the running statistics, and the buffers a failed attempt was
        seen to update — never a constant buffer."""
        return frozenset(self._slots.names[i] for i in self._copies)

    def save(self) -> None:
        """Before an attempt: remembers every buffer's version and copies the running ones."""
        if not self._slots.slots:  # a model without buffers: nothing to remember, every step
            return
        tensors = self._tensors = self._slots.tensors()
        self._versions = BufferSlots.versions(tensors)
        saved = self._saved = [i for i in self._running if tensors[i] is not None]
        if not saved:
            return
        for i in saved:
            if i not in self._copies or self._copies[i].shape != tensors[i].shape:
                self._copies[i] = torch.empty_like(tensors[i])
        with torch.no_grad():
            torch._foreach_copy_([self._copies[i] for i in saved], [tensors[i] for i in saved])

    def changed(self) -> list[str]:
        """Buffers updated since :meth:`save`."""
        return [self._slots.names[i] for i in self._slots.moved(self._tensors, self._versions)]

    def restore(self) -> None:
        """After a failed attempt: puts back the buffers it updated (and learns to save those it could not)."""
        # every saved buffer goes back, changed or not: BatchNorm's kernel updates its running statistics without
        # bumping their version counters (only num_batches_tracked's moves)
        back = self._saved
        if back:
            with torch.no_grad():
                torch._foreach_copy_([self._tensors[i] for i in back], [self._copies[i] for i in back])
        lost = sorted(set(self._slots.moved(self._tensors, self._versions)) - set(back))
        if lost:
            self._running = sorted(set(self._running) | set(lost))
            if not self._warned:
                self._warned = True
                names = [self._slots.names[i] for i in lost]
                self.warn(f"lightning-memguard: the failed attempt updated buffers that were not saved before it "
                          f"({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}); the retry starts from their "
                          "updated values. They are saved before every attempt from now on.")
        self._tensors = self._slots.tensors()
        self._versions = BufferSlots.versions(self._tensors)
