"""The meta kernels' memo on the transformers zoo: every estimate a plan makes (no block, one and all checkpointed, in
fp32 and bf16-mixed) is byte-identical with and without it — padded batches (the mask helpers' real tensors meet the
weights' meta ones), grouped-query attention, an encoder-decoder and a mixture of experts (``torch._grouped_mm``)."""

import pytest
import torch

from lightning_memguard.mitigations.checkpointing import find_blocks
from tests.helpers import assert_same_estimate, estimates_with_and_without_meta_memo
from tests.zoo.models import MOE, build, loss_of

CASES = [("gpt2", True), ("llama", True), ("llama", False), ("t5", True), *[(name, False) for name in MOE[:1]]]


@pytest.mark.parametrize("name, padded", CASES, ids=[f"{n}-{'padded' if p else 'full'}" for n, p in CASES])
def test_zoo_estimates_are_byte_identical_with_the_meta_memo(name, padded):
    model, make = build(name)
    pairs = estimates_with_and_without_meta_memo(model, make(0, padded=padded), len(find_blocks(model)),
                                                 optimizer=torch.optim.AdamW, loss_fn=loss_of, target="cuda")
    for memo, no_memo in pairs:
        assert memo.path == "meta"
        assert_same_estimate(memo, no_memo)
