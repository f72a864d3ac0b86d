"""RunningBuffers: a failed attempt's updates of running buffers are put back, constant buffers are never copied."""

from __future__ import annotations

import torch
from torch import nn

from lightning_memguard.base.buffers import RunningBuffers


# stays here: a buffer of its own written in place is the behaviour these tests check
class Counting(nn.Module):
    """Keeps a running count in a buffer of its own (not a norm layer's), and a constant table it never writes."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("table", torch.arange(8.0))

    def forward(self, x):
        self.seen += x.shape[0]
        return x * self.table[: x.shape[1]].sum()


def test_a_failed_attempt_leaves_batchnorm_statistics_as_they_were():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    said = []
    buffers = RunningBuffers(model, said.append)
    buffers.save()
    model(torch.randn(16, 4))  # the attempt that fails: the forward already updated the statistics
    assert buffers.changed() == ["1.num_batches_tracked"]  # the kernel bumps no version of the statistics
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    buffers.restore()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert said == []


def test_a_buffer_updated_in_place_by_other_code_is_learned_after_one_warning():
    model = Counting()
    said = []
    buffers = RunningBuffers(model, said.append)
    buffers.save()
    model(torch.ones(3, 4))
    buffers.restore()  # not saved before the first attempt: cannot be put back, said once
    assert float(model.seen) == 3 and len(said) == 1 and "seen" in said[0] and "table" not in said[0]
    buffers.save()
    model(torch.ones(5, 4))
    buffers.restore()
    assert float(model.seen) == 3 and len(said) == 1  # learned: saved and put back from then on
    assert buffers.copied == {"seen"}  # a constant buffer (table) is never copied


def test_a_model_without_running_buffers_costs_no_copy():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    buffers = RunningBuffers(model, print)
    buffers.save()
    model(torch.randn(2, 4))
    buffers.restore()
    assert buffers.copied == frozenset()
