"""A rare long batch under FSDP2, with no collective to agree on the parts: two CPU processes (gloo), the plain-loop
guard with its default ladder (the micro-batch rung among its rungs) around a :class:`~tests.models.Stack` whose every
block and root are ``fully_shard``-ed. Only rank 1's batch at ``LONG`` has four times the tokens: rank 1 predicts it
does not fit and runs it as micro-batches, alone; rank 0 runs its batch whole, then meets each further part's
all-gathers and reduce-scatters in a shadow part (its own shards gathered, zeros reduced), told after each backward,
inside the smallest reduce-scatter, that a rank has parts left. No step after the first costs a collective of the
guard's own, no rank hangs, and the parameters equal an unguarded FSDP2 run's."""

import json
import os

import pytest
import torch

from tests.helpers import budget_crossed_between, gloo_group, guard_counting_agreements, mse, rank_csvs, \
    token_batches, wrap_for
from tests.models import Stack
from tests.spawn import spawn_ranks

STEPS, LONG = 6, 3


def _worker(rank: int, root: str, settings) -> None:
    with gloo_group(rank, root):
        model = wrap_for(Stack(), "fsdp")  # seeded: the same parameters on both ranks
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        data = token_batches(rank, STEPS, LONG)
        if settings is None:
            for batch in data:
                optimizer.zero_grad(set_to_none=True)
                mse(model, batch).backward()
                optimizer.step()
        else:
            guard_counting_agreements(model, optimizer, data, root, rank, None, **settings)
        full = {name: value.full_tensor().detach().clone() for name, value in model.state_dict().items()}
        torch.save(full, os.path.join(root, f"parameters.rank{rank}.pt"))


def _train(root, settings=None) -> dict:
    os.makedirs(root, exist_ok=True)
    spawn_ranks(_worker, (str(root), settings), timeout_s=240)  # a rank left waiting fails the test, not the suite
    return {rank: torch.load(os.path.join(root, f"parameters.rank{rank}.pt")) for rank in (0, 1)}


@pytest.mark.slow
def test_a_long_batch_on_one_rank_is_split_alone_under_fsdp2_with_no_collective_to_agree(tmp_path):
    _train(tmp_path / "probe", dict(budget="1GB", mitigations=(), cpu_sample_every=1))
    per_step = {rank: frame.groupby("step")["peak_bytes"].max()
                for rank, frame in rank_csvs(tmp_path / "probe", "memguard_history.csv").items()}
    normal = max(int(per_step[0].max()), int(per_step[1].drop(LONG).max()))
    budget = budget_crossed_between(int(per_step[1][LONG]), normal)  # the threshold line between the two

    reference = _train(tmp_path / "plain")
    guarded = _train(tmp_path / "guarded", dict(budget=budget))  # the default ladder

    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    assert events[1]["action"].tolist() == ["predicted_split"] and events[1]["step"].tolist() == [LONG], events[1]
    assert events[0].empty, events[0]  # rank 0's batch fits whole: it runs whole
    parts = {rank: frame.groupby("step")["micro_batches"].max()
             for rank, frame in rank_csvs(tmp_path / "guarded", "memguard_history.csv").items()}
    assert parts[1][LONG] in (2, 4) and (parts[1].drop(LONG) == 1).all(), parts[1]
    assert (parts[0] == 1).all(), parts[0]
    agreed = {rank: json.load(open(tmp_path / "guarded" / f"agreed.rank{rank}.json")) for rank in (0, 1)}
    assert agreed[0] == agreed[1]  # every collective met on both ranks
    # the first step agrees (no step has shown FSDP2's collectives yet); no later one does, the long batch's included
    assert agreed[0] and [step for step in agreed[0] if step > 0] == [], agreed[0]
    for rank in (0, 1):
        for name, value in guarded[rank].items():
            # the long batch's parts' weighted gradients are added in another order than the whole batch's: 1e-6, as
            # micro-batches get in tests/integration/test_fsdp_recover.py
            torch.testing.assert_close(value, reference[rank][name], atol=1e-6, rtol=1e-5, msg=name)
            assert torch.equal(value, guarded[1 - rank][name]), name  # FSDP2 kept the ranks' parameters equal
