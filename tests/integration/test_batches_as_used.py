"""Batch structures users train on, split by the micro-batch rung under a hard limit where only micro-batches fit:
an RNN fed a ``PackedSequence`` built in the collate function (in a tuple, in a dict, first), a jagged nested tensor,
and transformers' packed sequences (several sequences back to back in a row, ``position_ids`` restarting) — two rows
split by row and train as unguarded; one row cannot be split, and the report says so instead of cutting the
sequences."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from lightning_memguard import MemGuardOutOfMemoryError
from tests.helpers import DOORS, assert_same_parameters, probe, pytree_registered, run, train_unguarded

FEATURES, HIDDEN, SAMPLES, STEPS = 8, 64, 16, 40


class Classifier(nn.Module):
    """A two-layer LSTM over packed sequences, classifying each from its last hidden state."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.LSTM(FEATURES, HIDDEN, num_layers=2, batch_first=True)
        self.head = nn.Linear(HIDDEN, 3)

    def forward(self, packed: PackedSequence) -> torch.Tensor:
        _, (hidden, _) = self.rnn(packed)
        return self.head(hidden[-1])


def packed_batches(n: int, layout: str) -> list:
    """Batches whose sequences of 3 to ``STEPS`` steps are packed as a collate function packs them: ``(y, packed)``
    (``enforce_sorted=False``), ``{"y", "x"}``, or ``(packed, y)`` given sorted (``pack_sequence``'s default)."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(n):
        lengths = torch.randint(3, STEPS + 1, (SAMPLES,), generator=g)
        x = torch.randn(SAMPLES, STEPS, FEATURES, generator=g)
        y = torch.randint(0, 3, (SAMPLES,), generator=g)
        if layout == "sorted first":
            lengths, order = lengths.sort(descending=True)
            batches.append((pack_padded_sequence(x[order], lengths, batch_first=True), y[order]))
            continue
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        batches.append((y, packed) if layout == "tuple" else {"y": y, "x": packed})
    return batches


def classify(model: nn.Module, batch) -> torch.Tensor:
    if isinstance(batch, dict):
        return F.cross_entropy(model(batch["x"]), batch["y"])
    packed, y = batch if isinstance(batch[0], PackedSequence) else batch[::-1]
    return F.cross_entropy(model(packed), y)


def limit_where_micro_batches_fit(door: str, model: nn.Module, batches: list, loss, tmp_path,
                                  share: float = 0.4) -> int:
    """A hard limit ``share`` of the way from what a step holds to its probed peak: the whole batch does not fit."""
    probed = probe(door, model, batches, tmp_path / "probe", loss=loss)
    held = probed.allocated("batch_start", from_step=1)
    return int(held + share * (probed.highest(from_step=1) - held))


@pytest.mark.parametrize("door, layout", [*((door, "tuple") for door in DOORS), ("loop", "dict"),
                                          ("loop", "sorted first")])
def test_an_rnn_on_packed_sequences_in_the_batch_trains_as_unguarded_in_micro_batches(door, layout, tmp_path):
    data = packed_batches(3, layout)
    limit = limit_where_micro_batches_fit(door, Classifier(), data, classify, tmp_path)
    result = run(door, Classifier(), data, tmp_path, loss=classify, lr=0.1, cpu_hard_limit=limit,
                 mitigations=("microbatch",), explain=False)
    # each micro-batch runs its own sequences only: before, every part ran every sequence (its indices sliced, its
    # data whole) and saved nothing, or failed on a shape mismatch, or the rung was off
    assert result.guard.history["micro_batches"].max() >= 2
    assert not result.said or all("revert" not in message and "off for" not in message for message in result.said)
    assert_same_parameters(result.model, train_unguarded(Classifier(), data, loss=classify, lr=0.1), atol=1e-6)


class Pooled(nn.Module):
    """Three blocks applied to every token of a jagged nested batch, each sequence's mean classified."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)))
        self.head = nn.Linear(32, 3)

    def forward(self, nested: torch.Tensor) -> torch.Tensor:
        return self.head(torch.stack([row.mean(0) for row in self.blocks(nested).unbind()]))


def nested_batches(n: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.nested.nested_tensor([torch.randn(int(length), 32, generator=g)
                                         for length in torch.randint(5, 60, (32,), generator=g)], layout=torch.jagged),
             torch.randint(0, 3, (32,), generator=g)) for _ in range(n)]


def pooled_loss(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def test_a_jagged_nested_batch_trains_as_unguarded_in_micro_batches(tmp_path):
    data = nested_batches(3)
    limit = limit_where_micro_batches_fit("loop", Pooled(), data, pooled_loss, tmp_path)
    result = run("loop", Pooled(), data, tmp_path, loss=pooled_loss, lr=0.1, cpu_hard_limit=limit,
                 mitigations=("microbatch",), explain=False)
    assert result.guard.history["micro_batches"].max() >= 2  # torch cannot slice it: the rung broke and was reverted
    assert not result.warnings_with("revert")
    assert_same_parameters(result.model, train_unguarded(Pooled(), data, loss=pooled_loss, lr=0.1), atol=1e-6)


# --- transformers' packed sequences ---------------------------------------------------------------------------------
def packed_rows(seed: int, rows: int, lengths=(50, 30, 60, 45, 55)) -> dict:
    """What transformers' DataCollatorWithFlattening makes, in ``rows`` rows: sequences back to back, their
    ``position_ids`` restarting at 0, each one's first label -100 (it has no token before it in its sequence)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (rows, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths]).repeat(rows, 1)
    return {"input_ids": ids, "position_ids": positions, "labels": ids.masked_fill(positions == 0, -100)}


def causal_lm_loss(model: nn.Module, batch) -> torch.Tensor:
    return model(**batch).loss


def test_packed_sequences_in_two_rows_are_split_by_row_and_train_as_unguarded(tmp_path):
    pytest.importorskip("transformers")
    from tests.zoo.models import build

    data = [packed_rows(seed, rows=2) for seed in range(3)]
    # 2 rows: 2 micro-batches at most, a step of one row well over half the whole's
    limit = limit_where_micro_batches_fit("loop", build("llama")[0], data, causal_lm_loss, tmp_path, share=0.75)
    result = run("loop", build("llama")[0], data, tmp_path, loss=causal_lm_loss, cpu_hard_limit=limit,
                 mitigations=("microbatch",), explain=False)
    assert result.guard.history["micro_batches"].max() == 2
    want = train_unguarded(build("llama")[0], data, loss=causal_lm_loss)
    assert_same_parameters(result.model, want, atol=1e-6)


def test_packed_sequences_in_one_row_are_not_cut_and_the_report_says_why(tmp_path):
    pytest.importorskip("transformers")
    from tests.zoo.models import build

    data = [packed_rows(seed, rows=1) for seed in range(2)]
    limit = limit_where_micro_batches_fit("loop", build("llama")[0], data, causal_lm_loss, tmp_path)
    result = run("loop", build("llama")[0], data, tmp_path, loss=causal_lm_loss, cpu_hard_limit=limit,
                 mitigations=("microbatch",), explain=False, raises=MemGuardOutOfMemoryError)
    report = str(result.error)
    # not "microbatch at 0/0: has no level to climb to": the batch is one sample, its sequence is never cut
    assert "the batch holds one sample" in report and "shape [1, 240]" in report
    assert "never a sequence" in report and "DataCollatorWithFlattening" in report


# --- one target a sample in a list --------------------------------------------------------------------------------
class TokenPooler(nn.Module):
    """Blocks over every token of a sample, the tokens' mean as its box prediction."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).mean(1)


def detection_batches(n: int, samples: int = 24) -> list:
    """A detection-style batch: inputs, and each sample's boxes in a dict of a list, one a sample."""
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(samples, 100, 64, generator=g),
             "targets": [{"boxes": torch.randn(int(count), 4, generator=g)}
                         for count in torch.randperm(60, generator=g)[:samples] + 1]} for _ in range(n)]


def paired_loss(model: nn.Module, batch) -> torch.Tensor:
    """Each prediction against the mean of its own sample's boxes: predictions and targets paired by zip."""
    predictions = model(batch["x"])
    return torch.stack([F.mse_loss(p, t["boxes"].mean(0)) for p, t in zip(predictions, batch["targets"])]).mean()


def test_a_list_of_one_target_a_sample_is_split_with_its_samples_and_trains_as_unguarded(tmp_path):
    data = detection_batches(2)
    probed = probe("loop", TokenPooler(), data, tmp_path / "probe", loss=paired_loss)
    result = run("loop", TokenPooler(), data, tmp_path, loss=paired_loss, budget=int(0.6 * probed.highest()),
                 mitigations=("microbatch",), explain=False)
    # whole in every micro-batch, the list would pair the second micro-batch's samples with the first ones' boxes
    # (the parameters drifted 1e-3 after 3 steps, no error): each micro-batch gets its samples' targets
    assert result.guard.history["micro_batches"].max() > 1
    assert len(result.warnings_with("its list ['targets'] holds one item a sample (dicts)")) == 1
    assert_same_parameters(result.model, train_unguarded(TokenPooler(), data, loss=paired_loss), atol=1e-6)


# --- a batch class of the user's own ----------------------------------------------------------------------------------
class Pair:
    """A batch class of a user's own, as Lightning moves one (by its ``to``): inputs, targets and where they came from
    (a leaf every part keeps)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, source: str = "synthetic") -> None:
        self.x, self.y, self.source = x, y, source

    def to(self, *args, **kwargs) -> "Pair":
        return Pair(self.x.to(*args, **kwargs), self.y.to(*args, **kwargs), self.source)


@pytest.fixture
def registered_pair():
    """:class:`Pair` registered with torch's pytree for this test only, as a user does for ``torch.compile``."""
    with pytree_registered(Pair, lambda pair: ([pair.x, pair.y], pair.source),
                           lambda children, source: Pair(*children, source)):
        yield Pair


def pair_batches(n: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [Pair(torch.randn(32, 100, 64, generator=g), torch.randn(32, 4, generator=g)) for _ in range(n)]


def pair_loss(model: nn.Module, batch: Pair) -> torch.Tensor:
    assert batch.source == "synthetic" and len(batch.x) == len(batch.y)
    return F.mse_loss(model(batch.x), batch.y)


@pytest.mark.parametrize("door", DOORS)
def test_a_batch_class_registered_with_torchs_pytree_trains_as_unguarded_in_micro_batches(door, registered_pair,
                                                                                            tmp_path):
    """Its tensors are found and cut through the class's own flatten and unflatten functions: each part is a
    ``Pair`` of its samples (before, a batch of an unknown class was one leaf: no micro-batches, no estimate)."""
    data = pair_batches(3)
    probed = probe(door, TokenPooler(), data, tmp_path / "probe", loss=pair_loss)
    result = run(door, TokenPooler(), data, tmp_path, loss=pair_loss, budget=int(0.6 * probed.highest()),
                 mitigations=("microbatch",), explain=False)
    assert result.guard.history["micro_batches"].max() > 1
    assert not result.warnings_with("no tensor with a sample dimension")
    assert_same_parameters(result.model, train_unguarded(TokenPooler(), data, loss=pair_loss), atol=1e-6)


def test_a_batch_class_nothing_knows_trains_whole_and_the_warning_says_how_to_make_it_splittable(tmp_path):
    data = pair_batches(2)
    probed = probe("lightning", TokenPooler(), data, tmp_path / "probe", loss=pair_loss)
    result = run("lightning", TokenPooler(), data, tmp_path, loss=pair_loss, budget=int(0.6 * probed.highest()),
                 mitigations=("microbatch",), explain=False)
    assert (result.guard.history["micro_batches"] == 1).all()
    off = result.warnings_with("the microbatch rung is off for this run: a batch of type Pair has no tensor")
    assert len(off) == 1 and "registered with torch.utils._pytree.register_pytree_node" in off[0]
    assert_same_parameters(result.model, train_unguarded(TokenPooler(), data, loss=pair_loss), atol=1e-6)
