"""What a pre-flight estimate says about one training step: its memory by category, phase, module and block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pandas as pd

from ..base.snapshot import format_bytes

__all__ = ["MemoryEstimate"]


@dataclass
class MemoryEstimate:
    """One training step's memory (a step after the first: gradients and optimizer state exist).

    Attributes:
        parameters_bytes / gradients_bytes / optimizer_state_bytes / batch_bytes: held across the step.
        activations_bytes: what autograd saves for backward (excluding parameters and the batch), and the inputs
            that checkpointed blocks keep for their recomputation.
        temporaries_bytes: the most a phase allocated and freed again within itself (workspaces, casts).
        runtime_bytes: fixed allocations of the CUDA runtime held across steps, on target cuda: the cuBLAS and
            cuBLASLt workspaces of the training thread's and autograd's backward thread's handles, for the threads
            that run such matmuls (sizes by torch's settings:
            :func:`~lightning_memguard.estimate.cuda_kernels.workspace_sizes`).
        target: the device the estimate is for (``"cuda"`` or ``"cpu"``).
        path: how the step was run: ``"meta"`` (the weights and all they touch are shapes only, no FLOPs; the batch
            and what is computed from it alone keep their values) or ``"cpu"`` (real execution on CPU, for models
            that read values computed from the weights).
        phase_peaks: phase -> peak bytes (``forward``, ``backward``, ``optimizer_step``).
        peak_bytes: the overall peak.
        modules: activation bytes saved by each module's own ops (DataFrame: module, activations_bytes).
        blocks: the same summed per repeated block (DataFrame: block, activations_bytes): which blocks hold the
            memory, and what checkpointing each would save.
        variants: the same step under each remedy (DataFrame: config, amp, checkpointed_blocks, peak_bytes, ...).
        strategy / world_size: ``"ddp"`` or ``"fsdp"`` over ``world_size`` ranks when the estimate is one rank's
            (:mod:`~lightning_memguard.estimate.ranks`; parameters, gradients and optimizer state are then the rank's
            shares); ``None`` / 1 for one process.
        strategy_bytes: what the strategy adds on a rank: DDP's gradient buckets, FSDP2's gathered units in flight
            (in backward, its most).
        reserved_bytes: on target cuda (one process), the most the caching allocator reserves by then — the
            segments its model (:class:`~lightning_memguard.estimate.caching_allocator.CachingAllocatorModel`) took
            for the weights, a warm-up step and the measured step, none given back, and the runtime's workspaces:
            what a capacity that caps reserved memory (the card, a memory fraction) must hold, where the cache's
            free blocks cannot serve a request; ``None`` elsewhere, and where the allocator's options (the
            environment's ``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF`` when the estimate is made, or this
            process's settings) change the policy the model replays (``notes`` says which).
        notes: what the estimate left out and why, in words (printed with it).
    """

    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    temporaries_bytes: int
    batch_bytes: int
    phase_peaks: dict[str, int]
    precision: str
    device: str
    target: str = "cpu"
    path: str = "cpu"
    runtime_bytes: int = 0
    checkpointed_blocks: int = 0
    n_blocks: int = 0
    modules: pd.DataFrame = field(default_factory=pd.DataFrame)
    blocks: pd.DataFrame = field(default_factory=pd.DataFrame)
    variants: pd.DataFrame = field(default_factory=pd.DataFrame)
    strategy: Optional[str] = None
    world_size: int = 1
    strategy_bytes: int = 0
    reserved_bytes: Optional[int] = None
    notes: tuple[str, ...] = ()

    @property
    def peak_bytes(self) -> int:
        return max(self.phase_peaks.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phase_peaks, key=self.phase_peaks.get)

    @property
    def ddp_bucket_bytes(self) -> int:
        """DDP's gradient buckets (``strategy_bytes`` under DDP, else 0): held all step long, as the parameters are
        (FSDP2's gathered units come and go)."""
        return self.strategy_bytes if self.strategy == "ddp" else 0

    def to_dataframe(self) -> pd.DataFrame:
        """Rows ``(kind, name, bytes)``: the categories, then the phase peaks, then the overall peak."""
        rows = [("category", name, getattr(self, f"{name}_bytes")) for name in
                ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "batch", "runtime")]
        if self.strategy is not None:
            rows.append(("category", "ddp_buckets" if self.strategy == "ddp" else "fsdp_gathered",
                         self.strategy_bytes))
        rows += [("phase_peak", phase, peak) for phase, peak in self.phase_peaks.items()]
        rows.append(("peak", "overall", self.peak_bytes))
        return pd.DataFrame(rows, columns=["kind", "name", "bytes"])

    def __str__(self) -> str:
        lines = [f"Memory estimate for one training step on {self.target} ({self.precision}, run on {self.path}"
                 + (f", {self.checkpointed_blocks}/{self.n_blocks} blocks checkpointed" if self.checkpointed_blocks
                    else "")
                 + (f", one rank of {self.world_size} under {self.strategy}" if self.strategy else "") + ")"]
        for kind, name, nbytes in self.to_dataframe().itertuples(index=False):
            label = {"category": name, "phase_peak": f"peak in {name}", "peak": "PEAK"}[kind]
            lines.append(f"  {label:<26}{format_bytes(int(nbytes)):>12}")
        if not self.blocks.empty:
            lines.append(f"  activations per block: {len(self.blocks)} blocks, "
                         f"{format_bytes(int(self.blocks['activations_bytes'].max()))} in the largest")
        if not self.modules.empty:
            lines.append("  activations by module (largest first):")
            for module, nbytes in self.modules.head(8).itertuples(index=False):
                lines.append(f"    {module or '(top level)':<36}{format_bytes(int(nbytes)):>12}")
        if not self.variants.empty:
            lines.append("  remedies:")
            for row in self.variants.itertuples(index=False):
                lines.append(f"    {row.config:<28}{format_bytes(int(row.peak_bytes)):>12}  "
                             f"x{row.peak_bytes / self.peak_bytes:.2f}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)
