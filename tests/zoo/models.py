"""The model zoo: transformers models people train, built from tiny configs with random weights (no downloads), and
the batches they are trained on — padded token batches with labels -100 on the padding, and the ``BatchEncoding``
every tokenizer returns, and :func:`zoo_run` through any front door. Shared by the zoo tests of every front door.
:data:`ZOO` runs through every door; :data:`MORE_FAMILIES` (Whisper, a LoRA on Llama, Qwen2, Mistral) and
:data:`STRUCTURES` (BART, Wav2Vec2 with a CTC loss, CLIP) where named.

``build(name)`` returns ``(model, make_batch)``; ``make_batch(seed, batch_size=..., padded=..., encoding=...)`` a
batch for ``model(**batch)`` whose output has a ``.loss``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers import Run, run
from tests.helpers import train_unguarded as unguarded
from tests.models import pl

transformers = pytest.importorskip("transformers")

VOCAB = 128
SEQ = 16
#: every zoo model; "resnet" is a BatchNorm net, "llama" has grouped-query attention, "t5" is an encoder-decoder
ZOO = ("gpt2", "llama", "bert", "t5", "vit", "resnet")
#: the zoo models that take token batches (and so padded masks and labels -100)
TOKEN_MODELS = ("gpt2", "llama", "bert", "t5")
#: mixture-of-experts models (token batches too), router loss on: built like the zoo's, tested where named
MOE = tuple(name for name, cls in (("mixtral", "MixtralForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM"))
            if hasattr(transformers, cls))
#: more families people train, tested where named (outside ZOO, so that the every-door tests stay fast): a speech
#: encoder-decoder with a frozen parameter and tied output embeddings ("whisper": mel features in, labels padded with
#: -100 out), a peft LoRA on the zoo's Llama (base frozen, adapters trainable), Qwen2 (grouped-query attention, tied
#: embeddings) and Mistral (grouped-query, sliding-window attention)
MORE_FAMILIES = ("whisper", "llama_lora", "qwen2", "mistral")
MEL_BINS, FRAMES = 16, 32  # Whisper's encoder halves the frames: 2 x max_source_positions


def _config(name: str):
    t = transformers
    if name == "gpt2":
        return t.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=3, n_head=4, bos_token_id=0,
                            eos_token_id=0)
    if name == "bert":
        return t.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64)
    if name == "t5":
        return t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                          num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    if name == "vit":
        return t.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=3,
                           num_attention_heads=4, intermediate_size=64, num_labels=5)
    if name == "resnet":
        return t.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2],
                              layer_type="basic", num_labels=5)
    if name == "mixtral":
        return t.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=64, output_router_logits=True)
    if name == "qwen2_moe":
        return t.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                max_position_embeddings=64, output_router_logits=True)
    if name == "whisper":
        return t.WhisperConfig(vocab_size=VOCAB, num_mel_bins=MEL_BINS, d_model=32, encoder_layers=2, decoder_layers=2,
                               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                               decoder_ffn_dim=64, max_source_positions=FRAMES // 2, max_target_positions=64,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    if name in ("llama_lora", "llama"):
        return t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if name == "qwen2":
        return t.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=True)
    if name == "mistral":  # a window shorter than the rows, so that the sliding window masks something
        return t.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               sliding_window=SEQ // 2)
    config = _structure_config(name) or _wider_config(name) or _signals_config(name)
    if config is not None:
        return config
    raise ValueError(f"unknown zoo model {name!r}; allowed: "
                     f"{ZOO + MOE + MORE_FAMILIES + STRUCTURES + SWITCH + WIDER + SIGNALS}")


#: families of structures the others lack, tested where named: a text encoder-decoder whose decoder makes its own
#: mask ("bart"), a convolutional audio encoder trained with a CTC loss ("wav2vec2": raw samples in, labels padded with
#: -100, the CTC loss a mean over samples), and a two-tower contrastive model ("clip": text and images in, its loss
#: couples the samples of a batch, so micro-batching is not exact)
STRUCTURES = ("bart", "wav2vec2", "clip")
#: more decoders, encoders and mixtures of experts, each from a tiny config as the others, tested where named (the
#: estimate's agreement with a real step, a fit under a budget): Gemma 2 (logit soft-capping, sliding window), Gemma 3,
#: Phi-3, GPT-NeoX, Falcon; ModernBERT (local and global attention), DeBERTa-v2 (disentangled relative attention),
#: DistilBERT; Qwen3-MoE and OLMoE (router loss on), DeepSeek-V3 (latent attention, shared experts); Mamba (a state
#: space model: torch's slow path on CPU)
WIDER_CLASSES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gpt_neox": "GPTNeoXForCausalLM", "falcon": "FalconForCausalLM",
                 "modernbert": "ModernBertForMaskedLM", "deberta_v2": "DebertaV2ForMaskedLM",
                 "distilbert": "DistilBertForMaskedLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "olmoe": "OlmoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "mamba": "MambaForCausalLM"}
WIDER = tuple(name for name, cls in WIDER_CLASSES.items() if hasattr(transformers, cls))


def _wider_config(name: str):
    t, small = transformers, dict(vocab_size=VOCAB, max_position_embeddings=64)
    decoder = dict(small, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
    if name == "gemma2":
        return t.Gemma2Config(**decoder, num_key_value_heads=2, head_dim=8, sliding_window=SEQ // 2,
                              final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    if name == "gemma3":
        return t.Gemma3TextConfig(**decoder, num_key_value_heads=2, head_dim=8, sliding_window=SEQ // 2)
    if name == "phi3":
        return t.Phi3Config(**decoder, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "gpt_neox":
        return t.GPTNeoXConfig(**decoder, bos_token_id=0, eos_token_id=0)
    if name == "falcon":
        return t.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                              bos_token_id=0, eos_token_id=0)
    if name == "modernbert":
        return t.ModernBertConfig(**decoder, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                  sep_token_id=2, local_attention=8, global_attn_every_n_layers=2)
    if name == "deberta_v2":
        return t.DebertaV2Config(**decoder, relative_attention=True, pos_att_type=["p2c", "c2p"],
                                 max_relative_positions=-1, position_buckets=8, position_biased_input=False,
                                 pad_token_id=0)
    if name == "distilbert":
        return t.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=3, n_heads=4, hidden_dim=64,
                                  max_position_embeddings=64, pad_token_id=0)
    moe = dict(small, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_experts_per_tok=2)
    if name == "qwen3_moe":
        return t.Qwen3MoeConfig(**moe, num_key_value_heads=2, num_experts=4, output_router_logits=True)
    if name == "olmoe":
        return t.OlmoeConfig(**{**moe, "intermediate_size": 32}, num_key_value_heads=4, num_experts=4,
                             output_router_logits=True, pad_token_id=0, eos_token_id=1)
    if name == "deepseek_v3":
        return t.DeepseekV3Config(**moe, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
                                  kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8,
                                  qk_nope_head_dim=8, n_group=2, topk_group=1, first_k_dense_replace=1)
    if name == "mamba":
        return t.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                             conv_kernel=4)
    return None


#: images, segmentation maps and time series beyond ViT and ResNet, tested where named (the estimate's agreement with
#: a real step): Swin (window attention, patch merging), ConvNeXt, DINOv2, MobileViT (BatchNorm beside attention),
#: SegFormer (label maps with pixels ignored: 255), PatchTST (BatchNorm over transposed rows: a layout meta's kernel
#: did not write as the devices' do)
SIGNALS_CLASSES = {"swin": "SwinForImageClassification", "convnext": "ConvNextForImageClassification",
                   "dinov2": "Dinov2ForImageClassification", "mobilevit": "MobileViTForImageClassification",
                   "segformer": "SegformerForSemanticSegmentation", "patchtst": "PatchTSTForPrediction"}
SIGNALS = tuple(name for name, cls in SIGNALS_CLASSES.items() if hasattr(transformers, cls))
IMAGE_MODELS = ("vit", "resnet", "swin", "convnext", "dinov2", "mobilevit")
PATCHTST_CHANNELS, PATCHTST_CONTEXT, PATCHTST_HORIZON = 3, 32, 8


def _signals_config(name: str):
    t, image = transformers, dict(num_channels=3, num_labels=5)
    if name == "swin":
        return t.SwinConfig(**image, image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                            window_size=4, mlp_ratio=2.0, drop_path_rate=0.0)
    if name == "convnext":
        return t.ConvNextConfig(**image, patch_size=4, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                                drop_path_rate=0.0, image_size=32)
    if name == "dinov2":
        return t.Dinov2Config(**image, image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=4, mlp_ratio=2, drop_path_rate=0.0)
    if name == "mobilevit":
        return t.MobileViTConfig(**image, image_size=32, patch_size=2, hidden_sizes=[32, 32, 32],
                                 neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32], num_attention_heads=4, mlp_ratio=2.0)
    if name == "segformer":
        return t.SegformerConfig(**image, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                 patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[2, 4], mlp_ratios=[2, 2],
                                 drop_path_rate=0.0, decoder_hidden_size=32)
    if name == "patchtst":
        return t.PatchTSTConfig(num_input_channels=PATCHTST_CHANNELS, context_length=PATCHTST_CONTEXT,
                                prediction_length=PATCHTST_HORIZON, patch_length=8, patch_stride=8, d_model=32,
                                num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, loss="mse")
    return None


#: a T5-style mixture of experts whose router losses (load balancing and z-loss) are switched on by its batch
#: (``output_router_logits=True``: its forward's default is off, whatever the config says), tested where named
SWITCH = ("switch",) if hasattr(transformers, "SwitchTransformersForConditionalGeneration") else ()
SAMPLES = 800  # raw audio samples a row: 39 frames out of Wav2Vec2's tiny convolutional feature encoder


def _structure_config(name: str):
    t = transformers
    if name == "bart":
        return t.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                            decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2)
    if name == "wav2vec2":  # no SpecAugment masking (random): runs compare exactly
        return t.Wav2Vec2Config(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, conv_dim=(16, 16, 16), conv_stride=(5, 2, 2),
                                conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                                mask_time_prob=0.0, layerdrop=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
                                ctc_loss_reduction="mean", pad_token_id=0)
    if name == "clip":
        return t.CLIPConfig(text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                                             pad_token_id=0, bos_token_id=1, eos_token_id=2),
                            vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4),
                            projection_dim=16)
    if name == "switch":
        return t.SwitchTransformersConfig(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                          num_sparse_encoder_layers=1, num_decoder_layers=2,
                                          num_sparse_decoder_layers=1, num_heads=4, num_experts=4, expert_capacity=64,
                                          router_jitter_noise=0.0, decoder_start_token_id=0, pad_token_id=0)
    return None


def _model_class(name: str):
    t = transformers
    return {"gpt2": t.GPT2LMHeadModel, "llama": t.LlamaForCausalLM, "bert": t.BertForMaskedLM,
            "t5": t.T5ForConditionalGeneration, "vit": t.ViTForImageClassification,
            "resnet": t.ResNetForImageClassification, "mixtral": getattr(t, "MixtralForCausalLM", None),
            "qwen2_moe": getattr(t, "Qwen2MoeForCausalLM", None), "whisper": t.WhisperForConditionalGeneration,
            "llama_lora": t.LlamaForCausalLM, "qwen2": t.Qwen2ForCausalLM, "mistral": t.MistralForCausalLM,
            "bart": t.BartForConditionalGeneration, "wav2vec2": t.Wav2Vec2ForCTC, "clip": t.CLIPModel,
            "switch": getattr(t, "SwitchTransformersForConditionalGeneration", None),
            **{wider: getattr(t, cls, None) for wider, cls in {**WIDER_CLASSES, **SIGNALS_CLASSES}.items()}}[name]


def build(name: str, seed: int = 0) -> tuple[torch.nn.Module, Callable[..., Any]]:
    """A zoo model in training mode (dropout off, so that runs compare exactly) and its batch maker."""
    torch.manual_seed(seed)
    config = _config(name)
    for attr in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                 "dropout_rate", "attention_dropout", "dropout", "activation_dropout", "hidden_dropout", "mlp_dropout",
                 "embedding_dropout", "classifier_dropout", "seq_classif_dropout", "qa_dropout",
                 "classifier_dropout_prob", "positional_dropout", "path_dropout", "ff_dropout", "head_dropout"):
        if hasattr(config, attr):
            setattr(config, attr, 0.0)
    model = _model_class(name)(config)
    if name == "llama_lora":
        model = with_lora(model)
    model.train()
    return model, lambda seed=0, **kw: make_batch(name, seed, **kw)


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as peft wraps it for LoRA: every base parameter frozen, rank-4 adapters on the attention's query and
    value projections trainable (dropout off, as everywhere in the zoo)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft reads a transformers attribute renamed in version 5
        return peft.get_peft_model(model, config)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder layers of zoo model ``model`` (Llama's ``model.layers``, GPT-2's ``transformer.h``)."""
    for path in ("model.layers", "transformer.h"):
        owner = model
        for attribute in path.split("."):
            owner = getattr(owner, attribute, None)
        if isinstance(owner, torch.nn.ModuleList):
            return list(owner)
    raise ValueError(f"{type(model).__name__} has no decoder layers at model.layers or transformer.h")


def fully_shard_layers(model: torch.nn.Module, mesh: Any = None) -> torch.nn.Module:
    """``model`` sharded with FSDP2 as torchtitan shards its models: ``fully_shard`` on every decoder layer, then on
    the root (embeddings, final norm and head), over ``mesh`` (the default process group's when ``None``)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_batch(name: str, seed: int = 0, batch_size: int = 8, padded: bool = True, encoding: bool = False,
               seq: int = SEQ):
    """A batch for zoo model ``name``: token models get ``input_ids``, ``attention_mask`` and ``labels`` of ``seq``
    tokens a row (with ``padded``, rows end in padding of different lengths, masked 0 and labelled -100); vision
    models ``pixel_values`` and ``labels``; Whisper ``input_features`` (log-mel frames) and ``labels`` of ``seq``
    tokens (with ``padded``, rows end in -100: its decoder reads them shifted right, the padding as the pad token).
    ``encoding`` wraps it in a ``transformers.BatchEncoding``, as a tokenizer returns it (Whisper's in a
    ``BatchFeature``, as its processor returns it)."""
    g = torch.Generator().manual_seed(seed)
    if name == "wav2vec2":  # labels 1-31 (0 is the blank), rows padded with -100 as a processor pads them
        labels = torch.randint(1, 32, (batch_size, seq), generator=g)
        if padded:
            for row in range(batch_size):
                labels[row, seq - (row * 5) % (seq // 2):] = -100
        batch = {"input_values": torch.randn(batch_size, SAMPLES, generator=g), "labels": labels}
    elif name == "clip":
        ids = torch.randint(3, VOCAB, (batch_size, seq), generator=g)
        mask = torch.ones(batch_size, seq, dtype=torch.long)
        ids[:, -1] = 2  # CLIP pools the text at its end token; return_loss: the contrastive loss, as users train it
        batch = {"input_ids": ids, "attention_mask": mask,
                 "pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g), "return_loss": True}
    elif name in IMAGE_MODELS:
        batch = {"pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g),
                 "labels": torch.randint(0, 5, (batch_size,), generator=g)}
    elif name == "segformer":  # label maps, each row with its own band of ignored pixels
        labels = torch.randint(0, 5, (batch_size, 32, 32), generator=g)
        for row in range(batch_size):
            labels[row, : 4 * row] = 255
        batch = {"pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g), "labels": labels}
    elif name == "patchtst":
        batch = {"past_values": torch.randn(batch_size, PATCHTST_CONTEXT, PATCHTST_CHANNELS, generator=g),
                 "future_values": torch.randn(batch_size, PATCHTST_HORIZON, PATCHTST_CHANNELS, generator=g)}
    elif name == "whisper":
        labels = torch.randint(3, VOCAB, (batch_size, seq), generator=g)  # 0-2: pad, start and end tokens
        if padded:
            for row in range(batch_size):
                labels[row, seq - (row * 5) % (seq // 2):] = -100
        batch = {"input_features": torch.randn(batch_size, MEL_BINS, FRAMES, generator=g), "labels": labels}
    else:
        ids = torch.randint(1, VOCAB, (batch_size, seq), generator=g)
        mask = torch.ones(batch_size, seq, dtype=torch.long)
        if padded:
            for row in range(batch_size):
                length = seq - (row * 5) % (seq // 2)  # rows of different lengths, the first one unpadded
                mask[row, length:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        ids = ids.masked_fill(mask == 0, 0)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if name == "switch":  # its router losses on, as its users switch them on: in the batch
            batch["output_router_logits"] = True
    if not encoding:
        return batch
    # what a tokenizer returns, or for Whisper its processor (a BatchFeature: a UserDict too, with its own .to())
    return (transformers.BatchFeature if name == "whisper" else transformers.BatchEncoding)(batch)


def loss_of(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The plain-loop loss function of every zoo model: the model's own loss."""
    return model(**batch).loss


class ZooModule(pl.LightningModule):
    """A zoo model as a LightningModule: ``training_step`` returns the model's own loss; the data are ``n_batches``
    fixed batches (``DataLoader(batch_size=None)`` keeps each batch, a ``BatchEncoding`` too, as it is)."""

    def __init__(self, name: str, n_batches: int = 4, batch_size: int = 8, padded: bool = True,
                 encoding: bool = False, lr: float = 0.01, optimizer: str = "sgd", seed: int = 0) -> None:
        super().__init__()
        self.name, self.lr, self.optimizer_name = name, lr, optimizer
        self.model, make = build(name, seed)
        self.batches = [make(i, batch_size=batch_size, padded=padded, encoding=encoding) for i in range(n_batches)]

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(self.batches, batch_size=None, shuffle=False)


# --- the three front doors ----------------------------------------------------------------------------------------
def zoo_batches(name: str, steps: int, batch_size: int = 4, padded: bool = True, encoding: bool = False) -> list:
    return [make_batch(name, index, batch_size=batch_size, padded=padded, encoding=encoding) for index in range(steps)]


def zoo_run(door: str, name: str, root, steps: int, batch_size: int = 4, padded: bool = True, encoding: bool = False,
            lr: float = 0.01, prepare: Optional[Callable[[torch.nn.Module], Any]] = None, optimizer: str = "sgd",
            **settings) -> Run:
    """Zoo model ``name`` trained ``steps`` optimizer steps (``optimizer`` of
    :func:`tests.helpers.make_optimizer`, SGD with momentum by default) through ``door`` of
    :data:`tests.helpers.DOORS` under a guard built with ``settings``, without a logger: the guard's files go to
    ``root``. ``Run.model`` is the zoo model itself, so runs through different doors compare directly; ``prepare``
    is called on it before training."""
    model, _ = build(name)
    if prepare is not None:
        prepare(model)
    return run(door, model, zoo_batches(name, steps, batch_size, padded, encoding), root, loss=loss_of, lr=lr,
               optimizer=optimizer, logger=False, **settings)


def train_unguarded(name: str, steps: int, batch_size: int = 4, padded: bool = True, encoding: bool = False,
                    lr: float = 0.01, optimizer: str = "sgd") -> dict[str, torch.Tensor]:
    """The reference every guarded zoo run is compared with: the same model, batches and optimizer in a plain loop
    without a guard; its ``state_dict`` (parameters and buffers) after the last step."""
    model, _ = build(name)
    unguarded(model, zoo_batches(name, steps, batch_size, padded, encoding), loss=loss_of, lr=lr, optimizer=optimizer)
    return {key: value.detach().clone() for key, value in model.state_dict().items()}
