"""combine_outputs: the outputs of a batch run in parts are the whole batch's — per-sample tensors and lists
concatenated, means weighted by share, containers rebuilt with their types — checked against running the whole
batch."""

import collections
import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch import nn

from lightning_memguard.base.batches import slice_batch, split_ranges
from lightning_memguard.base.outputs import combine_outputs
from tests.helpers import pytree_registered


class Encoding(collections.UserDict):
    pass


@dataclasses.dataclass
class Prediction:
    logits: torch.Tensor
    loss: torch.Tensor
    note: str = "ok"


class Pair(NamedTuple):
    preds: torch.Tensor
    mean: float


def step(model: nn.Module, batch: torch.Tensor) -> dict:
    """An evaluation step returning every kind of output."""
    logits = model(batch)
    return {
        "logits": logits,
        "loss": logits.square().mean(),
        "count": 7,
        "labels": [f"sample {float(v):.3f}" for v in batch[:, 0]],
        "encoding": Encoding(hidden=logits * 2),
        "prediction": Prediction(logits=logits, loss=logits.abs().mean()),
        "pair": Pair(preds=logits.argmax(dim=1), mean=float(logits.mean())),
        "weights": model.weight.detach(),
        "nothing": None,
    }


def run_in_parts(batch: torch.Tensor, parts: int, fn) -> tuple[list, list[int]]:
    ranges = split_ranges(batch.shape[0], parts)
    return [fn(slice_batch(batch, a, b, batch.shape[0])) for a, b in ranges], [b - a for a, b in ranges]


@pytest.mark.parametrize("parts", [2, 3, 10])
def test_parts_combine_to_the_whole_batch(parts):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    # small integers: every sum is exact, so a part's logits are the whole batch's rows whatever order a matmul
    # over 1 row or 10 adds in
    batch = torch.randint(-3, 4, (10, 4)).float()
    with torch.no_grad():
        model.weight.copy_(torch.randint(-3, 4, (3, 4)).float())
        model.bias.copy_(torch.randint(-3, 4, (3,)).float())
        whole = step(model, batch)
        combined = combine_outputs(*run_in_parts(batch, parts, lambda part: step(model, part)))
    assert type(combined) is dict and list(combined) == list(whole)
    assert torch.equal(combined["logits"], whole["logits"])
    torch.testing.assert_close(combined["loss"], whole["loss"])  # a mean over samples stays the batch's mean
    assert combined["count"] == 7  # equal in every part: as it is
    assert combined["labels"] == whole["labels"]  # one item a sample: concatenated
    assert type(combined["encoding"]) is Encoding and torch.equal(combined["encoding"]["hidden"],
                                                                  whole["encoding"]["hidden"])
    prediction = combined["prediction"]
    assert type(prediction) is Prediction and prediction.note == "ok"
    assert torch.equal(prediction.logits, whole["prediction"].logits)
    torch.testing.assert_close(prediction.loss, whole["prediction"].loss)
    assert type(combined["pair"]) is Pair and torch.equal(combined["pair"].preds, whole["pair"].preds)
    assert combined["pair"].mean == pytest.approx(whole["pair"].mean, rel=1e-6)
    assert combined["weights"] is not None and torch.equal(combined["weights"], model.weight)  # same in every part
    assert combined["nothing"] is None


def test_one_part_is_returned_as_it_is():
    output = {"x": torch.ones(3)}
    assert combine_outputs([output], [3]) is output


def test_values_that_differ_and_cannot_be_combined_are_listed_in_order():
    assert combine_outputs(["a", "b"], [2, 2]) == ["a", "b"]
    assert combine_outputs(["same", "same"], [1, 3]) == "same"
    counts = combine_outputs([torch.tensor(3), torch.tensor(5)], [2, 2])  # an integer scalar is not a mean
    assert [int(c) for c in counts] == [3, 5]
    assert combine_outputs([True, False], [1, 1]) == [True, False]  # a bool is not a number to weigh


class Scored:
    """A class of the user's own that torch's pytree knows (registered in the test that uses it)."""

    def __init__(self, scores: torch.Tensor, loss: torch.Tensor, label: str) -> None:
        self.scores, self.loss, self.label = scores, loss, label


def test_outputs_of_a_class_registered_with_torchs_pytree_are_combined_through_its_functions():
    with pytree_registered(Scored, lambda o: ([o.scores, o.loss], o.label),
                           lambda children, label: Scored(*children, label)):
        parts = [Scored(torch.arange(3.0), torch.tensor(1.0), "val"), Scored(torch.arange(3.0, 4.0),
                                                                              torch.tensor(4.0), "val")]
        combined = combine_outputs(parts, [3, 1])
        assert type(combined) is Scored and combined.label == "val"
        torch.testing.assert_close(combined.scores, torch.arange(4.0))
        assert combined.loss.item() == pytest.approx(1.75)
        # parts that flatten differently (another context) are listed, as objects are
        other = combine_outputs([parts[0], Scored(torch.arange(1.0), torch.tensor(2.0), "test")], [3, 1])
        assert isinstance(other, list) and len(other) == 2


def test_a_mean_over_unequal_parts_is_weighted_by_their_samples():
    combined = combine_outputs([torch.tensor(1.0), torch.tensor(4.0)], [3, 1])
    assert combined.item() == pytest.approx(1.75)
    assert combine_outputs([1.0, 4.0], [3, 1]) == pytest.approx(1.75)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match=r"one size \(and share\) per part"):
        combine_outputs([1, 2], [1])
    with pytest.raises(ValueError, match="sizes="):
        combine_outputs([1, 2], [1, 0])


def test_given_shares_weigh_the_scalars_and_the_sizes_still_cut_the_tensors():
    # a mean over labelled tokens: part one holds 3 of the batch's 4, part two 1 (though each has 2 samples)
    outputs = [{"loss": torch.tensor(1.0), "logits": torch.zeros(2, 3)}, {"loss": torch.tensor(5.0),
                                                                          "logits": torch.ones(2, 3)}]
    combined = combine_outputs(outputs, [2, 2], [0.75, 0.25])
    assert combined["loss"].item() == pytest.approx(0.75 * 1.0 + 0.25 * 5.0)
    assert torch.equal(combined["logits"], torch.cat([torch.zeros(2, 3), torch.ones(2, 3)]))
    with pytest.raises(ValueError, match="shares=\\[1.0\\]"):
        combine_outputs(outputs, [2, 2], [1.0])


def test_rows_of_another_length_in_each_part_and_differing_ints_are_listed_not_merged():
    # generated tokens: each part's rows as long as that part's longest sequence
    generated = [torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 7, dtype=torch.long)]
    combined = combine_outputs([{"tokens": generated[0], "n": 5}, {"tokens": generated[1], "n": 3}], [2, 2])
    assert isinstance(combined["tokens"], list) and [t.shape[1] for t in combined["tokens"]] == [5, 7]
    assert combined["n"] == [5, 3]  # a count is not averaged
    assert combine_outputs([{"n": 4}, {"n": 4}], [2, 2]) == {"n": 4}


def test_token_rows_of_another_length_are_padded_with_the_pad_id_and_other_listed_rows_are_said():
    # part one's sequences all ended after 3 tokens, part two's ran to 5: generate() pads the whole batch's to 5
    generated = [torch.tensor([[1, 7, 2], [1, 8, 2]]), torch.tensor([[1, 5, 6, 6, 2], [1, 9, 2, 0, 0]])]
    said = []
    combined = combine_outputs([(generated[0], "a"), (generated[1], "a")], [2, 2], pad_value=0, on_listed=said.append)
    assert torch.equal(combined[0], torch.tensor([[1, 7, 2, 0, 0], [1, 8, 2, 0, 0], [1, 5, 6, 6, 2], [1, 9, 2, 0, 0]]))
    assert combined[1] == "a" and said == []
    # floating-point rows of another length (scores) are not token ids: listed, and said
    scores = [torch.zeros(2, 3), torch.zeros(2, 5)]
    assert isinstance(combine_outputs(scores, [2, 2], pad_value=0, on_listed=said.append), list)
    assert said == ["rows of shapes (2, 3), (2, 5)"]
    # no pad id: token rows are listed too, and said
    assert isinstance(combine_outputs(generated, [2, 2], on_listed=said.append), list)
    assert said[-1] == "rows of token ids of different lengths (3, 5) and no pad id to bring them to one"


def test_sequences_of_different_lengths_that_are_not_one_item_a_sample_are_listed_and_said():
    # generate's scores: one tensor a generation step, as many steps in each part as that part needed
    said = []
    scores = [tuple(torch.zeros(2, 4) for _ in range(3)), tuple(torch.zeros(2, 4) for _ in range(5))]
    combined = combine_outputs([{"scores": scores[0]}, {"scores": scores[1]}], [2, 2], on_listed=said.append)
    assert combined["scores"] == [scores[0], scores[1]] and said == ["tuples of different lengths (3, 5)"]


def test_tensors_that_are_not_one_row_a_sample_and_differ_are_listed_and_said():
    # generate(num_return_sequences=2): two rows a sample; a per-part confusion matrix; a count
    said = []
    rows = [torch.zeros(4, 3, dtype=torch.long), torch.ones(4, 3, dtype=torch.long)]
    assert isinstance(combine_outputs([rows[0], rows[1]], [2, 2], pad_value=0, on_listed=said.append), list)
    assert said == ["tensors of shapes (4, 3), (4, 3) that differ and are not one row a sample"]
    counts = combine_outputs([{"correct": torch.tensor(3)}, {"correct": torch.tensor(1)}], [2, 2],
                             on_listed=said.append)
    assert [int(c) for c in counts["correct"]] == [3, 1] and len(said) == 2
    # equal in every part: a constant of the step, kept and not said
    assert torch.equal(combine_outputs([torch.arange(4), torch.arange(4)], [2, 2], on_listed=said.append),
                       torch.arange(4)) and len(said) == 2
