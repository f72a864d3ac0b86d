"""Loops as users write them, guarded by ``MemGuard`` and ``FabricMemGuard``: models with dropout, models that
checkpoint their own blocks, two networks whose loss functions reach each other (a GAN). Each guarded run is compared
with the same loop unguarded from the same seed, and with what the guard says it did."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_memguard import EstimateFallbackWarning, MemGuard, estimate_memory
from tests.helpers import assert_same_state, mse, train_plain
from tests.models import Block, Stack, regression_batches


class DropoutBlock(Block):
    """A residual block with dropout: the random numbers it draws are part of what a run computes."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class SelfCheckpointed(Stack):
    """A stack whose forward checkpoints every block with torch.utils.checkpoint, as users do by hand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return self.head(h)


def guarded_steps(model: nn.Module, batches: list, **settings) -> tuple[MemGuard, list[str]]:
    """``model`` trained with SGD on ``batches`` under a loop guard from seed 0; the guard and the warnings."""
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard = MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), **settings)
        with guard:
            for batch in batches:
                guard.step(batch, mse)
    return guard, [str(w.message) for w in caught]


def test_a_planned_run_with_dropout_draws_the_random_numbers_of_the_unguarded_run():
    """The plan's estimate runs the model's step on CPU: its dropout drew from the process's generator, so every
    mask of the guarded run differed from the unguarded run's with the same seed."""
    batches = regression_batches(3, size=64)
    want = Stack(block=DropoutBlock)
    torch.manual_seed(0)
    train_plain(want, torch.optim.SGD(want.parameters(), lr=0.01, momentum=0.9), batches)
    got = Stack(block=DropoutBlock)
    guard, _ = guarded_steps(got, batches, budget="1GiB", plan_at_start=True, mitigations=("checkpointing",),
                             explain=False)
    assert guard.events["action"].tolist() == ["plan"], "the estimate ran"
    assert_same_state(got, want)


def test_the_estimate_leaves_the_random_generator_as_it_was():
    model = Stack(width=16, depth=2, block=DropoutBlock)
    torch.manual_seed(0)
    estimate_memory(model, regression_batches(1, size=8)[0], loss_fn=mse, target="cpu")
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4))


def test_a_model_checkpointing_its_own_blocks_is_estimated_in_mixed_precision_on_meta():
    """On meta, a recomputation in backward ran outside the emulated autocast (CheckpointError) and the estimate fell
    back to a CPU run; the model's own checkpoints now recompute under the kernel model (estimate/own_checkpoints.py):
    the meta estimate is made, with no fallback, and is the bytes of a real bf16 step on CPU."""
    model = SelfCheckpointed(width=16, depth=2)
    batch = regression_batches(1, size=8)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimate = estimate_memory(model, batch, loss_fn=mse, precision="bf16-mixed", target="cpu")
    assert estimate.path == "meta"
    assert not [w for w in caught if issubclass(w.category, EstimateFallbackWarning)]
    on_cpu = estimate_memory(model, batch, loss_fn=mse, precision="bf16-mixed", target="cpu", path="cpu")
    assert estimate.peak_bytes == on_cpu.peak_bytes


def test_the_amp_rung_is_not_turned_off_for_a_model_that_checkpoints_its_own_blocks():
    """The meta run's error was blamed on AMP: 'the amp rung is off for this run: SelfCheckpointed fails with it'."""
    guard, warned = guarded_steps(SelfCheckpointed(), regression_batches(2, size=64), budget="1GiB",
                                  plan_at_start=True, explain=False)
    assert not [w for w in warned if "amp rung is off" in w], warned
    assert guard.engine.ladder.usable("amp")


def test_a_gan_whose_loss_functions_reach_the_other_network_keeps_its_amp_rung():
    """Each network has its guard; the generator's loss runs the real discriminator, which the meta copy of the
    generator cannot feed: that is the meta run's failure, not AMP's, and both networks train as unguarded."""
    def networks():
        torch.manual_seed(0)
        g = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        d = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(), nn.Linear(32, 1))
        return g, d, torch.optim.SGD(g.parameters(), lr=0.01), torch.optim.SGD(d.parameters(), lr=0.01)

    def d_loss(d, batch, g):
        real, z = batch
        return (F.binary_cross_entropy_with_logits(d(real), torch.ones(len(real), 1))
                + F.binary_cross_entropy_with_logits(d(g(z).detach()), torch.zeros(len(z), 1)))

    def g_loss(g, batch, d):
        return F.binary_cross_entropy_with_logits(d(g(batch[1])), torch.ones(len(batch[1]), 1))

    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 16, generator=generator), torch.randn(32, 8, generator=generator)) for _ in range(3)]
    want_g, want_d, opt_g, opt_d = networks()
    for batch in batches:
        for opt, loss in ((opt_d, lambda: d_loss(want_d, batch, want_g)),
                          (opt_g, lambda: g_loss(want_g, batch, want_d))):
            opt.zero_grad(set_to_none=True)
            loss().backward()
            opt.step()
    g, d, opt_g, opt_d = networks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard_d = MemGuard(d, opt_d, budget="1GiB", plan_at_start=True, explain=False)
        guard_g = MemGuard(g, opt_g, budget="1GiB", plan_at_start=True, explain=False)
        with guard_d, guard_g:
            for batch in batches:
                guard_d.step(batch, lambda m, b: d_loss(m, b, g))
                guard_g.step(batch, lambda m, b: g_loss(m, b, d))
    assert not [w for w in caught if "amp rung is off" in str(w.message)], [str(w.message) for w in caught]
    assert guard_g.engine.ladder.usable("amp") and guard_d.engine.ladder.usable("amp")
    assert_same_state(g, want_g)
    assert_same_state(d, want_d)


def clip(model: nn.Module, optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def clipped_unguarded(batches: list) -> nn.Module:
    """The reference: SGD on ``batches``, each batch's gradient clipped to norm 0.05 before the step."""
    model = Stack()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        mse(model, batch).backward()
        clip(model, optimizer)
        optimizer.step()
    return model


def test_gradients_clipped_before_the_optimizer_step_are_the_whole_batchs_under_micro_batches():
    """A loop that clips has its place in the step: once, on the gradient of every micro-batch together."""
    batches = regression_batches(3, size=64)
    want = clipped_unguarded(batches)
    model = Stack()
    guard = MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), mitigations=("microbatch",),
                     explain=False, cpu_sample_every=1)
    guard.load_state_dict({"ladder": {"levels": {"microbatch": 2}}})  # four micro-batches from the first step
    calls = []
    with guard:
        for batch in batches:
            guard.step(batch, mse, before_optimizer_step=lambda m, o: (calls.append(1), clip(m, o)))
    backward = guard.history[guard.history["phase"] == "after_backward"]
    assert set(backward["micro_batches"]) == {4} and len(calls) == len(batches)
    assert_same_state(model, want, atol=1e-6)


def test_gradients_are_clipped_unscaled_when_the_amp_rung_runs_fp16_with_its_scaler(monkeypatch):
    """Where bf16 is not native (a V100, a T4) the AMP rung runs fp16 with a GradScaler: the loss is scaled by 65536,
    and clipping the scaled gradients would scale every step down to nothing."""
    import lightning_memguard.mitigations.amp as amp

    monkeypatch.setattr(amp, "amp_precision_for", lambda device: "16-mixed")
    batches = regression_batches(3, size=64)
    norms = []

    def clip_and_note(m, o):
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)))

    model = Stack()
    guard = MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), mitigations=("amp",),
                     explain=False)
    guard.load_state_dict({"ladder": {"levels": {"amp": 1}}})
    with guard:
        for batch in batches:
            guard.step(batch, mse, before_optimizer_step=clip_and_note)
    assert guard.levels == {"amp": 1}
    want = clipped_unguarded(batches)
    assert max(norms) < 100, f"the scaled gradients were clipped: norms {norms}"
    assert_same_state(model, want, atol=2e-2)  # fp16 autocast's rounding only
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), Stack().parameters()))
    assert moved > 1e-3, "the steps were taken"


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_fabric_clip_gradients_before_the_optimizer_step_clips_the_whole_batchs_unscaled_gradients(precision,
                                                                                                   monkeypatch):
    """Fabric's own clipping in the hook: once a step on the sum of four micro-batches' gradients, and under an AMP
    rung in fp16 unscaled once, by ``fabric.clip_gradients`` (the guard unscaling as well would make it raise)."""
    import lightning_memguard.mitigations.amp as amp
    from lightning.fabric import Fabric

    from lightning_memguard import FabricMemGuard

    monkeypatch.setattr(amp, "amp_precision_for", lambda device: "16-mixed")
    batches = regression_batches(3, size=64)
    want = clipped_unguarded(batches)
    fabric = Fabric(accelerator="cpu", devices=1)
    model = Stack()
    wrapped, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    guard = FabricMemGuard(fabric, wrapped, optimizer, mitigations=("amp", "microbatch"), explain=False)
    guard.load_state_dict({"ladder": {"levels": {"amp": int(precision != "32-true"), "microbatch": 2}}})
    norms = []
    with guard:
        for batch in batches:
            guard.step(batch, mse, before_optimizer_step=lambda m, o: norms.append(
                float(fabric.clip_gradients(m, o, max_norm=0.05))))
    assert guard.levels == {"amp": int(precision != "32-true"), "microbatch": 2}
    assert len(norms) == len(batches) and max(norms) < 100, norms
    assert_same_state(model, want, atol=1e-6 if precision == "32-true" else 2e-2)


def train_and_evaluate(model: nn.Module, batches: list, evaluation: torch.Tensor, **settings) -> MemGuard:
    """AdamW on ``batches``, the loop evaluating ``evaluation`` under ``torch.no_grad()`` after every second step,
    outside the guard (as loops do)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = MemGuard(model, optimizer, cpu_sample_every=1, explain=False, **settings)
    with guard:
        for index, batch in enumerate(batches):
            guard.step(batch, mse)
            if index % 2 == 1:
                with torch.no_grad():
                    model(evaluation).mean().item()
    return guard


def test_an_evaluation_between_steps_over_the_capacity_does_not_split_a_training_step_that_fits():
    """The step after the loop's evaluation had its batch_start peak over the capacity: the policy took that for a
    step that does not fit and split the training batch (which cannot lower what ran between the steps), then kept
    the split for the next step's lower peak. Now it holds, and says once that the peak is between the steps."""
    batches = regression_batches(5, size=128)
    evaluation = torch.randn(2048, 16)
    probed = train_and_evaluate(Stack(), batches, evaluation, mitigations=()).history
    own = probed[(probed["step"] >= 1) & (probed["phase"] != "batch_start")]["peak_bytes"].max()
    between = probed[probed["phase"] == "batch_start"]["peak_bytes"].max()
    capacity = int(own / 0.95)  # the training step between the threshold and the capacity
    assert own >= 0.9 * capacity and between > 1.2 * capacity, (own, between)
    guard = train_and_evaluate(Stack(), batches, evaluation, budget=capacity, mitigations=("microbatch",),
                               plan_at_start=False)
    events = guard.events
    assert "apply" not in set(events["action"]), events[["step", "action", "rung", "reason"]].to_string()
    assert guard.levels == {"microbatch": 0}
    said = events[events["action"] == "cannot_help"]["reason"].tolist()
    assert len(said) == 1 and "between optimizer steps" in said[0]


def test_a_fabric_csv_logger_holds_the_runs_memory_curves_once_the_guard_is_closed(tmp_path):
    """Fabric's CSVLogger writes its rows every 100th step: a shorter run's memory curves were in no file after
    ``close()``, which flushed TensorBoard loggers only."""
    import pandas as pd
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import CSVLogger

    from lightning_memguard import FabricMemGuard

    logger = CSVLogger(str(tmp_path), name="csv")
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[logger])
    model = Stack(width=16, depth=2)
    wrapped, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    guard = FabricMemGuard(fabric, wrapped, optimizer, budget="1GiB", log_every_n_steps=1, explain=False)
    with warnings.catch_warnings(record=True) as caught, guard:
        warnings.simplefilter("always")
        for batch in regression_batches(3, size=16):
            guard.step(batch, mse)
    # the guard's files in the logger's directory are not "previous log files" to it
    assert not [w for w in caught if "is not empty" in str(w.message)]
    assert (tmp_path / "csv" / "version_0" / "memguard_history.csv").exists()
    rows = pd.read_csv(tmp_path / "csv" / "version_0" / "metrics.csv")
    key = "memguard/after_backward/peak_GiB"
    logged = rows.dropna(subset=[key]).set_index("step")[key]
    history = guard.history[guard.history["phase"] == "after_backward"].set_index("step")["peak_bytes"]
    assert logged.index.tolist() == [0, 1, 2]
    assert logged.tolist() == pytest.approx((history / 2**30).tolist(), rel=1e-6)


def test_another_guards_cpu_hard_limit_does_not_stop_the_estimate_of_a_step():
    """Two guards in one process (a GAN's networks): the first guard's accountant counts every tensor of the process
    with its hard limit, so the second guard's estimate — a real step of a copy on CPU, which no guard counts as
    training — ran out of memory against it and was lost ('the rung levels cannot be predicted')."""
    from lightning_memguard.sources.cpu import CpuTensorAccountant

    model = Stack(width=32, depth=2)
    batch = regression_batches(1, size=64)[0]
    want = estimate_memory(model, batch, loss_fn=mse, target="cpu").peak_bytes
    other = CpuTensorAccountant(limit_bytes=want // 4)  # another guard's, started: its limit is below the estimate
    with other:
        got = estimate_memory(model, batch, loss_fn=mse, target="cpu").peak_bytes
        with pytest.raises(torch.OutOfMemoryError):  # its limit still holds for training
            torch.empty(want // 2, dtype=torch.uint8)
    assert got == want


def test_fabric_runs_in_the_users_precision_once_the_guard_that_switched_amp_on_is_closed(tmp_path):
    """The AMP rung swapped Fabric's precision plugin for bf16-mixed; after ``guard.close()`` it stayed, so the
    user's evaluation through the set-up module ran in bf16, and a guard stepping again read the mixed plugin as the
    user's and turned its AMP rung off ("Fabric already runs MixedPrecision") while bf16 went on. Fabric's own plugin
    is back at close; the level is kept, and a further step runs in bf16 again."""
    from lightning.fabric import Fabric

    from lightning_memguard import FabricMemGuard

    fabric = Fabric(accelerator="cpu", devices=1)
    model = Stack(width=32, depth=2)
    wrapped, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    users = fabric.strategy.precision
    guard = FabricMemGuard(fabric, wrapped, optimizer, mitigations=("amp",), budget="1GiB", explain=False,
                           log_dir=str(tmp_path))
    guard.load_state_dict({"ladder": {"levels": {"amp": 1}}})
    dtypes = []
    model.head.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
    batches = regression_batches(3, size=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches[:2]:
            guard.step(batch, mse)
        guard.close()
        assert dtypes == [torch.bfloat16] * 2 and guard.levels == {"amp": 1}
        assert fabric.strategy.precision is users and fabric._precision is users
        dtypes.clear()
        with torch.no_grad():
            evaluated = wrapped(batches[2][0])
        assert dtypes == [torch.float32]
        torch.testing.assert_close(evaluated, model(batches[2][0]).detach(), rtol=0, atol=0)  # as if unguarded
        dtypes.clear()
        guard.step(batches[2], mse)  # a further run of the same model goes on at its level
        guard.close()
    assert dtypes == [torch.bfloat16] and guard.levels == {"amp": 1} and fabric.strategy.precision is users
    assert not [w for w in caught if "amp rung is off" in str(w.message)]
