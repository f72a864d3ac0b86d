"""What the multi-process tests share: a gloo process group for a spawned rank, each rank's data, the plain loop and
the guard a rank runs, parameters gathered and compared across ranks, and what each rank wrote, read back.

The runners and tests that start ranks (:mod:`tests.spawn` launches them) import from here; single-process helpers
are in :mod:`tests.helpers`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd
import torch
from torch import nn

from lightning_memguard import MemGuard, MemGuardCallback
from tests.helpers import LossFn, budget_crossed_between, mse, train_plain
from tests.models import Stack, regression_batches


def budget_crossed_by_rank_one_at(folder, step: int) -> int:
    """A budget whose threshold line lies between rank 1's peak at ``step`` and every other step's of both ranks, read
    from a monitor-only two-rank run's histories in ``folder``."""
    per_step = {rank: frame.groupby("step")["peak_bytes"].max()
                for rank, frame in rank_csvs(Path(folder), "memguard_history.csv").items()}
    normal = max(int(per_step[0].max()), int(per_step[1].drop(step).max()))
    return budget_crossed_between(int(per_step[1][step]), normal)


@contextlib.contextmanager
def gloo_group(rank: int, root, world_size: int = 2):
    """A CPU process group for a spawned test worker, met through a file under ``root`` (no port to race another
    process for); a collective one rank never joins fails after two minutes instead of hanging the suite."""
    import datetime

    import torch.distributed as dist

    from lightning_memguard.adapters import worker_release

    rendezvous = os.path.abspath(os.path.join(str(root), "gloo_rendezvous"))
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        yield
    finally:
        # the GIL released until gloo's workers let go of what the guard handed them: a worker still doing so when a
        # process group's destructor runs (the GIL held) deadlocks the two (seen once in test_ddp_recovery.py)
        worker_release.wait_for_workers(at_most_s=10)
        end_process_group()  # FSDP2's modules and their pending collectives go before the group they use


def guard_counting_agreements(model: nn.Module, optimizer, data: list, root, rank: int, crossing: Optional[int],
                              **settings) -> None:
    """A spawned rank's plain-loop guard over ``data``, where only rank 1's loss at step ``crossing`` holds 3 MB more
    through its forward (it alone crosses a threshold between the two; ``None``: no step does); every collective the
    guard makes of its own (the plain loop's ``reduce_max``) is counted by step, written to
    ``root/agreed.rank<N>.json``. ``settings``: the guard's (its budget, its ladder)."""
    import json

    from lightning_memguard.adapters import torch_backend

    agreed_at, step = [], [0]
    real = torch_backend.dist_reduce_max

    def counted(values):
        agreed_at.append(step[0])
        return real(values)

    def loss(model, batch):
        held = torch.ones(750_000) if rank == 1 and step[0] == crossing else torch.zeros(())
        return mse(model, batch) + 0 * held.sum()

    torch_backend.dist_reduce_max = counted
    try:
        guard = MemGuard(model, optimizer, log_dir=str(root), min_gain=0.0, tensorboard=False, plan_at_start=False,
                         **settings)
        with guard:
            for step[0], batch in enumerate(data):
                guard.step(batch, loss)
    finally:
        torch_backend.dist_reduce_max = real
    with open(os.path.join(str(root), f"agreed.rank{rank}.json"), "w") as out:
        json.dump(agreed_at, out)


def counting_worker(rank: int, root: str, strategy: str, steps: int, crossing: Optional[int],
                    settings: Optional[dict]) -> None:
    """A spawned rank of the quiet-step tests: a :class:`~tests.models.Stack` wrapped for ``strategy``
    (:func:`wrap_for`) under SGD with momentum, on its :func:`rank_half` of ``steps`` batches, trained without a guard
    where ``settings`` is ``None``, else under :func:`guard_counting_agreements` (rank 1 crossing at ``crossing``)
    with ``settings``; its full parameters saved to ``root`` (:func:`save_full_parameters`)."""
    with gloo_group(rank, root):
        model = wrap_for(Stack(), strategy)  # seeded: the same parameters on both ranks
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        data = rank_half(rank, steps)
        if settings is None:
            train_plain(model, optimizer, data)
        else:
            guard_counting_agreements(model, optimizer, data, root, rank, crossing, **settings)
        save_full_parameters(model, root, rank)


def train_counting_agreements(root, strategy: str, steps: int, crossing: Optional[int],
                              settings: Optional[dict] = None) -> dict[int, dict[str, torch.Tensor]]:
    """Both ranks of :func:`counting_worker` in ``root`` (a hang fails the test); returns each rank's parameters."""
    from tests.spawn import spawn_ranks

    os.makedirs(root, exist_ok=True)
    spawn_ranks(counting_worker, (str(root), strategy, steps, crossing, settings), timeout_s=240)
    return rank_parameters(root)


def token_batches(rank: int, steps: int, long_step: int, samples: int = 8,
                  tokens: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A rank's seeded batches of ``samples`` rows of ``tokens`` 16-feature tokens (targets per token); rank 1's batch
    at ``long_step`` alone has four times the tokens (a rare long batch)."""
    generator = torch.Generator().manual_seed(rank)
    batches = []
    for step in range(steps):
        x = torch.randn(samples, tokens * (4 if rank == 1 and step == long_step else 1), 16, generator=generator)
        batches.append((x, x.sum(dim=-1, keepdim=True).sin()))
    return batches


def wrap_for(model: nn.Module, strategy: str, mesh: Any = None) -> nn.Module:
    """``model`` as a data-parallel rank trains it inside a process group: ``"ddp"`` wraps it in
    DistributedDataParallel, ``"fsdp"`` shards every block of ``model.blocks`` and then the root with FSDP2's
    ``fully_shard`` (the recipe the per-rank estimate models) over ``mesh`` (the default group's when ``None``)."""
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if strategy != "fsdp":
        raise ValueError(f"strategy={strategy!r}; allowed: 'ddp', 'fsdp'")
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s state as one process holds it whole: FSDP2's shards gathered (a collective: every rank
    calls it), DistributedDataParallel's module unwrapped (its keys without ``module.``)."""
    state = getattr(model, "module", model).state_dict()
    return {key: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for key, value in state.items()}


def rank_half(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s half (128 samples) of each of ``steps`` seeded regression batches of 256: the two ranks' data
    together make the batches one process would train on."""
    return [(x[128 * rank:128 * (rank + 1)], y[128 * rank:128 * (rank + 1)]) for x, y in regression_batches(steps, 256)]


def rank_doubled(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s share of each of ``steps`` seeded regression batches of 256: the first 128 samples on rank 0,
    all 256 on rank 1 (twice the memory a step)."""
    return [(x[:128 + 128 * rank], y[:128 + 128 * rank]) for x, y in regression_batches(steps, 256)]


def save_full_parameters(model: nn.Module, folder, rank: int) -> None:
    """``model``'s :func:`full_parameters` to ``<folder>/parameters.rank<rank>.pt`` (FSDP2's gathering is a
    collective: every rank calls it, after every rank finished training)."""
    torch.save(full_parameters(model), os.path.join(str(folder), f"parameters.rank{rank}.pt"))


def rank_parameters(folder) -> dict[int, dict[str, torch.Tensor]]:
    """Each rank's parameters that :func:`save_full_parameters` wrote to ``folder``."""
    return {rank: torch.load(os.path.join(str(folder), f"parameters.rank{rank}.pt")) for rank in (0, 1)}


def rank_texts(folder, stem: str) -> dict[int, str]:
    """Each rank's ``<folder>/<stem>.rank<N>.txt`` (``outcome``: how its run ended, :func:`run_recording_outcome`)."""
    return {rank: Path(folder, f"{stem}.rank{rank}.txt").read_text() for rank in (0, 1)}


def assert_ranks_trained_alike(reference: dict, guarded: dict, atol: float = 0.0, rtol: float = 0.0) -> None:
    """Two FSDP2 runs' gathered parameters (rank -> name -> tensor, :func:`rank_parameters`): each the same on both
    ranks, and the guarded run's equal to the reference's (bit for bit with the default tolerance)."""
    for name, value in reference[0].items():
        assert torch.equal(value, reference[1][name]) and torch.equal(guarded[0][name], guarded[1][name]), name
        torch.testing.assert_close(guarded[0][name], value, atol=atol, rtol=rtol, msg=name)


def assert_each_rank_close(got: dict, want: dict, atol: float = 2e-5, rtol: float = 1e-4) -> None:
    """Each rank's parameters in ``got`` (rank -> name -> tensor) close to that rank's in ``want``: the defaults allow
    for gradients added in another order (micro-batches) over a few steps."""
    for rank, parameters in got.items():
        for name, value in parameters.items():
            torch.testing.assert_close(value, want[rank][name], atol=atol, rtol=rtol, msg=(rank, name))


def assert_every_step_ran(folder, steps: int) -> None:
    """Both ranks' histories in ``folder`` end an optimizer step for each of ``steps`` steps: none was skipped."""
    for rank, history in rank_csvs(Path(folder), "memguard_history.csv").items():
        assert set(history[history["phase"] == "after_optimizer_step"]["step"]) == set(range(steps)), rank


def step_with_one_oom(guard: Any, batches: list, loss: LossFn, rank: int, ballast: Optional["OneOffBallast"],
                      failing_step: int) -> None:
    """A rank's guarded steps over ``batches``, where rank 1 alone runs out of memory once, at ``failing_step``
    (``ballast`` armed there; ``None``: no OOM); the guard is closed at the end."""
    with guard:
        for step, batch in enumerate(batches):
            if ballast is not None:
                ballast.armed = rank == 1 and step == failing_step
            guard.step(batch, loss)


def rank_csvs(directory, name: str) -> dict[int, pd.DataFrame]:
    """One of a two-rank run's CSV files per rank (``name`` is rank 0's; rank 1 writes ``<stem>.rank1.csv``)."""
    stem = name.removesuffix(".csv")
    return {0: pd.read_csv(directory / name), 1: pd.read_csv(directory / f"{stem}.rank1.csv")}


def stepped(history: pd.DataFrame) -> list[int]:
    """The optimizer steps a history has rows of (one ``after_optimizer_step`` row each)."""
    return history[history["phase"] == "after_optimizer_step"]["step"].tolist()


def shows_rank_zeros_results(guard: Any, directory, steps: int) -> dict[str, int]:
    """Asserts that the launching process's ``guard`` shows rank 0's rows and events of a two-rank launch (spawned or
    forked) that wrote to ``directory`` and ran ``steps`` optimizer steps, not rank 1's, and that the ladder acted alike
    on both ranks; returns where the fit left the rungs (rank 0's last level of each rung it changed), asserted to be
    the guard's ``levels`` and its ``state_dict()``'s, and not those of this process's own engine, which ran no step."""
    histories = rank_csvs(directory, "memguard_history.csv")
    events = rank_csvs(directory, "memguard_events.csv")
    assert stepped(guard.history) == list(range(steps))  # every optimizer step of the fit
    pd.testing.assert_frame_equal(guard.history, histories[0])
    assert not guard.history["peak_bytes"].equals(histories[1]["peak_bytes"])  # rank 1's ballast: not its rows
    pd.testing.assert_frame_equal(guard.events, events[0])
    changes = [frame[frame["action"].isin(["apply", "keep", "revert"])][["step", "action", "rung", "level"]]
               .reset_index(drop=True) for frame in (guard.events, events[1])]
    assert len(changes[0]) >= 1  # the ladder acted in the ranks, and the launching process sees it
    pd.testing.assert_frame_equal(changes[0], changes[1])
    last = changes[0].groupby("rung")["level"].last().astype(int).to_dict()
    assert {rung: guard.levels[rung] for rung in last} == last and any(last.values())
    assert guard.state_dict()["ladder"]["levels"] == guard.levels != guard.engine.levels
    return last


def applied_alike(events: dict[int, pd.DataFrame]) -> pd.DataFrame:
    """Two ranks' ``apply`` events (rank -> frame) as (step, rung, level) rows, asserted the same on both ranks (the
    same rung and level at the same step); rank 0's."""
    applied = [frame[frame["action"] == "apply"][["step", "rung", "level"]].reset_index(drop=True)
               for frame in events.values()]
    pd.testing.assert_frame_equal(applied[0], applied[1])
    return applied[0]


def agreed_steps(folder) -> list[int]:
    """The steps at which :func:`guard_counting_agreements` counted a collective of the guard's own, asserted the
    same on both ranks (every collective met on both)."""
    import json

    agreed = [json.loads(Path(folder, f"agreed.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert agreed[0] == agreed[1], agreed
    return agreed[0]


class OneOffBallast:
    """Makes ``module`` run out of memory once under a CPU hard limit of ``limit`` bytes: while :attr:`armed`, its next
    call makes a tensor past the limit in its forward (``phase="forward"``) or in its backward (``"backward"``: a hook
    on its output), and disarms. The attempt that runs again does not."""

    def __init__(self, module: nn.Module, phase: str, limit: int) -> None:
        if phase not in ("forward", "backward"):
            raise ValueError(f"phase={phase!r}; allowed: 'forward', 'backward'")
        self.phase, self.limit, self.armed = phase, limit, False
        module.register_forward_hook(self._after_forward)

    def _ballast(self, *_) -> None:
        if self.armed:
            self.armed = False
            torch.empty(self.limit // 4 + 1)

    def _after_forward(self, module, inputs, output) -> None:
        if self.phase == "forward":
            self._ballast()
        elif self.armed:
            output.register_hook(self._ballast)


def assert_rescued_together(events: dict, step: int, rung: str, phase: str) -> None:
    """Two ranks' events (rank -> frame) after rank 1 alone ran out of memory in ``phase`` of ``step``: the same
    decisions on both, one ``rescue`` of ``rung`` at that step, rank 1's for its own OOM, rank 0's for its peer's."""
    import pandas as pd

    decisions = {rank: frame[["step", "action", "rung", "level"]] for rank, frame in events.items()}
    pd.testing.assert_frame_equal(decisions[0], decisions[1])  # the same rung and level, at the same step
    rescues = decisions[0][decisions[0]["action"] == "rescue"]
    assert rescues[["step", "rung"]].values.tolist() == [[step, rung]], decisions[0]
    rescued = events[1]["action"] == "rescue"
    assert f"out of memory in {phase} of step {step} (OutOfMemoryError: DefaultCPUAllocator" in \
        events[1][rescued]["reason"].iloc[0]
    assert f"out of memory in {phase} of step {step} (PeerOutOfMemoryError: another rank" in \
        events[0][rescued]["reason"].iloc[0]


def end_process_group() -> None:
    """Ends a runner's process group before the interpreter's exit: what its fits left in reference cycles (FSDP2's
    modules and their collectives' work objects) first, then the group. Left to the interpreter's exit, the group's
    destructor ran while gloo's threads were still joinable and aborted a finished rank ("terminate called without an
    active exception", once in CI, after an unguarded FSDP2 reference fit)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def fit_recording_results(trainer: Any, module: Any, trained: nn.Module, folder: str,
                          guard: Optional[MemGuardCallback] = None) -> str:
    """One rank of a multi-process runner: ``trainer.fit(module)`` through :func:`run_recording_outcome` (its outcome
    written to ``folder``), then, where it finished, ``trained``'s full parameters (:func:`save_full_parameters`) and
    ``guard``'s levels at the end (``levels.rank<N>.json``, when a guard is given). Returns the outcome."""
    import json

    outcome = run_recording_outcome(lambda: trainer.fit(module), folder, lambda: trainer.global_rank)
    rank = trainer.global_rank
    if outcome == "finished":  # gathering the shards is a collective: only after both ranks finished
        save_full_parameters(trained, folder, rank)
        if guard is not None:
            with open(os.path.join(folder, f"levels.rank{rank}.json"), "w") as file:
                json.dump(guard.levels, file)
    return outcome


def run_recording_outcome(run: Callable[[], None], folder: str, rank: Callable[[], int]) -> str:
    """Runs one rank's fit (``run``) in a multi-process test's runner and writes how it ended to
    ``<folder>/outcome.rank<N>.txt`` (``finished``, or the error's type and first line), an error's traceback to
    ``<folder>/traceback.rank<N>.txt`` (``N``: ``rank()``, read after the run: a launcher sets it while fitting).
    Returns the outcome. The error is caught so that every rank writes its outcome (uncaught, Lightning's launcher
    could kill rank 0 before it does). What the guard handed the process group's workers must be let go of by then,
    else the outcome says so."""
    from lightning_memguard.adapters import worker_release

    outcome = "finished"
    try:
        run()
    except Exception as error:  # what ended this rank, for the test to read
        outcome = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        with open(os.path.join(folder, f"traceback.rank{rank()}.txt"), "w") as file:
            traceback.print_exc(file=file)
    # what the fit left in reference cycles (FSDP2's collectives' work objects) goes while the process group is alive,
    # as the guard's teardown does: left to interpreter exit, a gloo worker aborted an unguarded reference rank
    # ("terminate called without an active exception") in one CI run
    gc.collect()
    if not worker_release.wait_for_workers(at_most_s=10):  # would hold the rank at exit, up to the wait's limit
        outcome += f" ({worker_release.still_held()} objects handed to the process group's workers still held)"
    with open(os.path.join(folder, f"outcome.rank{rank()}.txt"), "w") as file:
        file.write(outcome)
    return outcome
