"""The cheapest configuration that fits a capacity, chosen from estimates (framework-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..base.checks import check_bool, check_number, check_size
from ..base.prediction import PeakModel, PhaseEstimate
from ..base.snapshot import format_bytes
from ..mitigations.checkpointing import BlockSpec, find_blocks
from ..mitigations.microbatch import batch_size_of
from .memory import (
    PRECISIONS,
    OptimizerSpec,
    _device_of,
    check_estimate_arguments,
    estimate_memory,
    meta_copy,
    optimizer_like,
    resolve_target,
    unwrap_parallel,
)

__all__ = ["Plan", "plan_configuration", "ladder_peak_model", "RungPredictionError"]


class RungPredictionError(Exception):
    """The step ran as it is, but failed with a rung applied: the rung, not the estimate, breaks the model."""

    def __init__(self, rung: str, error: BaseException) -> None:
        super().__init__(f"{rung}: {type(error).__name__}: {error}")
        self.rung, self.error = rung, error


@dataclass(frozen=True)
class Plan:
    """The cheapest configuration expected to fit: ``amp`` (bool), ``checkpointed_blocks`` (k of ``n_blocks``)."""

    amp: bool
    checkpointed_blocks: int
    n_blocks: int
    expected_peak_bytes: int
    limit_bytes: int
    fits: bool
    reason: str


def plan_configuration(
    model: nn.Module,
    example_batch: Any,
    capacity_bytes: int | str,
    threshold: float = 0.9,
    optimizer: OptimizerSpec = None,
    loss_fn: Optional[Callable] = None,
    blocks: BlockSpec = None,
    allow_amp: bool = True,
    target: Optional[str] = None,
    allow_checkpointing: bool = True,
    precision: str = "32-true",
) -> Plan:
    """The cheapest configuration whose estimated peak stays under ``threshold × capacity``.

    Ranked by expected extra compute: checkpointing k blocks recomputes ~k/N of a forward, AMP adds none. So the
    plan is the configuration with the fewest checkpointed blocks that fits — no change, AMP alone, or k blocks
    with or without AMP — keeping full precision at a tie. If nothing fits, the lowest estimated peak is returned
    with ``fits=False``. The fewest blocks are found by bisection (the saving grows with k): a plan costs a handful
    of estimates, not one per candidate.

    ``capacity_bytes`` is bytes or a size string (``"20GiB"``); ``target`` (``"cuda"``, ``"cpu"``, default: cuda
    where it is available) is the device the run will train on; ``allow_amp`` / ``allow_checkpointing``: whether
    the plan may use AMP / checkpointing (a guard whose ladder lacks the rung); ``precision``: the run's own (in a
    mixed-precision run every configuration is estimated in it, and AMP is no choice); the other arguments are those of
    :func:`~lightning_memguard.estimate.estimate_memory`.

    Raises:
        ValueError: a bad argument, naming it and what is allowed.
    """
    capacity_bytes = check_size("capacity_bytes", capacity_bytes)
    threshold = check_number("threshold", threshold, 0, 1, low_open=True)
    check_bool("allow_amp", allow_amp)
    check_estimate_arguments(model, example_batch, optimizer, precision, loss_fn, blocks)
    target = resolve_target(target)
    limit = int(threshold * capacity_bytes)
    # AMP is estimated on meta with the target's autocast emulated (CUDA's or the CPU's), on any model device
    amp_ok = allow_amp and precision == "32-true"
    check_bool("allow_checkpointing", allow_checkpointing)
    # counted in place: a copy of a GPU model would take GPU memory
    n_blocks = len(find_blocks(model, blocks)) if allow_checkpointing else 0
    tried: list[tuple[bool, int, int]] = []
    held: list[int] = []  # parameters, gradients, optimizer state and runtime: what no activation remedy lowers
    fallbacks = _Fallbacks(target)

    def estimate(amp: bool, k: int) -> int:
        run_precision = "bf16-mixed" if amp else precision
        est = estimate_memory(model, example_batch, optimizer, run_precision, loss_fn, blocks if k else None, k,
                              target=target, path=fallbacks.path(run_precision))
        fallbacks.note(est)
        tried.append((amp, k, est.peak_bytes))
        held.append(est.parameters_bytes + est.gradients_bytes + est.optimizer_state_bytes + est.runtime_bytes)
        return est.peak_bytes

    def fewest_blocks(amp: bool) -> Optional[int]:
        """The fewest checkpointed blocks that fit with this precision (bisection: the saving grows with k)."""
        if estimate(amp, 0) <= limit:
            return 0
        if not n_blocks or estimate(amp, n_blocks) > limit:
            return None
        low, high = 0, n_blocks  # peak(low) > limit >= peak(high)
        while high - low > 1:
            mid = (low + high) // 2
            if estimate(amp, mid) <= limit:
                high = mid
            else:
                low = mid
        return high

    base = "fp32" if precision == "32-true" else precision  # how the tried configurations are named
    fitting = [(k, amp) for amp in ([False, True] if amp_ok else [False]) if (k := fewest_blocks(amp)) is not None]
    peaks = {(a, k): p for a, k, p in tried}
    if fitting:
        k, amp = min(fitting)  # fewest recomputed blocks; at a tie full precision
        return _plan(amp, k, n_blocks, peaks[(amp, k)], limit, tried, base=base)
    amp, k, peak = min(tried, key=lambda t: t[2])
    plan = _plan(amp, k, n_blocks, peak, limit, tried, fits=False, base=base)
    if min(held) >= limit:  # say it before step 1: the optimizer step is where this run would die
        plan = Plan(amp, k, n_blocks, peak, limit, False, (
            f"the optimizer state cannot fit: parameters, gradients, optimizer state and runtime alone hold "
            f"{format_bytes(min(held))}, over the {format_bytes(limit)} limit; activation remedies cannot lower "
            "that. What would: an optimizer with less state (SGD, 8-bit or factored Adam), sharding or offloading "
            "the optimizer state (FSDP, DeepSpeed ZeRO), or fewer trainable parameters. " + plan.reason))
    return plan


def _plan(amp, k, n_blocks, peak, limit, tried, fits=True, base="fp32") -> Plan:
    tried_text = "; ".join(f"{'amp' if a else base}+{kk} blocks: {format_bytes(p)}" for a, kk, p in tried)
    if fits:
        what = "no change" if not amp and not k else " + ".join(
            ([("AMP")] if amp else []) + ([f"checkpointing {k}/{n_blocks} blocks"] if k else []))
        reason = f"{what} is the cheapest configuration estimated under {format_bytes(limit)} ({tried_text})"
    else:
        reason = f"nothing estimated fits under {format_bytes(limit)}; the lowest peak is shown ({tried_text})"
    return Plan(amp, k, n_blocks, peak, limit, fits, reason)


def ladder_peak_model(model: nn.Module, example_batch: Any, blocks: BlockSpec = None, target: Optional[str] = None,
                      optimizer: OptimizerSpec = None, loss_fn: Optional[Callable] = None,
                      checkpointing: bool = True, amp: bool = False, precision: str = "32-true") -> PeakModel:
    """What the guard's rungs will do to a step's peak, from estimates — on the meta device for a CUDA target and
    for mixed precision (shapes only: no memory, no FLOPs; the target's autocast and kernels emulated; on CPU, with
    one warning, where the step reads values computed from the weights and the model is on CPU), on a copy of the
    model for a CPU target in full precision (a real step): the step as it is and, with ``checkpointing``, with one
    and with every block checkpointed (each block saves its share of the activations until what no block holds is
    the peak), in the order the checkpointing rung takes them; with ``amp``, both again in bf16 mixed precision.
    ``precision`` is the run's own: level 0 of the AMP rung. Micro-batching is predicted from the same numbers
    (:class:`~lightning_memguard.base.prediction.PeakModel`). ``optimizer`` and ``loss_fn`` are those of
    :func:`~lightning_memguard.estimate_memory`.

    Raises:
        ValueError: the model cannot be estimated this way (no repeated blocks, or it reads values computed from the
            weights and is not on CPU).
        RungPredictionError: the step ran, but not with a rung (checkpointing or AMP) applied.
    """
    model = unwrap_parallel(model)
    # the batch is given as it is: the estimate keeps its values (on CPU) for the model's questions about its inputs
    if resolve_target(target) == "cuda" and _device_of(model).type not in ("cpu", "meta"):
        work = meta_copy(model)  # a copy of a GPU model would take GPU memory
    else:  # on CPU the estimate copies the model itself, and can run it there where it must
        work = model
    batch = example_batch
    n_blocks = len(find_blocks(work, blocks)) if checkpointing else 0
    fallbacks = _Fallbacks(resolve_target(target))

    def phases(precision: str) -> PhaseEstimate:
        def run(k: int):
            est = estimate_memory(work, batch, optimizer=_on(optimizer, model, work), precision=precision,
                                  loss_fn=loss_fn, blocks=blocks if k else None, checkpointed_blocks=k,
                                  target=target, path=fallbacks.path(precision))
            fallbacks.note(est)
            return est

        plain = run(0)
        forward, backward = [plain.phase_peaks["forward"]], [plain.phase_peaks["backward"]]
        if n_blocks:
            # Each checkpointed block saves its share of the saved activations, until what no block holds (the
            # head, the loss, one block recomputed in backward) is the peak: a line from none to one block,
            # floored at all blocks
            try:
                one, full = run(1), run(n_blocks)
            except Exception as err:
                raise RungPredictionError("checkpointing", err) from err
            shares = plain.blocks["activations_bytes"].tolist()
            saved = 0
            for share in shares[:-1]:
                saved += share / (shares[0] or 1)
                forward.append(_saving(plain, one, full, "forward", saved))
                backward.append(_saving(plain, one, full, "backward", saved))
            forward.append(full.phase_peaks["forward"])
            backward.append(full.phase_peaks["backward"])
        held = (plain.parameters_bytes + plain.gradients_bytes + plain.optimizer_state_bytes + plain.runtime_bytes
                + plain.batch_bytes)
        return PhaseEstimate(forward, backward, plain.phase_peaks["optimizer_step"], held, plain.gradients_bytes)

    by_amp = {0: phases(precision)}
    if amp and precision == "32-true":
        try:
            by_amp[1] = phases("bf16-mixed")
        except Exception as err:
            raise RungPredictionError("amp", err) from err
    return PeakModel(by_amp, batch_size_of(example_batch))


class _Fallbacks:
    """Which precisions' steps had to leave the meta device for the CPU (they warned once): those run on CPU at once
    from then on. Meta is tried first for a CUDA target, and for a CPU target in mixed precision."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.on_cpu: set[str] = set()

    def path(self, precision: str) -> Optional[str]:
        return "cpu" if precision in self.on_cpu else None

    def note(self, estimate) -> None:
        if estimate.path == "cpu" and (self.target == "cuda" or estimate.precision != "32-true"):
            # on a CUDA target the reason (a value read from the weights) holds in every precision
            self.on_cpu.update(PRECISIONS if self.target == "cuda" else {estimate.precision})


def _saving(plain, one, full, phase: str, blocks: float) -> int:
    """The phase peak with ``blocks`` first blocks' worth of activations checkpointed (in units of the first's)."""
    per_block = plain.phase_peaks[phase] - one.phase_peaks[phase]
    return int(max(plain.phase_peaks[phase] - per_block * blocks, full.phase_peaks[phase]))


def _on(optimizer: OptimizerSpec, original: nn.Module, work: nn.Module) -> OptimizerSpec:
    """An optimizer instance built on ``original`` becomes a like one on ``work``'s parameters (a class or a factory
    is built on whatever model it is given)."""
    if work is original or not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    return optimizer_like(optimizer, original, work)
