"""An estimate's measured step is the step before it replayed (estimate/step_replay.py): byte-identical to running it
again, on meta and on CPU, for CUDA and CPU targets, checkpointed and in mixed precision; and run again where the
first step changed what the second does (a tensor a module keeps, a gradient zero_grad leaves)."""

import pytest
import torch
from torch import nn

import lightning_memguard.estimate.step as step_module
from lightning_memguard import estimate_memory
from lightning_memguard.commands.demo import SmallCNN, TinyGPT
from lightning_memguard.estimate.caching_allocator import CachingAllocatorModel
from lightning_memguard.estimate.step_replay import Replay, StepRecorder, replay_enabled
from tests.helpers import assert_same_estimate, estimates_replayed_and_run_again
from tests.models import Block, Stack

class Branches(Stack):
    """Branches on an activation's value: the meta device has none, so the estimate runs the step on CPU."""

    def forward(self, x):
        h = super().forward(x)
        return torch.relu(h) if h.mean() > -100 else h


# name: (model, estimate's arguments, the paths the steps run on: a CPU target's mixed precision runs on meta)
CASES = {
    "mlp-cuda": (lambda: Stack(width=32, depth=4), {"target": "cuda", "blocks": {Block}}, {"meta"}),
    "mlp-cpu-target-on-cpu": (lambda: Stack(width=32, depth=4), {"target": "cpu", "blocks": {Block}}, {"cpu", "meta"}),
    "cuda-target-fallen-back-to-cpu": (lambda: Branches(width=32, depth=4), {"target": "cuda", "blocks": {Block}},
                                       {"cpu"}),
    "cnn-cudnn-workspaces": (lambda: SmallCNN(channels=8, image_size=16, batch_size=4), {"target": "cuda"}, {"meta"}),
    "gpt-tied-head": (lambda: TinyGPT(d_model=32, nlayers=2, seq_len=16, batch_size=4), {"target": "cuda"}, {"meta"}),
}


def batch_of(model):
    if isinstance(model, Stack):
        return (torch.randn(8, 16), torch.randn(8, 1))
    return next(iter(model.train_dataloader()))


def mse(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


@pytest.mark.parametrize("name", list(CASES))
def test_replayed_estimates_equal_those_that_run_the_step_again(name):
    build, kwargs, paths = CASES[name]
    model = build()
    extra = {"loss_fn": mse, "optimizer": torch.optim.AdamW} if isinstance(model, Stack) else {}
    n_blocks = 4 if isinstance(model, Stack) else 2
    pairs, replays = estimates_replayed_and_run_again(model, batch_of(model), n_blocks, **kwargs, **extra)
    assert replays == len(pairs)  # every step replayed: nothing these models do changes their next step
    for replayed, again in pairs:
        assert_same_estimate(replayed, again)
    assert {replayed.path for replayed, _ in pairs} == paths


class KeepsATable(nn.Module):
    """Makes a table at its first forward and keeps it (as Lightning's demo Transformer keeps its positional
    encoding): the second step does not make it again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 64)
        self.table = None

    def forward(self, x):
        if self.table is None:
            self.table = torch.ones(4096, 64, device=self.lin.weight.device)
        return self.lin(x) + self.table[: x.shape[0]]


def replays_of(model, batch, **kwargs):
    replays = []
    replay_phases = step_module.replay_phases
    step_module.replay_phases = lambda *args: replays.append(1) or replay_phases(*args)
    try:
        return estimate_memory(model, batch, **kwargs), len(replays)
    finally:
        step_module.replay_phases = replay_phases


def test_a_tensor_a_module_keeps_from_its_first_forward_makes_the_step_run_again(monkeypatch):
    model, batch = KeepsATable(), torch.randn(8, 16)
    estimate, replays = replays_of(model, batch, target="cuda")
    assert replays == 0
    with replay_enabled(False):
        assert_same_estimate(estimate, estimate_memory(model, batch, target="cuda"))
    # replayed regardless, the step would make the table again in its forward: a megabyte too many
    monkeypatch.setattr(StepRecorder, "refusal", lambda self, *args: None)
    forced = estimate_memory(model, batch, target="cuda")
    assert forced.phase_peaks["forward"] - estimate.phase_peaks["forward"] == 4096 * 64 * 4


def all_but_the_head(params):
    return torch.optim.AdamW(list(params)[:-1])


def test_a_gradient_the_optimizer_does_not_clear_makes_the_step_run_again():
    # the head's bias is trained but not the optimizer's: zero_grad leaves its gradient, the next backward adds into
    # it instead of making it
    model, batch = Stack(width=32, depth=2), (torch.randn(8, 16), torch.randn(8, 1))
    estimate, replays = replays_of(model, batch, loss_fn=mse, target="cuda", optimizer=all_but_the_head)
    assert replays == 0
    with replay_enabled(False):
        assert_same_estimate(estimate, estimate_memory(model, batch, loss_fn=mse, target="cuda",
                                                       optimizer=all_but_the_head))


def test_the_recorder_refuses_what_the_next_step_would_not_repeat():
    recorder = StepRecorder()
    recorder.seen(1, 100, known=False, changed=lambda: False)
    recorder.seen(1, 100, known=True, changed=lambda: False)  # counted again, same size: nothing new
    recorder.seen(1, 200, known=True, changed=lambda: False)  # resized in place
    recorder.seen(7, 50, known=True, changed=lambda: False)  # a weight seen again
    recorder.freed(1)
    recorder.seen(2, 8, known=False, changed=lambda: False)  # the gradient
    assert recorder.events == [(1, 100), (1, 200), (1, None), (2, 8)]
    assert recorder.refusal([2], cleared=True) is None
    assert "outlived" in recorder.refusal([], cleared=True)
    assert "zero_grad" in recorder.refusal([2], cleared=False)
    resized = StepRecorder()
    resized.seen(7, 60, known=True, changed=lambda: True)
    assert "resized" in resized.refusal([], cleared=True)
    freed = StepRecorder()
    freed.freed(7)
    assert "freed" in freed.refusal([], cleared=True)


def test_a_replay_gives_each_recorded_storage_a_key_of_its_own():
    # the address 1 is used twice, one storage after the other: two storages, neither the key alive now
    allocator = CachingAllocatorModel()
    allocator.malloc(1, 4096)  # the storage at address 1 now (a gradient, say)
    replay = Replay(allocator.hold, allocator.free)
    replay.run([(1, 2048), (1, None), (1, 1024), (3, 512)])
    assert set(replay.keys) == {1, 3} and replay.keys[1] < 0 and replay.keys[3] < 0
    assert allocator.block_size(replay.keys[1]) == 1024 and allocator.block_size(1) == 4096
    allocator.free(1)
    allocator.rename(replay.keys.pop(1), 1)
    assert allocator.block_size(1) == 1024
    with pytest.raises(ValueError, match="already holds"):
        allocator.rename(replay.keys[3], 1)
