"""DistributedDataParallel's first gradient buckets on the CPU accountant's count.

DDP allocates its buckets (one more copy of the gradients, which it reduces) when it wraps the module, before the
accountant starts, so the accountant never saw them: a DDP rank's first step on CPU was a gradient copy low. At the
start of the second training forward DDP builds them again (in the order the gradients became ready; not under
``find_unused_parameters=True`` without a static graph), and the new buckets, allocated while counting, showed as a
gradient copy more held after that step than before it — growth from which the guard predicted a next step over the
capacity and took a rung it did not need. So the first buckets are counted as held from the start and taken off the
count when DDP replaces them: DDP's ``_pre_forward``, where it rebuilds them before any activation exists, is wrapped
on the instance (not a hook on the user's module, which an estimate or an EMA callback deep-copies with its hooks)
until its flag says the rebuild ran; the new buckets were counted as they were allocated, and the peak is put back to
what it was, since DDP frees the first buckets before it makes the new ones (where the accountant sees the first
ones, in a plain loop, the second step's peak is the third's). Where the rebuild ran while the accountant was off (a
step not sampled), the new buckets were not counted and the first ones' bytes stand in for them."""

from __future__ import annotations

import re

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .cpu import CpuTensorAccountant

__all__ = ["FirstBuckets"]


class FirstBuckets:
    """The first buckets of ``ddp`` held on ``accountant``'s count until DDP rebuilds them (:meth:`close` ends the
    watch, the count left as it is). Nothing is held where ``ddp`` is not a DistributedDataParallel module that has
    yet to rebuild, or has no ``_pre_forward`` to watch (a torch that changed it)."""

    def __init__(self, accountant: CpuTensorAccountant, ddp: nn.Module) -> None:
        self._accountant, self._ddp, self._watching = accountant, ddp, False
        if (not isinstance(ddp, DistributedDataParallel) or getattr(ddp, "_has_rebuilt_buckets", True)
                or not callable(getattr(ddp, "_pre_forward", None))):
            return
        # a bucket each: where DDP writes a gradient into a bucket on the counted thread (its division by the
        # ranks, an out= op), the accountant sees that bucket's storage and counts it instead (CpuTensorAccountant.hold)
        sizes = _bucket_bytes(ddp)
        keys = [("ddp-first-bucket", id(ddp), index) for index in range(len(sizes))]
        for key, nbytes in zip(keys, sizes):
            accountant.hold(key, nbytes)
        pre_forward = ddp._pre_forward

        def watched(*args, **kwargs):
            peak = accountant.read(reset_peak=False).peak_bytes
            out = pre_forward(*args, **kwargs)
            if ddp._has_rebuilt_buckets:
                if accountant.started:  # the new buckets were counted as they were allocated, after the first freed
                    for key in keys:
                        accountant.release(key, peak_before=peak)
                self.close()
            return out

        ddp._pre_forward = watched
        self._watching = True

    def close(self) -> None:
        if self._watching:
            self._watching = False
            vars(self._ddp).pop("_pre_forward", None)


def _bucket_bytes(ddp: DistributedDataParallel) -> list[int]:
    """The bytes of each of DDP's buckets as its logging data gives them (``bucket_sizes``), else one bucket of the
    gradients of the parameters it reduces; none where there are none."""
    try:
        sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
        found = [int(size) for size in re.findall(r"\d+", sizes)]
    except Exception:  # a private API: where it changed, count from the parameters
        found = []
    if found:
        return [size for size in found if size]
    total = sum(p.numel() * p.element_size() for p in ddp.module.parameters() if p.requires_grad)
    return [total] if total else []
