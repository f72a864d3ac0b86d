"""MemGuardCallback under manual optimization, in real CPU Trainers: a small GAN in the usual Lightning 2.x way (two
optimizers, ``toggle_optimizer``, ``manual_backward``, ``opt.step()`` in ``training_step``) under a budget of 0.6x its
monitored step. What the ladder can do there it does — the checkpointing rung climbs, exact — and what it cannot is
said once each: micro-batches cannot split a step the module runs itself, and an OOM cannot be run again. The plan
before the first step estimates the step with its optimizers, backward and toggling stood in for."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_memguard import MemGuardCallback, MemGuardOutOfMemoryError, Rung, estimate_memory
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


def test_a_gan_under_a_budget_is_planned_checkpointed_exactly_and_told_what_manual_optimization_rules_out(tmp_path):
    """The estimate runs a step that calls its optimizers itself (its copy has no Trainer: the optimizers, the backward
    and the toggling stood in for), so the plan acts before the first step, as under automatic optimization, and
    predicts what the steps then measure."""
    # max_steps counts both optimizers' steps: 8 are 4 batches
    peaks = probe_module(SmallGAN(), tmp_path / "probe", 8)
    budget = budget_for_a_share_of_the_step(peaks, 0.6)
    reference, model = SmallGAN(), SmallGAN()
    fit_module(reference, [], tmp_path / "plain", max_steps=8)
    guard = MemGuardCallback(budget=budget, mitigations=("checkpointing", "microbatch"), explain=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit_module(model, [guard], tmp_path / "guarded", max_steps=8)
    said = [str(w.message) for w in caught if "lightning-memguard" in str(w.message)]
    assert trainer.global_step == 8
    assert any("microbatch rung is off" in s and "automatic optimization" in s for s in said)
    assert not any("OOM rescue" in s for s in said)  # in one process, rescued before an optimizer steps
    events = guard.events
    plan = events[events["action"] == "plan"]
    assert plan[["step", "rung"]].values.tolist() == [[0, "checkpointing"]], events
    assert set(events["action"]) == {"plan"}  # nothing ran over after it
    assert set(guard.levels) == {"checkpointing"} and guard.levels["checkpointing"] >= 1  # microbatch: off
    stepped = guard.history[guard.history["phase"] == "after_optimizer_step"]
    assert stepped["step"].tolist() == [0, 1, 2, 3]  # one row a batch, both optimizers' steps in it
    later = guard.history[guard.history["step"] >= 1].groupby("step")["peak_bytes"].max()
    assert later.tolist() == pytest.approx([plan["peak_before_bytes"].iloc[0]] * 3, rel=0.01)
    assert_same_state(model, reference)  # bit for bit


def test_a_gan_whose_plan_is_mixed_precision_measures_what_the_plan_predicted(tmp_path):
    """The AMP rung acts on a manual step (the precision plugin runs its forward and ``manual_backward``): a budget
    that bf16 alone fits (the plain step ~5.1 MiB, bf16 ~4.5 MiB) is planned with AMP before the first step, and the
    bf16 steps measure what the estimate of the step, autocast emulated on meta, predicted."""
    guard = MemGuardCallback(budget="5.2MiB", mitigations=("amp", "checkpointing"), explain=False)
    trainer = fit_module(SmallGAN(), [guard], tmp_path, max_steps=8)
    assert trainer.global_step == 8
    events = guard.events
    assert events[["step", "action", "rung", "level"]].values.tolist() == [[0, "plan", "amp", 1]], events
    later = guard.history[guard.history["step"] >= 1].groupby("step")["peak_bytes"].max()
    assert later.tolist() == pytest.approx([events["peak_before_bytes"].iloc[0]] * 3, rel=0.01)


class AccumulatedByHand(pl.LightningModule):
    """A residual MLP stepped by hand every second batch (its loss halved, Adam's step then ``zero_grad``), as
    accumulation is written under manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(16, 64), *[Block(64) for _ in range(6)], nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer = self.optimizers()
        self.manual_backward(nn.functional.mse_loss(self.net(x), y) / 2)
        if batch_idx % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(regression_dataset(512, 0), batch_size=64)


def test_a_step_accumulated_by_hand_is_estimated_as_its_heaviest_batch(tmp_path):
    """The estimate runs the step at batch 0, which does not step the optimizer here: without its state the estimate
    fell short of every stepping batch by Adam's two moments. The optimizer steps once after the warm-up, and the
    estimate is the window's heaviest batch as measured (the gradients summed, the state held)."""
    model = AccumulatedByHand()
    estimate = estimate_memory(model, next(iter(model.train_dataloader())))
    peaks = probe_module(AccumulatedByHand(), tmp_path, 4)  # 4 optimizer steps: 8 batches
    history = peaks.history[peaks.history["step"] >= 2]
    for phase, boundary in (("forward", "after_forward"), ("backward", "after_backward")):
        measured = history[history["phase"] == boundary]["peak_bytes"].max()
        assert estimate.phase_peaks[phase] == pytest.approx(measured, rel=0.001), phase


class BreakingRung(Rung):
    """A rung whose level 1 makes the module's ``broken`` phase raise (as an op autocast cannot run would)."""

    name, levels = "breaking", 1

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def apply(self, module, level):
        module.broken = self.phase if level else None


class BreakableGAN(SmallGAN):
    """:class:`SmallGAN` whose generator's forward (before any backward) or discriminator's update (after the
    generator's optimizer stepped) raises while a rung says so."""

    broken = None

    def training_step(self, batch, batch_idx):
        if self.broken == "generator forward":
            raise RuntimeError("the rung broke the generator's forward")
        return super().training_step(batch, batch_idx)

    def untoggle_optimizer(self, optimizer):
        super().untoggle_optimizer(optimizer)
        if self.broken == "after the generator stepped" and optimizer is self.optimizers()[0]:
            raise RuntimeError("the rung broke the discriminator's update")


def test_a_rung_that_breaks_a_manual_step_before_its_backward_is_put_back_and_the_batch_runs_again(tmp_path):
    """Under manual optimization the step's errors went straight to the Trainer: a rung that broke the step ended the
    run (MemGuard the reason it died). Now the manual loop's step runs through the attempt loop: an error of the first
    step after the rung climbed, raised before any backward, puts it back and runs the batch again, so the run trains
    like one without the rung."""
    peaks = probe_module(SmallGAN(), tmp_path / "probe", 8)
    budget = budget_for_a_share_of_the_step(peaks, 0.6)
    reference, model = SmallGAN(), BreakableGAN()
    fit_module(reference, [], tmp_path / "plain", max_steps=8)
    guard = MemGuardCallback(budget=budget, mitigations=(BreakingRung("generator forward"),), explain=False)
    trainer = fit_module(model, [guard], tmp_path / "guarded", max_steps=8)
    assert trainer.global_step == 8
    events = guard.events
    assert events[events["rung"] == "breaking"]["action"].tolist() == ["apply", "revert"]
    assert guard.levels == {"breaking": 0}
    assert_same_state(model, reference)


def test_a_manual_step_that_fails_after_an_optimizer_stepped_is_not_run_again(tmp_path):
    """Once the step's backward began (here the generator's optimizer stepped) running it again would step that
    optimizer twice: the error is raised as it is, not retried."""
    peaks = probe_module(SmallGAN(), tmp_path / "probe", 8)
    guard = MemGuardCallback(budget=budget_for_a_share_of_the_step(peaks, 0.6),
                             mitigations=(BreakingRung("after the generator stepped"),), explain=False)
    model = BreakableGAN()
    with pytest.raises(RuntimeError, match="broke the discriminator's update"):
        fit_module(model, [guard], tmp_path / "guarded", max_steps=8)
    assert "revert" not in set(guard.events["action"])


class FrozenOnRetryGAN(SmallGAN):
    """:class:`SmallGAN` whose step breaks while a rung says so, at ``broken``: right after the generator's optimizer
    was toggled (the discriminator's parameters frozen until untoggled), or inside the generator's backward, once
    the generator's later layers have their gradients (a hook on its first block's output)."""

    broken = None

    def __init__(self) -> None:
        super().__init__()
        self.generator[1].register_forward_hook(self._break_backward)

    def toggle_optimizer(self, optimizer):
        super().toggle_optimizer(optimizer)
        if self.broken == "after the toggle":
            raise RuntimeError("the rung broke the generator's forward")

    def _break_backward(self, module, inputs, output):
        if self.broken == "in the backward" and output.requires_grad:
            def broken(grad):
                raise RuntimeError("the rung broke the generator's backward")

            output.register_hook(broken)


@pytest.mark.parametrize("where", ["after the toggle", "in the backward"])
def test_a_manual_step_broken_after_its_toggle_or_in_its_backward_runs_again_as_without_the_rung(tmp_path, where):
    """Run again after a failure between ``toggle_optimizer`` and ``untoggle_optimizer``, the step toggled once more
    with the discriminator's parameters still frozen, so Lightning's record of them said frozen and untoggling kept
    them so: the discriminator never trained again, silently. The flags are put back with the rest of the step's state.
    And a step whose backward broke ended the run, though nothing had stepped and every gradient it could add to was
    empty when it began: those gradients are emptied again and the batch runs again."""
    peaks = probe_module(SmallGAN(), tmp_path / "probe", 8)
    reference, model = SmallGAN(), FrozenOnRetryGAN()
    fit_module(reference, [], tmp_path / "plain", max_steps=8)
    guard = MemGuardCallback(budget=budget_for_a_share_of_the_step(peaks, 0.6), mitigations=(BreakingRung(where),),
                             explain=False)
    trainer = fit_module(model, [guard], tmp_path / "guarded", max_steps=8)
    assert trainer.global_step == 8
    events = guard.events
    assert events[events["rung"] == "breaking"]["action"].tolist() == ["apply", "revert"]
    assert all(p.requires_grad for p in model.parameters())
    assert_same_state(model, reference)


class WideGeneratorGAN(SmallGAN):
    """:class:`SmallGAN` with a generator of width 256 on batches of 1024: the step's peak is in the generator's
    forward and backward, before its optimizer steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.generator = nn.Sequential(nn.Linear(8, 256), *[Block(256) for _ in range(3)], nn.Linear(256, 16))

    def train_dataloader(self):
        return DataLoader(regression_dataset(4096, 0), batch_size=1024)


class HeavyAfterTheGeneratorStepped(SmallGAN):
    """:class:`SmallGAN` that holds ``extra`` bytes for a moment right after its generator's optimizer stepped."""

    def __init__(self, extra: int) -> None:
        super().__init__()
        self.extra = extra

    def untoggle_optimizer(self, optimizer):
        super().untoggle_optimizer(optimizer)
        if optimizer is self.optimizers()[0]:
            torch.empty(self.extra // 4).fill_(0)


def test_an_oom_before_a_manual_step_stepped_is_rescued_and_one_after_is_reported(tmp_path):
    """Under manual optimization an OOM ended the run (the rescue was off). Now, in one process, a step that ran out
    of memory before any optimizer stepped (its backwards began on empty gradients, emptied again) runs again one rung
    higher, as under automatic optimization, and trains as unguarded; one that ran out after an optimizer stepped is
    not run again — the optimizer would step twice — and the report says so."""
    peaks = probe_module(WideGeneratorGAN(), tmp_path / "probe", 8)
    limit = int(0.98 * peaks.highest(1))  # the steps do not fit whole
    reference, model = WideGeneratorGAN(), WideGeneratorGAN()
    fit_module(reference, [], tmp_path / "plain", max_steps=8)
    guard = MemGuardCallback(budget=limit, cpu_hard_limit=limit, mitigations=("checkpointing",), plan_at_start=False,
                             explain=False)
    trainer = fit_module(model, [guard], tmp_path / "rescued", max_steps=8)
    assert trainer.global_step == 8
    rescues = guard.events.query("action == 'rescue'")
    assert len(rescues) >= 1 and set(rescues["rung"]) == {"checkpointing"}
    assert_same_state(model, reference)  # checkpointing is exact, and the batch ran once
    assert all(p.requires_grad for p in model.parameters())

    held = int(peaks.history["allocated_bytes"].max())
    guard = MemGuardCallback(budget=2 * held, cpu_hard_limit=2 * held, mitigations=("checkpointing",),
                             plan_at_start=False, explain=False)
    with pytest.raises(MemGuardOutOfMemoryError, match="an optimizer had already stepped"):
        fit_module(HeavyAfterTheGeneratorStepped(2 * held), [guard], tmp_path / "reported", max_steps=8)
    assert "rescue" not in set(guard.events["action"])
