"""Micro-batches of vision-language batches whose images are one tensor that does not lead with the samples —
packed as patch rows (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: every image's rows in one ``pixel_values``, one grid row an
image) or stacked (LLaVA, Gemma 3: ``[images, 3, H, W]``, a sample any number of them): each micro-batch gets its own
samples' images, videos and grids, so the split step equals the whole one — its loss, its gradients, a guarded fit's
parameters. Before, every micro-batch got all the images and the step failed (the rung reverted as one that breaks
it)."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_memguard import MemGuardCallback
from lightning_memguard.estimate.plan import ladder_predictions
from lightning_memguard.mitigations.microbatch import MicroBatching
from tests.helpers import assert_same_parameters, fit_module, probe, probe_module, run, train_unguarded
from tests.models import pl, trainer_kwargs
from tests.ranks import rank_csvs
from tests.spawn import ranks_killed_after
from tests.zoo.vision_language import (IMAGE, MODELS, VisionLanguageModule, build, collate, make_batch, samples,
                                       text_last_samples)

pytest.importorskip("transformers")


def _loss_and_gradients(model, batch, factor=1.0):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    (loss * factor).backward()
    return loss.detach() * factor, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("k", [2, 3, 8])
def test_the_weighted_parts_of_a_packed_image_batch_give_the_whole_batch_s_loss_and_gradients(name, k):
    model = build(name)
    batch = make_batch(name)
    rung = MicroBatching(model)
    rung.observe_batch(batch)
    assert rung.splittable, rung.unsplittable
    parts = rung.split(batch, k)
    assert len(parts) == k
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        if key in batch:
            assert sum(part[key].shape[0] for part, _ in parts if part[key] is not None) == batch[key].shape[0], key
    whole_loss, whole_grads = _loss_and_gradients(model, batch)
    total, summed = torch.zeros(()), {}
    for part, weight in parts:
        loss, grads = _loss_and_gradients(model, part, weight)
        total += loss
        for key, grad in grads.items():
            summed[key] = summed.get(key, 0) + grad
    torch.testing.assert_close(total, whole_loss, atol=1e-5, rtol=1e-5)
    assert summed.keys() == whole_grads.keys()
    for key, grad in whole_grads.items():
        torch.testing.assert_close(summed[key], grad, atol=1e-6, rtol=1e-4, msg=key)


@pytest.mark.parametrize("name, said", [("qwen2_vl", "image_grid_thw cannot be told apart by sample: sample 1's"),
                                        ("gemma3", "pixel_values cannot be told apart by sample")])
def test_images_whose_tokens_do_not_add_up_leave_the_batch_whole_and_say_why(name, said):
    model = build(name)
    batch = collate(samples(4, name=name), name)
    row, column = (batch["input_ids"] == IMAGE).nonzero()[0].tolist()
    batch["input_ids"][row, column] = 5  # one image token fewer than sample `row`'s images hold
    rung = MicroBatching(model)
    rung.observe_batch(batch)
    assert not rung.splittable
    assert said in rung.unsplittable
    assert "off for this run" in rung.no_levels_reason


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_5_vl", "llava"])
def test_a_vision_language_fit_that_only_fits_in_micro_batches_trains_like_an_unguarded_one(tmp_path, name):
    videos = name == "qwen2_5_vl"
    reference = VisionLanguageModule(name, videos=videos)
    peaks = probe_module(VisionLanguageModule(name, videos=videos), tmp_path / "probe", max_steps=4)
    held = peaks.allocated("batch_start", 1)
    budget = int((held + 0.7 * (peaks.highest(1) - held)) / 0.9)  # what a step adds must shrink by 30 %: a split
    guard = MemGuardCallback(budget=budget, mitigations=("microbatch",))
    guarded = VisionLanguageModule(name, videos=videos)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_module(guarded, guard, tmp_path / "guarded", max_steps=4)
    fit_module(reference, [], tmp_path / "plain", max_steps=4)
    said = " ".join(str(w.message) for w in caught)
    assert "broke the step" not in said and "go whole into every micro-batch" not in said
    events = guard.events
    assert not events[events["rung"] == "microbatch"].empty
    assert events[events["action"] == "revert"].empty
    split = guard.history[guard.history["micro_batches"] > 1]
    assert set(split["step"]) == {0, 1, 2, 3}  # planned before the first step
    assert_same_parameters(guarded, reference)


def test_the_estimate_of_a_micro_batch_runs_the_part_the_rung_would_run():
    """A CUDA target's plan estimates one micro-batch's step (the allocator's segments of a split step): the part
    holds its samples' images, so the estimate runs, and a smaller part peaks lower."""
    model, batch = build("qwen2_5_vl"), make_batch("qwen2_5_vl")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        predictions = ladder_predictions(model, batch, target="cuda")
        halves, quarters = predictions.measure_part(False, 0, 1), predictions.measure_part(False, 0, 2)
    assert not [w for w in caught if "lightning-memguard" in str(w.message)]
    assert quarters[0] < halves[0] < predictions.measure(False, 0)


def test_a_micro_batch_without_images_gets_none_for_them_as_a_text_only_batch_has():
    model = build("qwen2_vl")
    batch = collate(text_last_samples(8)[2:6])  # samples 2, 3 with an image, 4, 5 text-only
    rung = MicroBatching(model)
    rung.observe_batch(batch)
    (first, _), (second, _) = rung.split(batch, 2)
    assert first["pixel_values"] is not None and len(first["image_grid_thw"]) == 2
    assert second["pixel_values"] is None and second["image_grid_thw"] is None


@pytest.mark.slow
def test_micro_batches_under_ddp_whose_split_leaves_a_part_text_only_train_like_whole_batches(tmp_path, fresh_port):
    """Each rank's batch has images in its first samples only: split in two, its second part is text-only. DDP
    all-reduces in the last part's backward and waits for every parameter's gradient there: a text-only last part
    reaches no parameter of the vision tower, and the ranks hung. Its loss now reaches them (mitigations/ddp_reach.py),
    and training equals plain DDP's."""
    def fit(callbacks, root):
        torch.manual_seed(0)
        module = VisionLanguageModule("qwen2_vl", batch_size=4, n_samples=32, text_last=True)
        trainer = pl.Trainer(callbacks=callbacks, default_root_dir=str(root), logger=False,
                             **trainer_kwargs(strategy="ddp_spawn", devices=2, max_steps=4))
        with ranks_killed_after(240):
            trainer.fit(module)
        return module

    reference = fit([], tmp_path / "plain")
    peaks = probe_module(VisionLanguageModule("qwen2_vl", batch_size=4, text_last=True), tmp_path / "probe",
                         max_steps=2)
    held = peaks.allocated("batch_start", 1)
    guard = MemGuardCallback(budget=int((held + 0.6 * (peaks.highest(1) - held)) / 0.9), mitigations=("microbatch",))
    guarded = fit([guard], tmp_path / "guarded")
    for rank, frame in rank_csvs(tmp_path / "guarded", "memguard_history.csv").items():
        split = set(frame[frame["micro_batches"] > 1]["step"])
        assert len(split) >= 2 and 3 in split, rank
    assert_same_parameters(guarded, reference)


@pytest.mark.parametrize("door", ["fabric", "loop"])
def test_vision_language_micro_batches_through_fabric_and_the_plain_loop_train_like_whole_batches(tmp_path, door):
    def loss(model, batch):
        return model(**batch).loss

    batches = [make_batch("qwen2_5_vl", 8, seed) for seed in range(3)]
    peaks = probe(door, build("qwen2_5_vl"), batches, tmp_path / "probe", loss=loss)
    held = peaks.allocated("batch_start", 1)
    guarded = run(door, build("qwen2_5_vl"), batches, tmp_path / "guarded", loss=loss, mitigations=("microbatch",),
                  budget=int((held + 0.6 * (peaks.highest(1) - held)) / 0.9))
    history, events = guarded.guard.history, guarded.guard.events
    assert set(history[history["micro_batches"] > 1]["step"]) == {0, 1, 2}
    assert events[events["action"] == "revert"].empty
    assert_same_parameters(guarded.model, train_unguarded(build("qwen2_5_vl"), batches, loss=loss))
