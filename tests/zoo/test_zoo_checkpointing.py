"""The checkpointing rung on the zoo's transformers models: the blocks it finds, training with every block
checkpointed equal to the unguarded run bit for bit (parameters, gradients, buffers; padded token batches, so that
decoders materialise their masks and hand each block a key/value cache), models that checkpoint themselves, and
compiled models."""

import copy
import warnings

import pytest
import torch

from lightning_memguard.guard.ladder import Ladder
from lightning_memguard.mitigations.checkpointing import ActivationCheckpointing, find_blocks, is_checkpointed
from tests.helpers import one_intra_op_thread
from tests.zoo.models import MORE_FAMILIES, STRUCTURES, ZOO, ZooModule, build

EXPECTED_BLOCKS = {
    "gpt2": ["transformer.h.0", "transformer.h.1", "transformer.h.2"],
    "llama": ["model.layers.0", "model.layers.1", "model.layers.2"],
    "bert": ["bert.encoder.layer.0", "bert.encoder.layer.1", "bert.encoder.layer.2"],
    "t5": ["encoder.block.0", "decoder.block.0", "encoder.block.1", "decoder.block.1"],
    "vit": ["vit.layers.0", "vit.layers.1", "vit.layers.2"],
    "resnet": ["resnet.encoder.stages.0", "resnet.encoder.stages.1"],
    "whisper": ["model.encoder.layers.0", "model.decoder.layers.0", "model.encoder.layers.1",
                "model.decoder.layers.1"],
    "llama_lora": ["base_model.model.model.layers.0", "base_model.model.model.layers.1",
                   "base_model.model.model.layers.2"],  # the decoder layers inside peft's wrappers
    "qwen2": ["model.layers.0", "model.layers.1", "model.layers.2"],
    "mistral": ["model.layers.0", "model.layers.1", "model.layers.2"],
    "bart": ["model.encoder.layers.0", "model.decoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.1"],
    # the convolutional feature encoder's layers after its first (which normalises, the others do not: a run of one
    # class), beside the transformer layers
    "wav2vec2": ["wav2vec2.feature_extractor.conv_layers.1", "wav2vec2.encoder.layers.0",
                 "wav2vec2.feature_extractor.conv_layers.2", "wav2vec2.encoder.layers.1"],
    "clip": ["text_model.encoder.layers.0", "vision_model.encoder.layers.0", "text_model.encoder.layers.1",
             "vision_model.encoder.layers.1"],  # both towers
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_intra_op_thread():
        yield


@pytest.mark.parametrize("name", ZOO + MORE_FAMILIES + STRUCTURES)
def test_finds_the_repeated_blocks_of_every_zoo_model(name):
    model, _ = build(name)
    assert [block for block, _ in find_blocks(model)] == EXPECTED_BLOCKS[name]


def train(model, make, steps=3, **call):
    """Plain-loop SGD with momentum; the parameters, gradients and buffers after the last step, and how many tensors
    the first forward kept for backward outside checkpointed regions."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kept = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(1) or t, lambda t: t)
        with hooks if step == 0 else torch.enable_grad():
            loss = model(**make(step, batch_size=4), **call).loss
        loss.backward()
        optimizer.step()
    state = ({n: p.detach() for n, p in model.named_parameters()}, {n: p.grad for n, p in model.named_parameters()},
             dict(model.named_buffers()))
    return state, len(kept)


@pytest.mark.parametrize("name", ZOO + MORE_FAMILIES + STRUCTURES)
def test_training_with_every_block_checkpointed_is_bit_identical(name):
    model, make = build(name)
    guarded = copy.deepcopy(model)
    rung = ActivationCheckpointing(guarded)
    rung.set_level(rung.max_level)
    assert rung.unavailable_reason() is None and rung.checkpointed_names() == EXPECTED_BLOCKS[name]

    got, kept_guarded = train(guarded, make)
    # T5 is compared with its unguarded run without a cache: a checkpointed call drops the cache (as transformers'
    # own checkpointing does), and T5's cache changes the unguarded gradients by rounding (the cached keys are a
    # contiguous copy, so attention's matmuls take another path). GPT-2 and Llama match their cached runs exactly.
    expected, kept_plain = train(model, make, **({"use_cache": False} if name == "t5" else {}))

    assert kept_guarded < kept_plain  # the blocks really were checkpointed: their activations were not kept
    for kind, ref, new in zip(("parameter", "gradient", "buffer"), expected, got):
        assert ref.keys() == new.keys()
        for key in ref:
            if ref[key] is None:  # a frozen parameter's gradient (Whisper's positions, a LoRA's base): none in both
                assert new[key] is None and kind == "gradient", (kind, key)
            else:
                assert torch.equal(ref[key], new[key]), (kind, key)
    if name == "resnet":  # the running statistics moved once per step, in both runs
        assert int(got[2]["resnet.encoder.stages.0.layers.0.layer.0.normalization.num_batches_tracked"]) == 3


def ladder_warnings(model):
    warnings = []
    ladder = Ladder(("checkpointing",), 0.9, None, 0.05, warn=warnings.append)
    ladder.setup(model, torch.device("cpu"), None)
    assert "checkpointing" not in ladder.rungs
    return warnings


def enable_own_checkpointing(model):
    """transformers' own gradient checkpointing, switched on the way most code does it (the name is a deprecated
    alias of ``activation_checkpointing_enable`` since transformers 5; both set the same per-layer flags)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def test_llama_with_its_own_gradient_checkpointing_turns_the_rung_off_with_the_reason():
    model, _ = build("llama")
    enable_own_checkpointing(model)
    rung = ActivationCheckpointing(model)
    assert rung.max_level == 0
    assert rung.own_checkpointed == EXPECTED_BLOCKS["llama"]
    reason = rung.unavailable_reason()
    assert reason.startswith("the model checkpoints its blocks itself")
    assert ladder_warnings(model) == [f"lightning-memguard: the checkpointing rung is off for this run: {reason}."]


def test_blocks_the_model_checkpoints_itself_are_left_out_and_the_others_checkpointed_once():
    model, make = build("llama")
    guarded = copy.deepcopy(model)
    enable_own_checkpointing(guarded)
    guarded.model.layers[1].gradient_checkpointing = False  # the per-layer switch: layers 0 and 2 stay the model's

    rung = ActivationCheckpointing(guarded)
    assert [block for block, _ in rung.blocks] == ["model.layers.1"]
    assert rung.own_checkpointed == ["model.layers.0", "model.layers.2"]
    assert rung.unavailable_reason() is None
    rung.set_level(1)
    assert is_checkpointed(guarded.model.layers[1]) and not is_checkpointed(guarded.model.layers[0])

    got, kept_guarded = train(guarded, make)
    expected, kept_plain = train(model, make)
    assert kept_guarded < kept_plain
    for ref, new in zip(expected, got):
        for key in ref:
            assert torch.equal(ref[key], new[key]), key


def test_a_compiled_model_turns_the_rung_off_with_the_reason():
    model, _ = build("gpt2")
    compiled = torch.compile(model)  # compiles at its first call, which this test never makes
    reason = ActivationCheckpointing(compiled).unavailable_reason()
    assert reason.startswith("the model is compiled with torch.compile")
    assert ladder_warnings(compiled) == [f"lightning-memguard: the checkpointing rung is off for this run: {reason}."]

    module = ZooModule("gpt2", n_batches=1)
    assert ActivationCheckpointing(module).unavailable_reason() is None
    module.model = torch.compile(module.model)  # a LightningModule holding a compiled model
    # the same reason, naming where the compiled code is
    assert ActivationCheckpointing(module).unavailable_reason() == reason.replace("GPT2LMHeadModel (", "model (")
