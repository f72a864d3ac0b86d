"""Python's cyclic garbage collector is held off while an estimate and the first batch's plan run (a full collection
there walks the whole process, about 0.3 s with torch, Lightning and transformers loaded), and on again after them."""

import contextlib
import gc

import pytest
import torch
import torch.nn.functional as F

import lightning_memguard.guard.engine as engine_module
from lightning_memguard import MemGuard, estimate_memory
from lightning_memguard.base.collection import collection_paused
from lightning_memguard.guard.ladder import Ladder
from tests.models import Stack


@contextlib.contextmanager
def collections_seen(inside: list, threshold: int = 50):
    """``(generation, inside[0])`` of each automatic collection that runs in the block, with young collections made
    frequent (every ``threshold`` objects) so that any stretch left to the collector shows."""
    seen: list[tuple[int, bool]] = []

    def callback(phase, info):
        if phase == "start":
            seen.append((info["generation"], inside[0]))

    old = gc.get_threshold()
    gc.collect()
    gc.set_threshold(threshold, 2, 2)
    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*old)


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def test_no_automatic_collection_runs_inside_an_estimate_and_the_collector_is_on_after_it():
    model, batch = Stack(width=32, depth=4), (torch.randn(8, 16), torch.randn(8, 1))
    in_step = [False]

    def loss_fn(m, b):  # the estimate's warm-up step (the measured step replays it)
        in_step[0] = True
        try:
            return mse(m, b)
        finally:
            in_step[0] = False

    with collections_seen(in_step) as seen:
        estimate = estimate_memory(model, batch, loss_fn=loss_fn, target="cpu")
        during = list(seen)
    assert estimate.peak_bytes > 0
    # one young collection at most, where the estimate ends and the collector is back; none in its steps
    assert [inside for _, inside in during] in ([], [False]), f"collections ran inside the estimate: {during}"
    assert all(generation == 0 for generation, _ in during)
    assert gc.isenabled()


def test_an_estimate_leaves_a_collector_its_caller_turned_off_off():
    model, batch = Stack(width=32, depth=2), (torch.randn(4, 16), torch.randn(4, 1))
    gc.disable()
    try:
        estimate_memory(model, batch, loss_fn=mse, target="cpu")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_pause_ends_with_the_block_that_started_it_even_on_an_error():
    with pytest.raises(RuntimeError):
        with collection_paused():
            with collection_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the inner block did not turn it on under the outer one
            raise RuntimeError("a failed estimate")
    assert gc.isenabled()


def test_the_first_batch_notes_and_plans_with_the_collector_held_off(monkeypatch, tmp_path):
    """The plain loop's first step under a budget its step does not fit: the ladder's estimate of the first batch
    and the plan run with the collector off; the step itself, and the steps after, with it on."""
    states: dict[str, list[bool]] = {"note_batch": [], "plan": []}
    note_batch, plan = Ladder.note_batch, engine_module.plan_at_start

    def noted(self, *args, **kwargs):
        states["note_batch"].append(gc.isenabled())
        return note_batch(self, *args, **kwargs)

    def planned(*args, **kwargs):
        states["plan"].append(gc.isenabled())
        return plan(*args, **kwargs)

    monkeypatch.setattr(Ladder, "note_batch", noted)
    monkeypatch.setattr(engine_module, "plan_at_start", planned)
    model = Stack(width=64, depth=6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = (torch.randn(256, 16), torch.randn(256, 1))
    plain = estimate_memory(model, batch, optimizer=optimizer, loss_fn=mse, target="cpu").peak_bytes
    guard = MemGuard(model, optimizer, budget=int(plain * 0.8), mitigations=("checkpointing", "microbatch"),
                     log_dir=str(tmp_path), tensorboard=False)
    enabled_in_steps = []
    for _ in range(2):
        # the estimates call loss_fn too, on their copy of the model: only the training step's calls are looked at
        guard.step(batch, lambda m, b: (m is model and enabled_in_steps.append(gc.isenabled()), mse(m, b))[1])
    guard.close()
    assert states == {"note_batch": [False], "plan": [False]}
    assert "plan" in set(guard.events["action"])  # the plan was made, not skipped
    assert enabled_in_steps and all(enabled_in_steps)
    assert gc.isenabled()
