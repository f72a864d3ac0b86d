"""The AMP rung: run forward and backward in mixed precision from the next batch on, and back.

Parameters stay fp32; only the compute switches. *How* a run switches is its front door's business — Lightning swaps
the trainer's precision plugin, Fabric its strategy's precision, a plain loop enters ``torch.autocast`` (with a
``GradScaler`` for fp16) — so the rung talks to a :class:`PrecisionSwitch`. Framework-free.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from .rung import BuiltinRung

__all__ = ["AmpSwitch", "PrecisionSwitch", "amp_precision_for", "cpu_has_native_bf16", "mixed_precision_name"]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (oneDNN's check); without it bf16 matmuls are emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True  # cannot tell: keep the rung, as before


def amp_precision_for(device: torch.device) -> str:
    """``bf16-mixed`` where bf16 is native (CPU, Ampere and newer), else ``16-mixed`` (which uses a GradScaler)."""
    if device.type == "cuda":
        try:
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch < 2.4 has no emulation flag (and reported native support only)
            native = torch.cuda.is_bf16_supported()
        return "bf16-mixed" if native else "16-mixed"
    return "bf16-mixed"


def mixed_precision_name(plugin: object, mixed_class: type) -> str:
    """``"bf16-mixed"`` or ``"16-mixed"`` for a mixed-precision plugin (Lightning's or Fabric's), else ``"32-true"``."""
    name = str(getattr(plugin, "precision", "")) if isinstance(plugin, mixed_class) else ""
    return name if name in ("bf16-mixed", "16-mixed") else "32-true"



class PrecisionSwitch(Protocol):
    """How one front door changes the precision of the training step it runs."""

    device: torch.device
    #: the precision the run had when the guard started, as the estimate names it (``"32-true"``, ``"bf16-mixed"``,
    #: ``"16-mixed"``; another one, say ``"bf16-true"``, reads as ``"32-true"``): what the predictions start from
    base_precision: str

    def fixed_reason(self) -> Optional[str]:
        """Why this run's precision must not be switched (already mixed, a sharding strategy that fixed it when it
        wrapped the model, ...), or ``None``."""

    def enable(self, precision: str) -> None:
        """From the next forward on, run in ``precision`` (``"bf16-mixed"`` or ``"16-mixed"``)."""

    def disable(self) -> None:
        """Back to the precision the run had before :meth:`enable`."""

    # optional: ``fit_ended()``, the fit is over — what runs after it (a Trainer's test or predict) runs in the run's
    # own precision again, while the rung keeps its level for a further fit (which enables it again)


class AmpSwitch(BuiltinRung):
    """Level 1 runs the step in mixed precision (bf16 where native, else fp16 with a scaler); level 0 as it was.

    Args:
        switch: the front door's way of changing precision.
        explicit: named in ``mitigations=`` by the user (kept even where it would be slow), not taken from the
            default ladder.
    """

    name = "amp"
    max_level = 1

    def __init__(self, switch: PrecisionSwitch, explicit: bool = True) -> None:
        self.switch = switch
        self.explicit = explicit
        self.level = 0

    @property
    def device(self) -> torch.device:
        return self.switch.device

    def unavailable_reason(self) -> Optional[str]:
        reason = self.switch.fixed_reason()
        if reason:
            return reason
        if self.device.type not in ("cuda", "cpu"):
            return f"no autocast switch for device {self.device}"
        if self.device.type == "cpu" and not self.explicit and not cpu_has_native_bf16():
            return ("this CPU has no native bf16 (no AVX512-BF16 or AMX), so autocast would emulate it, many times "
                    "slower than fp32; name 'amp' in mitigations= to use it anyway")
        return None

    @property
    def precision(self) -> Optional[str]:
        """The mixed precision in use at level 1 (``None`` at level 0)."""
        return amp_precision_for(self.device) if self.level else None

    @property
    def safe_mid_step(self) -> bool:
        """bf16 needs no GradScaler, so switching to it between a failed forward and its retry is safe."""
        return amp_precision_for(self.device) == "bf16-mixed"

    def close(self) -> None:
        """The fit ended, however: the front door's own precision is back for what runs after it (``trainer.test``
        or ``predict`` then runs as the user set it up: fp32 outputs from an fp32 Trainer, not the fit's bf16). The
        level stays where the fit left it, saved with a checkpoint and enabled again by a further fit. Idempotent."""
        fit_ended = getattr(self.switch, "fit_ended", None)
        if self.level and callable(fit_ended):
            fit_ended()

    def set_level(self, level: int) -> None:
        if level not in (0, 1):
            raise ValueError(f"level={level} must be 0 or 1")
        if level == self.level:
            return
        if level == 1:
            self.switch.enable(amp_precision_for(self.device))
        else:
            self.switch.disable()
        self.level = level
