"""A plan's estimates step the meta copy the estimator made for them, not a fresh copy each: the same numbers as
fresh copies give, no gradient or hook carried from one estimate to the next, and the caller's models never stepped."""

import pytest
import torch
import torch.nn.functional as F

import lightning_memguard.estimate.step as step_module
from lightning_memguard import estimate_memory
from lightning_memguard.estimate.copies import is_own_copy, meta_copy, own_copy
from lightning_memguard.estimate.plan import ladder_predictions
from tests.models import Block, Stack

BLOCKS = {Block}


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def case():
    model = Stack(width=32, depth=4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), (torch.randn(8, 16), torch.randn(8, 1))


def numbers(estimate):
    return estimate.peak_bytes, estimate.reserved_bytes, dict(estimate.phase_peaks)


def test_estimates_of_the_estimators_own_copy_equal_those_of_fresh_copies_one_after_another():
    model, optimizer, batch = case()
    own = own_copy(meta_copy(model))
    settings = [("32-true", 0), ("32-true", 2), ("bf16-mixed", 4), ("32-true", 0), ("bf16-mixed", 0)]
    for precision, blocks in settings:
        stepped = estimate_memory(own, batch, optimizer=torch.optim.AdamW, loss_fn=mse, precision=precision,
                                  blocks=BLOCKS if blocks else None, checkpointed_blocks=blocks, target="cuda")
        fresh = estimate_memory(model, batch, optimizer=torch.optim.AdamW, loss_fn=mse, precision=precision,
                                blocks=BLOCKS if blocks else None, checkpointed_blocks=blocks, target="cuda")
        assert numbers(stepped) == numbers(fresh), (precision, blocks)
    # stepped: its parameters hold the last estimate's gradients (the next estimate clears them)
    assert all(p.grad is not None for p in own.parameters())


def test_a_failed_forward_leaves_no_hook_on_the_own_copy_for_the_next_estimate():
    model, optimizer, batch = case()
    own = own_copy(meta_copy(model))
    with pytest.raises(ValueError):
        estimate_memory(own, batch, loss_fn=lambda m, b: m(b[0][:, :3]).sum(), blocks=BLOCKS,
                        checkpointed_blocks=2, target="cuda")  # the first layer wants 16 features
    assert not any(block._forward_pre_hooks for block in own.blocks)
    after = estimate_memory(own, batch, loss_fn=mse, blocks=BLOCKS, checkpointed_blocks=2, target="cuda")
    assert numbers(after) == numbers(estimate_memory(model, batch, loss_fn=mse, blocks=BLOCKS,
                                                     checkpointed_blocks=2, target="cuda"))


def test_a_meta_model_the_caller_gives_is_copied_and_never_stepped():
    with torch.device("meta"):
        model = Stack(width=32, depth=2)
    batch = (torch.randn(8, 16), torch.randn(8, 1))
    assert not is_own_copy(model)
    estimate_memory(model, batch, loss_fn=mse, target="cuda")
    assert all(p.grad is None for p in model.parameters())


def test_a_plans_later_estimates_make_no_copy_of_the_model(monkeypatch):
    copies = []
    for name in ("meta_copy", "copy_without_trainer"):
        made = getattr(step_module, name)
        monkeypatch.setattr(step_module, name, lambda m, made=made, name=name: copies.append(name) or made(m))
    model, optimizer, batch = case()
    predictions = ladder_predictions(model, batch, BLOCKS, "cuda", optimizer, mse, amp=True, later=True)
    first = list(copies)
    for amp in (0, 1):  # every precision and block count the model holds, estimated as they are read
        for blocks in range(predictions.model.n_blocks + 1):
            assert predictions.model.peak({"amp": amp, "checkpointing": blocks}) > 0
    assert first == ["meta_copy"]  # the step as it is, estimated at once on a copy of the caller's model
    assert copies == first  # the later ones step the plan's own meta copy
    assert all(p.grad is None for p in model.parameters())
