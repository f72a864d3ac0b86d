"""largest_batch: the per-rank batch the estimate says fits, checked by training at that size under a hard limit of
the budget (no out-of-memory error) and at a quarter more (out of memory), in one process and on two gloo ranks
under FSDP2."""

import os

import pytest
import torch

from lightning_memguard import MemGuard, estimate_memory, largest_batch
from lightning_memguard.estimate.batch_size import batch_of_size
from tests.helpers import mse
from tests.models import BlockStack, Stack, regression_batches
from tests.ranks import gloo_group, wrap_for
from tests.spawn import spawn_ranks

BUDGET = 16 * 2**20  # parameters, gradients and Adam's state ~4 MiB: activations fill the rest
EXAMPLE = regression_batches(1, size=32)[0]


def _fits(model, optimizer, size: int) -> bool:
    """Whether three steps at ``size`` samples a rank train under a hard limit of the budget."""
    guard = MemGuard(model, optimizer, tensorboard=False, cpu_hard_limit=BUDGET, mitigations=(), explain=False)
    try:
        with guard:
            for batch in regression_batches(3, size=size):
                guard.step(batch, mse)
    except torch.OutOfMemoryError:  # MemGuardOutOfMemoryError is one too
        return False
    return True


def test_the_largest_batch_fits_and_a_quarter_more_does_not():
    size = largest_batch(Stack(width=64, depth=8), EXAMPLE, budget=BUDGET, optimizer=torch.optim.Adam,
                         loss_fn=mse, target="cpu")
    assert size > 32
    model = Stack(width=64, depth=8)
    assert _fits(model, torch.optim.Adam(model.parameters()), size)
    model = Stack(width=64, depth=8)
    assert not _fits(model, torch.optim.Adam(model.parameters()), int(size * 1.25))


def test_a_lightning_module_brings_its_optimizer_and_a_smaller_share_of_the_budget_fits_fewer():
    module = BlockStack(width=64, depth=8, optimizer="adam", log_loss=False)
    plain = largest_batch(Stack(width=64, depth=8), EXAMPLE, budget="16MiB", optimizer=torch.optim.Adam,
                          loss_fn=mse, target="cpu")
    assert largest_batch(module, EXAMPLE, budget="16MiB", target="cpu") == plain
    assert largest_batch(module, EXAMPLE, budget="16MiB", target="cpu", threshold=0.7) < plain
    # four FSDP2 ranks share the states: more samples fit on each
    assert largest_batch(module, EXAMPLE, budget="16MiB", target="cpu", strategy="fsdp", world_size=4) > plain


def test_a_batch_held_ahead_is_counted_beside_each_step():
    """A loader that fetches the next batch into the same memory: the size is the largest whose step's estimate plus
    one more batch of that size fits under the line, found in one search."""
    def need(size: int) -> int:
        sized = batch_of_size(EXAMPLE, size)
        step = estimate_memory(Stack(width=64, depth=8), sized, optimizer=torch.optim.Adam, loss_fn=mse,
                               target="cpu").peak_bytes
        return step + sum(tensor.nbytes for tensor in sized)

    plain = largest_batch(Stack(width=64, depth=8), EXAMPLE, budget=BUDGET, optimizer=torch.optim.Adam,
                          loss_fn=mse, target="cpu")
    size = largest_batch(Stack(width=64, depth=8), EXAMPLE, budget=BUDGET, optimizer=torch.optim.Adam,
                         loss_fn=mse, target="cpu", batches_ahead=1)
    assert size < plain
    assert need(size) <= 0.9 * BUDGET < need(size + 1)


@pytest.mark.parametrize("batch, budget, extra, says", [
    (torch.tensor(3.0), "16MiB", {}, "no tensor with a sample dimension"),
    (EXAMPLE, "1MiB", {}, "not even one sample fits: .* needed, .* available"),
    (EXAMPLE, "lots", {}, "budget='lots'"),
    (EXAMPLE, "16MiB", {"batches_ahead": -1}, "batches_ahead=-1 must be an int >= 0"),
])
def test_what_cannot_be_answered_is_a_value_error_saying_why(batch, budget, extra, says):
    with pytest.raises(ValueError, match=says):
        largest_batch(Stack(width=64, depth=8), batch, budget=budget, optimizer=torch.optim.Adam, loss_fn=mse,
                      target="cpu", **extra)


def _fsdp_worker(rank: int, root: str, size: int) -> None:
    with gloo_group(rank, root):
        for name, samples in (("fits", size), ("over", int(size * 1.25))):
            model = wrap_for(Stack(width=64, depth=8), "fsdp")
            ok = _fits(model, torch.optim.Adam(model.parameters()), samples)
            open(os.path.join(root, f"{name}.rank{rank}.{ok}"), "w").close()
            if not ok:
                return  # the other rank stopped too (the out-of-memory step fails on both: same sizes)


@pytest.mark.slow
def test_on_two_fsdp2_ranks_the_largest_batch_fits_each_rank(tmp_path):
    size = largest_batch(Stack(width=64, depth=8), EXAMPLE, budget=BUDGET, optimizer=torch.optim.Adam,
                         loss_fn=mse, target="cpu", strategy="fsdp", world_size=2)
    spawn_ranks(_fsdp_worker, (str(tmp_path), size), timeout_s=300)
    names = set(os.listdir(tmp_path))
    assert {"fits.rank0.True", "fits.rank1.True"} <= names, names
    assert "over.rank0.False" in names or "over.rank1.False" in names, names
