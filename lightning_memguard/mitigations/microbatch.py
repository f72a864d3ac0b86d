"""The micro-batch rung: run the batch of one optimizer step as k smaller micro-batches, so that only one micro-batch's
activations are alive at a time, while the optimizer still sees the whole batch's gradient.

Level L means k = 2**L micro-batches (capped at the batch size). Every batch structure is split
(:mod:`lightning_memguard.base.batches`). Each micro-batch's loss is multiplied by its share of what the loss averages
over, so that the summed gradients are the whole batch's:

- ``microbatch_weight=fn`` given: ``fn(micro_batch)`` over the sum of it for every micro-batch;
- ``microbatch_weight="sum"``: 1 for every micro-batch, for a loss that adds up its samples (``reduction="sum"``, or
  a sum divided by a count of the whole batch that the batch carries): no share of anything makes such a loss exact;
- the batch carries ``num_items_in_batch`` (a key or attribute): 1 for every micro-batch. A transformers loss given
  it divides a sum by that number, the whole batch's count: the micro-losses already add up to the whole batch's;
- the model takes transformers' CTC loss (Wav2Vec2, HuBERT...): the share of samples where its reduction is
  ``"mean"`` (a mean over samples of per-target-length losses), 1 for every micro-batch where it is ``"sum"``;
- the batch carries ``future_observed_mask`` and the transformers model takes it (a time-series model, whose loss
  is a mean over the observed future points): the share of observed points (a point counts where every target value
  at it is observed);
- the batch carries transformers-style ``labels`` (a key or attribute; ``shift_labels`` when present): the share of
  labels that are not -100 (a segmentation model's ``config.semantic_loss_ignore_index``, 255 for SegFormer), counted
  as the loss counts them. A transformers causal LM shifts its labels one token left before its loss, so the first
  label of each row counts for nothing (see :func:`model_shifts_labels`);
- the batch has no such field but exactly one integer tensor of its samples that holds -100 (labels padded for the
  ``ignore_index`` of torch's ``cross_entropy`` and ``nll_loss``, -100 by default, in a tuple or under a key of the
  user's own): the share of its entries that are not -100, counted as for ``labels``. A loss written by hand over such
  labels is most often torch's mean over the labels it does not ignore, which a share of samples gets wrong whenever
  the micro-batches hold different numbers of them;
- otherwise the share of samples.

A micro-batch whose weight is 0 (every label -100) runs joined to its neighbour: alone its mean loss would be 0/0,
NaN, and poison the step's gradients; joined, its samples still run forward and backward (adding nothing to the loss,
as in the whole batch) and the step stays exact. When the whole batch weighs 0 the micro-batches take sample shares:
the whole batch's own loss is then 0/0 as well.

What the rung only describes is here; the training loop that runs the micro-batches belongs to the front door.
Framework-free (a transformers model is recognised by its attributes; transformers is only read when loaded).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import sys
from collections import Counter
from collections.abc import Mapping
from typing import Any, Callable, Literal, Optional, Union

import torch
from torch import nn

from ..base.batches import (NO_SAMPLES, batch_field, batch_shapes, batch_size_of, batch_tensors, item_lists,
                             map_tensors, per_sample_lists, RowGroups, slice_batch, split_batch, split_ranges)
from ..base.checks import warn as default_warn
from ..base.step_signature import ITERATOR_PARAMETER, fetches_own_batches
from .checkpointing import compiled_reason
from .coupled_losses import contrastive_loss_text, ctc_reduction, forward_parameters
from .image_rows import image_layout, image_row_groups
from .rung import BuiltinRung
from .sequence_layout import time_axis_layers, time_major_text

__all__ = ["MicroBatching", "MicroBatchWeight", "batch_size_of", "split_batch", "micro_batches_of",
           "model_shifts_labels", "transformers_model_in", "router_loss_text", "validate_microbatch_weight",
           "IGNORE_INDEX"]

#: A level past any real batch (2**16 micro-batches); the rung caps it at the batch size once it has seen a batch.
_UNKNOWN_MAX_LEVEL = 16
#: The label transformers' and torch's cross-entropy losses ignore.
IGNORE_INDEX = -100
#: ``batch -> number``: what the loss of that batch averages over (see ``microbatch_weight=``); or ``"sum"``: the
#: loss adds up its samples, and the micro-losses are added unweighted.
MicroBatchWeight = Union[Callable[[Any], Any], Literal["sum"]]
#: ``microbatch_weight=`` for a loss that is a sum over the batch, not a mean.
SUMMED = "sum"


def validate_microbatch_weight(weight: Any) -> None:
    """Checks a ``microbatch_weight=`` argument: ``None``, a callable ``batch -> number`` or ``"sum"``.

    Raises:
        ValueError: naming the value and what is allowed.
    """
    if weight is not None and not callable(weight) and not (isinstance(weight, str) and weight == SUMMED):
        raise ValueError(f"microbatch_weight={weight!r} must be a callable batch -> number (what that batch's loss "
                         "averages over, e.g. its labelled tokens), 'sum' (the loss adds up its samples: "
                         "reduction='sum') or None (labels not -100 when the batch has labels or one integer tensor "
                         "holding -100, else samples)")


def model_shifts_labels(module: nn.Module) -> bool:
    """Whether the transformers model in ``module`` computes its loss on labels shifted one token left (a causal LM).

    The model is the one :func:`transformers_model_in` finds (inside a wrapper such as peft's). It shifts when
    the loss function it calls is transformers' ``ForCausalLMLoss``: the one set with ``model.loss_function = ...``,
    else the one its ``loss_type`` names in ``LOSS_MAPPING`` — what ``model.loss_function`` returns. Two exceptions,
    read from transformers' source: an encoder-decoder model (``config.is_encoder_decoder``: T5, BART, Whisper...)
    never shifts, since its decoder reads the labels shifted right and its loss counts every label, although its
    ``loss_type`` ``ForConditionalGeneration`` names ``ForCausalLMLoss``; a model whose class names no loss type
    (``GPT2LMHeadModel``) shifts when it can generate, the causal-LM classes, as ``loss_function`` falls back to
    ``ForCausalLMLoss``. The class name alone would miss ``GPT2LMHeadModel`` and take T5 for a causal LM.
    """
    losses = sys.modules.get("transformers.loss.loss_utils")
    model = transformers_model_in(module)
    if losses is None or model is None or getattr(model.config, "is_encoder_decoder", False):
        return False
    loss_fn = getattr(model, "_loss_function", None)
    if loss_fn is None:
        loss_type = getattr(model, "loss_type", None)
        if loss_type not in losses.LOSS_MAPPING:
            can_generate = getattr(model, "can_generate", None)
            return bool(can_generate()) if callable(can_generate) else False
        loss_fn = losses.LOSS_MAPPING[loss_type]
    return loss_fn is losses.ForCausalLMLoss


def router_loss_text(module: nn.Module, flag: Optional[bool] = None, source: str = "in the batch") -> Optional[str]:
    """What to say where the transformers model in ``module`` adds a router loss to its loss (a mixture of experts
    whose forward takes ``output_router_logits``: Mixtral, Qwen-MoE, OLMoE, SwitchTransformers...), else ``None``.
    The flag is ``flag`` where the model is known to be called with one (its batch's ``output_router_logits``, said
    ``source``), else the forward's own default where it has one (SwitchTransformers': ``False``), else
    ``config.output_router_logits``; the loss is on where the flag is and ``config.router_aux_loss_coef`` (load
    balancing) or ``config.router_z_loss_coef`` is above 0. That loss is taken over the tokens of the batch the forward
    sees: over a micro-batch, the sum of the weighted micro-losses is not the whole batch's loss, nor the router's
    gradient the whole batch's."""
    model = transformers_model_in(module)
    parameter, kinds = _router_loss_parts(model)
    if parameter is None or not kinds:
        return None
    if flag is None and isinstance(parameter.default, bool):  # the forward decides, not the config
        flag, source = parameter.default, "by the forward's default"
    elif flag is None:
        flag, source = bool(getattr(model.config, "output_router_logits", False)), "in the config"
    if not flag:
        return None
    losses = "a router load-balancing loss" if list(kinds.values()) == ["load-balancing"] else \
        "a router z-loss" if list(kinds.values()) == ["z"] else "router load-balancing and z-losses"
    coefficients = ", ".join(f"{name}={getattr(model.config, name)}" for name in kinds)
    remedy = "config.output_router_logits=False" if source == "in the config" else \
        f"output_router_logits=False {source}"
    return (f"{type(model).__name__} adds {losses} (output_router_logits=True {source}, {coefficients}) "
            "taken over the tokens of each forward, so with micro-batches computed per micro-batch, not over the "
            "whole batch: the loss and the router's gradients are no longer the whole batch's (the token loss still "
            "is). Micro-batching is used only where nothing exact fits "
            f"(AMP and checkpointing come first); to keep the step exact, give a larger budget or set {remedy}")


def _router_loss_parts(model: Optional[nn.Module]) -> tuple[Optional[inspect.Parameter], dict[str, str]]:
    """The ``output_router_logits`` parameter of the transformers model's forward (``None`` where it takes none), and
    the router losses its config weighs above 0 (coefficient name -> kind)."""
    config = getattr(model, "config", None)
    if config is None:
        return None, {}
    parameter = forward_parameters(model).get("output_router_logits")
    kinds = {name: kind for name, kind in (("router_aux_loss_coef", "load-balancing"), ("router_z_loss_coef", "z"))
             if (getattr(config, name, 0) or 0) > 0}
    return parameter, kinds


def transformers_model_in(module: nn.Module) -> Optional[nn.Module]:
    """The outermost submodule of ``module`` (itself included) that is a transformers ``PreTrainedModel``, else the
    outermost with transformers' ``loss_type`` and ``config`` attributes, else ``None``. The model itself, not a
    wrapper that hands attribute reads on to it: peft's ``PeftModel`` has both attributes that way, but its forward
    takes the model's arguments as ``**kwargs`` (the router loss's flag among them) and its name is not the model's."""
    utils = sys.modules.get("transformers.modeling_utils")  # loaded with any transformers model; never imported here
    pretrained = getattr(utils, "PreTrainedModel", None)
    if isinstance(pretrained, type):
        found = next((m for m in module.modules() if isinstance(m, pretrained)), None)
        if found is not None:
            return found
    return next((m for m in module.modules() if hasattr(m, "loss_type") and hasattr(m, "config")), None)


def micro_batches_of(module: nn.Module, batch: Any, k: int) -> list[Any]:
    """``batch`` cut into at most ``k`` micro-batches as the rung cuts it for ``module`` (a vision-language model's
    packed images go with their samples: image_rows.py), without the loss weights: what an estimate of a part runs.

    Raises:
        ValueError: the batch cannot be split (no sample dimension; packed images not told apart by sample)."""
    size, model = batch_size_of(batch), transformers_model_in(module)
    groups = image_row_groups(model, image_layout(model), batch, size) if size is not None else {}
    return [part for part, _ in split_batch(batch, k, groups)]


def generation_pad_id(module: nn.Module) -> Optional[int]:
    """The token id ``generate`` pads with in the transformers model in ``module`` (:func:`transformers_model_in`):
    its ``generation_config.pad_token_id``, else, as ``generate`` falls back, its (first) ``eos_token_id``; ``None``
    where there is no such model or id. A split evaluation batch's generated rows are padded with it to one length
    (a pad id passed to ``generate`` itself is not seen here: the model's generation config should hold it)."""
    model = transformers_model_in(module)
    config = getattr(model, "generation_config", None)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, torch.Tensor) and value.numel() >= 1:
            value = int(value.reshape(-1)[0])
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class MicroBatching(BuiltinRung):
    """Level L runs each batch as ``2**L`` micro-batches inside one optimizer step; level 0 runs it whole.

    Args:
        module: the model (to say when BatchNorm layers will see smaller batches, and whether a causal LM shifts
            its labels).
        automatic_optimization: the framework runs forward and backward for us (micro-batching needs to split them).
        weight: ``microbatch_weight=``: ``batch -> number``, what the loss of that batch averages over; ``None``:
            the rule of this module's docstring.
        warn: how to warn (a front door with several processes warns on rank zero only).
    """

    name = "microbatch"
    safe_mid_step = True  # a retried batch runs from its first micro-batch, after the gradients were zeroed

    def __init__(self, module: nn.Module, automatic_optimization: bool = True,
                 weight: Optional[MicroBatchWeight] = None, warn: Callable[[str], None] = default_warn) -> None:
        validate_microbatch_weight(weight)
        self.module = module
        self.automatic_optimization = automatic_optimization
        self.weight = weight
        self.warn = warn
        self.level = 0
        self.max_level = _UNKNOWN_MAX_LEVEL
        #: why the batches cannot be split (the rung is off for the fit), or ``None``
        self.unsplittable: Optional[str] = None
        #: the model's layers that read their input's leading size as time steps (sequence_layout.py)
        self.time_axis_layers = time_axis_layers(module)
        #: whether the batch's shapes leave it to those layers to say if its leading size is time steps: a forward
        #: shows what they receive (:meth:`judge_layout`)
        self.needs_layout = False
        self._size: Optional[int] = None
        self._first_shape: list[int] = []  # the observed batch's first tensor's shape, for the texts
        self.notices: list[str] = []
        self._notices_pending = False  # engaged before a batch was seen: the caveats wait for the first one
        self._whole: list[str] = []  # what of the first batch goes whole into every micro-batch, worth saying
        self._shifts: Optional[bool] = None  # read from the model once, when first needed
        model = transformers_model_in(module)
        self._ctc: Optional[str] = ctc_reduction(model)  # "mean", "sum" or None
        #: how a vision-language model takes its batch's images in one tensor (image_rows.py), else None
        self._image_model, self._image_layout = model, image_layout(model)
        #: the label the model's loss leaves out: -100, or the transformers model's
        #: ``config.semantic_loss_ignore_index`` (a segmentation model's, 255 by default: SegFormer, BEiT, DPT...)
        ignored = getattr(getattr(model, "config", None), "semantic_loss_ignore_index", None)
        self.ignore_index = ignored if isinstance(ignored, int) and not isinstance(ignored, bool) else IGNORE_INDEX
        # a time-series model's loss is a mean over the future points its batch's mask says are observed
        self._takes_observed_mask = "future_observed_mask" in forward_parameters(model)
        self._rule: Optional[str] = None  # what the first batch's loss averages over, for the caveat
        self._padded = ""  # the first batch's integer tensor(s) holding the ignored label, in words (rule "padded")
        #: the output_router_logits the model is known to be called with (the first batch's, or the training step's
        #: call's where a split step saw it), and where that was seen
        self._router_flag: Optional[bool] = None
        self._router_source = "in the batch"
        self._router_watch: Any = None  # the hook reading the flag of the model's first call while split
        self._said_joined = False

    def unavailable_reason(self) -> Optional[str]:
        if not self.automatic_optimization:
            return "it needs automatic optimization (the training loop must run forward and backward)"
        if fetches_own_batches(getattr(self.module, "training_step", None)):
            return (f"the training step fetches its own batches (it takes {ITERATOR_PARAMETER}), so no batch is in "
                    "hand to split before it runs")
        return None

    def observe_batch(self, batch: Any) -> None:
        """Learns the batch size from a batch: the top level becomes the one whose micro-batches hold one sample.
        The samples are the leading size of the batch's first tensor (as Lightning counts a batch's size); a batch
        whose first tensor is not batch-major (more tensors share another leading size, or it is time-major:
        :func:`_time_major_text`) is not split at all (:attr:`unsplittable` says why); where every tensor shares one
        leading size and the model has time-major layers, :attr:`needs_layout` asks for what they receive in a
        forward (:meth:`judge_layout`). What goes whole into every micro-batch though a reader may expect it split
        (tensors of another leading size, an int field counting the samples) is named once when the rung engages."""
        size = batch_size_of(batch)
        self._first_shape = list(next(iter(batch_shapes(batch)), ()))
        self.unsplittable = None if size is not None else f"a batch of type {type(batch).__name__} {NO_SAMPLES}"
        self._whole = []
        self._size, self.needs_layout = size, False
        if size is not None:
            self.max_level = max(1, math.ceil(math.log2(size))) if size > 1 else 0
            try:
                self._judge_batch(batch, size, self.row_groups(batch, size))
            except ValueError as err:  # images in one tensor that cannot be told apart by sample
                self.unsplittable = str(err)
        self._rule = self._rule_for(batch)
        self._padded = self._padded_labels_text(batch, size)
        flag = batch_field(batch, "output_router_logits")
        self._router_flag = flag if isinstance(flag, bool) else None
        if self.level and self.splittable:  # engaged before the first batch (resumed at a level): said now
            weight = [self._weight_note()] if self._notices_pending else []
            self._notices_pending = False
            self.notices = self.notices + weight
            for note in weight + self._whole:
                self.warn(f"lightning-memguard: {note}.")

    def _judge_batch(self, batch: Any, size: int, groups: RowGroups) -> None:
        counts_field = _count_fields(batch, size)
        if counts_field:
            self._whole.append(
                f"the batch's {', '.join(counts_field)} equals its {size} samples and goes unchanged into every "
                "micro-batch: a loss divided by it is no longer the batch's mean (take the mean, or name the count "
                "num_items_in_batch: the micro-losses are then added unweighted)")
        lists = item_lists(batch, size)
        if lists:
            # each micro-batch gets its samples' items (a detection batch's targets); what the items hold is theirs,
            # not the batch's samples: left out of the shapes below
            where, items = lists[0]
            kind = "tensor" if isinstance(items[0], torch.Tensor) else type(items[0]).__name__
            self._whole.append(
                f"its list {where} holds one item a sample ({kind}s): each micro-batch gets its samples' items. A "
                "loss normalised by a count over the whole batch's targets (a detection loss by its number of boxes) "
                "is normalised by the micro-batch's: weigh the micro-batches by that count with microbatch_weight= "
                "(a function of the batch)")
            per_sample = {id(found) for _, found in lists}  # per_sample_lists, from the lists found above
            batch = map_tensors(lambda t: t, batch, lambda values: None if id(values) in per_sample else values,
                                whole=per_sample)
        if groups:  # images in one tensor: each micro-batch gets its samples' rows, whatever its leading size
            batch = map_tensors(lambda t: None if id(t) in groups else t, batch)
        shapes = batch_shapes(batch)  # a PackedSequence as one tensor of its sequences
        counts = Counter(shape[0] for shape in shapes)
        if len(counts) == 1:  # every tensor is batch-major (most batches), or every one is time-major
            self.needs_layout = bool(self.time_axis_layers)
            return
        common, count = counts.most_common(1)[0]
        if count > counts[size]:
            # splitting the first tensor's leading dimension would cut a table shared by the samples and give every
            # micro-batch all the samples: a wrong gradient; refused rather than guessed
            self.unsplittable = (
                f"its first tensor (shape {list(shapes[0])}) has leading size {size}, taken as the samples, but "
                f"{count} tensors have leading size {common}: splitting it would give wrong gradients. Put a tensor "
                "with the samples first in the batch (tensors of another leading size then go whole into every "
                "micro-batch)")
            return
        time_major = _time_major_text(shapes, size, counts)
        if time_major is not None:
            self.unsplittable = time_major
            return
        others = ", ".join(str(list(shape)) for shape in shapes if shape[0] != size)
        self._whole.append(
            f"micro-batches split the batch's {size} samples (the leading size of its first tensor); its tensors of "
            f"shape {others} have another leading size and go whole into every micro-batch: right for a tensor all "
            "samples share (a lookup table) and for a second dataloader's batch whose loss is a mean of its own, but "
            "they take as much memory in each micro-batch as in the whole batch. A shared tensor whose leading size "
            "happens to equal the samples' would be split with them: keep such a tensor out of the batch")

    def judge_layout(self, inputs: Mapping[str, tuple[int, ...]]) -> None:
        """Reads the shapes :attr:`time_axis_layers` received in a forward of the observed batch (layer name ->
        shape): where one reads the batch's leading size as time steps, the batches are not split
        (:attr:`unsplittable` says why)."""
        self.needs_layout = False
        text = time_major_text(inputs, self._size) if self._size is not None else None
        if text is not None:
            self.unsplittable = text

    @property
    def no_levels_reason(self) -> Optional[str]:
        """Why the rung has no level to climb to for the observed batch (it cannot be split, or it holds one sample),
        in words for the report; ``None`` where it has levels, or before a batch was seen."""
        if not self.splittable:
            return f"off for this run: {self.unsplittable}"
        if self._size != 1:
            return None
        return (f"the batch holds one sample (the leading size of its first tensor, shape {self._first_shape}): "
                "micro-batches split samples, never a sequence. A batch of one row — several sequences packed back "
                "to back, as transformers' DataCollatorWithFlattening makes them — cannot be split: pack into "
                "several rows, or fewer tokens a batch")

    @property
    def splittable(self) -> bool:
        """Whether the batches can be split (else :attr:`unsplittable` says why)."""
        return self.unsplittable is None

    @property
    def micro_batches(self) -> int:
        level = self.level  # micro_batches_at's rule, without its call: asked twice before every batch
        return 2**level if level else 1

    @staticmethod
    def micro_batches_at(level: int) -> int:
        """How many micro-batches level ``level`` runs a batch as (before the cap at the batch size)."""
        return 2**level if level else 1

    def set_level(self, level: int) -> None:
        if not 0 <= level <= _UNKNOWN_MAX_LEVEL:
            raise ValueError(f"level={level} must be in [0, {_UNKNOWN_MAX_LEVEL}]")
        if level and not self.level:
            # engaged before the first batch (resumed at a level): the weight, read from that batch, is said when it
            # comes (observe_batch), not guessed now
            self._notices_pending = self._rule is None and self._ctc is None
            self.notices = self._caveats()
            self._watch_router_call()
        self.level = level

    def _watch_router_call(self) -> None:
        """Where the model may add a router loss and none is known to be on, its first call while split is read once
        (a forward pre-hook that removes itself): a training step may turn the loss on in its own call
        (``self.model(**batch, output_router_logits=True)``), which neither the batch nor the config shows. A loss
        found on there is said then, and makes the split inexact (:meth:`inexact_reason`). Not on a compiled model
        (a hook added and removed would recompile it twice)."""
        model = transformers_model_in(self.module)
        parameter, kinds = _router_loss_parts(model)
        if self._router_watch is not None or parameter is None or not kinds or self._coupled_loss_text() is not None \
                or compiled_reason(self.module) is not None:
            return

        def read_flag(module, args, kwargs):
            if module is not model:  # a copy the estimate made (its warnings are silenced): the model's own call
                return
            self.close()
            flag = kwargs.get("output_router_logits")
            if isinstance(flag, bool) and flag != self._router_flag:
                self._router_flag, self._router_source = flag, "in the training step's call"
                text = self._coupled_loss_text()
                if text is not None and self.level:
                    self.warn(f"lightning-memguard: {text}.")

        self._router_watch = model.register_forward_pre_hook(read_flag, with_kwargs=True)

    def close(self) -> None:
        """Removes the hook :meth:`_watch_router_call` left on the model, where the model was not called since."""
        if self._router_watch is not None:
            self._router_watch.remove()
            self._router_watch = None

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_router_watch"] = None  # a hook on this process's model (and a closure: not picklable)
        return state

    # --- splitting --------------------------------------------------------------------------------------------------
    def split(self, batch: Any, k: int) -> list[tuple[Any, float]]:
        """The batch as at most ``k`` micro-batches, each with the factor its loss is multiplied by (see the module
        docstring): the factors times the micro-losses add up to the whole batch's loss.

        Raises:
            ValueError: the batch has no tensor with a sample dimension, or ``microbatch_weight`` returned something
                other than a finite number >= 0.
        """
        size = batch_size_of(batch)
        if size is None:
            return split_batch(batch, k)  # raises the ValueError that says why
        groups = self.row_groups(batch, size)
        rule = self._rule_for(batch)
        if rule in ("sum", "num_items", "ctc_sum"):
            return [(part, 1.0) for part, _ in split_batch(batch, k, groups)]
        if rule in ("samples", "ctc_mean"):
            return split_batch(batch, k, groups)
        ranges = split_ranges(size, k)
        per_sample = per_sample_lists(batch, size)  # found once, not once a part
        parts = [slice_batch(batch, start, stop, size, per_sample, groups) for start, stop in ranges]
        at = _padded_labels_at(batch, size, self.ignore_index)[0] if rule == "padded" else None
        weights = [self._weight_of(part, rule, at) for part in parts]
        total = sum(weights)
        if total == 0:  # nothing to average over in the whole batch: its own loss is 0/0 too
            return split_batch(batch, k, groups)
        joined = _join_weightless(ranges, weights)
        if len(joined) < len(ranges):
            self._say_joined(len(ranges) - len(joined))
            parts = [slice_batch(batch, start, stop, size, per_sample, groups) for start, stop, _ in joined]
            weights = [weight for _, _, weight in joined]
        return [(part, weight / total) for part, weight in zip(parts, weights)]

    def row_groups(self, batch: Any, size: int) -> RowGroups:
        """The runs of rows each sample has in the batch's image tensors (image_rows.py): empty for a model that takes
        no images in one tensor. Raises ValueError where they cannot be told apart by sample."""
        return image_row_groups(self._image_model, self._image_layout, batch, size)

    def _rule_for(self, batch: Any) -> str:
        if isinstance(self.weight, str):
            return "sum"
        if self.weight is not None:
            return "weight"
        if batch_field(batch, "num_items_in_batch") is not None:
            return "num_items"
        if self._ctc is not None:  # labels, but the loss is not a mean over them
            return f"ctc_{self._ctc}"
        if self._takes_observed_mask and _observed_mask(batch) is not None:
            return "observed"
        if _labels_of(batch) is not None:
            return "tokens"
        if len(_padded_labels_at(batch, batch_size_of(batch), self.ignore_index)) == 1:
            return "padded"
        return "samples"

    def _padded_labels_text(self, batch: Any, size: Optional[int]) -> str:
        """The batch's integer tensors that hold the ignored label (:func:`_padded_labels_at`), in words: where and
        of which shape; where there are several and no rule of a higher rank applies, why none is taken as the labels
        is one of the notes said when the rung engages."""
        found = _padded_labels_at(batch, size, self.ignore_index)
        if not found:
            return ""
        tensors = batch_tensors(batch)
        where = " and ".join(f"#{at} (shape {list(tensors[at].shape)})" for at in found)
        if len(found) > 1 and self._rule == "samples":
            self._whole.append(
                f"the batch's tensors {where} each hold {self.ignore_index}, the label torch's cross_entropy ignores: "
                "micro-batches weigh their share of samples, not of either's labels. A sum of losses that each "
                "average over their own labels (a multi-task loss) is exact under no one weight: divide each sum by "
                "its count over the whole batch, carried in the batch, and give microbatch_weight='sum' (or one loss: "
                "say what it averages over with microbatch_weight=)")
        return f"tensor {where}" if len(found) == 1 else ""

    def _weight_of(self, part: Any, rule: str, at: Optional[int] = None) -> float:
        """What ``part``'s loss averages over by ``rule``; ``at``: where the padded labels are among the part's
        tensors (rule ``"padded"``, :func:`_padded_labels_at`)."""
        if rule == "weight":
            return _checked_weight(self.weight(part), self.weight)
        if rule == "observed":  # a time point counts where every target value at it is observed, as the loss does
            mask = _observed_mask(part)
            return float((mask.amin(dim=-1) if mask.dim() > 2 else mask).sum())
        ignored = self.ignore_index
        shift_labels = batch_field(part, "shift_labels")
        if isinstance(shift_labels, torch.Tensor):  # already shifted by the caller: the loss counts them as they are
            return float((shift_labels != ignored).sum())
        labels = _labels_of(part) if at is None else batch_tensors(part)[at]
        if labels.dim() >= 2 and self.shifts_labels:
            labels = labels[..., 1:]  # the first label of each row has no token before it to predict it
        return float((labels != ignored).sum())

    @property
    def shifts_labels(self) -> bool:
        """Whether the module's loss counts its labels after the causal-LM shift (:func:`model_shifts_labels`)."""
        if self._shifts is None:
            self._shifts = model_shifts_labels(self.module)
        return self._shifts

    def _say_joined(self, count: int) -> None:
        if self._said_joined:
            return
        self._said_joined = True
        self.warn(f"lightning-memguard: {count} micro-batch(es) had nothing the loss averages over (weight 0: every "
                  "label -100); each runs joined to its neighbour, forward and backward, since alone its mean loss "
                  "would be 0/0 (NaN) and poison the step. Said once per fit.")

    # --- what the user is told --------------------------------------------------------------------------------------
    def describe_weight(self) -> str:
        """Which weight each micro-batch's loss gets, in words."""
        if self._rule == "sum":
            return ("micro-batching adds the micro-batches' losses unweighted: microbatch_weight='sum' says the loss "
                    "adds up its samples")
        if self._rule == "weight":
            name = getattr(self.weight, "__qualname__", None) or repr(self.weight)
            return (f"micro-batching weights each micro-batch's loss by microbatch_weight={name}: its share of the "
                    "batch's total")
        if self._rule == "num_items":
            return ("micro-batching adds the micro-batches' losses unweighted: the batch carries num_items_in_batch, "
                    "so each loss is already divided by the whole batch's count")
        if self._ctc is not None:  # the rule of every batch without num_items_in_batch
            name = type(transformers_model_in(self.module)).__name__
            if self._ctc == "sum":
                return (f"micro-batching adds the micro-batches' losses unweighted: {name}'s CTC loss is a sum over "
                        "the samples (config.ctc_loss_reduction='sum')")
            return (f"micro-batching weights each micro-batch's loss by its share of the batch's samples: {name}'s "
                    "CTC loss is a mean over the samples (config.ctc_loss_reduction='mean')")
        if self._rule == "observed":
            name = type(transformers_model_in(self.module)).__name__
            return (f"micro-batching weights each micro-batch's loss by its share of the batch's observed future time "
                    f"points (future_observed_mask), exact for {name}'s loss, a mean over them")
        model = transformers_model_in(self.module) if self.shifts_labels else None
        shifted = f", counted after {type(model).__name__}'s causal-LM shift" if model is not None else ""
        tokens = f"labelled tokens (labels not {self.ignore_index}{shifted})"
        if self._rule == "tokens":
            return (f"micro-batching weights each micro-batch's loss by its share of the batch's {tokens}, exact for "
                    "a loss that is a mean over those tokens (transformers' own)")
        if self._rule == "padded":
            return (f"micro-batching weights each micro-batch's loss by its share of the batch's labels not "
                    f"{self.ignore_index}{shifted} in its {self._padded}, the one integer tensor holding "
                    f"{self.ignore_index} (the label torch's cross_entropy and nll_loss ignore by default), exact for "
                    "their mean over the labels not ignored, label smoothing included; a mean over samples, or over "
                    "labels the training step shifts itself (labels[:, 1:]), needs microbatch_weight=")
        if self._rule == "samples":
            return ("micro-batching weights each micro-batch's loss by its share of the batch's samples, exact for a "
                    "loss that is a mean over the batch's samples")
        return (f"micro-batching weights each micro-batch's loss by its share of the batch's {tokens} when the batch "
                "carries labels, else of its samples, exact for a loss that is a mean over those")

    def _caveats(self) -> list[str]:
        coupled = self._coupled_loss_text()
        notes = [coupled] if coupled is not None else []  # not exact: said first, plainly
        if not self._notices_pending:  # else said with the first batch
            notes.append(self._weight_note())
        notes.extend(self._whole)
        if self._has_batch_norm():
            notes.append(_BATCH_NORM_NOTE)
        return notes

    def _weight_note(self) -> str:
        """What each micro-batch's loss is weighted by, and what changes where the loss averages over another count."""
        if self._ctc is not None and self._rule not in ("weight", "num_items"):  # the model's own loss is known
            return (self.describe_weight() + "; a loss of the training step's own is weighted so too: say what it "
                    "averages over with microbatch_weight=")
        return (self.describe_weight() + "; a loss that averages over something else changes: say what it averages "
                "over with microbatch_weight=, or microbatch_weight='sum' for a summed loss (reduction='sum'). A loss "
                "that couples the samples (in-batch negatives: InfoNCE, CLIP-style; batch-hard triplet mining) scores "
                "each sample against its micro-batch's only, whatever the weight")

    def inexact_reason(self) -> Optional[str]:
        """Why micro-batches are known to train this model differently from whole batches (a router
        load-balancing loss taken per micro-batch, a contrastive loss scoring samples within a micro-batch only,
        BatchNorm statistics per micro-batch), else ``None``: such a split
        is worth it for memory, not for speed."""
        return self._coupled_loss_text() or (_BATCH_NORM_NOTE if self._has_batch_norm() else None)

    def _coupled_loss_text(self) -> Optional[str]:
        """Why the model's own loss is not the sum of its micro-batches' (a router loss, a contrastive loss)."""
        return (router_loss_text(self.module, self._router_flag, self._router_source)
                or contrastive_loss_text(transformers_model_in(self.module)))

    def _has_batch_norm(self) -> bool:
        return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.module.modules())


_BATCH_NORM_NOTE = ("the model has BatchNorm layers: their statistics are now taken over each micro-batch, not the "
                    "whole batch")


def _time_major_text(shapes: list[tuple[int, ...]], size: int, counts: Counter) -> Optional[str]:
    """Why a batch looks time-major (``x`` of shape [T, B, F] first, ``y`` of [B]), else ``None``: its first tensor's
    second size leads other tensors, and every tensor of the first's leading size has that second size too. Its
    leading size is then most likely the time steps: split, every micro-batch would hold all the samples and a part of
    each sequence — wrong gradients, with no error to show it. A shared tensor whose size happens to be the sequence
    length (positions of shape [L] beside ids of [B, L]) reads the same: the rung is then off where it could have
    split, which the text says how to undo."""
    first = shapes[0]
    across = first[1] if len(first) > 1 else None
    if across is None or across == size or not counts[across]:
        return None
    if any(len(shape) < 2 or shape[1] != across for shape in shapes if shape[0] == size):
        return None
    leading = ", ".join(str(list(shape)) for shape in shapes if shape[0] == across)
    return (f"its first tensor (shape {list(first)}) looks time-major: its second size, {across}, is the leading size "
            f"of {leading}, so its leading size {size} is most likely time steps, not samples, and splitting it would "
            "cut every sequence instead of the batch: wrong gradients. Put the samples first (batch_first=True); a "
            f"tensor all samples share whose leading size is {across} (positions, a mask) belongs outside the batch")


def _count_fields(batch: Any, size: int) -> list[str]:
    """The names of the batch's top-level int fields (keys, dataclass or named-tuple fields) equal to ``size``: a count
    of the batch's samples that a split cannot change (``num_items_in_batch`` has its own rule)."""
    if size < 2:
        return []
    if isinstance(batch, Mapping):
        items = list(batch.items())
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = [(f.name, getattr(batch, f.name, None)) for f in dataclasses.fields(batch)]
    elif isinstance(batch, tuple) and hasattr(type(batch), "_fields"):
        items = list(zip(type(batch)._fields, batch))
    else:
        return []
    return [repr(name) for name, value in items if isinstance(value, int) and not isinstance(value, bool)
            and value == size and name != "num_items_in_batch"]


def _observed_mask(batch: Any) -> Optional[torch.Tensor]:
    """The batch's ``future_observed_mask`` (a transformers time-series batch's: which future values the loss counts),
    a tensor with a sample dimension, else ``None``."""
    mask = batch_field(batch, "future_observed_mask")
    return mask if isinstance(mask, torch.Tensor) and mask.dim() > 1 else None


def _padded_labels_at(batch: Any, size: Optional[int], ignored: int) -> list[int]:
    """Where among the batch's tensors (:func:`batch_tensors`, whose order a split keeps) its integer tensors of its
    ``size`` samples are that hold ``ignored``: labels padded for the ``ignore_index`` of a cross-entropy loss. Read
    only for a batch run in parts (on CUDA each tensor's answer waits for the device, as the labels' count does)."""
    if size is None:
        return []
    return [at for at, t in enumerate(batch_tensors(batch))
            if t.dim() > 0 and t.shape[0] == size and not t.is_floating_point() and not t.is_complex()
            and t.dtype != torch.bool and bool((t == ignored).any())]


def _labels_of(batch: Any) -> Optional[torch.Tensor]:
    """The batch's transformers-style labels (``shift_labels`` first): a tensor with a sample dimension, else None."""
    for name in ("shift_labels", "labels"):
        labels = batch_field(batch, name)
        if isinstance(labels, torch.Tensor) and labels.dim() > 0:
            return labels
    return None


def _join_weightless(ranges: list[tuple[int, int]], weights: list[float]) -> list[tuple[int, int, float]]:
    """The ranges with each weight-0 one joined to the one before it (the first ones to the one after them)."""
    joined: list[list] = []
    pending_start: Optional[int] = None
    for (start, stop), weight in zip(ranges, weights):
        if weight == 0:
            if joined:
                joined[-1][1] = stop
            elif pending_start is None:
                pending_start = start
            continue
        if pending_start is not None:
            start, pending_start = pending_start, None
        joined.append([start, stop, weight])
    return [(start, stop, weight) for start, stop, weight in joined]


def _checked_weight(value: Any, fn: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"microbatch_weight={getattr(fn, '__qualname__', fn)!r} returned {value!r}; it must return "
                         "a finite number >= 0 (what the micro-batch's loss averages over)")
    return float(value)
