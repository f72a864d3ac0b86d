"""The zoo's models estimated for a CPU target on the meta device, CPU autocast and the CPU's attention kernel
emulated, against real CPU steps under the same accounting: in bf16-mixed (a real step is slow on a CPU without
native bf16, the estimate on meta is not) and in fp32 with the CPU's fused attention (no s x s probabilities kept).
Models with frozen parameters (a LoRA, Whisper's fixed positions) get gradients and AdamW state for the trainable
ones only, and tied ones (Qwen2's head, Whisper's output projection) once, in the estimate as in a real step.
BART's decoder makes its own mask as a floating constant that transformers' mask helper reads; Wav2Vec2 sets
requires_grad on the batch's audio (so the batch gets a gradient) and takes a CTC loss, whose op has no meta kernel."""

import warnings

import pytest
import torch

from lightning_memguard.estimate import estimate_memory
from tests.helpers import one_intra_op_thread
from tests.zoo.models import MORE_FAMILIES, SIGNALS, STRUCTURES, TOKEN_MODELS, WIDER, ZOO, build, loss_of

CASES = [(name, padded, precision) for name in ZOO for padded in ((False, True) if name in TOKEN_MODELS else (False,))
         for precision in ("bf16-mixed", "32-true")
         if precision == "bf16-mixed" or (name in ("gpt2", "llama") and padded)]
CASES += [(name, True, precision) for name in MORE_FAMILIES + STRUCTURES + WIDER + SIGNALS
          for precision in ("bf16-mixed", "32-true")]
IDS = [f"{name}-{'padded' if padded else 'full'}-{precision}" for name, padded, precision in CASES]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_intra_op_thread():
        yield


@pytest.mark.parametrize("name, padded, precision", CASES, ids=IDS)
def test_a_cpu_estimate_on_meta_agrees_with_a_real_cpu_step(name, padded, precision):
    model, make = build(name)
    batch = make(0, padded=padded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on its configs
        meta = estimate_memory(model, batch, optimizer=torch.optim.AdamW, loss_fn=loss_of, precision=precision,
                               target="cpu", path="meta")
        cpu = estimate_memory(model, batch, optimizer=torch.optim.AdamW, loss_fn=loss_of, precision=precision,
                              target="cpu", path="cpu")
    assert (meta.path, cpu.path) == ("meta", "cpu")
    for phase, peak in cpu.phase_peaks.items():
        assert meta.phase_peaks[phase] == pytest.approx(peak, rel=0.01), phase
    assert meta.activations_bytes == pytest.approx(cpu.activations_bytes, rel=0.01)


@pytest.mark.parametrize("name", ["llama_lora", "whisper", "qwen2"])
def test_gradients_and_adamw_state_are_estimated_for_the_trainable_parameters_only_and_tied_ones_once(name):
    """The LoRA's base is frozen (its adapters are a few percent of the parameters); Whisper's encoder positions are
    a fixed parameter, its output projection the decoder's embedding; Qwen2 ties its head to its embedding. AdamW
    built on every parameter keeps state only for those that get a gradient, one for a tied pair: the estimate says
    what a real AdamW step on the same model and batch holds."""
    model, make = build(name)
    batch = make(0)
    trainable = [p for p in model.parameters() if p.requires_grad]  # a tied parameter is listed once
    assert trainable and (name == "qwen2" or not all(p.requires_grad for p in model.parameters()))
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimate = estimate_memory(model, batch, optimizer=torch.optim.AdamW, loss_fn=loss_of, target="cpu",
                                   path="meta")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)  # every parameter, as most training code builds it
    loss_of(model, batch).backward()
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert set(map(id, optimizer.state)) == set(map(id, trainable))
    held = sum(t.untyped_storage().nbytes() for t in state)
    assert estimate.parameters_bytes == sum(t.untyped_storage().nbytes() for t in (*model.parameters(),
                                                                                     *model.buffers()))
    assert estimate.gradients_bytes == trainable_bytes
    # the two moments of each trainable parameter, and its step counter (a 4-byte scalar)
    assert estimate.optimizer_state_bytes == held == 2 * trainable_bytes + 4 * len(trainable)
