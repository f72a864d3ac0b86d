"""FSDP2 on transformers models as torchtitan shards them (``fully_shard`` on every decoder layer, then the root), two
CPU gloo ranks, AdamW, padded token batches (labels -100 on the padding), under the plain-loop guard. Rank 1's batches
have twice rank 0's rows, so its step needs more memory. All cases run in one launch of the two ranks (a module
fixture; each case takes a second or two, the launch most of the time):

- each rank's counted peaks are within 10 % of the per-rank estimate ``estimate_memory(..., strategy="fsdp",
  world_size=2)`` made in one process from the unsharded model;
- under a budget whose threshold only rank 1's step crosses, both ranks plan the same rung at the same step and the
  gathered parameters equal an unguarded FSDP2 run's on the same data: bit for bit with checkpointed layers, to
  float rounding (as AdamW magnifies it) with micro-batches;
- rank 1 alone runs out of memory (a CPU hard limit, passed once in a layer's forward or backward): both ranks run
  the batch again one rung higher and finish, with the parameters of the unguarded run.
"""

from __future__ import annotations

import os
import warnings

import pandas as pd
import pytest
import torch

from lightning_memguard import MemGuard, estimate_memory
from tests.helpers import train_plain
from tests.ranks import (
    OneOffBallast, assert_every_step_ran, assert_ranks_trained_alike, assert_rescued_together, gloo_group, rank_csvs,
    rank_parameters, rank_texts, run_recording_outcome, save_full_parameters, step_with_one_oom,
)
from tests.spawn import spawn_ranks
from tests.zoo.models import build, decoder_layers, fully_shard_layers, loss_of, make_batch

STEPS, FAILING_STEP = 4, 2  # the OOM after complete steps: FSDP2's sequence of collectives is known by then
ROWS = (8, 16)  # each rank's rows a batch
LIMIT = 32 * 2 ** 20  # far above a step (~1.5 MiB on rank 0, ~2.6 MiB on rank 1); the ballast alone passes it
#: model -> the cases run on it after the unguarded reference and the monitored run: case -> (rung, OOM phase or
#: None for a budget only rank 1 crosses)
CASES = {
    "llama": {"budget-checkpointing": ("checkpointing", None), "budget-microbatch": ("microbatch", None),
              "oom-checkpointing": ("checkpointing", "backward"), "oom-microbatch": ("microbatch", "forward")},
    "gpt2": {"oom-checkpointing": ("checkpointing", "backward")},  # tied embeddings, Conv1D layers
}
#: micro-batches add each part's weighted gradients in another order; AdamW divides every update by the gradient's
#: running size, so rounding-level differences in small gradients move a weight by up to ~1e-5 in four steps at lr
#: 0.01 (6e-6 measured in one process without FSDP2, splitting by hand; 1.2e-5 here)
MICRO_BATCH_TOLERANCE = {"atol": 3e-5, "rtol": 1e-4}


def _batches(name: str, rank: int) -> list[dict]:
    return [make_batch(name, 10 * rank + index, batch_size=ROWS[rank]) for index in range(STEPS)]


def _train(name: str, rank: int, folder: str, settings=None, ballast_phase=None) -> None:
    """One run of zoo model ``name`` sharded over the two ranks (unguarded where ``settings`` is None), its outcome
    and gathered parameters written to ``folder``."""
    model = fully_shard_layers(build(name)[0])  # seeded: the same parameters on both ranks
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)

    def train() -> None:
        if settings is None:
            train_plain(model, optimizer, _batches(name, rank), loss_of)
            return
        ballast = OneOffBallast(decoder_layers(model)[1], ballast_phase, LIMIT) if ballast_phase else None
        guard = MemGuard(model, optimizer, log_dir=folder, tensorboard=False, explain=False, **settings)
        step_with_one_oom(guard, _batches(name, rank), loss_of, rank, ballast, FAILING_STEP)

    if run_recording_outcome(train, folder, lambda: rank) == "finished":  # gathering the shards is a collective
        save_full_parameters(model, folder, rank)


def _highest_peaks(folder: str, rank: int) -> list[int]:
    """Each rank's highest counted peak after the first step, gathered on every rank."""
    import torch.distributed as dist

    history = pd.read_csv(os.path.join(folder, "memguard_history.csv" if rank == 0 else
                                       "memguard_history.rank1.csv"))
    own = torch.tensor(int(history[history["step"] >= 1]["peak_bytes"].max()))
    peaks = [torch.zeros_like(own) for _ in range(2)]
    dist.all_gather(peaks, own)
    return [int(peak) for peak in peaks]


def _worker(rank: int, root: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # two ranks on a busy machine: a second thread per rank only adds waiting
    with gloo_group(rank, root):
        for name, cases in CASES.items():
            folders = {case: os.path.join(root, name, case) for case in ("plain", "monitored", *cases)}
            for folder in folders.values():
                os.makedirs(folder, exist_ok=True)
            _train(name, rank, folders["plain"])
            _train(name, rank, folders["monitored"], {"mitigations": (), "cpu_sample_every": 1})
            low, high = _highest_peaks(folders["monitored"], rank)
            budget = int((low + high) / 2 / 0.9)  # a threshold halfway between the ranks' peaks
            with open(os.path.join(root, name, "budget.txt"), "w") as out:
                out.write(f"{low} {high} {budget}")
            for case, (rung, phase) in cases.items():
                limits = ({"cpu_hard_limit": LIMIT, "threshold": 1.0, "plan_at_start": False} if phase else
                          {"budget": budget})
                _train(name, rank, folders[case], {"mitigations": (rung,), **limits}, phase)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The folder of the one launch of every case: ``<model>/<case>/`` with each rank's files."""
    root = tmp_path_factory.mktemp("zoo_fsdp")
    spawn_ranks(_worker, (str(root),), timeout_s=240)
    return root


def _assert_trained_like_the_unguarded_run(root, name: str, case: str, rung: str) -> None:
    reference, guarded = rank_parameters(root / name / "plain"), rank_parameters(root / name / case)
    initial = build(name)[0].state_dict()
    assert reference[0].keys() == initial.keys()
    assert_ranks_trained_alike(reference, guarded, **({} if rung == "checkpointing" else MICRO_BATCH_TOLERANCE))
    head = "lm_head.weight"
    assert not torch.equal(reference[0][head], initial[head])  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_counts_its_shard_within_10_percent_of_the_per_rank_estimate(runs, name):
    for rank, history in rank_csvs(runs / name / "monitored", "memguard_history.csv").items():
        batch = make_batch(name, 10 * rank, batch_size=ROWS[rank])
        kwargs = {"optimizer": torch.optim.AdamW, "loss_fn": loss_of, "target": "cpu"}
        estimate = estimate_memory(build(name)[0], batch, strategy="fsdp", world_size=2, **kwargs)
        one_process = estimate_memory(build(name)[0], batch, **kwargs)
        for row_phase, phase in {"after_forward": "forward", "after_backward": "backward",
                                 "after_optimizer_step": "optimizer_step"}.items():
            measured = history[(history["phase"] == row_phase) & (history["step"] >= 1)]["peak_bytes"].max()
            assert estimate.phase_peaks[phase] == pytest.approx(measured, rel=0.10), (rank, phase)
        # sharding matters: the optimizer step (shards of the parameters, gradients and AdamW's state) is about half
        # of one process's
        measured = history[history["phase"] == "after_optimizer_step"]["peak_bytes"].max()
        assert one_process.phase_peaks["optimizer_step"] > 1.5 * measured, rank


@pytest.mark.slow
@pytest.mark.parametrize("rung", ["checkpointing", "microbatch"])
def test_a_budget_only_rank_one_crosses_moves_both_ranks_alike_and_trains_as_unguarded(runs, rung):
    case = f"budget-{rung}"
    folder = runs / "llama" / case
    assert rank_texts(folder, "outcome") == {0: "finished", 1: "finished"}
    low, high, budget = (int(n) for n in (runs / "llama" / "budget.txt").read_text().split())
    assert low < 0.9 * budget < high  # rank 0's own step would stay under the threshold
    events = rank_csvs(folder, "memguard_events.csv")
    decisions = {rank: frame[["step", "action", "level"]] for rank, frame in events.items()}
    pd.testing.assert_frame_equal(decisions[0], decisions[1])  # the same plan, at the same step, on both ranks
    assert set(decisions[0]["action"]) == {"plan"} and set(decisions[0]["step"]) == {0}, events[0]
    assert_every_step_ran(folder, STEPS)
    histories = rank_csvs(folder, "memguard_history.csv")
    for rank, history in histories.items():
        assert history["peak_bytes"].max() < 0.9 * budget, rank  # the rung brought rank 1 under the threshold
    parts = [history.groupby("step")["micro_batches"].max().tolist() for history in histories.values()]
    assert parts[0] == parts[1] == ([2] * STEPS if rung == "microbatch" else [1] * STEPS), parts
    _assert_trained_like_the_unguarded_run(runs, "llama", case, rung)


@pytest.mark.slow
@pytest.mark.parametrize("name, case", [(name, case) for name, cases in CASES.items() for case in cases
                                        if case.startswith("oom")])
def test_one_ranks_oom_is_run_again_on_both_ranks_one_rung_higher(runs, name, case):
    rung, phase = CASES[name][case]
    folder = runs / name / case
    assert rank_texts(folder, "outcome") == {0: "finished", 1: "finished"}
    events = rank_csvs(folder, "memguard_events.csv")
    assert_rescued_together(events, FAILING_STEP, rung, phase)
    assert_every_step_ran(folder, STEPS)
    _assert_trained_like_the_unguarded_run(runs, name, case, rung)
