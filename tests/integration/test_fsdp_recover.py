"""Ranks sharded with FSDP2 recover an out-of-memory error together: two CPU processes (gloo) train a
:class:`~tests.models.Stack` whose every block and root are ``fully_shard``-ed, under the plain-loop guard. At one step
rank 1 alone runs out of memory (a tensor past the CPU hard limit, made in the middle of its forward or of its
backward, on that attempt only). Rank 1 puts FSDP2 back as between iterations and issues the rest of the step's
all-gathers and reduce-scatters with zeros, the reduce-scatters marked; rank 0's backward completes and finds the
mark; the ranks agree once and both run the batch again one rung higher: no rank dies of a closed connection, no batch
is skipped, and the full parameters equal a run without a guard. A module with an FSDP2 collective of the user's keeps
it (no recovery, one warning)."""

import os

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

from lightning_memguard import MemGuard
from tests.helpers import mse, train_plain
from tests.models import Stack
from tests.ranks import (
    OneOffBallast, assert_every_step_ran, assert_ranks_trained_alike, assert_rescued_together, gloo_group, rank_csvs,
    rank_half, rank_parameters, rank_texts, run_recording_outcome, save_full_parameters, step_with_one_oom, wrap_for,
)
from tests.spawn import spawn_ranks

STEPS = 4
FAILING_STEP = 2  # after complete steps: the sequence of FSDP2's collectives is known
LIMIT = 32 * 2 ** 20  # far above a step (a few MB); the ballast alone passes it
BLOCK = 4  # of the stack's 8 blocks: the OOM comes with collectives both issued and not yet issued


def _worker(rank: int, root: str, phase, mitigations) -> None:
    with gloo_group(rank, root):
        model = wrap_for(Stack(), "fsdp")  # seeded: the same parameters on both ranks
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        data = rank_half(rank, STEPS)

        def train() -> None:
            if phase is None:  # the reference: no guard
                train_plain(model, optimizer, data)
                return
            ballast = OneOffBallast(model.blocks[BLOCK], phase, LIMIT)
            guard = MemGuard(model, optimizer, log_dir=root, cpu_hard_limit=LIMIT, mitigations=mitigations,
                             threshold=1.0, plan_at_start=False, tensorboard=False)
            step_with_one_oom(guard, data, mse, rank, ballast, FAILING_STEP)

        if run_recording_outcome(train, root, lambda: rank) == "finished":  # gathering is a collective
            save_full_parameters(model, root, rank)


def _train(root, phase=None, mitigations=()) -> tuple[dict, dict]:
    os.makedirs(root, exist_ok=True)
    spawn_ranks(_worker, (str(root), phase, mitigations), timeout_s=240)
    outcomes = rank_texts(root, "outcome")
    return (rank_parameters(root) if set(outcomes.values()) == {"finished"} else {}), outcomes


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("mitigations, rung, atol", [
    (("checkpointing",), "checkpointing", 0.0),  # the same ops recomputed on the same inputs: bit for bit
    (("microbatch",), "microbatch", 1e-6),  # the parts' weighted gradients add up in another order
])
def test_an_oom_on_one_rank_is_run_again_on_both_ranks_one_rung_higher(tmp_path, phase, mitigations, rung, atol):
    reference, _ = _train(tmp_path / "plain")
    guarded, outcomes = _train(tmp_path / "guarded", phase, mitigations)
    assert outcomes == {0: "finished", 1: "finished"}, outcomes

    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    assert_rescued_together(events, FAILING_STEP, rung, phase)
    assert_every_step_ran(tmp_path / "guarded", STEPS)

    assert reference[0].keys() == Stack().state_dict().keys()
    assert_ranks_trained_alike(reference, guarded, atol=atol, rtol=10 * atol)


class _OwnAllGather(DefaultAllGather):
    """A user's own all-gather (FSDP2's, renamed): the recovery leaves it in place."""


def _install_worker(rank: int, root: str) -> None:
    from lightning_memguard.adapters.fsdp_recovery import FSDPRecovery

    with gloo_group(rank, root):
        said: list[str] = []
        plain, custom = wrap_for(Stack(), "fsdp"), wrap_for(Stack(), "fsdp")
        custom.blocks[3].set_custom_all_gather(_OwnAllGather())
        recovery = FSDPRecovery.install(plain, said.append)
        results = {
            "installed": recovery is not None and FSDPRecovery.install(plain, said.append) is recovery,
            "own_kept": FSDPRecovery.install(custom, said.append) is None
            and type(custom.blocks[3]._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm) is _OwnAllGather,
            "not_rescuing": FSDPRecovery.install(wrap_for(Stack(), "fsdp"), said.append, rescue=False) is None,
            "said": said,
        }
        torch.save(results, os.path.join(root, f"install.rank{rank}.pt"))


@pytest.mark.slow
def test_the_recovery_counts_fsdp2s_own_collectives_and_leaves_a_users_in_place(tmp_path):
    spawn_ranks(_install_worker, (str(tmp_path),), timeout_s=120)
    for rank in (0, 1):
        results = torch.load(tmp_path / f"install.rank{rank}.pt")
        assert results["installed"] and results["own_kept"] and results["not_rescuing"], results
        assert results["said"] == ["lightning-memguard: the ranks cannot recover an OOM together under FSDP2: module "
                                   "'blocks.3' already has its own collective (_OwnAllGather)."], results


def test_one_process_has_no_recovery():
    from lightning_memguard.adapters.fsdp_recovery import FSDPRecovery

    assert FSDPRecovery.install(Stack(), print) is None
