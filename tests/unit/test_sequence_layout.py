"""Which size of a batch a model reads as time steps (mitigations/sequence_layout.py, estimate/probe.py): torch's
time-major layers are found, the input they receive in one forward on the meta device says whether the batch's
leading size is time steps, and a batch whose shapes all look batch-major is then not split."""

import pytest
import torch
from torch import nn

from lightning_memguard.adapters.torch_backend import AutocastSwitch
from lightning_memguard.estimate.probe import first_inputs
from lightning_memguard.guard.ladder import Ladder
from lightning_memguard.mitigations.sequence_layout import time_axis_layers, time_major_text


def test_the_time_major_layers_are_torchs_recurrent_and_attention_layers_without_batch_first():
    model = nn.ModuleDict({"gru": nn.GRU(4, 8), "lstm": nn.LSTM(4, 8, batch_first=True), "lin": nn.Linear(4, 4),
                           "encoder": nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2), 2,
                                                            enable_nested_tensor=False),
                           "attn": nn.MultiheadAttention(8, 2, batch_first=True)})
    assert time_axis_layers(model) == ["gru", "encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    assert time_axis_layers(nn.Sequential(nn.Linear(2, 2))) == []


@pytest.mark.parametrize("shape, size, time_major", [
    ((12, 16, 8), 12, True),  # the batch's leading size is the layer's time steps
    ((12, 16, 8), 16, False),  # the samples second: a batch-major model that transposed its batch
    ((12, 12, 8), 12, False),  # as many steps as samples: cannot be told, split as before
    ((12, 8), 12, True),  # one unbatched sequence: its steps are the leading size
    ((12,), 12, False),
])
def test_the_input_a_time_major_layer_receives_says_whether_the_leading_size_is_time_steps(shape, size, time_major):
    text = time_major_text({"rnn": shape}, size)
    assert (text is not None) is time_major
    if time_major:
        assert "'rnn'" in text and str(list(shape)) in text and f"leading size {size}" in text


class Tagger(nn.Module):
    """Token ids ``[T, B]`` and tags ``[T, B]``, an embedding and a time-major LSTM: every tensor leads with T."""

    def __init__(self, transpose: bool = False) -> None:
        super().__init__()
        self.transpose = transpose
        self.embed, self.rnn, self.head = nn.Embedding(50, 8), nn.LSTM(8, 16), nn.Linear(16, 5)

    def forward(self, ids):
        x = self.embed(ids.t() if self.transpose else ids)
        return self.head(self.rnn(x)[0])


def tag_loss(model, batch):
    ids, tags = batch
    logits = model(ids)
    return nn.functional.cross_entropy(logits.flatten(0, 1), (tags.t() if model.transpose else tags).flatten())


def test_first_inputs_are_seen_on_meta_and_the_model_is_not_changed():
    model, batch = Tagger(), (torch.randint(0, 50, (12, 4)), torch.randint(0, 5, (12, 4)))
    before = [p.detach().clone() for p in model.parameters()]
    assert first_inputs(model, batch, ["rnn", "head", "missing"], tag_loss) == {"rnn": (12, 4, 8), "head": (12, 4, 16)}
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(not m._forward_pre_hooks for m in model.modules())


def ladder_for(model, loss_fn):
    said = []
    ladder = Ladder(("microbatch",), 0.9, None, 0.03, warn=said.append)
    ladder.setup(model, torch.device("cpu"), AutocastSwitch(torch.device("cpu")), guarding=True)
    return ladder, said


@pytest.mark.parametrize("transpose", [False, True])
def test_the_ladder_turns_the_microbatch_rung_off_where_the_leading_size_is_time_steps(transpose):
    model = Tagger(transpose)
    shape = (4, 12) if transpose else (12, 4)  # batch-major ids, transposed in forward; else time-major
    batch = (torch.randint(0, 50, shape), torch.randint(0, 5, shape))
    ladder, said = ladder_for(model, tag_loss)
    ladder.note_batch(batch, model, None, loss_fn=tag_loss)
    rung = ladder.rungs["microbatch"]
    assert rung.splittable is transpose
    off = [message for message in said if "microbatch rung is off" in message]
    assert len(off) == (0 if transpose else 1)
    if not transpose:
        assert "'rnn'" in off[0] and "[12, 4, 8]" in off[0]


class AsksAWeight(Tagger):
    def forward(self, ids):
        if self.head.weight.sum().item() > 1e9:  # a value the meta device has not, whatever the batch
            ids = ids + 1
        return super().forward(ids)


def test_a_forward_that_cannot_run_on_meta_is_said_once_and_the_batch_is_split_as_before():
    model, batch = AsksAWeight(), (torch.randint(0, 50, (12, 4)), torch.randint(0, 5, (12, 4)))
    ladder, said = ladder_for(model, tag_loss)
    ladder.note_batch(batch, model, None, loss_fn=tag_loss)
    assert ladder.rungs["microbatch"].splittable
    assert len(said) == 1 and "could not run on the meta device" in said[0] and "'rnn'" not in said[0]
    assert "rnn" in said[0]


def test_first_inputs_names_a_wrapped_models_layers_as_the_wrapper_does():
    model = nn.DataParallel(Tagger())  # on CPU it only wraps: the names gain "module."
    batch = (torch.randint(0, 50, (12, 4)), torch.randint(0, 5, (12, 4)))
    assert time_axis_layers(model) == ["module.rnn"]
    assert first_inputs(model, batch, ["module.rnn"], tag_loss) == {"module.rnn": (12, 4, 8)}
