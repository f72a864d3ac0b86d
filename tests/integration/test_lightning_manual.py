"""MemGuardCallback under manual optimization, in real CPU Trainers: a small GAN in the usual Lightning 2.x way (two
optimizers, ``toggle_optimizer``, ``manual_backward``, ``opt.step()`` in ``training_step``) under a budget of 0.6x its
monitored step. What the ladder can do there it does — the checkpointing rung climbs, exact — and what it cannot is
said once each: micro-batches cannot split a step the module runs itself, an OOM cannot be run again, and no estimate
runs a step that calls the Trainer's optimizers (the plan says so, not that the batch "does not fit")."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_memguard import MemGuardCallback
from tests.helpers import assert_same_state, budget_for_a_share_of_the_step, fit_module, probe_module
from tests.models import Block, pl, regression_dataset


class SmallGAN(pl.LightningModule):
    """A generator and a discriminator of 3 residual blocks each, trained alternately on batches of 128 real
    samples with seeded noise; no dropout or BatchNorm, so checkpointing is exact."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(8, 64), *[Block(64) for _ in range(3)], nn.Linear(64, 16))
        self.discriminator = nn.Sequential(nn.Linear(16, 64), *[Block(64) for _ in range(3)], nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        real, _ = batch
        size = real.shape[0]
        generator_optimizer, discriminator_optimizer = self.optimizers()
        noise = torch.randn(size, 8, generator=torch.Generator().manual_seed(batch_idx))
        bce = nn.functional.binary_cross_entropy_with_logits

        self.toggle_optimizer(generator_optimizer)
        fake = self.generator(noise)
        generator_loss = bce(self.discriminator(fake), torch.ones(size, 1))
        generator_optimizer.zero_grad()
        self.manual_backward(generator_loss)
        generator_optimizer.step()
        self.untoggle_optimizer(generator_optimizer)

        self.toggle_optimizer(discriminator_optimizer)
        discriminator_loss = (bce(self.discriminator(real), torch.ones(size, 1))
                              + bce(self.discriminator(fake.detach()), torch.zeros(size, 1))) / 2
        discriminator_optimizer.zero_grad()
        self.manual_backward(discriminator_loss)
        discriminator_optimizer.step()
        self.untoggle_optimizer(discriminator_optimizer)
        self.log_dict({"generator_loss": generator_loss, "discriminator_loss": discriminator_loss})

    def configure_optimizers(self):
        return [torch.optim.Adam(self.generator.parameters(), lr=1e-3),
                torch.optim.Adam(self.discriminator.parameters(), lr=1e-3)]

    def train_dataloader(self):
        return DataLoader(regression_dataset(1024, 0), batch_size=128)


def test_a_gan_under_a_budget_is_checkpointed_exactly_and_told_what_manual_optimization_rules_out(tmp_path):
    # max_steps counts both optimizers' steps: 8 are 4 batches
    peaks = probe_module(SmallGAN(), tmp_path / "probe", 8)
    budget = budget_for_a_share_of_the_step(peaks, 0.6)
    reference, model = SmallGAN(), SmallGAN()
    fit_module(reference, [], tmp_path / "plain", max_steps=8)
    guard = MemGuardCallback(budget=budget, mitigations=("checkpointing", "microbatch"), plan_at_start=True,
                             explain=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit_module(model, [guard], tmp_path / "guarded", max_steps=8)
    said = [str(w.message) for w in caught if "lightning-memguard" in str(w.message)]
    assert trainer.global_step == 8
    assert any("microbatch rung is off" in s and "automatic optimization" in s for s in said)
    assert any("OOM rescue needs automatic optimization" in s for s in said)
    plan = [s for s in said if "plan_at_start" in s]
    assert len(plan) == 1 and "optimizes manually" in plan[0] and "does not fit" not in plan[0], plan
    events = guard.events
    assert set(events.loc[events["action"].isin(["apply", "keep"]), "rung"]) == {"checkpointing"}
    assert set(guard.levels) == {"checkpointing"} and guard.levels["checkpointing"] >= 1  # microbatch: off
    stepped = guard.history[guard.history["phase"] == "after_optimizer_step"]
    assert stepped["step"].tolist() == [0, 1, 2, 3]  # one row a batch, both optimizers' steps in it
    assert_same_state(model, reference)  # bit for bit
