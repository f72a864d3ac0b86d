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
from tests.models import Block, BlockStack, ConvBatchNormNet


# stays here: its calling convention (positional and keyword arguments, some None, a tuple back) is what the
# checkpointing tests below check
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


def test_the_blocks_between_a_stem_and_a_head_are_a_stack_and_a_run_of_one_is_not():
    # one Sequential holding a stem, three alike blocks and a head: the run of blocks; mixed neighbours are not a run
    model = nn.Sequential(nn.Linear(16, 8), Block(8), Block(8), Block(8), nn.Sequential(nn.LayerNorm(8)), Block(8))
    assert [name for name, _ in find_blocks(model)] == ["1", "2", "3"]
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    plain = copy.deepcopy(model)
    checkpointing = ActivationCheckpointing(model)
    checkpointing.set_level(3)
    assert checkpointing.checkpointed_names() == ["1", "2", "3"] and all(is_checkpointed(model[i]) for i in (1, 2, 3))
    for net in (model, plain):
        net(x).square().mean().backward()
    for (name, ours), theirs in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(ours.grad, theirs.grad), name


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
    assert block.forward.inner is user_forward  # wrapped once, around the user's forward
    x = torch.ones(2, 8, requires_grad=True)
    assert torch.equal(block(x), x * 2)
    uncheckpoint_module(block)
    assert block.forward is user_forward


def test_a_deep_copy_of_a_checkpointed_model_trains_its_own_blocks():
    model = BlockStack(width=8, depth=2)
    ActivationCheckpointing(model).set_level(2)
    twin = copy.deepcopy(model)  # an EMA copy, a copy to estimate on
    assert is_checkpointed(twin.blocks[0]) and is_checkpointed(twin.blocks[1])
    twin(torch.randn(3, 16)).sum().backward()
    assert all(p.grad is not None for p in twin.parameters())
    assert all(p.grad is None for p in model.parameters())  # the original's blocks were not run


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


# --- what a block's forward does besides its output: running buffers, caches -------------------------------------

# RunningScale, CachingBlock/CachingStack and FlaggedLayers stay here: each is one behaviour these tests check
class RunningScale(nn.Module):
    """Reads a buffer it updates in place in training (as a spectral norm's power iteration does): the output, and so
    the gradients, depend on the buffer's value at the forward."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x):
        y = self.lin(x)
        if self.training:
            with torch.no_grad():
                self.scale.mul_(0.5).add_(0.5 * y.abs().mean(0))
        return y / self.scale


def train_copies(model, batches, loss_fn, setup, steps=3):
    """Trains ``model`` and a copy that ``setup`` prepares (SGD with momentum): both copies' (parameters, gradients,
    buffers) after each step."""
    guarded = copy.deepcopy(model)
    setup(guarded)
    history = []
    for net in (model, guarded):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        states = []
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(net, batches[step]).backward()
            optimizer.step()
            states.append(({n: p.detach().clone() for n, p in net.named_parameters()},
                           {n: p.grad.clone() for n, p in net.named_parameters()},
                           {n: b.clone() for n, b in net.named_buffers()}))
        history.append(states)
    return history


def assert_same(reference, guarded, what=("parameters", "gradients", "buffers")):
    for kind, ref, got in zip(("parameters", "gradients", "buffers"), reference, guarded):
        if kind not in what:
            continue
        assert ref.keys() == got.keys()
        for name in ref:
            assert torch.equal(ref[name], got[name]), (kind, name)


def checkpoint_all(model):
    rung = ActivationCheckpointing(model)
    rung.set_level(rung.max_level)
    assert rung.level > 0
    return rung


def test_batchnorm_statistics_are_updated_once_per_checkpointed_step():
    torch.manual_seed(0)
    model = ConvBatchNormNet().train()
    batches = [torch.randn(6, 3, 8, 8) for _ in range(3)]
    plain, guarded = train_copies(model, batches, lambda net, x: net(x).square().mean(), checkpoint_all)
    for step, (ref, got) in enumerate(zip(plain, guarded)):
        assert_same(ref, got)
        assert got[2]["blocks.1.bn.num_batches_tracked"].item() == step + 1
    # the statistics did move: the comparison is not between two untouched buffers
    assert not torch.equal(guarded[-1][2]["blocks.0.bn.running_mean"], torch.zeros(8))


def test_a_buffer_the_forward_reads_is_restored_for_the_recomputation_once_learned():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(RunningScale(8), nn.ReLU()),
                          nn.Sequential(RunningScale(8), nn.ReLU()))
    batches = [torch.randn(5, 8) for _ in range(3)]
    plain, guarded = train_copies(model, batches, lambda net, x: net(x).square().mean(),
                                  lambda net: ActivationCheckpointing(net, blocks={RunningScale}).set_level(2))
    for ref, got in zip(plain, guarded):
        assert_same(ref, got, what=("buffers",))  # each forward updates the buffer once
    # the first checkpointed forward teaches which buffers change; from the second on, the recomputation starts
    # from the value the forward saw, so the gradients are the unguarded ones
    for ref, got in zip(plain[1:], guarded[1:]):
        assert_same(ref, got, what=("gradients",))


class CachingBlock(nn.Module):
    """Appends to a cache object it is given, like a transformers layer given a DynamicCache."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x, past_key_values=None, use_cache=False, layer_past=None):
        self.seen = (past_key_values, use_cache, layer_past)
        if past_key_values is not None:
            past_key_values.append(x.shape)
        return torch.relu(self.lin(x))


class CachingStack(nn.Module):
    def __init__(self, width=8, positional=False):
        super().__init__()
        self.positional = positional
        self.blocks = nn.ModuleList([CachingBlock(width), CachingBlock(width)])

    def forward(self, x, cache):
        for block in self.blocks:
            x = block(x, cache, True) if self.positional else block(x, past_key_values=cache, use_cache=True,
                                                                     layer_past=("k", "v"))
        return x


@pytest.mark.parametrize("positional", [False, True])
def test_a_checkpointed_training_call_gets_no_cache_and_use_cache_false(positional):
    model = CachingStack(positional=positional)
    rung = ActivationCheckpointing(model)
    rung.set_level(1)  # the first block only
    first, second = model.blocks
    cache = []
    model(torch.randn(2, 8, requires_grad=True), cache).sum().backward()
    assert first.seen[:2] == (None, False)  # seen by the recomputation too: it never got the cache
    assert first.seen[2] is None or positional
    assert second.seen[:2] == (cache, True)  # an unchecked block keeps it
    assert len(cache) == 1  # appended once, by the second block
    model.eval()
    cache.clear()
    model(torch.randn(2, 8), cache)
    assert first.seen[:2] == (cache, True) and len(cache) == 2  # outside training the call is as it was


# --- blocks the model checkpoints itself ---------------------------------------------------------------------------

def wrap_blocks(model, names):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    chosen = {id(model.get_submodule(name)) for name in names}
    apply_activation_checkpointing(model, check_fn=lambda module: id(module) in chosen)


def test_blocks_in_torch_checkpoint_wrappers_are_left_to_them():
    pytest.importorskip("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
    model = TinyGPT()
    wrap_blocks(model, ["h.1", "h.3"])
    rung = ActivationCheckpointing(model)
    assert [name for name, _ in rung.blocks] == ["h.0", "h.2"]
    assert rung.own_checkpointed == ["h.1", "h.3"]
    assert rung.unavailable_reason() is None
    assert [name for name, _ in find_blocks(model)] == ["h.0", "h.2"]

    wrap_blocks(model, ["h.0", "h.2"])
    rung = ActivationCheckpointing(model)
    assert rung.max_level == 0 and len(rung.own_checkpointed) == 4
    assert "checkpoints its blocks itself" in rung.unavailable_reason()


class FlaggedLayers(nn.Module):
    """A layer loop that checkpoints its layers itself when its ``gradient_checkpointing`` flag is set."""

    def __init__(self, width=8):
        super().__init__()
        self.gradient_checkpointing = False
        self.layers = nn.ModuleList(Block(width) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) \
                if self.gradient_checkpointing and self.training else layer(x)
        return x


def test_a_layer_loop_with_its_own_checkpointing_flag_is_left_to_it():
    model = nn.Sequential(FlaggedLayers(), nn.Linear(8, 1))
    assert ActivationCheckpointing(model).max_level == 3
    model[0].gradient_checkpointing = True
    rung = ActivationCheckpointing(model)
    assert rung.max_level == 0
    assert rung.own_checkpointed == ["0.layers.0", "0.layers.1", "0.layers.2"]
    assert rung.unavailable_reason().startswith("the model checkpoints its blocks itself")


# --- compiled models -----------------------------------------------------------------------------------------------

def test_a_compiled_model_or_submodule_makes_the_rung_unavailable():
    # building the compiled wrappers compiles nothing: that happens at the first call
    compiled_in_place = TinyGPT()
    compiled_in_place.h[2].compile()  # Module.compile() compiles one module in place
    for model in (torch.compile(TinyGPT()), nn.Sequential(torch.compile(TinyGPT()), nn.Identity()),
                  compiled_in_place):
        rung = ActivationCheckpointing(model)
        assert rung.max_level == 4  # the blocks are found (through OptimizedModule._orig_mod)
        assert "compiled with torch.compile" in rung.unavailable_reason()
    assert ActivationCheckpointing(TinyGPT()).unavailable_reason() is None
