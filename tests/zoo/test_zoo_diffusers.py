"""diffusers models (tests/zoo/diffusers_models.py) as Lightning users train them: a DDPM UNet, a Stable-Diffusion-style
conditional UNet with cross-attention, an AutoencoderKL and a diffusion transformer.

- the checkpointing rung finds the repeated blocks (ResNet blocks, attention layers, whole encoder and decoder
  blocks, transformer blocks), and training with all of them checkpointed is bit-identical — dropout on, the noise
  drawn in the training step;
- the CPU estimate on meta equals a real CPU step byte for byte, in fp32 and bf16 (GroupNorm of the channels-last
  residual diffusers' attention blocks hand on, the convolutions after it, the MSE loss's input-sized buffer), also
  with diffusers' own gradient checkpointing on, which the CUDA estimate now runs too;
- the noise is drawn from torch's generator in the step: a guarded fit whose estimates never act trains as the
  unguarded one, an out-of-memory step rescued by checkpointing draws the noise the failed attempt drew, and
  micro-batches are the whole batch's step where the batch carries its noise (drawn in the step, each micro-batch
  draws its own);
- a fit under a budget is planned to fit and stays under it.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_memguard import MemGuardCallback, estimate_memory
from lightning_memguard.estimate import EstimateFallbackWarning
from lightning_memguard.mitigations.checkpointing import ActivationCheckpointing, find_blocks
from tests.helpers import fit_module, one_intra_op_thread
from tests.zoo.diffusers_models import BATCH, DIFFUSERS, SHAPES, DiffusionModule, build, loss_of, make_batch, state_of

EXPECTED_BLOCKS = {
    # the ResNet blocks and spatial attention layers of each level, the mid block's ResNet blocks (its single
    # attention layer is no run): the levels' blocks are of different classes, so their children are the runs
    "unet": ["down_blocks.0.resnets.0", "down_blocks.1.attentions.0", "down_blocks.1.resnets.0",
             "up_blocks.0.attentions.0", "up_blocks.0.resnets.0", "up_blocks.1.resnets.0", "mid_block.resnets.0",
             "down_blocks.0.resnets.1", "down_blocks.1.attentions.1", "down_blocks.1.resnets.1",
             "up_blocks.0.attentions.1", "up_blocks.0.resnets.1", "up_blocks.1.resnets.1", "mid_block.resnets.1",
             "up_blocks.0.attentions.2", "up_blocks.0.resnets.2", "up_blocks.1.resnets.2"],
    # the cross-attention Transformer2DModels of the attention levels beside their ResNet blocks
    "sd_unet": ["down_blocks.0.attentions.0", "down_blocks.0.resnets.0", "down_blocks.1.resnets.0",
                "up_blocks.0.resnets.0", "up_blocks.1.attentions.0", "up_blocks.1.resnets.0", "mid_block.resnets.0",
                "down_blocks.0.attentions.1", "down_blocks.0.resnets.1", "down_blocks.1.resnets.1",
                "up_blocks.0.resnets.1", "up_blocks.1.attentions.1", "up_blocks.1.resnets.1", "mid_block.resnets.1",
                "up_blocks.0.resnets.2", "up_blocks.1.attentions.2", "up_blocks.1.resnets.2"],
    # the encoder's and decoder's levels whole (one class each), and their mid blocks' ResNet blocks
    "vae": ["encoder.down_blocks.0", "encoder.mid_block.resnets.0", "decoder.up_blocks.0",
            "decoder.mid_block.resnets.0", "encoder.down_blocks.1", "encoder.mid_block.resnets.1",
            "decoder.up_blocks.1", "decoder.mid_block.resnets.1"],
    "dit": ["transformer_blocks.0", "transformer_blocks.1", "transformer_blocks.2"],
}
LADDER = ("checkpointing", "microbatch")  # no AMP: a machine's bf16 support must not change the numerics


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module", autouse=True)
def lazy_imports_done():
    """diffusers imports some of its modules at their first use; one (the resampling kernels) makes small tensors at
    import, which the first estimate of a CPU step would count as made by the step (16 bytes). One step of each model
    first."""
    for name in DIFFUSERS:
        loss_of(build(name), make_batch(name, 0, batch_size=2)).backward()


def quiet(call, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fits' notices of a CPU run
        return call(*args, **kwargs)


@pytest.mark.parametrize("name", DIFFUSERS)
def test_finds_the_repeated_blocks_of_each_diffusers_model(name):
    assert [block for block, _ in find_blocks(build(name))] == EXPECTED_BLOCKS[name]


def train(model, name, steps=2):
    """Plain-loop AdamW on fresh batches, the noise drawn in the step (seeded the same for every run)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, make_batch(name, step)).backward()
        optimizer.step()
    return state_of(model)


@pytest.mark.parametrize("name", DIFFUSERS)
def test_training_with_every_block_checkpointed_is_bit_identical(name):
    """Dropout on in the UNets: torch's checkpoint recomputes a block with the generator state its forward saw."""
    torch.manual_seed(1)
    model = build(name, dropout=0.1)
    guarded = build(name, dropout=0.1)
    guarded.load_state_dict(model.state_dict())
    rung = ActivationCheckpointing(guarded)
    rung.set_level(rung.max_level)
    assert rung.checkpointed_names() == EXPECTED_BLOCKS[name]

    expected, got = train(model, name), train(guarded, name)

    for key in expected:
        assert torch.equal(expected[key], got[key]), key


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("name", DIFFUSERS)
def test_a_cpu_estimate_on_meta_equals_a_real_cpu_step(name, precision):
    """Byte for byte: diffusers' spatial attention hands on a channels-last residual, which the CPU's GroupNorm and
    convolutions keep (the VAE was 2 % low before); the MSE loss keeps an input-sized buffer; a bf16 GroupNorm's input
    gradient is bf16 (meta's kernel made it fp32, then a bf16 copy). One known gap: a LayerNorm without weights (DiT's)
    keeps its mean and reciprocal deviation in bf16 on the CPU, in fp32 on meta (as CUDA does)."""
    module = DiffusionModule(name)
    batch = make_batch(name, 0)
    meta = estimate_memory(module, batch, precision=precision, target="cpu", path="meta")
    cpu = estimate_memory(module, batch, precision=precision, target="cpu", path="cpu")
    assert (meta.path, cpu.path) == ("meta", "cpu")
    gap = 0
    if precision == "bf16-mixed":
        rows = [m for m in module.modules() if isinstance(m, torch.nn.LayerNorm) and m.weight is None]
        gap = len(rows) * 2 * 2 * (BATCH * (SHAPES["dit"][1] // 2) ** 2)  # two statistics, 2 bytes more a row
    assert meta.activations_bytes == cpu.activations_bytes + gap
    for phase, peak in cpu.phase_peaks.items():
        assert meta.phase_peaks[phase] in (peak, peak + gap), phase


@pytest.mark.parametrize("name", DIFFUSERS)
def test_a_cuda_estimate_runs_on_meta_through_diffusers_attention_processors(name):
    """No GPU, no fallback: SDPA of diffusers' AttnProcessor2_0 goes to the fused kernel CUDA picks, on meta."""
    module = DiffusionModule(name)
    for precision in ("32-true", "bf16-mixed"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", EstimateFallbackWarning)
            estimate = estimate_memory(module, make_batch(name, 0), precision=precision, target="cuda")
        assert estimate.path == "meta" and estimate.activations_bytes > 0


@pytest.mark.parametrize("name", ["unet", "sd_unet", "vae", "dit"])
def test_diffusers_own_gradient_checkpointing_is_estimated_on_meta_for_both_targets(name):
    """``enable_gradient_checkpointing()``: torch's checkpoint in diffusers' forwards recomputes in the backward, where
    the estimate's kernel model (a torch function mode) is not active — it raised CheckpointError (or mixed dtypes) on
    meta, for every CUDA estimate. The rung leaves those blocks to the model and says so."""
    module = DiffusionModule(name)
    plain = estimate_memory(module, make_batch(name, 0), target="cpu", path="cpu").activations_bytes
    module.model.enable_gradient_checkpointing()
    reason = ActivationCheckpointing(module.model).unavailable_reason()
    assert reason.startswith("the model checkpoints its blocks itself") and "diffusers'" in reason
    batch = make_batch(name, 0)

    cpu = estimate_memory(module, batch, target="cpu", path="cpu")
    meta = estimate_memory(module, batch, target="cpu", path="meta")
    assert meta.phase_peaks == cpu.phase_peaks and meta.activations_bytes == cpu.activations_bytes < plain
    half_cpu = estimate_memory(module, batch, target="cpu", path="cpu", precision="bf16-mixed")
    half_meta = estimate_memory(module, batch, target="cpu", path="meta", precision="bf16-mixed")
    for phase, peak in half_cpu.phase_peaks.items():
        assert half_meta.phase_peaks[phase] == pytest.approx(peak, rel=0.01), phase
    for precision in ("32-true", "bf16-mixed"):
        assert estimate_memory(module, batch, target="cuda", precision=precision).path == "meta"


def fit(root, guard=None, **module):
    """A Trainer fit of a DiffusionModule (seeded the same for every run); the module after it."""
    torch.manual_seed(0)
    trained = DiffusionModule(**module)
    torch.manual_seed(1)
    quiet(fit_module, trained, [guard] if guard is not None else [], root, max_steps=len(trained.batches))
    return trained


def test_a_guarded_fit_whose_estimates_never_act_trains_as_the_unguarded_one(tmp_path):
    """With a budget the guard estimates the first batch: that runs the training step on a copy, drawing noise from
    the same generator as training (the batch is real, so on meta too). The generators are put back after it."""
    expected = state_of(fit(tmp_path / "plain", name="unet", dropout=0.1))
    guard = MemGuardCallback(budget="4GiB", explain=False)

    got = state_of(fit(tmp_path / "guarded", guard, name="unet", dropout=0.1))

    assert guard.events.empty
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def monitored_peak(root, name, step=0):
    guard = MemGuardCallback(mitigations=(), cpu_sample_every=1, explain=False)
    fit(root, guard, name=name, dropout=0.1)
    history = guard.history
    return int(history.loc[history["step"] == step, "peak_bytes"].max())


def test_an_oom_rescued_by_checkpointing_draws_the_noise_the_failed_attempt_drew(tmp_path):
    """The first step runs out of memory in its forward (a real CPU hard limit), is rescued by checkpointed blocks
    and runs again: torch's generators are put back with the running buffers, so the retry draws the same noise,
    timesteps and dropout masks, and the fit is the unguarded one bit for bit."""
    limit = int(0.85 * monitored_peak(tmp_path / "probe", "unet"))
    expected = state_of(fit(tmp_path / "plain", name="unet", dropout=0.1))
    guard = MemGuardCallback(budget=limit, cpu_hard_limit=limit, mitigations=("checkpointing",), plan_at_start=False,
                             threshold=1.0, explain=False)

    got = state_of(fit(tmp_path / "guarded", guard, name="unet", dropout=0.1))

    assert guard.events["action"].tolist()[:1] == ["rescue"] and guard.levels["checkpointing"] >= 1
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


@pytest.mark.parametrize("carried", [True, False], ids=["noise-in-the-batch", "noise-drawn-in-the-step"])
def test_micro_batches_are_the_whole_batch_step_where_the_batch_carries_its_noise(tmp_path, carried):
    """The MSE over the noise is a mean over samples, each of the same size: weighted by their share of samples, the
    micro-batches' gradients add up to the whole batch's (up to rounding) — given the same noise and timesteps. Drawn
    in ``training_step`` (as diffusers' scripts do), each micro-batch draws its own: another draw of the same
    distribution, not the whole batch's numbers."""
    module = DiffusionModule("sd_unet", carried=carried)
    peak = estimate_memory(module, module.batches[0], target="cpu").peak_bytes
    expected = fit(tmp_path / "plain", name="sd_unet", carried=carried)
    guard = MemGuardCallback(budget=int(0.8 * peak), mitigations=("microbatch",), explain=False)

    got = fit(tmp_path / "guarded", guard, name="sd_unet", carried=carried)

    assert guard.levels["microbatch"] >= 1 and (guard.history["micro_batches"] > 1).any()
    difference = max((p - q).abs().max().item() for p, q in zip(expected.parameters(), got.parameters()))
    assert (difference < 1e-4) if carried else (difference > 1e-4)


@pytest.mark.parametrize("name", ["unet", "vae"])
def test_a_fit_under_a_budget_of_0_6_the_monitored_peak_is_planned_to_fit(tmp_path, name):
    limit = int(0.6 * monitored_peak(tmp_path / "probe", name, step=1))
    guard = MemGuardCallback(budget=limit, cpu_hard_limit=limit, mitigations=LADDER, rescue_oom=False,
                             explain=False)

    fit(tmp_path / "guarded", guard, name=name, dropout=0.1)

    events = guard.events
    assert events["action"].iloc[0] == "plan" and events["step"].iloc[0] == 0
    assert not {"rescue", "gave_up", "cannot_help", "exhausted"} & set(events["action"]), events
    assert (guard.history["peak_bytes"] <= limit).all()
