"""A rare long batch, through every front door: one batch in eight has four times the tokens of the others, under a
hard limit that batch alone does not fit whole. The guard predicts its peak before it runs and runs it — only it — as
micro-batches: no out-of-memory error, no rescue, the batches after it whole again, and the parameters those of an
unguarded run. Where memory grows faster than the tokens (attention scores, T × T) the linear prediction falls short:
the split batch runs out of memory and the rescue runs it again in more parts. Limits are placed from the probed peaks
of the same model and data."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import DOORS, event_texts, limit_between, probe, run, train_unguarded
from tests.models import Stack, TokenAttention

SAMPLES, TOKENS, FEATURES = 8, 32, 16
LONG_EVERY, LONG_TIMES = 8, 4
N_BATCHES = 16
LONG = [i for i in range(N_BATCHES) if i % LONG_EVERY == LONG_EVERY - 3]  # steps 5 and 13


def token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded ``(x, y)`` batches of ``SAMPLES`` sequences of per-token features and targets; the batches at ``LONG``
    have ``LONG_TIMES`` times the tokens. The stack works token by token (its linears and norms act on the last
    dimension) and the loss is a mean over every token, so a step's activations are linear in the tokens."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for i in range(N_BATCHES):
        tokens = TOKENS * (LONG_TIMES if i in LONG else 1)
        x = torch.randn(SAMPLES, tokens, FEATURES, generator=generator)
        batches.append((x, x.sum(dim=-1, keepdim=True).sin()))
    return batches


@pytest.mark.parametrize("door", DOORS)
def test_a_rare_long_batch_runs_split_once_without_an_oom(door, tmp_path):
    data = token_batches()
    probed = probe(door, Stack(), data, tmp_path / "probe").per_step()
    normal, long = int(probed.drop(LONG).max()), int(probed[LONG].min())
    limit = limit_between(long, normal)
    assert long > limit and normal < 0.9 * limit  # the long batch alone does not fit; the others stay under the line

    result = run(door, Stack(), data, tmp_path / "run", cpu_hard_limit=limit, mitigations=("microbatch",),
                 explain=False)

    history, events = result.guard.history, result.guard.events
    assert result.steps_done == N_BATCHES and result.steps_seen() == list(range(N_BATCHES))
    assert history["num_ooms"].max() == 0 and (history["peak_bytes"] <= limit).all()
    assert events["action"].tolist() == ["predicted_split"] * len(LONG)  # no rescue, no rung raised
    assert events["step"].tolist() == LONG and set(events["rung"]) == {"microbatch"}
    reason = events["reason"].iloc[0]
    assert f"{LONG_TIMES:.1f}x the" in reason and f"of step {LONG[0] - 1} (the last step measured whole)" in reason
    assert "micro-batches" in reason and "this batch only" in reason
    texts = event_texts(result.log_dir)  # each event also as TensorBoard text
    assert sum(f"step {step}: predicted_split microbatch - a batch of" in t for t in texts for step in LONG) == 2
    parts = history.groupby("step")["micro_batches"].max()
    assert sorted(parts[parts > 1].index) == LONG  # exactly the long batches ran split; the next ones whole again
    assert result.guard.levels["microbatch"] == 0
    calls = [step for step, _ in result.seen]
    assert [calls.count(step) for step in LONG] == [parts[step] for step in LONG]  # each part once, nothing retried

    # the split weights each part's loss by its share: the same training as an unguarded run
    expected = train_unguarded(Stack(), data)
    for (name, got), want in zip(result.model.state_dict().items(), expected.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("door", DOORS)
def test_a_long_batch_the_prediction_misses_is_rescued_once_then_split_before_it_runs(door, tmp_path):
    data = token_batches()
    probed = probe(door, TokenAttention(FEATURES), data, tmp_path / "probe").per_step()
    normal, long = int(probed.drop(LONG).max()), int(probed[LONG].min())
    assert long > 4 * normal  # four times the tokens, more than four times the memory
    limit = int(normal / 0.75)  # the normal batches well under the line; the long one, even in four parts, over it

    result = run(door, TokenAttention(FEATURES), data, tmp_path / "run", cpu_hard_limit=limit,
                 mitigations=("microbatch",), explain=False)

    events, history = result.guard.events, result.guard.history
    assert "gave_up" not in set(events["action"]) and result.steps_done == N_BATCHES
    first_long, second_long = (events[events["step"] == step] for step in LONG)
    actions = first_long["action"].tolist()
    assert actions[0] == "predicted_split" and set(actions[1:]) == {"rescue_split"}  # the prediction fell short
    assert all("this batch only (the levels stay)" in reason for reason in first_long["reason"].iloc[1:])
    parts = history.groupby("step")["micro_batches"].max()
    assert parts[LONG[0]] >= 2 * 2 ** int(first_long["level"].iloc[0])  # twice the parts of the split that failed
    # the second long batch starts in the parts the first needed: no OOM, no rescue
    assert second_long["action"].tolist() == ["predicted_split"] and "as that one needed" in second_long[
        "reason"].iloc[0]
    assert parts[LONG[1]] == parts[LONG[0]]
    ooms = history.groupby("step")["num_ooms"].max()
    assert ooms[LONG[1]] == ooms[LONG[0]] == ooms.max()  # every OOM of the run came with the first long batch
    # no lasting slowdown: the ladder never moved, every other batch ran whole
    assert result.guard.levels["microbatch"] == 0 and (parts.drop(LONG) == 1).all()
    assert (history["peak_bytes"] <= limit).all()
    expected = train_unguarded(TokenAttention(FEATURES), data)
    for (name, got), want in zip(result.model.state_dict().items(), expected.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("door", ["lightning", "loop"])
def test_a_long_batch_rescued_by_a_rung_is_predicted_at_its_size_so_one_oom_is_enough(door, tmp_path):
    """No micro-batch rung to split the long batch: its OOM raises checkpointing, to the level the estimate predicts
    for the long batch (its activations four times the first batch's), not the first batch's level scaled to the
    failed attempt, which fell short and took an OOM a level."""
    data = token_batches()[:LONG[0] + 2]  # the first long batch and one after it
    probed = probe(door, Stack(), data, tmp_path / "probe").per_step()
    normal, long = int(probed.drop(LONG[:1]).max()), int(probed[LONG[0]])
    limit = limit_between(long, normal)
    result = run(door, Stack(), data, tmp_path / "run", cpu_hard_limit=limit, mitigations=("checkpointing",),
                 plan_at_start=False, explain=False, threshold=1.0)
    events = result.guard.events
    assert result.steps_done == len(data) and "gave_up" not in set(events["action"])
    rescues = events[events["action"] == "rescue"]
    assert len(rescues) == 1 and rescues["step"].tolist() == LONG[:1], events[["step", "action", "level"]]
    assert f"predicted for this batch of {SAMPLES * LONG_TIMES * TOKENS * (FEATURES + 1)} elements, 4.0x" in \
        rescues["reason"].iloc[0]
    assert (result.guard.history["peak_bytes"] <= limit).all()
    calls = [step for step, _ in result.seen]
    assert calls.count(LONG[0]) == 2  # the failed attempt and the one that ran
    expected = train_unguarded(Stack(), data)  # checkpointing keeps the math
    for (name, got), want in zip(result.model.state_dict().items(), expected.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
