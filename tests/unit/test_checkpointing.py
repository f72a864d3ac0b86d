"""Activation checkpointing on real modules: gradients, identity of parameters and keys, reversibility."""

import copy

import pytest
import torch
from torch import nn

from lightning_memguard.commands.demo import DemoTransformer
from lightning_memguard.mitigations.checkpointing import (
    ActivationCheckpointing,
    checkpoint_module,
    find_blocks,
    is_checkpointed,
    uncheckpoint_module,
)
from lightning_memguard.sources import CpuTensorAccountant
from tests.models import Block, BlockStack


class GPTBlock(nn.Module):
    """Takes positional and keyword arguments, some None, and returns a tuple, like common transformer blocks."""

    def __init__(self, width):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True, dropout=0.1)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.ln = nn.LayerNorm(width)

    def forward(self, x, attn_mask=None, *, scale=1.0, cache=None):
        h = self.ln(x)
        x = x + self.attn(h, h, h, attn_mask=attn_mask, need_weights=False)[0]
        return x + scale * self.mlp(x), cache


class TinyGPT(nn.Module):
    def __init__(self, width=32, depth=4):
        super().__init__()
        self.embed = nn.Embedding(50, width)
        self.h = nn.ModuleList(GPTBlock(width) for _ in range(depth))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 50))  # mixed classes: not a stack

    def forward(self, tokens):
        x = self.embed(tokens)
        mask = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), 1)
        for block in self.h:
            x, _ = block(x, mask, scale=0.5, cache=None)
        return self.head(x)


def test_detects_the_encoder_and_decoder_stacks_of_the_demo_transformer():
    names = [name for name, _ in find_blocks(DemoTransformer(nlayers=3))]
    assert names == ["model.transformer.encoder.layers.0", "model.transformer.decoder.layers.0",
                     "model.transformer.encoder.layers.1", "model.transformer.decoder.layers.1",
                     "model.transformer.encoder.layers.2", "model.transformer.decoder.layers.2"]


def test_detects_gpt_blocks_and_skips_mixed_or_leaf_sequences():
    assert [name for name, _ in find_blocks(TinyGPT())] == ["h.0", "h.1", "h.2", "h.3"]
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == []  # leaves are not blocks


def test_blocks_by_class_or_predicate_skip_nested_matches():
    model = TinyGPT()
    by_class = [name for name, _ in find_blocks(model, {GPTBlock, nn.Linear})]
    assert by_class == ["h.0", "h.1", "h.2", "h.3", "head.1"]  # the Linears inside blocks are not listed again
    by_name = [name for name, _ in find_blocks(model, lambda name, m: name in ("h.1", "h.3"))]
    assert by_name == ["h.1", "h.3"]
    with pytest.raises(ValueError, match="blocks="):
        find_blocks(model, set())


def run_step(model, tokens):
    torch.manual_seed(1)  # dropout draws the same masks in both runs
    model.zero_grad(set_to_none=True)
    loss = model(tokens).logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_checkpointing_keeps_parameters_keys_types_and_gives_the_same_gradients():
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 50, (4, 12))
    ids = {name: id(p) for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    types = [type(m) for m in model.modules()]

    rung = ActivationCheckpointing(model)
    rung.set_level(rung.max_level)
    assert rung.checkpointed_names() == ["h.0", "h.1", "h.2", "h.3"]
    loss, grads = run_step(model, tokens)
    ref_loss, ref_grads = run_step(reference, tokens)

    assert torch.equal(loss, ref_loss)
    for name in ref_grads:
        assert torch.equal(grads[name], ref_grads[name]), name
    assert {name: id(p) for name, p in model.named_parameters()} == ids
    assert list(model.state_dict()) == keys
    assert [type(m) for m in model.modules()] == types


def test_checkpointing_lowers_what_the_forward_keeps_and_undoing_restores_it():
    model = BlockStack(width=64, depth=6)
    x = torch.randn(256, 16)

    def graph_bytes():
        acc = CpuTensorAccountant()
        acc.track(model.parameters())
        start = acc.read().allocated_bytes
        with acc:
            out = model(x)
            kept = acc.read().allocated_bytes - start
        del out
        return kept

    plain = graph_bytes()
    rung = ActivationCheckpointing(model)
    rung.set_level(3)
    half = graph_bytes()
    rung.set_level(6)
    full = graph_bytes()
    rung.set_level(0)
    assert graph_bytes() == plain
    assert not any(is_checkpointed(m) for m in model.blocks)
    # each checkpointed block keeps its input only instead of ~10 activations of the same size
    assert full < half < plain
    assert plain - half == pytest.approx(half - full, rel=0.05)  # the saving is per block


def test_checkpoint_module_is_idempotent_and_respects_a_user_forward():
    block = Block(8)
    user_forward = lambda x: x * 2  # noqa: E731
    block.forward = user_forward
    checkpoint_module(block)
    checkpoint_module(block)
    assert block.forward._memguard_inner is user_forward  # wrapped once, around the user's forward
    x = torch.ones(2, 8, requires_grad=True)
    assert torch.equal(block(x), x * 2)
    uncheckpoint_module(block)
    assert block.forward is user_forward


def test_eval_and_no_grad_run_the_plain_forward():
    model = BlockStack(width=16, depth=2)
    rung = ActivationCheckpointing(model)
    rung.set_level(2)
    x = torch.randn(4, 16)
    model.eval()
    with torch.no_grad():
        out = model(x)
    assert out.shape == (4, 1)


def test_no_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="no blocks to checkpoint in Linear"):
        ActivationCheckpointing(nn.Linear(2, 2))
