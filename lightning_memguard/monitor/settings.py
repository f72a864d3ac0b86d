"""The settings of what MemGuard measures, logs and writes (framework-free), checked once at construction. The guard's
settings (:class:`~lightning_memguard.guard.settings.GuardSettings`) extend them with what acts on the numbers; the
monitor takes this part as one object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..base.checks import check_bool, check_int, check_number, check_size

__all__ = ["MonitorSettings"]


@dataclass
class MonitorSettings:
    """What is measured and where it goes.

    Args:
        budget: the capacity to guard, as int bytes or a string like ``"1.5GiB"`` / ``"800MB"``. Needed on CPU to
            guard anything; on CUDA it replaces the device total (or the per-process memory fraction).
        explain: when the threshold is first crossed, record the next step with a
            :class:`~lightning_memguard.TensorDiff` and write ``memguard_tensor_diff_step<N>.csv`` and
            ``memguard_top_consumers_step<N>.csv``; on CUDA also an allocator snapshot
            (``memguard_memory_snapshot_step<N>.pickle``, for pytorch.org/memory_viz), and one on every OOM.
            Snapshot pickles must only be loaded from runs you trust.
        record_memory_history: on CUDA, record allocation stacks from the start of training (costs time per
            allocation; otherwise recording starts at the first crossing and stops after one step).
        snapshot_max_entries: bound on the recorded allocation history.
        log_every_n_steps: log every N optimizer steps; ``None`` follows ``Trainer(log_every_n_steps=...)`` under
            Lightning and logs every step elsewhere.
        history_max_rows: rows kept in memory (the CSV keeps all); ``None`` keeps all.
        nvml_interval_s: seconds between NVML samples (CUDA only).
        cpu_hard_limit: on CPU, raise ``torch.OutOfMemoryError`` when live tensor bytes pass this (to test
            out-of-memory handling without a GPU); ``None``: no limit.
        cpu_sample_every: on CPU, count tensors during every N-th optimizer step only. Counting costs ~12 µs per
            aten op, ~20 % of a step made of thousands of small ops; the other steps run uncounted and have no
            history rows (a logging step among them logs the latest counted step's values). ``None``: every step
            when a ``budget`` or ``cpu_hard_limit`` is given (guarding needs every step), else every 4th step.
    Raises:
        ValueError: on a bad argument, naming it, the value and what is allowed.
    """

    budget: Optional[int | str] = None
    explain: bool = True
    record_memory_history: bool = False
    snapshot_max_entries: int = 100_000
    log_every_n_steps: Optional[int] = None
    history_max_rows: Optional[int] = 100_000
    nvml_interval_s: float = 0.2
    cpu_hard_limit: Optional[int | str] = None
    cpu_sample_every: Optional[int] = None

    def __post_init__(self) -> None:
        # every argument is checked here, so a bad one fails now and not deep inside training
        self.budget_bytes = check_size("budget", self.budget,
                                       none_means="the device total on CUDA; monitor only on CPU")
        self.cpu_hard_limit_bytes = check_size("cpu_hard_limit", self.cpu_hard_limit, none_means="no limit")
        for name in ("explain", "record_memory_history"):
            setattr(self, name, check_bool(name, getattr(self, name)))
        self.snapshot_max_entries = check_int("snapshot_max_entries", self.snapshot_max_entries)
        check_int("log_every_n_steps", self.log_every_n_steps, none_means="follow the Trainer, else every step")
        check_int("history_max_rows", self.history_max_rows, none_means="keep every row")
        self.nvml_interval_s = check_number("nvml_interval_s", self.nvml_interval_s, 0, 3600, low_open=True)
        check_int("cpu_sample_every", self.cpu_sample_every, none_means="automatic")
        if self.cpu_sample_every is None:  # guarding a budget needs every step measured
            self.cpu_sample_every = 1 if self.budget_bytes is not None or self.cpu_hard_limit_bytes is not None else 4
