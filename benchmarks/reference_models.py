"""The models of the CUDA reference (benchmarks/cuda_reference.json), built from a case's description, as the
measuring script (cuda_reference.py), the accuracy benchmark and the tests build them.

A case is ``{"model": NAME, "kwargs": {...}, "precision": ...}``. NAME is one of this project's demo models
(``BlockStack``, ``DemoTransformer``, ``TinyGPT``, ``SmallCNN``) or ``zoo:NAME`` for a transformers model of the test
zoo (tests/zoo/models.py: ``gpt2``, ``llama``, ``bert``, ``t5``, ``vit``, ``resnet``, and ``mixtral`` of its
mixture-of-experts models), wrapped in a LightningModule
whose loss is the model's own; its kwargs may scale the zoo's tiny config (``config``) and batch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests.models and tests.zoo; the checkout's package, not an installed one
    sys.path.insert(0, str(ROOT))

from lightning_memguard.commands.demo import DemoTransformer, SmallCNN, TinyGPT  # noqa: E402
from tests.models import BlockStack  # noqa: E402

DEMO_MODELS = {"BlockStack": BlockStack, "DemoTransformer": DemoTransformer, "TinyGPT": TinyGPT,
               "SmallCNN": SmallCNN}
ZOO_PREFIX = "zoo:"
PRECISIONS = ("32-true", "bf16-mixed")

#: the demo models at the sizes of the reference: a small one and a large one each, both precisions
DEMO_SIZES = [
    ("BlockStack", {"width": 128, "depth": 8, "batch_size": 256}),
    ("BlockStack", {"width": 1024, "depth": 16, "batch_size": 4096}),
    ("DemoTransformer", {}),
    ("DemoTransformer", {"d_model": 512, "d_ff": 2048, "nlayers": 6, "seq_len": 256, "batch_size": 32,
                         "vocab_size": 8000}),
    ("TinyGPT", {"d_model": 128, "nlayers": 4, "seq_len": 64}),
    ("TinyGPT", {"d_model": 768, "nhead": 12, "nlayers": 8, "seq_len": 1024, "batch_size": 8, "vocab_size": 16000}),
    ("SmallCNN", {}),
    ("SmallCNN", {"channels": 64, "image_size": 128, "batch_size": 64}),
]

#: the zoo models as the tests build them (tiny, padded token batches: the estimate runs them on CPU), and at a
#: size where activations, not the runtime's workspaces, fill memory (no padding and no mask: the meta path)
_TOKENS = {"batch_size": 8, "seq_len": 512, "vocab_size": 8000, "padded": False}
_IMAGES = {"batch_size": 32, "image_size": 224, "padded": False}
ZOO_SIZES = [(f"{ZOO_PREFIX}{name}", {}) for name in ("gpt2", "llama", "bert", "t5", "vit", "resnet")] + [
    ("zoo:gpt2", {"config": {"n_embd": 512, "n_layer": 6, "n_head": 8, "n_positions": 512}, **_TOKENS}),
    ("zoo:llama", {"config": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 6,
                              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                              "max_position_embeddings": 512},
                   **_TOKENS}),
    ("zoo:bert", {"config": {"hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8,
                             "intermediate_size": 2048, "max_position_embeddings": 512}, **_TOKENS}),
    ("zoo:t5", {"config": {"d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 4, "num_decoder_layers": 4,
                           "num_heads": 8}, **_TOKENS}),
    ("zoo:vit", {"config": {"image_size": 224, "patch_size": 16, "hidden_size": 512, "num_hidden_layers": 6,
                            "num_attention_heads": 8, "intermediate_size": 2048}, **_IMAGES}),
    ("zoo:resnet", {"config": {"embedding_size": 64, "hidden_sizes": [64, 128, 256, 512], "depths": [2, 2, 2, 2]},
                    **_IMAGES}),
    # a mixture of experts (torch._grouped_mm on the GPU): not measured on a GPU yet
    ("zoo:mixtral", {"config": {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
                                "num_attention_heads": 8, "num_key_value_heads": 4, "num_local_experts": 8,
                                "max_position_embeddings": 512}, **_TOKENS}),
]


def reference_cases(kind: str = "all") -> list[dict]:
    """The cases the reference holds: ``kind`` "demo", "zoo" or "all"; every size in fp32 and bf16-mixed (the tiny
    zoo models in fp32 only: their step is the runtime's workspaces and little else)."""
    sizes = {"demo": DEMO_SIZES, "zoo": ZOO_SIZES, "all": DEMO_SIZES + ZOO_SIZES}[kind]
    return [{"model": model, "kwargs": kwargs, "precision": precision}
            for model, kwargs in sizes for precision in PRECISIONS
            if precision == "32-true" or not is_zoo(model) or kwargs]


def is_zoo(model: str) -> bool:
    return model.startswith(ZOO_PREFIX)


def build_case(case: dict):
    """The LightningModule of a reference case, seeded; its ``train_dataloader`` gives the batches."""
    torch.manual_seed(0)
    if is_zoo(case["model"]):
        return zoo_module(case["model"][len(ZOO_PREFIX):], **case["kwargs"])
    return DEMO_MODELS[case["model"]](**case["kwargs"])


def zoo_module(name: str, config: Optional[dict] = None, batch_size: int = 8, seq_len: Optional[int] = None,
               vocab_size: Optional[int] = None, image_size: Optional[int] = None, padded: bool = True):
    """A zoo model as a LightningModule (AdamW, the model's own loss), its tiny config updated with ``config`` and
    its batches at the given size (``None``: the zoo's)."""
    from tests.zoo.models import MOE, TOKEN_MODELS, ZooModule

    tokens = name in TOKEN_MODELS + MOE

    module = ZooModule(name, n_batches=5, batch_size=batch_size, padded=padded, optimizer="adamw", lr=1e-3)
    if config or vocab_size:
        model = module.model
        model.config.update({**(config or {}), **({"vocab_size": vocab_size} if vocab_size else {})})
        module.model = type(model)(model.config).train()
    if seq_len or vocab_size or image_size:
        vocab = module.model.config.vocab_size if tokens else None
        module.batches = [_batch(tokens, i, batch_size, seq_len, vocab, image_size, padded)
                          for i in range(5)]
    return module


def _batch(tokens: bool, seed: int, batch_size: int, seq_len: Optional[int], vocab: Optional[int],
           image_size: Optional[int], padded: bool) -> dict[str, Any]:
    """A batch as tests.zoo.models.make_batch makes it, at another sequence length, vocabulary or image size."""
    from tests.zoo.models import SEQ

    generator = torch.Generator().manual_seed(seed)
    if not tokens:
        side = image_size or 32
        return {"pixel_values": torch.randn(batch_size, 3, side, side, generator=generator),
                "labels": torch.randint(0, 5, (batch_size,), generator=generator)}
    seq = seq_len or SEQ
    ids = torch.randint(1, vocab, (batch_size, seq), generator=generator)
    mask = torch.ones(batch_size, seq, dtype=torch.long)
    if padded:  # as make_batch pads: rows of different lengths, the first unpadded
        for row in range(batch_size):
            mask[row, seq - (row * 5) % (seq // 2):] = 0
    if not padded:  # no mask: as a packed or fixed-length pipeline trains (and the estimate's meta path: reading a
        return {"input_ids": ids, "labels": ids}  # mask's values needs the CPU path)
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}
