"""Which rows of a vision-language batch's image tensors belong to which sample, for the micro-batch rung.

A vision-language model takes all the images of a batch in one tensor that does not lead with the batch's samples:

- packed: Qwen2-VL and the models built like it (Qwen2.5-VL, Qwen3-VL, GLM-4V...) take every image's ``t * h * w``
  patch rows back to back in ``pixel_values`` and one ``(t, h, w)`` row an image in ``image_grid_thw``; an image
  stands for ``t * h * w / merge**2`` tokens of its sample's text (``merge``: the vision tower's
  ``spatial_merge_size``). Videos alike (``pixel_values_videos``, ``video_grid_thw`` and, in Qwen2.5-VL,
  ``second_per_grid_ts``);
- stacked: LLaVA, Gemma 3, PaliGemma... take ``pixel_values`` of ``[images, channels, height, width]``, as many
  images as the batch has, a sample any number of them (none in a text-only one); every image stands for as many
  tokens of its sample's text.

A split that cuts only the samples' tensors hands every micro-batch all the images (or, where there happen to be as
many images as samples, the wrong ones) with a part of the texts: the model then fails ("Image features and image
tokens do not match"). The text says which images are whose: each sample's image tokens (``config.image_token_id``)
take its images in the batch's order.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..base.batches import RowGroups, batch_field
from .coupled_losses import forward_parameters

__all__ = ["image_layout", "image_row_groups"]

#: (patch rows, their grids, the config's token id, what else holds one row a grid) for images and for videos
_PACKED = (("pixel_values", "image_grid_thw", "image_token_id", ()),
           ("pixel_values_videos", "video_grid_thw", "video_token_id", ("second_per_grid_ts",)))


def image_layout(model: Optional[nn.Module]) -> Optional[str]:
    """How ``model`` (a transformers model) takes a batch's images as one tensor marked by image tokens in its text
    (it takes ``pixel_values`` and its config names an image token): ``"packed"`` (it takes ``image_grid_thw``) or
    ``"stacked"``; ``None`` where it takes no images so. Read once per model: a signature is not read per batch."""
    parameters = forward_parameters(model)
    if "pixel_values" not in parameters or not isinstance(_image_token(model), int):
        return None
    return "packed" if "image_grid_thw" in parameters else "stacked"


def image_row_groups(model: nn.Module, layout: Optional[str], batch: Any, size: int) -> RowGroups:
    """The runs of rows each of the ``size`` samples has in the batch's image and video tensors (see the module
    docstring), as :data:`~lightning_memguard.base.batches.RowGroups`, for ``model`` whose :func:`image_layout` is
    ``layout``; empty where it is ``None`` or the batch holds no images.

    Raises:
        ValueError: the images cannot be told apart by sample (the batch has no ``input_ids`` of ``size`` rows, or
            the samples' image tokens do not add up to whole images): the text says which.
    """
    if layout is None:
        return {}
    if layout == "stacked":
        return _stacked(model, batch, size)
    groups: dict[int, list[int]] = {}
    merge = getattr(getattr(model.config, "vision_config", None), "spatial_merge_size", None)
    for rows_name, grid_name, token_name, per_grid in _PACKED:
        rows, grids = batch_field(batch, rows_name), batch_field(batch, grid_name)
        if not isinstance(rows, torch.Tensor) or not isinstance(grids, torch.Tensor):
            continue
        if not isinstance(merge, int):
            raise ValueError(f"its {grid_name} cannot be told apart by sample: the model's config has no "
                             "vision_config.spatial_merge_size")
        patches = grids.prod(dim=-1).tolist()  # patch rows an image
        image_offsets, row_offsets = _runs(batch, size, getattr(model.config, token_name, None), token_name,
                                           [n // merge**2 for n in patches], patches, rows, grid_name)
        groups[id(rows)], groups[id(grids)] = row_offsets, image_offsets
        for name in per_grid:
            value = batch_field(batch, name)
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == grids.shape[0]:
                groups[id(value)] = image_offsets
    return groups


def _stacked(model: nn.Module, batch: Any, size: int) -> RowGroups:
    """The runs of a stacked ``pixel_values`` (one row an image, each standing for as many tokens)."""
    images = batch_field(batch, "pixel_values")
    ids = batch_field(batch, "input_ids")
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or not isinstance(ids, torch.Tensor) or ids.is_meta:
        return {}  # no images, or images a sample ([samples, crops, ...]: split with the samples)
    token = _image_token(model)
    count = len(images)
    total = int((ids == token).sum())
    if count == 0 or total % count:
        raise ValueError(f"its pixel_values cannot be told apart by sample: {total} image tokens (image_token_id "
                         f"{token}) are not as many for each of its {count} images")
    offsets, _ = _runs(batch, size, token, "image_token_id", [total // count] * count, [1] * count, images,
                       "pixel_values")
    return {id(images): offsets}


def _image_token(model: nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    token = getattr(config, "image_token_id", None)
    return token if token is not None else getattr(config, "image_token_index", None)


def _runs(batch: Any, size: int, token: Any, token_name: str, tokens: list[int], rows: list[int],
          tensor: torch.Tensor, name: str) -> tuple[list[int], list[int]]:
    """``(image offsets, row offsets)``: where each sample's images begin among the images (``tokens`` and ``rows``
    each image stands for and takes), and its rows of ``tensor``."""
    ids = batch_field(batch, "input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != size or not isinstance(token, int) \
            or ids.is_meta:
        raise ValueError(f"its {name} cannot be told apart by sample: that needs the batch's input_ids ([samples, "
                         f"tokens]) and the model's config.{token_name}")
    image_offsets, row_offsets, image, row = [0], [0], 0, 0
    for sample, wanted in enumerate((ids == token).sum(dim=-1).tolist()):
        while wanted > 0 and image < len(tokens):
            wanted -= tokens[image]
            row += rows[image]
            image += 1
        if wanted != 0:
            raise ValueError(f"its {name} cannot be told apart by sample: sample {sample}'s image tokens "
                             f"({token_name} {token}) do not add up to whole images")
        image_offsets.append(image)
        row_offsets.append(row)
    if image != len(tokens) or row != tensor.shape[0]:
        raise ValueError(f"its {name} cannot be told apart by sample: the samples' image tokens take {image} of "
                         f"{len(tokens)} images and {row} of {tensor.shape[0]} rows")
    return image_offsets, row_offsets
