"""diffusers models people train, built from tiny configs with random weights (no downloads), and the LightningModule
that trains them as the diffusers example scripts do.

:data:`DIFFUSERS` names them: ``"unet"`` (``UNet2DModel``, DDPM: noise prediction on images, ResNet blocks with
GroupNorm and spatial self-attention), ``"sd_unet"`` (``UNet2DConditionModel``: latents, cross-attention to text
embeddings, as Stable Diffusion trains), ``"vae"`` (``AutoencoderKL``: reconstruction loss and a small KL term, the
latent sampled) and ``"dit"`` (``DiTTransformer2DModel``: a class-conditional diffusion transformer on latents).

:class:`DiffusionModule` draws the noise and the timesteps in ``training_step`` from torch's global generator
(``torch.randn_like``, ``torch.randint``), as the diffusers scripts do, unless the batch carries them
(``carried=True``: drawn by the data, the same numbers whatever runs the step). ``dropout`` turns the UNets' dropout
on (0 elsewhere, as the transformers zoo does), so that a rescued step can be checked to draw what the failed attempt
drew.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.models import pl

diffusers = pytest.importorskip("diffusers")

DIFFUSERS = ("unet", "sd_unet", "vae", "dit")
TIMESTEPS = 100
BATCH = 8
#: what each model trains on: (channels, size) of its images or latents
SHAPES = {"unet": (3, 16), "sd_unet": (4, 16), "vae": (3, 16), "dit": (4, 8)}
TEXT_TOKENS, TEXT_DIM, CLASSES = 8, 24, 10


def build(name: str, dropout: float = 0.0) -> torch.nn.Module:
    """A tiny diffusers model, random weights. The UNets have two ResNet blocks a level (as DDPM and Stable Diffusion:
    runs of them for the checkpointing rung) and 8-wide attention heads (a fused attention kernel's alignment)."""
    d = diffusers
    if name == "unet":
        return d.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=2,
                             block_out_channels=(16, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                             up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8, attention_head_dim=8,
                             dropout=dropout)
    if name == "sd_unet":  # attention_head_dim is the number of heads in this class
        return d.UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=2,
                                      block_out_channels=(16, 32),
                                      down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                      up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=TEXT_DIM,
                                      norm_num_groups=8, attention_head_dim=2, dropout=dropout)
    if name == "vae":
        return d.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                               up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32),
                               latent_channels=4, norm_num_groups=8, sample_size=16, layers_per_block=2)
    if name == "dit":
        return d.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                       num_layers=3, sample_size=8, patch_size=2, num_embeds_ada_norm=CLASSES,
                                       norm_num_groups=8)
    raise ValueError(f"unknown diffusers model {name!r}; allowed: {DIFFUSERS}")


def make_batch(name: str, seed: int, batch_size: int = BATCH, carried: bool = False) -> dict:
    """A batch of ``name``'s training data: ``images`` (or ``latents``), ``text`` embeddings for the conditional UNet,
    ``class_labels`` for DiT; with ``carried`` its ``noise`` and ``timesteps`` too."""
    g = torch.Generator().manual_seed(seed)
    channels, size = SHAPES[name]
    x = torch.randn(batch_size, channels, size, size, generator=g)
    batch = {"latents" if name in ("sd_unet", "dit") else "images": x}
    if name == "sd_unet":
        batch["text"] = torch.randn(batch_size, TEXT_TOKENS, TEXT_DIM, generator=g)
    if name == "dit":
        batch["class_labels"] = torch.randint(0, CLASSES, (batch_size,), generator=g)
    if carried and name != "vae":
        batch["noise"] = torch.randn(x.shape, generator=g)
        batch["timesteps"] = torch.randint(0, TIMESTEPS, (batch_size,), generator=g)
    return batch


def loss_of(model: torch.nn.Module, batch: dict, scheduler=None) -> torch.Tensor:
    """The training loss of a diffusers model on a batch: noise-prediction MSE (noise and timesteps from the batch, else
    drawn here from torch's global generator), or the VAE's reconstruction MSE plus 1e-6 KL."""
    if "images" in batch and isinstance(model, diffusers.AutoencoderKL):
        posterior = model.encode(batch["images"]).latent_dist
        reconstruction = model.decode(posterior.sample()).sample
        return F.mse_loss(reconstruction, batch["images"]) + 1e-6 * posterior.kl().mean()
    x = batch.get("latents", batch.get("images"))
    noise = batch["noise"] if "noise" in batch else torch.randn_like(x)
    timesteps = batch["timesteps"] if "timesteps" in batch else torch.randint(0, TIMESTEPS, (x.shape[0],))
    scheduler = scheduler or diffusers.DDPMScheduler(num_train_timesteps=TIMESTEPS)
    noisy = scheduler.add_noise(x, noise, timesteps)
    if "text" in batch:
        prediction = model(noisy, timesteps, encoder_hidden_states=batch["text"]).sample
    elif "class_labels" in batch:
        prediction = model(noisy, timestep=timesteps, class_labels=batch["class_labels"]).sample
    else:
        prediction = model(noisy, timesteps).sample
    return F.mse_loss(prediction, noise)


class DiffusionModule(pl.LightningModule):
    """A diffusers model trained with AdamW on fixed batches, one optimizer step a batch."""

    def __init__(self, name: str, steps: int = 2, batch_size: int = BATCH, carried: bool = False,
                 dropout: float = 0.0, lr: float = 1e-3) -> None:
        super().__init__()
        self.model = build(name, dropout)
        self.scheduler = diffusers.DDPMScheduler(num_train_timesteps=TIMESTEPS)
        self.batches = [make_batch(name, seed, batch_size, carried) for seed in range(steps)]
        self.lr = lr

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.model, batch, self.scheduler)
        self.log("train_loss", loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(self.batches, batch_size=None, shuffle=False)


def state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in module.state_dict().items()}
