"""Vision-language models built from tiny configs with random weights, and the batches their processors make: per
sample 0 to 2 images (the first sample none) and, with ``videos``, a video. Labels are the text tokens (image, video
and padding tokens -100).

- packed (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``pixel_values`` holds every image's patch rows back to back (images of
  different sizes), ``image_grid_thw`` one ``(t, h, w)`` row an image;
- stacked (LLaVA with a CLIP tower, Gemma 3 with a SigLIP one): ``pixel_values`` of ``[images, 3, 8, 8]``, every
  image as many tokens."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.utils.data import DataLoader

from tests.models import pl

transformers = pytest.importorskip("transformers")

IMAGE, VIDEO, START, END, PAD = 120, 121, 122, 123, 0
PATCH_FEATURES = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch
MERGE = 2  # spatial_merge_size: merge x merge patches make one token
PACKED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
#: tokens an image of a stacked model stands for: LLaVA's 4 x 4 patches, Gemma 3's pooled to 2 x 2
STACKED = {"llava": 16, "gemma3": 4}
MODELS = PACKED + tuple(STACKED)
#: the models whose videos :func:`samples` lays out as their processors do (Qwen3-VL puts timestamps between frames)
VIDEO_MODELS = ("qwen2_vl", "qwen2_5_vl")

_TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256,
             rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})
_VISION = dict(depth=2, num_heads=2, patch_size=2, spatial_merge_size=MERGE, temporal_patch_size=2, in_channels=3)
_TOWER = dict(image_size=8, patch_size=2, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2)
_LM = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256)


def _stacked(name: str):
    if name == "llava":
        return transformers.LlavaForConditionalGeneration, transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(**_TOWER, projection_dim=32),
            text_config=transformers.LlamaConfig(**_LM), image_token_id=IMAGE, image_seq_length=STACKED[name],
            vision_feature_layer=-1, pad_token_id=PAD)
    return transformers.Gemma3ForConditionalGeneration, transformers.Gemma3Config(
        vision_config=transformers.SiglipVisionConfig(**_TOWER),
        text_config=transformers.Gemma3TextConfig(**_LM, head_dim=8, sliding_window=16),
        mm_tokens_per_image=STACKED[name], image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END,
        pad_token_id=PAD)


def build(name: str, seed: int = 0) -> torch.nn.Module:
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                  pad_token_id=PAD)
    if name in STACKED:
        cls, config = _stacked(name)
    elif name == "qwen2_vl":
        config = transformers.Qwen2VLConfig(text_config=_TEXT, vision_config=dict(
            _VISION, embed_dim=32, hidden_size=32, mlp_ratio=2), **tokens)
        cls = transformers.Qwen2VLForConditionalGeneration
    elif name == "qwen3_vl":  # a rope of its own, and the vision tower's features fed to early text layers too
        text = dict(_TEXT, head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [2, 1, 1], "mrope_interleaved": True})
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=dict(
            _VISION, hidden_size=32, intermediate_size=64, out_hidden_size=32, num_position_embeddings=16,
            deepstack_visual_indexes=[0]), **{k: v for k, v in tokens.items() if k != "pad_token_id"})
        cls = transformers.Qwen3VLForConditionalGeneration
    else:
        config = transformers.Qwen2_5_VLConfig(text_config=_TEXT, vision_config=dict(
            _VISION, hidden_size=32, intermediate_size=64, out_hidden_size=32, window_size=8,
            fullatt_block_indexes=[1]), **tokens)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    return cls(config)


def _visual(generator: torch.Generator, token: int, frames: int) -> tuple[list[int], torch.Tensor, list[int]]:
    """One packed image (``frames`` 1) or video: its tokens, patch rows and grid."""
    height = 2 * int(torch.randint(1, 3, (), generator=generator))
    grid = [frames, height, 4]
    patches = frames * height * 4
    return [START] + [token] * (patches // MERGE**2) + [END], torch.randn(patches, PATCH_FEATURES,
                                                                          generator=generator), grid


def samples(n: int, seed: int = 0, videos: bool = False, name: str = "qwen2_vl") -> list[dict]:
    """``n`` samples for model ``name``: text around 0 to 2 images (the first sample none) and, with ``videos``, a
    video each second sample; the texts differ in length."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for index in range(n):
        ids, images, image_grids, clips, clip_grids = [], [], [], [], []
        for _ in range(0 if index == 0 else 1 + index % 2):
            if name in STACKED:
                tokens, rows, grid = [IMAGE] * STACKED[name], torch.randn(3, 8, 8, generator=generator), None
            else:
                tokens, rows, grid = _visual(generator, IMAGE, 1)
            ids += tokens + torch.randint(1, 100, (2,), generator=generator).tolist()
            images.append(rows)
            image_grids.append(grid)
        if videos and index % 2:
            tokens, rows, grid = _visual(generator, VIDEO, 2)
            ids += tokens
            clips.append(rows)
            clip_grids.append(grid)
        ids += torch.randint(1, 100, (3 + index % 4,), generator=generator).tolist()
        made.append(dict(ids=ids, images=images, image_grids=image_grids, clips=clips, clip_grids=clip_grids))
    return made


def text_last_samples(n: int, seed: int = 0) -> list[dict]:
    """``n`` samples for a packed model whose batches of 4, dealt to two ranks sample by sample (as
    ``DistributedSampler`` deals them), give each rank an image in its first two samples and none in its last two:
    every whole batch uses the vision tower, the last of two micro-batches does not."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for index in range(n):
        ids, images, grids = [], [], []
        if index % 8 < 4:
            tokens, rows, grid = _visual(generator, IMAGE, 1)
            ids, images, grids = tokens, [rows], [grid]
        ids = ids + torch.randint(1, 100, (4 + index % 3,), generator=generator).tolist()
        made.append(dict(ids=ids, images=images, image_grids=grids, clips=[], clip_grids=[]))
    return made


def collate(batch: list[dict], name: str = "qwen2_vl") -> dict:
    """What model ``name``'s processor and a padding collator make: texts padded right, every image in one tensor."""
    length = max(len(sample["ids"]) for sample in batch)
    ids = torch.full((len(batch), length), PAD)
    mask = torch.zeros(len(batch), length, dtype=torch.long)
    for row, sample in enumerate(batch):
        ids[row, :len(sample["ids"])] = torch.tensor(sample["ids"])
        mask[row, :len(sample["ids"])] = 1
    visual = (ids == IMAGE) | (ids == VIDEO)
    made = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill((mask == 0) | visual, -100))
    if name == "gemma3":  # its images attend both ways
        made["token_type_ids"] = (ids == IMAGE).long()
    elif name in PACKED:  # what the multimodal rope reads
        made["mm_token_type_ids"] = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    images = [rows for sample in batch for rows in sample["images"]]
    if images:
        made["pixel_values"] = torch.stack(images) if name in STACKED else torch.cat(images)
        if name in PACKED:
            made["image_grid_thw"] = torch.tensor([grid for sample in batch for grid in sample["image_grids"]])
    clips = [rows for sample in batch for rows in sample["clips"]]
    if clips:
        made["pixel_values_videos"] = torch.cat(clips)
        made["video_grid_thw"] = torch.tensor([grid for sample in batch for grid in sample["clip_grids"]])
        made["second_per_grid_ts"] = torch.ones(len(clips))
    return made


def make_batch(name: str, n: int = 8, seed: int = 0) -> dict:
    """A batch of ``n`` samples for model ``name``, with videos where it takes them."""
    return collate(samples(n, seed, videos=name in VIDEO_MODELS, name=name), name)


class VisionLanguageModule(pl.LightningModule):
    """A vision-language model fine-tuned as people do: ``model(**batch).loss``, SGD, batches of ``batch_size``."""

    def __init__(self, name: str, batch_size: int = 8, n_samples: int = 32, videos: bool = False,
                 text_last: bool = False) -> None:
        super().__init__()
        self.model, self.model_name = build(name), name
        self.batch_size, self.n_samples, self.videos, self.text_last = batch_size, n_samples, videos, text_last

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        made = text_last_samples(self.n_samples) if self.text_last else samples(self.n_samples, videos=self.videos,
                                                                                 name=self.model_name)
        return DataLoader(made, batch_size=self.batch_size, collate_fn=partial(collate, name=self.model_name))
