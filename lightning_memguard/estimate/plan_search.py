"""How a plan reads the peak model while it searches (framework-free): the block counts between one and all from the
model's line, except those that decide the pick, which are estimated (each estimate is a step run); a whole batch's
readings recorded for the plan's reason; the caching allocator's segments read through one
:class:`~lightning_memguard.base.prediction.ReservedSegments`."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable, Mapping, Optional

from ..base.prediction import PeakModel, ReservedSegments

__all__ = ["LINE_MARGIN", "PlanReader", "cost_of"]

#: how far over a plan's line the model's interpolation between block counts may put a configuration that the plan
#: then estimates (it might fit): the interpolation has been within 3 % of the estimates of the zoo's and the demo's
#: models (benchmarks/RESULTS.md); one it puts further over is taken to be over
LINE_MARGIN = 1.03

Read = Callable[[Mapping[str, int]], Optional[int]]
Found = Optional[tuple[dict[str, int], int]]


def cost_of(levels: Mapping[str, int]) -> tuple[int, int, int]:
    """What ``levels`` cost in the order a choice ranks them: micro-batch halvings, then blocks, then AMP."""
    return levels.get("microbatch", 0), levels["checkpointing"], int(levels["amp"])


class PlanReader:
    """The peaks a plan's search reads from ``peaks`` (exact with no block, one and every one of ``n_blocks``
    checkpointed, a line between), with a block count in between estimated once :meth:`settled` finds that it
    decides the pick: by ``measure`` (``(amp, blocks) -> peak``) for a whole batch, by ``measure_phases`` (``(amp,
    blocks) -> (forward peak, backward peak)``) for a split one; without them the line stands. A whole batch's
    readings are checked against ``segments`` (in ``limit``'s units where over their cap) and kept for
    :attr:`tried`."""

    def __init__(self, peaks: PeakModel, n_blocks: int, limit: int, segments: ReservedSegments,
                 measure: Optional[Callable[[bool, int], int]],
                 measure_phases: Optional[Callable[[bool, int], tuple[int, int]]]) -> None:
        self.peaks, self.n_blocks, self.limit, self.segments = peaks, n_blocks, limit, segments
        self._measure = functools.cache(measure) if measure is not None else None  # read more than once a search
        self._measure_phases = measure_phases
        self._tried: dict[tuple[bool, int], int] = {}
        self._refined: dict[tuple[int, int], PeakModel] = {}
        self._estimated: set[tuple[int, int]] = set()  # the block counts between one and all estimated so far

    @property
    def tried(self) -> list[tuple[bool, int, int]]:
        """The configurations of a whole batch read exactly, in the order read: (AMP, blocks, peak)."""
        return [(with_amp, blocks, peak) for (with_amp, blocks), peak in self._tried.items()]

    def on_line(self, levels: Mapping[str, int]) -> bool:
        """Whether ``levels`` are read from the model's line: blocks between one and all, not estimated yet, where
        they can be."""
        blocks = levels["checkpointing"]
        can = self._measure_phases if levels.get("microbatch", 0) else self._measure
        return 1 < blocks < self.n_blocks and can is not None and (levels["amp"], blocks) not in self._estimated

    def peak(self, levels: Mapping[str, int]) -> Optional[int]:
        """The allocated peak at ``levels`` as the search reads it now (a whole batch's over the segments' cap: in
        the limit's units)."""
        if self.on_line(levels):  # estimated only where it decides the pick (settled)
            return self.peaks.peak(levels)
        with_amp, blocks, micro = bool(levels["amp"]), levels["checkpointing"], levels.get("microbatch", 0)
        between = 0 < blocks < self.n_blocks
        if not micro:
            measure = self._measure
            predicted = measure(with_amp, blocks) if measure is not None and between else self.peaks.peak(levels)
            predicted = self.segments.reading(levels, predicted, self.limit)
            if predicted is not None:
                self._tried.setdefault((with_amp, blocks), predicted)
            return predicted
        model = self.peaks
        if self._measure_phases is not None and between:  # the model's line replaced by the estimate there
            key = (int(with_amp), blocks)
            if key not in self._refined:
                self._refined[key] = _with_phases(self.peaks, key[0], blocks,
                                                  *self._measure_phases(with_amp, blocks))
            model = self._refined[key]
        return model.peak(levels)

    def split_peak(self, levels: Mapping[str, int]) -> Optional[int]:
        """:meth:`peak` as a split's search reads it: through the segments where they are being checked."""
        return self.segments.peak(levels, self.peak(levels))

    def settled(self, search: Callable[[Read], Found], read: Read, line: float) -> Found:
        """``search(read)``'s pick, once every configuration it read from the model's line at no more cost than
        the pick, within ``LINE_MARGIN`` of ``line`` (it might fit: the line is a few per cent off the estimates,
        either way), is estimated — the cheapest such first, then searched again. A plan estimates what decides its
        pick, not every block count a bisection passes."""
        while True:
            doubtful: dict[tuple[int, int, int], Mapping[str, int]] = {}

            def noted(levels: Mapping[str, int]) -> Optional[int]:
                value = read(levels)
                if value is not None and self.on_line(levels) and value <= LINE_MARGIN * line:
                    doubtful[cost_of(levels)] = levels
                return value

            found = search(noted)
            if found is None:  # no block count's line was read unless every block fitted: nothing to settle
                return None
            unsure = [cost for cost in doubtful if cost <= cost_of(found[0])]
            if not unsure:
                return found
            first = doubtful[min(unsure)]
            self._estimated.add((first["amp"], first["checkpointing"]))


def _with_phases(peaks: PeakModel, amp: int, blocks: int, forward: int, backward: int) -> PeakModel:
    """``peaks`` with the phase peaks of ``blocks`` checkpointed blocks in precision ``amp`` replaced by estimated
    ones (the model draws a line there)."""
    e = peaks.by_amp[amp]
    f, b = list(e.forward), list(e.backward)
    f[blocks], b[blocks] = forward, backward
    return PeakModel({**peaks.by_amp, amp: replace(e, forward=f, backward=b)}, peaks.batch_size)
