"""Which rows of a vision-language batch's image tensors belong to which sample, for the micro-batch rung.

Qwen2-VL and the models built like it (Qwen2.5-VL, Qwen3-VL, GLM-4V...) take all the images of a batch as one tensor
of patches: ``pixel_values`` holds every image's ``t * h * w`` patch rows back to back, and ``image_grid_thw`` one
``(t, h, w)`` row an image. Neither leads with the batch's samples, so a split that cuts only the samples' tensors
hands every micro-batch all the images and a part of the texts: the model then fails ("Image features and image
tokens do not match"). The text says which images are whose: a sample holds ``t * h * w / merge**2`` image tokens
an image (``merge``: the vision tower's ``spatial_merge_size``), its images in the batch's order. Videos are packed
the same way (``pixel_values_videos``, ``video_grid_thw`` and, in Qwen2.5-VL, ``second_per_grid_ts``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..base.batches import RowGroups, batch_field
from .coupled_losses import forward_parameters

__all__ = ["image_row_groups", "packs_images"]

#: (patch rows, their grids, the config's token id, what else holds one row a grid) for images and for videos
_PACKED = (("pixel_values", "image_grid_thw", "image_token_id", ()),
           ("pixel_values_videos", "video_grid_thw", "video_token_id", ("second_per_grid_ts",)))


def packs_images(model: Optional[nn.Module]) -> bool:
    """Whether ``model`` (a transformers model) takes a batch's images packed as patch rows with their grids."""
    return model is not None and "image_grid_thw" in forward_parameters(model)


def image_row_groups(model: Optional[nn.Module], batch: Any, size: int) -> RowGroups:
    """The runs of rows each of the ``size`` samples has in the batch's packed image and video tensors (see the
    module docstring), as :data:`~lightning_memguard.base.batches.RowGroups`; empty where the model packs no images
    or the batch holds none.

    Raises:
        ValueError: the images cannot be told apart by sample (the batch has no ``input_ids`` of ``size`` rows, or
            the samples' image tokens do not add up to the images' grids): the text says which.
    """
    if not packs_images(model):
        return {}
    groups: dict[int, list[int]] = {}
    for rows_name, grid_name, token_name, per_grid in _PACKED:
        rows, grids = batch_field(batch, rows_name), batch_field(batch, grid_name)
        if not isinstance(rows, torch.Tensor) or not isinstance(grids, torch.Tensor):
            continue
        image_offsets, row_offsets = _runs(model, batch, size, rows, grids, grid_name, token_name)
        groups[id(rows)], groups[id(grids)] = row_offsets, image_offsets
        for name in per_grid:
            value = batch_field(batch, name)
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == grids.shape[0]:
                groups[id(value)] = image_offsets
    return groups


def _runs(model: nn.Module, batch: Any, size: int, rows: torch.Tensor, grids: torch.Tensor, grid_name: str,
          token_name: str) -> tuple[list[int], list[int]]:
    """``(image offsets, row offsets)``: where each sample's images begin among the grids, and its patch rows."""
    ids = batch_field(batch, "input_ids")
    config = getattr(model, "config", None)
    token = getattr(config, token_name, None)
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != size or not isinstance(token, int) \
            or not isinstance(merge, int) or ids.is_meta or grids.is_meta:
        raise ValueError(f"its {grid_name} cannot be told apart by sample: that needs the batch's input_ids "
                         f"([samples, tokens]) and the model's config.{token_name} and spatial_merge_size")
    patches = grids.prod(dim=-1).tolist()  # patch rows an image
    tokens = (ids == token).sum(dim=-1).tolist()  # image tokens a sample
    image_offsets, row_offsets, image, row = [0], [0], 0, 0
    for sample, wanted in enumerate(tokens):
        while wanted > 0 and image < len(patches):
            wanted -= patches[image] // merge**2
            row += patches[image]
            image += 1
        if wanted != 0:
            raise ValueError(f"its {grid_name} cannot be told apart by sample: sample {sample}'s image tokens "
                             f"({token_name} {token}) do not add up to whole images of the grids")
        image_offsets.append(image)
        row_offsets.append(row)
    if image != len(patches) or row != rows.shape[0]:
        raise ValueError(f"its {grid_name} cannot be told apart by sample: the samples' image tokens take "
                         f"{image} of {len(patches)} images and {row} of {rows.shape[0]} patch rows")
    return image_offsets, row_offsets
