"""estimate_memory on cases computed by hand, and against a real Lightning step."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_memguard import MemGuardCallback, estimate_memory, plan_configuration
from lightning_memguard.commands.demo import SmallCNN, TinyGPT
from lightning_memguard.mitigations.checkpointing import ActivationCheckpointing
from lightning_memguard.sources.cpu import CpuTensorAccountant
from tests.models import BlockStack, trainer_kwargs

WIDTH, DEPTH, BATCH = 256, 4, 32


def linear_stack():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)])


PARAM_BYTES = DEPTH * WIDTH * WIDTH * 4


@pytest.mark.parametrize("optimizer,state_copies", [
    (lambda p: torch.optim.SGD(p, lr=0.1), 0),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
    (torch.optim.Adam, 2),
])
def test_parameters_gradients_and_optimizer_state_of_a_linear_stack(optimizer, state_copies):
    estimate = estimate_memory(linear_stack(), torch.randn(BATCH, WIDTH), optimizer=optimizer)
    assert estimate.parameters_bytes == PARAM_BYTES
    assert estimate.gradients_bytes == PARAM_BYTES
    # Adam also keeps one scalar step per parameter tensor
    assert PARAM_BYTES * state_copies <= estimate.optimizer_state_bytes <= PARAM_BYTES * state_copies + DEPTH * 8
    # each Linear saves its input for the weight gradient; the first one's input is the batch, not an activation
    assert estimate.activations_bytes == (DEPTH - 1) * BATCH * WIDTH * 4
    assert estimate.batch_bytes == BATCH * WIDTH * 4


# Stage and ActivationsOnly stay here: the test below counts their saved tensors by hand from their exact ops
class Stage(nn.Module):
    """No parameters: exp() and sin() keep their inputs/outputs for backward."""

    def forward(self, x):
        return (x.exp() * 0.5).sin()


class ActivationsOnly(nn.Module):
    def __init__(self, n=8):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.stages = nn.ModuleList(Stage() for _ in range(n))

    def forward(self, x):
        x = x * self.scale
        for stage in self.stages:
            x = stage(x)
        return x


def test_checkpointing_k_of_n_blocks_removes_their_saved_bytes():
    x = torch.randn(64, 1024)  # 256 KiB per tensor
    model = ActivationsOnly(8)
    per_tensor = 64 * 1024 * 4
    estimates = {k: estimate_memory(model, x, blocks={Stage}, checkpointed_blocks=k) for k in (0, 2, 4, 8)}
    # exp saves its output, mul(0.5) nothing, sin its input: two tensors a stage (x * scale saves the batch and a
    # parameter, neither an activation)
    assert estimates[0].activations_bytes == 8 * 2 * per_tensor
    for k, estimate in estimates.items():
        # a checkpointed stage keeps only its input, for the recomputation
        assert estimate.activations_bytes == (8 - k) * 2 * per_tensor + k * per_tensor, k
    assert estimates[8].peak_bytes < estimates[4].peak_bytes < estimates[2].peak_bytes < estimates[0].peak_bytes
    blocks = estimates[0].blocks
    assert list(blocks["block"]) == [f"stages.{i}" for i in range(8)]
    assert (blocks["activations_bytes"] == 2 * per_tensor).all()


class MaskedStage(nn.Module):
    """A block called as transformers calls its layers: the hidden states positionally, a mask by keyword."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x, *, mask):
        return (x * self.scale + mask).sin()  # the product saves x (the scale's gradient), sin its input


class FrozenStemMaskedStages(nn.Module):
    """What a LoRA or a frozen embedding hands its first block: hidden states that need no gradient; and a mask
    computed from the batch, given to every block by keyword."""

    def __init__(self, n=4):
        super().__init__()
        self.stages = nn.ModuleList(MaskedStage() for _ in range(n))

    def forward(self, x):
        mask = (x > 0).float()
        x = x * 2.0  # saves nothing: the batch times a number
        for stage in self.stages:
            x = stage(x, mask=mask)
        return x


def bytes_left_by_forward(model, x) -> int:
    """What the forward leaves allocated for backward (the loss's 4 bytes not counted), by the CPU accountant
    alone."""
    accountant = CpuTensorAccountant()
    accountant.track([*model.parameters(), x])
    with accountant:
        before = accountant.read().allocated_bytes
        loss = model(x).sum()
        after = accountant.read().allocated_bytes
    del loss
    return after - before - 4


@pytest.mark.parametrize("checkpointed", [0, 2, 4])
def test_the_inputs_checkpointed_blocks_keep_are_counted_keyword_and_gradient_free_ones_too(checkpointed):
    """torch's checkpoint keeps every argument of a checkpointed block for the recomputation: the mask given by
    keyword too, and the first block's input although it needs no gradient. The estimate's activations are what
    the forward really leaves allocated, with any number of blocks checkpointed."""
    x = torch.randn(64, 1024)
    model = FrozenStemMaskedStages()
    estimate = estimate_memory(model, x, blocks={MaskedStage}, checkpointed_blocks=checkpointed)
    live = model
    if checkpointed:
        live = copy.deepcopy(model)
        rung = ActivationCheckpointing(live, blocks={MaskedStage})
        rung.set_level(checkpointed)
    assert estimate.activations_bytes == bytes_left_by_forward(live, x)
    per_tensor = 64 * 1024 * 4
    # each plain stage saves two tensors, each checkpointed one keeps its input; the mask once, where one keeps it
    assert estimate.activations_bytes == per_tensor * (2 * (4 - checkpointed) + checkpointed + (checkpointed > 0))


def measured_step_peak(model, tmp_path):
    guard = MemGuardCallback(mitigations=(), cpu_sample_every=1, explain=False)
    pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
               **trainer_kwargs(max_steps=3)).fit(model)
    history = guard.history
    return int(history[history["step"] >= 1]["peak_bytes"].max())


@pytest.mark.parametrize("make", [lambda: BlockStack(width=128, depth=6, batch_size=256),
                                  lambda: TinyGPT(d_model=64, nlayers=2, seq_len=32, batch_size=8),
                                  lambda: SmallCNN(channels=8, image_size=32, batch_size=8)],
                         ids=["residual-mlp", "gpt", "cnn"])
def test_estimate_is_within_5_percent_of_a_real_lightning_step(make, tmp_path):
    torch.manual_seed(0)
    model = make()
    batch = next(iter(model.train_dataloader()))
    estimate = estimate_memory(model, batch)
    measured = measured_step_peak(model, tmp_path)
    assert abs(estimate.peak_bytes / measured - 1) <= 0.05


def test_meta_device_estimates_without_memory_and_agrees_with_cpu():
    x = torch.randn(32, 16)
    cpu = estimate_memory(BlockStack(width=64, depth=4), (x, x[:, :1]))
    with torch.device("meta"):
        meta_model = BlockStack(width=64, depth=4)
    meta = estimate_memory(meta_model, (x, x[:, :1]))
    assert meta.device == "meta"
    assert meta.peak_bytes == pytest.approx(cpu.peak_bytes, rel=0.01)  # a few kernels differ by some bytes
    assert meta.activations_bytes == cpu.activations_bytes


def test_the_model_is_not_changed():
    model = linear_stack()
    before = [p.clone() for p in model.parameters()]
    estimate_memory(model, torch.randn(BATCH, WIDTH), optimizer=torch.optim.Adam)
    assert all(torch.equal(a, b) and b.grad is None for a, b in zip(before, model.parameters()))


def test_variants_and_printing():
    model = BlockStack(width=64, depth=4, batch_size=128)
    estimate = estimate_memory(model, next(iter(model.train_dataloader())), variants=True)
    configs = list(estimate.variants["config"])
    assert configs[:2] == ["as given", "amp (bf16-mixed)"] and configs[-1] == "checkpoint 4/4 blocks"
    assert estimate.variants["peak_bytes"].iloc[-1] < estimate.peak_bytes
    text = str(estimate)
    assert "PEAK" in text and "optimizer_state" in text and "remedies:" in text
    frame = estimate.to_dataframe()
    assert frame.iloc[-1].tolist() == ["peak", "overall", estimate.peak_bytes]


def test_plan_picks_the_cheapest_configuration_that_fits():
    model = BlockStack(width=64, depth=8, batch_size=512)
    batch = next(iter(model.train_dataloader()))
    peak = estimate_memory(model, batch).peak_bytes
    roomy = plan_configuration(model, batch, capacity_bytes=2 * peak)
    assert (roomy.amp, roomy.checkpointed_blocks, roomy.fits) == (False, 0, True)
    tight = plan_configuration(model, batch, capacity_bytes=int(0.8 * peak / 0.9), allow_amp=False)
    assert tight.fits and 0 < tight.checkpointed_blocks < 8
    assert tight.expected_peak_bytes <= tight.limit_bytes
    fewer = estimate_memory(model, batch, checkpointed_blocks=tight.checkpointed_blocks - 1)
    assert fewer.peak_bytes > tight.limit_bytes  # one block fewer would not fit: the fewest that do
    impossible = plan_configuration(model, batch, capacity_bytes=peak // 10)
    assert not impossible.fits and "no configuration of the whole batch estimated fits" in impossible.reason
    # a guard without the checkpointing rung: a plan it could not carry out is no plan
    no_blocks = plan_configuration(model, batch, capacity_bytes=int(0.8 * peak / 0.9), allow_amp=False,
                                   allow_checkpointing=False)
    assert not no_blocks.fits and no_blocks.checkpointed_blocks == 0 and no_blocks.n_blocks == 0


def test_a_training_step_that_asks_its_trainer_is_not_said_to_be_given_a_wrong_batch():
    """A LightningModule whose step reads ``self.trainer`` needs the Trainer the estimate's copy runs without: the error
    says so, not that the batch does not fit. One that gathers with ``self.all_gather`` is estimated, the gather stood
    in for: the tensor itself with one process, as Lightning's gather returns it, and ``world_size`` copies of it for
    one rank of several."""
    from tests.models import BlockStack

    class AsksItsTrainer(BlockStack):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * self.trainer.world_size

    class Gathers(BlockStack):
        def training_step(self, batch, batch_idx):
            self.gathered = self.all_gather(batch[0])
            return super().training_step(batch, batch_idx) + 0 * self.gathered.mean()

    batch = (torch.randn(8, 16), torch.randn(8, 1))
    with pytest.raises(ValueError, match="AsksItsTrainer.s training step uses its Trainer .* RuntimeError: .*attached"):
        estimate_memory(AsksItsTrainer(), batch)
    plain = estimate_memory(BlockStack(), batch)
    assert estimate_memory(Gathers(), batch).peak_bytes == plain.peak_bytes  # one process: no copy
    batch_bytes = 8 * 16 * 4
    for world_size in (2, 8):  # the gathered copies kept by the step (in the module) to its end
        ranks = estimate_memory(Gathers(), batch, strategy="ddp", world_size=world_size)
        alone = estimate_memory(BlockStack(), batch, strategy="ddp", world_size=world_size)
        assert ranks.phase_peaks["forward"] - alone.phase_peaks["forward"] == world_size * batch_bytes


def test_a_step_that_optimizes_itself_is_estimated_as_the_same_step_run_by_lightnings_loop():
    """A LightningModule with ``automatic_optimization = False`` asks its Trainer for its optimizers and backward,
    which the estimate's copy has not: they are stood in for, and a step that does by hand what Lightning's loop does
    (the loss, ``zero_grad``, ``manual_backward``, the step) is estimated as that loop's, phase by phase; the
    schedulers, the clipping and the toggling it adds hold nothing more, under one rank of DDP too."""
    from tests.models import BlockStack

    class ByHand(BlockStack):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.automatic_optimization = False

        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            with self.toggled_optimizer(optimizer):
                loss = super().training_step(batch, batch_idx)
                optimizer.zero_grad()
                self.manual_backward(loss)
                self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="value")
                optimizer.step()
            self.lr_schedulers().step()

    batch = next(iter(BlockStack().train_dataloader()))
    for kwargs in ({}, {"strategy": "ddp", "world_size": 2}, {"target": "cuda", "precision": "bf16-mixed"}):
        by_loop = estimate_memory(BlockStack(optimizer="adam"), batch, **kwargs)
        by_hand = estimate_memory(ByHand(optimizer="adam"), batch, **kwargs)
        assert {phase: by_hand.phase_peaks[phase] for phase in ("forward", "backward")} == \
            {phase: by_loop.phase_peaks[phase] for phase in ("forward", "backward")}, kwargs
        # the clipping's few scalars (at most one allocator block), beside the optimizer's step
        assert 0 <= by_hand.phase_peaks["optimizer_step"] - by_loop.phase_peaks["optimizer_step"] <= 512, kwargs
        assert by_hand.optimizer_state_bytes == by_loop.optimizer_state_bytes > 0, kwargs


def test_a_step_that_accumulates_by_hand_is_estimated_with_the_optimizer_state_of_its_later_batches():
    """A step that steps its optimizer on every second batch only does not step at batch 0, which the estimate runs:
    its optimizer state, held from the first stepping batch on, was missing. The optimizer steps once after the
    warm-up where the step did not: the estimate holds the state, as a step that steps every batch does."""
    from tests.models import BlockStack

    class ByHand(BlockStack):
        def __init__(self, every: int):
            super().__init__(optimizer="adam")
            self.automatic_optimization, self.every = False, every

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            self.manual_backward(super().training_step(batch, batch_idx) / self.every)
            if (batch_idx + 1) % self.every == 0:
                optimizer.step()
                optimizer.zero_grad()

    batch = next(iter(BlockStack().train_dataloader()))
    every_batch, every_second = estimate_memory(ByHand(1), batch), estimate_memory(ByHand(2), batch)
    params = sum(p.numel() * p.element_size() for p in BlockStack().parameters())
    assert every_second.optimizer_state_bytes == every_batch.optimizer_state_bytes >= 2 * params
    assert every_second.gradients_bytes == params  # summed over the window: alive through the forward


def test_a_step_that_fetches_its_own_batches_is_estimated_as_the_same_step_given_its_batch():
    """``training_step(self, dataloader_iter)`` is handed an iterator, not a batch: the estimate's call with
    ``(batch, 0)`` raised a TypeError, so such a module had no estimate and no plan. It is handed an iterator of the
    batch now, and estimated as the step given that batch, for CPU and for a CUDA target, automatic or by hand."""
    from tests.models import BlockStack

    class Fetching(BlockStack):
        def training_step(self, dataloader_iter):
            batch, batch_idx, _ = next(dataloader_iter)
            return super().training_step(batch, batch_idx)

    class FetchingByHand(Fetching):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.automatic_optimization = False

        def training_step(self, dataloader_iter):
            optimizer = self.optimizers()
            loss = super().training_step(dataloader_iter)
            optimizer.zero_grad()  # where Lightning's loop zeroes them: the last step's gradients live in the forward
            self.manual_backward(loss)
            optimizer.step()

    batch = next(iter(BlockStack().train_dataloader()))
    for target in ("cpu", "cuda"):
        given = estimate_memory(BlockStack(optimizer="adam"), batch, target=target)
        for module in (Fetching(optimizer="adam"), FetchingByHand(optimizer="adam")):
            fetched, case = estimate_memory(module, batch, target=target), (target, type(module).__name__)
            for phase, peak in given.phase_peaks.items():
                # a step by hand: a scalar or two more beside its optimizer's step (at most one allocator block)
                slack = 512 if phase == "optimizer_step" and not module.automatic_optimization else 0
                assert 0 <= fetched.phase_peaks[phase] - peak <= slack, (case, phase)
            assert fetched.optimizer_state_bytes == given.optimizer_state_bytes > 0, case


def test_a_training_step_without_a_batch_index_is_estimated_as_lightning_calls_it():
    """Lightning calls ``training_step(self, batch)`` without the index (it reads the signature); the estimate called
    it with ``(batch, 0)``: a TypeError, so such a module had no estimate, no plan and no predictions. It is called as
    Lightning calls it now, and estimated as the same step taking the index; ``*args`` gets the index."""
    class WithoutIndex(BlockStack):
        def training_step(self, batch):
            return super().training_step(batch, 0)

    class WithArgs(BlockStack):
        def training_step(self, batch, *args):
            return super().training_step(batch, *args)

    batch = next(iter(BlockStack().train_dataloader()))
    given = estimate_memory(BlockStack(optimizer="adam"), batch)
    for module in (WithoutIndex(optimizer="adam"), WithArgs(optimizer="adam")):
        assert estimate_memory(module, batch).phase_peaks == given.phase_peaks, type(module).__name__


def test_the_trainer_an_estimates_copy_reads_is_read_only_and_never_copied():
    """The copy's ``self.trainer`` is a view of its original's: reads answered, writes dropped, a copy of a copy
    reads the same Trainer (never a deep copy of it), and the module itself keeps its class."""
    import types

    from lightning_memguard.estimate.copies import copy_without_trainer, meta_copy

    module = BlockStack()
    trainer = types.SimpleNamespace(estimated_stepping_batches=40, should_stop=False)
    module._trainer = trainer
    try:
        work = copy_without_trainer(module)
        assert work.trainer.estimated_stepping_batches == 40 and work._trainer is None
        work.trainer.should_stop = True
        assert trainer.should_stop is False
        again = meta_copy(work)
        assert again.trainer.estimated_stepping_batches == 40 and type(again).__name__ == "BlockStack"
        assert type(module) is BlockStack and type(work) is type(again)
    finally:
        module._trainer = None


def test_anomaly_detection_does_not_send_the_estimate_off_the_meta_device():
    """Under ``Trainer(detect_anomaly=True)`` autograd checks every gradient for NaN, reading its values: on meta
    there are none, so the estimate fell back to running the whole step on CPU (real FLOPs and memory) and blamed
    the training step for reading a value. The estimate runs with anomaly detection off, on meta, and the same."""
    import warnings

    from lightning_memguard import EstimateFallbackWarning

    batch = next(iter(BlockStack().train_dataloader()))
    plain = estimate_memory(BlockStack(optimizer="adam"), batch, target="cuda")
    with warnings.catch_warnings(), torch.autograd.detect_anomaly():
        warnings.simplefilter("error", EstimateFallbackWarning)
        checked = estimate_memory(BlockStack(optimizer="adam"), batch, target="cuda")
        assert torch.is_anomaly_enabled()  # the user's mode, as it was
    assert checked.phase_peaks == plain.phase_peaks


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="does not fit Sequential's training step: RuntimeError"):
        estimate_memory(linear_stack(), torch.randn(BATCH, WIDTH + 1))
    with pytest.raises(ValueError, match="precision='fp8'"):
        estimate_memory(linear_stack(), torch.randn(BATCH, WIDTH), precision="fp8")


def test_a_plan_for_a_run_in_mixed_precision_estimates_every_configuration_in_it():
    model = BlockStack(width=64, depth=4, batch_size=256)
    batch = next(iter(model.train_dataloader()))
    bf16 = estimate_memory(model, batch, precision="bf16-mixed").peak_bytes
    plan = plan_configuration(model, batch, capacity_bytes=2 * bf16, precision="bf16-mixed")
    assert (plan.amp, plan.checkpointed_blocks, plan.fits) == (False, 0, True)  # AMP is no choice: it is on
    assert plan.expected_peak_bytes == bf16 and "bf16-mixed+0 blocks" in plan.reason


class HoldsItsData(nn.Module):
    """A model that keeps its training data as a plain attribute (2 MiB, in a list) and counts its calls in a small
    tensor its forward bumps in place."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(WIDTH, WIDTH)
        self.data = [torch.randn(2048, WIDTH)]
        self.calls = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.layer(x)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_a_dataset_the_model_holds_is_shared_by_the_estimates_copy_and_a_counter_it_bumps_is_copied(target):
    from lightning_memguard.estimate.copies import copy_without_trainer, meta_copy

    model = HoldsItsData()
    copied = meta_copy(model) if target == "cuda" else copy_without_trainer(model)
    assert copied.data[0] is model.data[0]  # not copied once per estimate
    assert copied.calls is not model.calls
    data = model.data[0].clone()
    estimate = estimate_memory(model, torch.randn(BATCH, WIDTH), target=target)
    assert estimate.parameters_bytes == (WIDTH * WIDTH + WIDTH) * 4
    # the user's model is untouched: its counter not bumped by the estimate's steps, its data unchanged
    assert model.calls.item() == 0 and torch.equal(model.data[0], data)
