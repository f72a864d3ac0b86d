"""What an estimate and a retried step do to the random number generators, and what the meta path gets right that
diffusion models showed it missed (their zoo: tests/zoo/test_zoo_diffusers.py), here on plain torch modules:

- an estimate runs the training step on a copy; what it draws (dropout on CPU, noise drawn from the real batch on
  meta) is no longer taken from the generators training draws from;
- a batch run again after an out-of-memory error draws what the failed attempt drew;
- blocks a model checkpoints itself with ``torch.utils.checkpoint`` recompute under the estimate's kernel model
  (before: ``CheckpointError`` on meta and for every CUDA estimate);
- a channels-last activation through GroupNorm and convolutions, and an MSE loss (whose output keeps an input-sized
  buffer), are counted on meta as a real CPU step holds them.
"""

import random

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_memguard import estimate_memory
from tests.helpers import one_intra_op_thread, probe, run, train_unguarded


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_intra_op_thread():
        yield


class NoisyBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), nn.Dropout(0.2)

    def forward(self, x):
        return x + self.down(self.drop(F.gelu(self.up(x))))


class NoisyStack(nn.Module):
    """Residual blocks with dropout; ``own_checkpoints``: the model checkpoints its blocks itself, as transformers'
    and diffusers' gradient checkpointing do (``torch.utils.checkpoint`` in its forward)."""

    def __init__(self, width: int = 32, depth: int = 4, own_checkpoints: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.head = nn.Linear(8, width), nn.Linear(width, 8)
        self.blocks = nn.ModuleList(NoisyBlock(width) for _ in range(depth))
        self.own_checkpoints = own_checkpoints

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.own_checkpoints else block(x)
        return self.head(x)


def denoising_loss(model, batch):
    """Noise drawn in the step from torch's generator, as diffusion training does; Python's and NumPy's drawn too."""
    noise = torch.randn_like(batch) * (1 + 0 * random.random() + 0 * numpy.random.rand())
    return F.mse_loss(model(batch + noise), noise)


def generators():
    return torch.get_rng_state(), random.getstate(), numpy.random.get_state()


@pytest.mark.parametrize("target, path", [("cpu", "cpu"), ("cpu", "meta"), ("cuda", "meta")])
def test_an_estimate_leaves_the_random_number_generators_as_they_were(target, path):
    batch, model = torch.randn(16, 8), NoisyStack()
    torch.manual_seed(3)
    before = generators()

    estimate_memory(model, batch, loss_fn=denoising_loss, target=target, path=path)

    after = generators()
    assert torch.equal(before[0], after[0]) and before[1] == after[1]
    assert all(numpy.array_equal(a, b) for a, b in zip(before[2][1:3], after[2][1:3]))


def test_a_batch_run_again_after_an_oom_draws_what_the_failed_attempt_drew(tmp_path):
    """Rescued by checkpointed blocks, the retried step draws the same noise and dropout masks: the guarded run is
    the unguarded one bit for bit (before, the retry drew new numbers, and the whole run after it differed)."""
    batches = [torch.randn(256, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    peaks = probe("loop", NoisyStack(), batches, tmp_path / "probe", loss=denoising_loss)
    held = peaks.allocated("batch_start", from_step=1)
    limit = held + (peaks.highest(from_step=1) - held) * 3 // 4  # every step runs out of memory unless checkpointed

    guarded = run("loop", NoisyStack(), batches, tmp_path / "guarded", loss=denoising_loss, cpu_hard_limit=limit,
                  budget=limit, mitigations=("checkpointing",), plan_at_start=False, threshold=1.0, explain=False)
    expected = train_unguarded(NoisyStack(), batches, loss=denoising_loss)

    assert guarded.guard.events["action"].iloc[0] == "rescue"
    for (name, p), q in zip(guarded.model.named_parameters(), expected.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_blocks_a_model_checkpoints_itself_are_estimated_on_meta_for_either_target(precision):
    batch = torch.randn(16, 8)
    own = NoisyStack(own_checkpoints=True)
    cpu = estimate_memory(own, batch, loss_fn=denoising_loss, target="cpu", path="cpu", precision=precision)
    meta = estimate_memory(own, batch, loss_fn=denoising_loss, target="cpu", path="meta", precision=precision)
    assert meta.activations_bytes == cpu.activations_bytes
    for phase, peak in cpu.phase_peaks.items():  # bf16: 64 bytes more in the backward (a recomputed cast)
        assert meta.phase_peaks[phase] == (peak if precision == "32-true" else pytest.approx(peak, rel=0.001))
    plain = estimate_memory(NoisyStack(), batch, loss_fn=denoising_loss, target="cpu", path="meta",
                            precision=precision)
    assert meta.activations_bytes < plain.activations_bytes
    cuda = estimate_memory(own, batch, loss_fn=denoising_loss, target="cuda", precision=precision)
    assert cuda.path == "meta" and cuda.activations_bytes < estimate_memory(
        NoisyStack(), batch, loss_fn=denoising_loss, target="cuda", precision=precision).activations_bytes


class ChannelsLast(nn.Module):
    def forward(self, x):
        return x.contiguous(memory_format=torch.channels_last)  # as diffusers' spatial attention hands it on


def image_model(channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), *([ChannelsLast()] if channels_last else []),
                         nn.GroupNorm(8, 16), nn.SiLU(), nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(8, 16),
                         nn.Conv2d(16, 3, 1))


@pytest.mark.parametrize("loss", ["mse", "smooth_l1", "l1"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
def test_groupnorm_convolutions_and_mse_on_meta_hold_what_a_cpu_step_holds(channels_last, precision, loss):
    """Byte for byte. Before: the CPU's GroupNorm keeps a channels-last input as it is (meta copied it contiguous, and
    its backward copied input and gradient again), convolutions keep the format (meta's wrote contiguous), a bf16
    GroupNorm's input gradient is bf16 (meta's was fp32, then copied) and its statistics fp32; the MSE loss's output
    keeps the storage of the elementwise loss, input-sized, as long as the loss lives (meta's: 4 bytes)."""
    batch = torch.randn(8, 3, 32, 32)
    loss_fn = getattr(F, f"{loss}_loss")

    def step(model, b):
        return loss_fn(model(b), b)

    meta = estimate_memory(image_model(channels_last), batch, loss_fn=step, target="cpu", path="meta",
                           precision=precision)
    cpu = estimate_memory(image_model(channels_last), batch, loss_fn=step, target="cpu", path="cpu",
                          precision=precision)
    assert meta.phase_peaks == cpu.phase_peaks
    assert (meta.activations_bytes, meta.temporaries_bytes) == (cpu.activations_bytes, cpu.temporaries_bytes)


def test_an_mse_loss_on_cuda_holds_its_elementwise_buffer_and_a_temporary_of_the_same_size():
    """torch's MSE kernel (one structured kernel for every device) writes the elementwise loss into a temporary and
    reduces it into its output, made at the inputs' shape and resized to a scalar: both at once on the device, the
    output's buffer until the loss dies. The same step with an L1 loss (a composite: its own temporaries) for
    comparison: the MSE step's forward peak is one input-sized buffer above the plain conv output."""
    model = nn.Conv2d(64, 64, 1)
    batch = (torch.randn(16, 64, 32, 32), torch.randn(16, 64, 32, 32))  # 4 MiB each
    size = batch[0].numel() * 4
    meta = estimate_memory(model, batch, loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]), target="cuda")
    cpu = estimate_memory(model, batch, loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]), target="cuda", path="cpu")
    assert meta.phase_peaks == cpu.phase_peaks
    held = 3 * size + meta.runtime_bytes  # the batch's two tensors, the output
    assert meta.phase_peaks["forward"] - held >= 2 * size  # the loss's buffer and the kernel's temporary
