"""Transformers object detectors (YOLOS; DETR on transformers' ResNet; small configs: random weights, no download)
trained on detection batches as users collate them: images, and each image's targets in a list of dicts
(``labels=[{"class_labels": ..., "boxes": ...}, ...]``, one a sample, boxes counted per image). Micro-batches give
each part its images' targets: with as many boxes in every image (the loss is normalised by the batch's number of
boxes) the split step is the whole batch's step up to rounding, under a Trainer and through a rescue; with boxes that
differ per image, the box-count weight a user gives makes the box losses the whole batch's. The largest batch that
fits scales the targets with the images."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_memguard import MemGuardCallback, estimate_memory
from lightning_memguard.estimate.batch_size import batch_of_size, largest_batch
from tests.helpers import assert_same_parameters, budget_for_a_share_of_the_step, fit_module, probe_module
from tests.models import pl

transformers = pytest.importorskip("transformers")

BATCH, STEPS = 8, 3


def detector(name: str = "yolos") -> torch.nn.Module:
    """YOLOS (a ViT whose detection tokens are the queries), or DETR on transformers' own ResNet (no timm, no
    download; dropout off: micro-batches draw other masks, as any split step does)."""
    torch.manual_seed(0)
    if name == "detr":
        backbone = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1],
                                             out_features=["stage4"])
        return transformers.DetrForObjectDetection(transformers.DetrConfig(
            use_timm_backbone=False, use_pretrained_backbone=False, backbone=None, backbone_config=backbone,
            d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=6, num_labels=3, dropout=0.0))
    config = transformers.YolosConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, image_size=[32, 32], patch_size=8, num_detection_tokens=6,
                                      num_labels=3)
    return transformers.YolosForObjectDetection(config)


def detection_batch(index: int, boxes_per_image) -> dict:
    g = torch.Generator().manual_seed(index)
    return {"pixel_values": torch.rand(BATCH, 3, 32, 32, generator=g),
            "labels": [{"class_labels": torch.randint(0, 3, (n,), generator=g),
                        "boxes": torch.rand(n, 4, generator=g) * 0.5 + 0.25} for n in boxes_per_image]}


class Detection(pl.LightningModule):
    def __init__(self, boxes_per_image=(2,) * BATCH, name: str = "yolos") -> None:
        super().__init__()
        self.model = detector(name)
        self.batches = [detection_batch(i, boxes_per_image) for i in range(STEPS)]

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(self.batches, batch_size=None, shuffle=False)


def at_four_parts(**settings) -> MemGuardCallback:
    guard = MemGuardCallback(budget="1GiB", mitigations=("microbatch",), explain=False, **settings)
    guard.load_state_dict({"ladder": {"levels": {"microbatch": 2}}})
    return guard


@pytest.mark.parametrize("name", ["yolos", "detr"])
def test_detection_targets_split_with_their_images_train_as_whole_batches(tmp_path, name):
    reference = Detection(name=name)
    fit_module(reference, [], tmp_path / "plain", max_steps=STEPS)
    guard = at_four_parts()
    module = Detection(name=name)
    fit_module(module, guard, tmp_path / "guarded", max_steps=STEPS)
    assert guard.history["micro_batches"].max() == 4
    assert_same_parameters(module, reference, atol=1e-5)


def test_an_oom_on_a_detection_batch_is_rescued_in_parts_that_train_as_the_whole_batch(tmp_path):
    peaks = probe_module(Detection(), tmp_path / "probe", STEPS)
    guard = MemGuardCallback(cpu_hard_limit=budget_for_a_share_of_the_step(peaks, 0.5), plan_at_start=False,
                             mitigations=("microbatch",), explain=False)
    reference, module = Detection(), Detection()
    fit_module(reference, [], tmp_path / "plain", max_steps=STEPS)
    fit_module(module, guard, tmp_path / "guarded", max_steps=STEPS)
    assert (guard.events["action"] == "rescue").any() and guard.history["micro_batches"].max() > 1
    assert_same_parameters(module, reference, atol=1e-5)


def boxes_in(batch: dict) -> int:
    """What a detection loss divides its box losses by: the batch's boxes."""
    return sum(len(target["boxes"]) for target in batch["labels"])


class BoxLosses(Detection):
    """Trained on the box losses alone (L1 and generalised IoU, each divided by the batch's boxes)."""

    def training_step(self, batch, batch_idx):
        losses = self.model(**batch).loss_dict
        return 5 * losses["loss_bbox"] + 2 * losses["loss_giou"]


def test_with_boxes_that_differ_per_image_a_box_count_weight_gives_the_whole_batchs_box_losses(tmp_path):
    boxes = (1, 4, 2, 3, 1, 5, 2, 2)
    reference, module = BoxLosses(boxes), BoxLosses(boxes)
    fit_module(reference, [], tmp_path / "plain", max_steps=STEPS)
    guard = at_four_parts(microbatch_weight=boxes_in)
    fit_module(module, guard, tmp_path / "guarded", max_steps=STEPS)
    assert guard.history["micro_batches"].max() == 4
    assert_same_parameters(module, reference, atol=1e-5)


def test_the_largest_batch_of_detection_samples_scales_their_targets_with_the_images():
    batch = detection_batch(0, (1, 4, 2, 3, 1, 5, 2, 2))
    larger = batch_of_size(batch, 12)
    assert len(larger["labels"]) == 12 and larger["labels"][8] is batch["labels"][0]
    # no loss_fn: the dict batch goes in as keyword arguments and the output's .loss is the loss
    size = largest_batch(detector(), batch, "20MiB")
    fits = estimate_memory(detector(), batch_of_size(batch, size)).peak_bytes
    over = estimate_memory(detector(), batch_of_size(batch, size + 1)).peak_bytes
    assert BATCH < size and fits <= 0.9 * 20 * 2**20 < over
    given = estimate_memory(detector(), batch_of_size(batch, size), loss_fn=lambda model, b: model(**b).loss)
    assert given.peak_bytes == fits
