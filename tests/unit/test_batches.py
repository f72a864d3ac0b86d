"""Batch structures (base/batches.py) and the micro-batch weights (mitigations/microbatch.py): every container kind is
counted, mapped and split with its type kept, and each micro-batch's loss gets its share of what the loss averages
over."""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple, Optional

import pytest
import torch
from torch import nn

from lightning_memguard import MemGuard
from lightning_memguard.base.batches import (
    BatchSize,
    batch_field,
    batch_size_of,
    batch_tensors,
    item_lists,
    map_tensors,
    slice_batch,
    split_batch,
    split_ranges,
)
from lightning_memguard.guard.settings import GuardSettings
from lightning_memguard.mitigations.microbatch import MicroBatching, model_shifts_labels
from tests.helpers import pytree_registered

N = 10  # samples in every test batch


class Encoding(collections.UserDict):
    """A mapping that is not a dict and carries an attribute of its own, as transformers' BatchEncoding does."""

    def __init__(self, data, note: str = "") -> None:
        super().__init__(data)
        self.note = note


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    y: torch.Tensor
    tag: str = "t"
    derived: int = dataclasses.field(init=False, default=0)  # dataclasses.replace could not set this one


class Pair(NamedTuple):
    inputs: torch.Tensor
    target: torch.Tensor


def samples(width: int = 3, offset: int = 0) -> torch.Tensor:
    return torch.arange(N * width, dtype=torch.float32).view(N, width) + offset


def nested_batch():
    """Every container kind, nested, with leaves that have no batch dimension."""
    return {
        "enc": Encoding({"ids": samples(), "scale": torch.tensor(2.0)}, note="kept"),
        "frozen": Frozen(samples(2), samples(1)),
        "pair": Pair(samples(4), torch.arange(N)),
        "list": [samples(1, 100), "text", None],
        "table": collections.OrderedDict(a=samples(1, 7), b=torch.ones(3, 3)),
        "counts": collections.defaultdict(list, c=torch.arange(N)),
        "tuple": (torch.arange(N), 5),
    }


def test_every_tensor_of_every_container_kind_is_found():
    batch = nested_batch()
    assert len(batch_tensors(batch)) == 11
    assert batch_size_of(batch) == N
    assert batch_size_of({"n": 3, "scalar": torch.tensor(1.0)}) is None


def test_map_tensors_keeps_every_container_type_and_attribute():
    batch = nested_batch()
    doubled = map_tensors(lambda t: t * 2, batch)
    assert type(doubled["enc"]) is Encoding and doubled["enc"].note == "kept"
    assert type(doubled["frozen"]) is Frozen and doubled["frozen"].tag == "t"
    assert type(doubled["pair"]) is Pair and type(doubled["table"]) is collections.OrderedDict
    assert type(doubled["counts"]) is collections.defaultdict and doubled["counts"].default_factory is list
    assert doubled["list"][1:] == ["text", None] and doubled["tuple"][1] == 5
    assert torch.equal(doubled["frozen"].y, batch["frozen"].y * 2)
    assert torch.equal(batch["enc"]["ids"], samples())  # the original is untouched
    unchanged = {"n": [1, 2], "s": "x"}
    assert map_tensors(lambda t: t * 2, unchanged) is unchanged  # nothing to map: the same object back


def test_a_split_keeps_types_slices_samples_and_keeps_the_rest_whole():
    batch = nested_batch()
    parts = split_batch(batch, 4)
    assert [len(part["pair"].inputs) for part, _ in parts] == [3, 3, 2, 2]
    assert sum(share for _, share in parts) == pytest.approx(1.0)
    for part, _ in parts:
        assert type(part["enc"]) is Encoding and part["enc"].note == "kept"
        assert type(part["frozen"]) is Frozen and type(part["pair"]) is Pair
        assert part["enc"]["scale"] is batch["enc"]["scale"]  # no batch dimension: whole in every part
        assert part["table"]["b"] is batch["table"]["b"]  # leading size 3, not the batch's
        assert part["list"][1] == "text" and part["tuple"][1] == 5
    for get in (lambda b: b["enc"]["ids"], lambda b: b["frozen"].x, lambda b: b["pair"].target,
                lambda b: b["list"][0], lambda b: b["table"]["a"], lambda b: b["counts"]["c"],
                lambda b: b["tuple"][0]):
        torch.testing.assert_close(torch.cat([get(part) for part, _ in parts]), get(batch))


def test_a_split_is_capped_at_the_batch_size_and_a_batch_without_samples_cannot_be_split():
    assert split_ranges(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert split_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert len(split_batch([torch.zeros(3, 2)], 8)) == 3
    with pytest.raises(ValueError, match="no tensor with a sample dimension"):
        split_batch({"n": 3, "scale": torch.tensor(1.0)}, 2)


class Graphs:
    """A class of the user's own that torch's pytree knows (registered in the test that uses it)."""

    def __init__(self, nodes: torch.Tensor, labels: torch.Tensor, name: str) -> None:
        self.nodes, self.labels, self.name = nodes, labels, name


def test_a_class_registered_with_torchs_pytree_is_walked_and_rebuilt_by_its_own_functions():
    with pytree_registered(Graphs, lambda g: ([g.nodes, g.labels], g.name),
                           lambda children, name: Graphs(*children, name)):
        batch = {"graphs": Graphs(samples(), samples(1), "train"), "ids": samples(2)}
        assert [t.shape for t in batch_tensors(batch)] == [(N, 3), (N, 1), (N, 2)] and batch_size_of(batch) == N
        parts = [part for part, _ in split_batch(batch, 3)]
        assert all(type(part["graphs"]) is Graphs and part["graphs"].name == "train" for part in parts)
        torch.testing.assert_close(torch.cat([part["graphs"].labels for part in parts]), batch["graphs"].labels)
        assert map_tensors(lambda t: t, batch)["graphs"] is batch["graphs"]  # nothing changed: the same object
        # a list of one such object a sample goes with its samples, as one of dicts does
        assert [where for where, _ in item_lists({"x": samples(), "g": [Graphs(samples(1), samples(2), "a")] * N},
                                                 N)] == ["['g']"]
    # unregistered, it is a leaf again, and the error says what would make it splittable
    with pytest.raises(ValueError, match="Graphs has no tensor .* registered with torch.utils._pytree"):
        split_batch(Graphs(samples(), samples(1), "train"), 2)


def test_per_sample_strings_and_numbers_are_split_with_their_samples_and_other_values_go_whole():
    batch = {"x": samples(), "names": [f"s{i}" for i in range(N)], "ids": tuple(range(N)),
             "mixed": [samples(1), "text"], "labels": ["cat", "dog"], "nested": (samples(2), ["a"] * N)}
    parts = [part for part, _ in split_batch(batch, 4)]
    assert [part["names"] for part in parts] == [["s0", "s1", "s2"], ["s3", "s4", "s5"], ["s6", "s7"], ["s8", "s9"]]
    assert [part["ids"] for part in parts][2] == (6, 7)  # a tuple stays a tuple
    assert all(part["labels"] is batch["labels"] for part in parts)  # not as long as the batch: whole
    assert all(part["mixed"][1] == "text" and len(part["mixed"][0]) == len(part["x"]) for part in parts)
    assert [len(part["nested"][1]) for part in parts] == [3, 3, 2, 2]
    assert map_tensors(lambda t: t, batch)["names"] is batch["names"]  # only a split touches them


def test_a_batch_whose_first_tensor_is_not_batch_major_is_not_split_and_other_sizes_are_named():
    table_first = {"table": torch.zeros(100, 3), "x": samples(), "y": samples(1)}
    micro = rung()
    micro.observe_batch(table_first)
    assert not micro.splittable and "leading size 100" in micro.unsplittable
    assert "2 tensors have leading size 10" in micro.unsplittable
    said = []
    micro = MicroBatching(nn.Linear(2, 2), warn=said.append)
    micro.observe_batch({"x": samples(), "y": samples(1), "table": torch.zeros(100, 3)})
    assert micro.splittable and micro.unsplittable is None and not said  # not engaged: nothing said yet
    micro.set_level(1)
    assert any("[100, 3]" in note and "go whole" in note for note in micro.notices)
    micro.observe_batch({"x": samples(), "y": samples(1)})  # every tensor batch-major: nothing to name
    assert micro.splittable and not said
    micro.observe_batch({"x": samples(), "other": torch.zeros(4, 3)})  # engaged already (resumed): said at once
    assert len(said) == 1 and "[4, 3]" in said[0]


@pytest.mark.parametrize("batch, time_major", [
    ((torch.zeros(12, 16, 3), torch.zeros(16)), True),  # a GRU's default: [T, B, F] and a label per sample
    ((torch.zeros(12, 16, 3), torch.zeros(12, 16), torch.zeros(16)), True),  # a label per step, lengths per sample
    ((torch.zeros(16, 12), torch.zeros(16, 12), torch.zeros(12)), True),  # ids [B, L], positions [L]: reads the same
    ((torch.zeros(16, 3, 8, 8), torch.zeros(16), torch.zeros(3)), False),  # images, labels, a per-channel tensor
    ((torch.zeros(16, 3), torch.zeros(16), torch.zeros(3, 5)), False),  # a shared table after the samples
    ((torch.zeros(16, 12), torch.zeros(16, 12), torch.zeros(12, 12), torch.zeros(16)), False),  # and a [B] field
])
def test_a_time_major_batch_is_not_split(batch, time_major):
    """The first tensor's second size leads other tensors and every tensor of its leading size has that second size:
    the leading size is most likely time steps, which a split would cut instead of the samples."""
    micro = rung()
    micro.observe_batch(batch)
    assert micro.splittable is not time_major
    if time_major:
        assert "time-major" in micro.unsplittable and f"{list(batch[0].shape)}" in micro.unsplittable


@pytest.mark.parametrize("batch, named", [({"x": samples(), "n": N}, "'n'"), (Pair(samples(), N), "'target'"),
                                          ({"x": samples(), "num_items_in_batch": N}, None),
                                          ({"x": samples(), "n": N - 1}, None)])
def test_an_int_field_counting_the_samples_is_named_when_the_rung_engages(batch, named):
    micro = rung()
    micro.observe_batch(batch)
    micro.set_level(1)
    notes = [note for note in micro.notices if "equals its 10 samples" in note]
    assert [named in note for note in notes] == ([True] if named else [])


def test_a_batch_encoding_is_split_with_its_type_and_encodings_kept():
    transformers = pytest.importorskip("transformers")
    batch = transformers.BatchEncoding({"input_ids": samples(), "attention_mask": torch.ones(N, 3)},
                                       n_sequences=1)
    assert batch_size_of(batch) == N and len(batch_tensors(batch)) == 2
    part = slice_batch(batch, 2, 5, N)
    assert type(part) is transformers.BatchEncoding and part.n_sequences == 1
    assert torch.equal(part["input_ids"], batch["input_ids"][2:5]) and torch.equal(part.input_ids, part["input_ids"])
    assert batch_field(part, "attention_mask").shape == (3, 3)


# --- weights ----------------------------------------------------------------------------------------------------------
def labelled(rows: list[int], width: int = 6) -> torch.Tensor:
    """Labels with ``rows[i]`` labelled tokens at the start of row i, -100 after."""
    labels = torch.full((len(rows), width), -100)
    for i, n in enumerate(rows):
        labels[i, :n] = 7
    return labels


def rung(module: Optional[nn.Module] = None, weight=None) -> MicroBatching:
    return MicroBatching(module if module is not None else nn.Linear(2, 2), weight=weight,
                         warn=lambda message: None)


def test_without_labels_micro_batches_weigh_their_share_of_samples():
    weights = [w for _, w in rung().split((torch.zeros(N, 2), torch.zeros(N)), 4)]
    assert weights == [0.3, 0.3, 0.2, 0.2]


def test_with_labels_micro_batches_weigh_their_share_of_labelled_tokens():
    batch = {"input_ids": torch.zeros(4, 6, dtype=torch.long), "labels": labelled([6, 2, 3, 1])}
    weights = [w for _, w in rung().split(batch, 2)]
    assert weights == pytest.approx([8 / 12, 4 / 12])  # not the sample shares 1/2, 1/2
    assert sum(w for _, w in rung().split(batch, 4)) == pytest.approx(1.0)



def test_a_batch_without_labels_weighs_its_one_integer_tensor_padded_with_minus_100():
    # (x, y) as a hand-written cross_entropy reads it: torch ignores -100 by default, so its mean is over labels
    batch = (torch.zeros(4, 6, 3), labelled([6, 2, 3, 1]))
    assert [w for _, w in rung().split(batch, 2)] == pytest.approx([8 / 12, 4 / 12])
    micro = rung()
    micro.observe_batch(batch)
    micro.set_level(1)
    assert "labels not -100 in its tensor #1 (shape [4, 6])" in micro.notices[0]
    # the ids beside them are integers too, but hold no -100: not taken for the labels
    ids = {"ids": torch.ones(4, 6, dtype=torch.long), "y": labelled([6, 2, 3, 1]), "mask": torch.ones(4, 6).bool()}
    assert [w for _, w in rung().split(ids, 2)] == pytest.approx([8 / 12, 4 / 12])


def test_two_integer_tensors_padded_with_minus_100_keep_sample_shares_and_say_why():
    batch = (torch.zeros(4, 2), labelled([6, 2, 3, 1]), labelled([1, 1, 1, 6]))
    assert [w for _, w in rung().split(batch, 2)] == [0.5, 0.5]  # which one the loss averages over is not known
    micro = rung()
    micro.observe_batch(batch)
    micro.set_level(1)
    assert "share of the batch's samples" in micro.notices[0]
    assert any("#1 (shape [4, 6]) and #2 (shape [4, 6]) each hold -100" in note and "microbatch_weight='sum'" in note
               for note in micro.notices[1:])


def test_a_summed_loss_adds_its_micro_losses_unweighted():
    batch = (torch.zeros(4, 6, 3), labelled([6, 2, 3, 1]))
    micro = rung(weight="sum")
    assert [w for _, w in micro.split(batch, 4)] == [1.0, 1.0, 1.0, 1.0]
    micro.observe_batch(batch)
    micro.set_level(1)
    assert "losses unweighted: microbatch_weight='sum'" in micro.notices[0]


@dataclasses.dataclass
class LabelledBatch:
    input_ids: torch.Tensor
    labels: torch.Tensor


def test_labels_are_found_as_an_attribute_and_shift_labels_are_counted_as_they_are():
    batch = LabelledBatch(torch.zeros(4, 6), labelled([6, 2, 3, 1]))
    assert [w for _, w in rung().split(batch, 2)] == pytest.approx([8 / 12, 4 / 12])
    shifted = {"labels": labelled([6, 6, 6, 6]), "shift_labels": labelled([1, 1, 4, 4])}
    assert [w for _, w in rung().split(shifted, 2)] == pytest.approx([0.2, 0.8])


def test_a_loss_divided_by_num_items_in_batch_is_summed_unweighted():
    batch = {"labels": labelled([6, 2, 3, 1]), "num_items_in_batch": torch.tensor(12)}
    parts = rung().split(batch, 2)
    assert [w for _, w in parts] == [1.0, 1.0] and all(p["num_items_in_batch"] is batch["num_items_in_batch"]
                                                        for p, _ in parts)


def test_a_user_weight_is_normalised_and_a_bad_one_is_refused():
    batch = {"x": torch.arange(N).float()}
    weights = [w for _, w in rung(weight=lambda b: b["x"].sum()).split(batch, 2)]
    assert weights == pytest.approx([10 / 45, 35 / 45])
    with pytest.raises(ValueError, match=r"returned -1.*finite number >= 0"):
        rung(weight=lambda b: -1).split(batch, 2)
    with pytest.raises(ValueError, match=r"returned 'many'"):
        rung(weight=lambda b: "many").split(batch, 2)


def test_a_weightless_micro_batch_runs_joined_to_its_neighbour_and_says_so():
    said = []
    micro = MicroBatching(nn.Linear(2, 2), warn=said.append)
    batch = {"labels": labelled([3, 0, 0, 2, 0, 1])}  # rows 1, 2 and 4 have no labelled token
    parts = micro.split(batch, 6)
    assert [len(p["labels"]) for p, _ in parts] == [3, 2, 1]  # every sample still runs, none alone at weight 0
    assert [w for _, w in parts] == pytest.approx([3 / 6, 2 / 6, 1 / 6])
    first_empty = micro.split({"labels": labelled([0, 0, 4, 2])}, 4)
    assert [len(p["labels"]) for p, _ in first_empty] == [3, 1]
    assert len(said) == 1 and "joined to its neighbour" in said[0]  # once per fit
    nothing = micro.split({"labels": labelled([0, 0, 0, 0])}, 2)  # the whole batch's own loss is 0/0 as well
    assert [w for _, w in nothing] == [0.5, 0.5]


def test_the_caveat_says_which_weight_is_used():
    for batch, words in [((torch.zeros(4, 2),), "share of the batch's samples"),
                         ({"labels": labelled([1, 2, 3, 4])}, "labelled tokens (labels not -100)"),
                         ({"labels": labelled([1, 2]), "num_items_in_batch": 3}, "unweighted")]:
        micro = rung()
        micro.observe_batch(batch)
        micro.set_level(1)
        assert words in micro.notices[0] and "microbatch_weight=" in micro.notices[0]

    def tokens_that_count(b):
        return 1

    micro = rung(weight=tokens_that_count)
    micro.observe_batch({"x": torch.zeros(2)})
    micro.set_level(1)
    assert "microbatch_weight=" + tokens_that_count.__qualname__ in micro.notices[0]


@pytest.mark.parametrize("name, shifts", [("gpt2", True), ("llama", True), ("bert", False), ("t5", False),
                                          ("vit", False)])
def test_the_causal_shift_is_read_from_the_transformers_model(name, shifts):
    pytest.importorskip("transformers")
    from tests.zoo.models import build

    model, _ = build(name)
    holder = nn.ModuleDict({"model": model})  # found inside a wrapper, as a LightningModule holds it
    assert model_shifts_labels(holder) is shifts
    assert model_shifts_labels(nn.Linear(2, 2)) is False


def test_a_causal_lm_counts_its_labels_after_the_shift():
    pytest.importorskip("transformers")
    from tests.zoo.models import build

    micro = rung(build("gpt2")[0])
    batch = {"labels": labelled([6, 2, 3, 1])}  # after the shift: 5, 1, 2, 0 labelled tokens
    assert [w for _, w in micro.split(batch, 2)] == pytest.approx([6 / 8, 2 / 8])


@pytest.mark.parametrize("bad", [3, "tokens", "mean", [len]])
def test_microbatch_weight_is_checked_at_construction_by_every_front_door(bad):
    with pytest.raises(ValueError, match=r"microbatch_weight=.*must be a callable batch -> number"):
        GuardSettings(microbatch_weight=bad)
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"microbatch_weight="):
        MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), microbatch_weight=bad)
    from lightning_memguard import MemGuardCallback

    with pytest.raises(ValueError, match=r"microbatch_weight="):
        MemGuardCallback(microbatch_weight=bad)


# --- samples t[start:stop] cannot cut: a PackedSequence, nested tensors ----------------------------------------------
def padded_sequences(lengths: list[int], features: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    steps = torch.arange(max(lengths))[None, :, None]
    mask = steps < torch.tensor(lengths)[:, None, None]
    return torch.randn(len(lengths), max(lengths), features, generator=g) * mask


@pytest.mark.parametrize("sorted_", [False, True], ids=["enforce_sorted=False", "given sorted"])
def test_a_packed_sequence_is_split_by_its_sequences_into_packed_parts(sorted_):
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    lengths = [6, 5, 3, 2, 1] if sorted_ else [3, 6, 1, 5, 2]
    x = padded_sequences(lengths)
    packed = pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=sorted_)
    y = torch.arange(5)
    batch = {"y": y, "x": packed}
    # its sequences are the samples, also where it comes first; its data's steps are the elements
    assert batch_size_of(batch) == batch_size_of((packed, y)) == 5
    assert BatchSize.of(batch).elements == 5 + packed.data.numel()
    parts = split_batch(batch, 2)
    assert [share for _, share in parts] == [3 / 5, 2 / 5]
    start = 0
    for part, _ in parts:
        got, got_lengths = pad_packed_sequence(part["x"], batch_first=True)
        stop = start + len(part["y"])
        # the part's sequences are the whole's, in their order, each alone (not every sequence with a slice of
        # the indices that order them, as a split of its tensors by their leading size made it)
        assert got_lengths.tolist() == lengths[start:stop]
        torch.testing.assert_close(got, x[start:stop, :max(lengths[start:stop])], rtol=0, atol=0)
        assert (part["x"].sorted_indices is None) == sorted_
        start = stop


@pytest.mark.parametrize("sorted_", [False, True], ids=["enforce_sorted=False", "given sorted"])
def test_a_larger_batch_repeats_a_packed_sequences_sequences_with_the_other_samples(sorted_):
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    from lightning_memguard.estimate.batch_size import batch_of_size

    lengths = [6, 5, 3, 2, 1] if sorted_ else [3, 6, 1, 5, 2]
    x = padded_sequences(lengths)
    batch = {"y": torch.arange(5), "x": pack_padded_sequence(x, torch.tensor(lengths), batch_first=True,
                                                            enforce_sorted=sorted_)}
    larger = batch_of_size(batch, 12)
    rows = torch.arange(12) % 5
    assert batch_size_of(larger) == 12 and torch.equal(larger["y"], rows)
    got, got_lengths = pad_packed_sequence(larger["x"], batch_first=True)
    assert got_lengths.tolist() == [lengths[i] for i in rows]
    torch.testing.assert_close(got, x[rows], rtol=0, atol=0)
    smaller = batch_of_size(batch, 3)  # cut: the first three, in their order
    assert pad_packed_sequence(smaller["x"], batch_first=True)[1].tolist() == lengths[:3]


def test_a_batch_with_a_packed_sequence_first_is_judged_by_its_sequences():
    from torch.nn.utils.rnn import pack_sequence

    packed = pack_sequence([torch.ones(4, 2), torch.ones(2, 2)])
    rung = MicroBatching(nn.Linear(2, 2))
    rung.observe_batch((packed, torch.zeros(2)))
    assert rung.splittable and rung.max_level == 1 and rung.no_levels_reason is None


def test_a_jagged_nested_tensor_is_split_by_its_leading_size():
    rows = [torch.randn(n, 3) for n in (2, 5, 1, 4)]
    nested = torch.nested.nested_tensor(rows, layout=torch.jagged)
    parts = split_batch((nested, torch.arange(4)), 2)
    got = [row for part, _ in parts for row in part[0].unbind()]
    assert [p[1].tolist() for p, _ in parts] == [[0, 1], [2, 3]]
    for row, want in zip(got, rows, strict=True):
        assert torch.equal(row, want)


def test_a_batch_of_one_sample_says_why_it_has_no_level():
    rung = MicroBatching(nn.Linear(2, 2))
    rung.observe_batch({"input_ids": torch.ones(1, 24, dtype=torch.long), "position_ids": torch.zeros(1, 24)})
    assert rung.max_level == 0
    assert "one sample" in rung.no_levels_reason and "[1, 24]" in rung.no_levels_reason


def test_a_list_of_one_target_a_sample_is_split_with_its_samples_never_inside_its_items():
    # a detection-style batch: the images' targets in a list of dicts, one a sample; the second image has as many
    # boxes as the batch has images, and every image has 3 boxes in the second batch: neither is cut
    targets = [{"boxes": torch.rand(n, 4), "labels": torch.zeros(n, dtype=torch.long)} for n in (1, 4, 2, 5)]
    batch = {"pixel_values": torch.rand(4, 8), "targets": targets}
    rung = MicroBatching(nn.Linear(2, 2))
    rung.observe_batch(batch)
    assert rung.splittable and any("its list ['targets'] holds one item a sample (dicts)" in note
                                   for note in rung._whole)
    parts = split_batch(batch, 2)
    assert [len(part["targets"]) for part, _ in parts] == [2, 2]
    assert all(a is b for (part, _) in parts for a, b in zip(part["targets"], targets[:2] if part is parts[0][0]
                                                            else targets[2:]))
    assert torch.equal(parts[1][0]["pixel_values"], batch["pixel_values"][2:])
    same_size = {"pixel_values": torch.rand(4, 8), "targets": [{"boxes": torch.rand(3, 4)} for _ in range(4)]}
    rung.observe_batch(same_size)  # twelve box tensors of leading size 3 are not mistaken for the samples
    assert rung.splittable
    assert [len(part["targets"]) for part, _ in split_batch(same_size, 4)] == [1, 1, 1, 1]
    # ragged tensors one a sample too; a tuple that holds the samples' own tensor, or tensors of one size, do not
    assert item_lists({"x": torch.ones(3, 2), "boxes": [torch.ones(n, 4) for n in (1, 2, 4)]}, 3)
    assert not item_lists((torch.ones(2, 5), torch.ones(2)), 2)
    assert not item_lists({"a": torch.ones(2, 5), "b": (torch.ones(7, 3), torch.ones(7))}, 2)


def test_a_rung_resumed_at_a_level_says_its_weight_as_the_first_batch_shows_it_once():
    said: list[str] = []
    rung = MicroBatching(nn.Linear(2, 2), warn=said.append)
    rung.set_level(2)  # restored from a checkpoint: no batch seen yet, its weight not said yet
    assert not any("micro-batching weights" in notice for notice in rung.notices) and said == []
    labels = torch.full((8, 6), -100)
    labels[:, :3] = 1
    rung.observe_batch({"input_ids": torch.ones(8, 6, dtype=torch.long), "labels": labels})
    weights = [text for text in said if "micro-batching weights" in text]
    assert len(weights) == 1 and "labelled tokens (labels not -100)" in weights[0]
    assert "when the batch carries labels" not in weights[0]  # the first batch decided: not the rule in general
    rung.observe_batch({"input_ids": torch.ones(8, 6, dtype=torch.long), "labels": labels})
    assert len([text for text in said if "micro-batching weights" in text]) == 1
