"""The AMP rung: switch Lightning's precision plugin to mixed precision mid-fit, and back.

Lightning reads ``trainer.strategy.precision_plugin`` at every training step (autocast context, backward scaling,
optimizer step), so a new plugin takes effect on the next batch; parameters stay fp32. The switch is not saved in
Lightning's checkpoint: the callback keeps it in its own state and re-applies it on resume, before Lightning
restores the scaler state.
"""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy


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


class AmpSwitch:
    """Level 1 puts the trainer in mixed precision; level 0 restores the plugin it had."""

    name = "amp"
    max_level = 1

    def __init__(self, trainer: pl.Trainer, explicit: bool = True) -> None:
        self.trainer = trainer
        self.explicit = explicit  # named in mitigations= by the user, not taken from the default ladder
        self.level = 0
        self._previous: Optional[Precision] = None

    def unavailable_reason(self) -> Optional[str]:
        strategy = self.trainer.strategy
        if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy)):
            return f"{type(strategy).__name__} fixes precision when it wraps the model"
        plugin = strategy.precision_plugin
        if type(plugin) is not Precision:  # already mixed, half, double or a custom plugin: leave it alone
            return f"the trainer already runs precision={self.trainer.precision!r}"
        if strategy.root_device.type not in ("cuda", "cpu"):
            return f"no autocast switch for device {strategy.root_device}"
        if strategy.root_device.type == "cpu" and not self.explicit and not cpu_has_native_bf16():
            return ("this CPU has no native bf16 (no AVX512-BF16 or AMX), so autocast would emulate it, many times "
                    "slower than fp32; name 'amp' in mitigations= to use it anyway")
        return None

    @property
    def safe_mid_step(self) -> bool:
        """bf16 needs no GradScaler, so switching to it between a failed forward and its retry is safe."""
        return amp_precision_for(self.trainer.strategy.root_device) == "bf16-mixed"

    def set_level(self, level: int) -> None:
        if level not in (0, 1):
            raise ValueError(f"level={level} must be 0 or 1")
        if level == self.level:
            return
        strategy = self.trainer.strategy
        if level == 1:
            self._previous = strategy.precision_plugin
            device = strategy.root_device
            strategy.precision_plugin = MixedPrecision(amp_precision_for(device), device=device.type)
        else:
            strategy.precision_plugin = self._previous if self._previous is not None else Precision()
            self._previous = None
        self.level = level

    @property
    def precision(self) -> Optional[str]:
        return self.trainer.strategy.precision_plugin.precision if self.level else None
