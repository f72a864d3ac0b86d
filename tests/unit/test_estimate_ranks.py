"""The per-rank estimate's arguments and its shares, in one process (the two-rank comparison with measured runs is
tests/integration/test_rank_estimate.py)."""

import pytest
import torch

from lightning_memguard import estimate_memory
from tests.helpers import mse
from tests.models import Stack, regression_batches

BATCH = regression_batches(1, size=64)[0]


@pytest.mark.parametrize("strategy, world_size, named", [
    ("zero3", 2, "strategy='zero3'"), ("fsdp", 0, "world_size=0"), ("ddp", None, "world_size="),
    (None, 4, "world_size=4"), ("fsdp", 2.5, "world_size=2.5")])
def test_bad_strategy_or_world_size_is_a_value_error_naming_it(strategy, world_size, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        estimate_memory(Stack(), BATCH, loss_fn=mse, target="cpu", strategy=strategy, world_size=world_size)


def test_ddp_adds_one_copy_of_the_gradients_and_fsdp_divides_the_states():
    one = estimate_memory(Stack(width=64, depth=4), BATCH, optimizer=torch.optim.Adam, loss_fn=mse, target="cpu")
    ddp = estimate_memory(Stack(width=64, depth=4), BATCH, optimizer=torch.optim.Adam, loss_fn=mse, target="cpu",
                          strategy="ddp", world_size=8)
    assert ddp.strategy_bytes == one.gradients_bytes
    assert all(ddp.phase_peaks[p] == one.phase_peaks[p] + one.gradients_bytes for p in one.phase_peaks)
    fsdp = {n: estimate_memory(Stack(width=64, depth=4), BATCH, optimizer=torch.optim.Adam, loss_fn=mse,
                               target="cpu", strategy="fsdp", world_size=n) for n in (2, 8)}
    assert fsdp[8].optimizer_state_bytes == pytest.approx(one.optimizer_state_bytes / 8, abs=8)
    assert fsdp[8].peak_bytes < fsdp[2].peak_bytes < one.peak_bytes
    assert fsdp[8].activations_bytes == one.activations_bytes  # each rank its own batch
    assert "one rank of 8 under fsdp" in str(fsdp[8])


def test_a_meta_model_is_estimated_per_rank_like_its_cpu_twin():
    with torch.device("meta"):
        meta = Stack(width=64, depth=4)
    on_meta = estimate_memory(meta, BATCH, optimizer=torch.optim.Adam, loss_fn=mse, target="cpu", strategy="fsdp",
                              world_size=4)
    on_cpu = estimate_memory(Stack(width=64, depth=4), BATCH, optimizer=torch.optim.Adam, loss_fn=mse,
                             target="cpu", strategy="fsdp", world_size=4)
    assert on_meta.peak_bytes == pytest.approx(on_cpu.peak_bytes, rel=0.05)


def test_fsdp_units_include_blocks_the_model_checkpoints_itself():
    # torchtitan-style: every block wrapped by torch's checkpoint_wrapper before fully_shard; the blocks stay the
    # units FSDP gathers one at a time, so the root is only the input and output layers
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    plain, wrapped = Stack(width=64, depth=4), Stack(width=64, depth=4)
    for i, block in enumerate(wrapped.blocks):
        wrapped.blocks[i] = checkpoint_wrapper(block)
    estimates = [estimate_memory(model, BATCH, optimizer=torch.optim.Adam, loss_fn=mse, target="cpu",
                                 strategy="fsdp", world_size=4) for model in (plain, wrapped)]
    block = sum(p.numel() * 4 for p in plain.blocks[0].parameters())
    root = sum(p.numel() * 4 for m in (plain.inp, plain.head) for p in m.parameters())
    assert [e.strategy_bytes for e in estimates] == [int((2 + 1 / 4) * block + root * 3 / 4)] * 2


class KeepsWhatItSees(Stack):
    """A :class:`Stack` whose forward records what it was given in plain attributes (a list and a counter), as a
    LightningModule's step updates its metrics' states."""

    def __init__(self) -> None:
        super().__init__(width=8, depth=2)
        self.seen, self.calls = [], 0

    def forward(self, x):
        self.seen.append(x.shape)
        self.calls += 1
        return super().forward(x)


def test_the_unsharded_copy_of_an_fsdp2_model_keeps_its_own_plain_attributes(tmp_path):
    from torch.distributed.fsdp import fully_shard

    from lightning_memguard.estimate.copies import unsharded_meta_copy
    from tests.ranks import gloo_group

    with gloo_group(0, tmp_path, world_size=1):
        model = KeepsWhatItSees()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        copy = unsharded_meta_copy(model)
        copy(torch.empty(4, 16, device="meta"))
        # what the estimate's step does to the copy stays in the copy: the model's own states are untouched
        assert copy.seen == [torch.Size([4, 16])] and copy.calls == 1
        assert model.seen == [] and model.calls == 0
        assert all(p.device.type == "meta" for p in copy.parameters())


def test_a_distributed_data_parallel_module_is_estimated_as_one_rank_with_its_buckets(tmp_path):
    from lightning_memguard.base.sharding import data_parallel_of
    from lightning_memguard.estimate.plan import ladder_predictions
    from tests.ranks import gloo_group

    torch.manual_seed(0)
    with gloo_group(0, tmp_path, world_size=1):
        replica = torch.nn.parallel.DistributedDataParallel(Stack(width=64, depth=4))
        assert data_parallel_of(replica) == ("ddp", 1) and data_parallel_of(replica.module) is None
        plain = estimate_memory(replica.module, BATCH, optimizer=torch.optim.Adam, loss_fn=mse, target="cpu")
        wrapped = estimate_memory(replica, BATCH, optimizer=torch.optim.Adam, loss_fn=mse, target="cpu")
        assert (wrapped.strategy, wrapped.world_size) == ("ddp", 1)
        assert wrapped.phase_peaks == {p: peak + plain.gradients_bytes for p, peak in plain.phase_peaks.items()}
        # the guard's predictions for the module a front door hands it, told it trains through DDP: the buckets are
        # held all step long, so each micro-batch level carries them too
        args = (replica.module, BATCH, None, "cpu", torch.optim.Adam, mse)
        alone, told = ladder_predictions(*args), ladder_predictions(*args, data_parallel=data_parallel_of(replica))
    assert told.model.by_amp[0].held_bytes == alone.model.by_amp[0].held_bytes + plain.gradients_bytes
    for level in (0, 2):
        assert (told.model.peak({"microbatch": level})
                == alone.model.peak({"microbatch": level}) + plain.gradients_bytes)
