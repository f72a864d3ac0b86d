"""The largest per-rank batch a step fits in, predicted by the estimate: no training, no trial out-of-memory errors.

A step's peak grows about linearly in the samples (activations scale with the batch; parameters, gradients and
optimizer state do not), so two estimates place the line, one more checks the size it points to, and a bisection
settles the last samples where the line was off. Each estimate is one rank's under ``strategy`` (DDP or FSDP2 over
``world_size`` ranks), so the size is the per-rank batch — what ``DataLoader(batch_size=...)`` takes on every rank.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from ..base.batches import batch_size_of, batch_tensors, map_tensors, per_sample_lists, select_packed
from ..base.checks import check_int, check_number, check_size
from ..base.snapshot import format_bytes
from ..mitigations.checkpointing import BlockSpec
from .copies import OptimizerSpec
from .memory import estimate_memory

__all__ = ["largest_batch", "batch_of_size"]


def batch_of_size(batch: Any, size: int) -> Any:
    """``batch`` with ``size`` samples: every tensor whose leading dimension is the batch's sample count gets its
    samples repeated cyclically (or cut) to ``size``, as do a ``PackedSequence``'s sequences and the per-sample lists a
    split cuts (strings, a detection batch's targets: :func:`~lightning_memguard.base.batches.slice_batch`); other
    tensors stay as they are."""
    samples = batch_size_of(batch)
    if samples is None:
        raise ValueError("the example batch has no tensor with a sample dimension (dim 0) to scale")
    rows = torch.arange(size) % samples
    per_sample = per_sample_lists(batch, samples)

    def repeated(values):
        return type(values)(values[int(i)] for i in rows) if len(values) == samples else values

    return map_tensors(lambda t: t[rows.to(t.device)] if t.dim() > 0 and t.shape[0] == samples else t, batch,
                       repeated, lambda packed: select_packed(packed, rows), whole=per_sample)


def largest_batch(
    model: nn.Module,
    batch: Any,
    budget: int | str,
    precision: str = "32-true",
    target: Optional[str] = None,
    strategy: Optional[str] = None,
    world_size: Optional[int] = None,
    optimizer: OptimizerSpec = None,
    loss_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
    threshold: float = 0.9,
    blocks: BlockSpec = None,
    max_size: int = 2**20,
    batches_ahead: int = 0,
) -> int:
    """The largest number of samples per rank whose estimated step peak stays under ``threshold × budget``.

    Samples are counted along dim 0 of ``batch`` (an example batch of any size: its samples are repeated to make
    larger ones). A handful of estimates (:func:`~lightning_memguard.estimate_memory`, on the meta device where the
    step allows): at one sample and at the example's size (the line), at the size the line points to (the check),
    and a bisection where the check fails or the next size still fits.

    Args:
        model: an ``nn.Module`` or a LightningModule (on CPU or meta; or already sharded by FSDP2), unsharded.
        batch: one example batch as the training step receives it.
        budget: the memory of one device in bytes or as a size string (``"80GiB"``).
        precision / target / optimizer / loss_fn / blocks: as :func:`~lightning_memguard.estimate_memory` takes
            them (``optimizer=None`` uses a LightningModule's ``configure_optimizers``).
        strategy / world_size: ``"ddp"`` or ``"fsdp"`` over ``world_size`` ranks (per-rank estimates), or ``None``.
        threshold: the share of ``budget`` a step may reach (the guard's threshold, 0.9 by default).
        max_size: the largest size looked at (a step whose peak does not grow with the batch returns it).
        batches_ahead: how many more batches of the size looked at stay in the target's memory through a step (a
            loader that fetches the next batch ahead into the same memory: Lightning's fetcher on a CPU target holds
            one), counted on top of each estimate.

    Raises:
        ValueError: a bad argument (naming it); a batch without a sample dimension to scale; a budget below what
            one sample needs ("not even one sample fits: X needed, Y available").
    """
    budget = check_size("budget", budget)
    threshold = check_number("threshold", threshold, 0, 1, low_open=True)
    max_size = check_int("max_size", max_size, minimum=1)
    batches_ahead = check_int("batches_ahead", batches_ahead, minimum=0)
    example = batch_size_of(batch)
    if example is None:
        raise ValueError("batch has no tensor with a sample dimension (dim 0) to scale: give a batch whose tensors "
                         "have the samples first")
    limit = int(threshold * budget)
    peaks: dict[int, int] = {}

    def peak(size: int) -> int:
        if size not in peaks:
            sized = batch_of_size(batch, size)
            kwargs = dict(optimizer=optimizer, precision=precision, loss_fn=loss_fn, blocks=blocks, target=target,
                          strategy=strategy, world_size=world_size)
            try:  # shapes only: a large batch costs no memory or FLOPs here
                peaks[size] = estimate_memory(model, sized, path="meta", **kwargs).peak_bytes
            except ValueError:  # the step reads values computed from the weights, or the model is not on CPU/meta
                peaks[size] = estimate_memory(model, sized, **kwargs).peak_bytes
            peaks[size] += batches_ahead * sum(tensor.nbytes for tensor in batch_tensors(sized))
        return peaks[size]

    if peak(1) > limit:
        raise ValueError(f"not even one sample fits: {format_bytes(peak(1))} needed, {format_bytes(limit)} available "
                         f"({threshold:g} of the {format_bytes(budget)} budget)")
    other = min(max(example, 2), max_size)
    if other == 1:
        return 1
    per_sample = (peak(other) - peak(1)) / (other - 1)
    if per_sample <= 0:
        return max_size
    guess = min(max_size, max(1, 1 + int((limit - peak(1)) / per_sample)))
    if peak(guess) <= limit:  # the line's size fits: look above it, in growing steps, until a size does not
        low, step = guess, max(1, guess // 64)
        while True:
            high = low + step
            if high > max_size:
                if peak(max_size) <= limit:
                    return max_size
                high = max_size
                break
            if peak(high) > limit:
                break
            low, step = high, step * 2
    else:
        low, high = 1, guess
    while high - low > 1:  # peak(low) fits, peak(high) does not
        middle = (low + high) // 2
        if peak(middle) <= limit:
            low = middle
        else:
            high = middle
    return low
