"""The measured step replayed from the step before it, on the transformers zoo: every estimate a plan makes (no
block, one and all checkpointed, in fp32 and bf16-mixed) is byte-identical to the one that runs the step again, and
each is replayed — padded batches, grouped-query attention, an encoder-decoder, an audio encoder-decoder, a
mixture of experts with its router loss, a LoRA (frozen weights: no gradient for most parameters), BART, Wav2Vec2 with
its CTC loss, CLIP — and on CPU."""

import pytest
import torch

from lightning_memguard.mitigations.checkpointing import find_blocks
from tests.helpers import assert_same_estimate, estimates_replayed_and_run_again
from tests.zoo.models import MOE, STRUCTURES, build, loss_of

CASES = [("gpt2", "cuda"), ("llama", "cuda"), ("t5", "cuda"), ("whisper", "cuda"), ("llama_lora", "cuda"),
         *[(name, "cuda") for name in MOE[:1]], *[(name, "cuda") for name in STRUCTURES], ("bert", "cpu")]


@pytest.mark.parametrize("name, target", CASES, ids=[f"{n}-{t}" for n, t in CASES])
def test_zoo_estimates_replayed_are_those_run_again(name, target):
    model, make = build(name)
    precisions = ("32-true",) if target == "cpu" else ("32-true", "bf16-mixed")
    pairs, replays = estimates_replayed_and_run_again(model, make(0, padded=True), len(find_blocks(model)),
                                                      precisions=precisions, optimizer=torch.optim.AdamW,
                                                      loss_fn=loss_of, target=target)
    assert replays == len(pairs)
    for replayed, again in pairs:
        assert replayed.path == ("cpu" if target == "cpu" else "meta")
        assert_same_estimate(replayed, again)
