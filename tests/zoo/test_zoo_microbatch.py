"""Micro-batching transformers batches: a tokenizer's ``BatchEncoding`` is split (an OOM is rescued by micro-batches,
in the plain loop and under a Trainer), and padded GPT-2 batches trained as micro-batches end with the parameters of
whole-batch training, because each micro-batch weighs its share of the tokens the loss averages over (labels not
-100, after the causal shift) — where weighting by samples drifts. OOMs are real, under ``cpu_hard_limit``."""

from __future__ import annotations

import copy
import warnings

import pandas as pd
import pytest
import torch

from lightning_memguard import MemGuard, MemGuardCallback, estimate_memory
from lightning_memguard.mitigations.microbatch import MicroBatching
from tests.helpers import DOORS, one_intra_op_thread, probe, pytree_registered, run
from tests.helpers import train_unguarded as train_model_unguarded
from tests.models import lightning_class, pl, trainer_kwargs
from tests.zoo.models import (MOE, MORE_FAMILIES, SWITCH, ZooModule, build, loss_of, make_batch, train_unguarded,
                              transformers,
                              with_lora, zoo_run)

BATCH, STEPS, LR = 8, 3, 0.1


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)  # ZooModule's optimizer


def whole_batch_parameters(model: torch.nn.Module, batches) -> list[torch.Tensor]:
    """The reference: plain training, whole batches, no guard."""
    model = copy.deepcopy(model)
    optimizer = sgd(model)
    for batch in batches:
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def largest_difference(model: torch.nn.Module, reference: list[torch.Tensor]) -> float:
    return max((p.detach() - q).abs().max().item() for p, q in zip(model.parameters(), reference))


def limit_between(history) -> int:
    """A CPU hard limit under the whole batch's step peak and over what stays across steps plus half the rest: the
    whole batch runs out of memory, micro-batches fit."""
    last = history[history["step"] == history["step"].max()]
    static = int(last.loc[last["phase"] == "batch_start", "allocated_bytes"].iloc[0])
    return static + (int(last["peak_bytes"].max()) - static) // 2


def rescued_by_micro_batches(guard) -> None:
    events = guard.events
    rescues = events[events["action"] == "rescue"]
    assert len(rescues) >= 1 and set(rescues["rung"]) == {"microbatch"}, events
    assert "gave_up" not in set(events["action"]) and guard.levels["microbatch"] >= 1


# --- the plain loop ---------------------------------------------------------------------------------------------------
def loop_run(model, batches, **settings) -> MemGuard:
    # the rescue is what these tests reach: no plan before the first step (it would split from step 0)
    guard = MemGuard(model, sgd(model), mitigations=("microbatch",), explain=False, plan_at_start=False, **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for batch in batches:
                guard.step(batch, loss_of)
        finally:
            guard.close()
    guard.said = [str(w.message) for w in caught]
    return guard


@pytest.fixture(scope="module")
def gpt2():
    model, make = build("gpt2")
    batches = [make(i, batch_size=BATCH, padded=True, encoding=True) for i in range(STEPS)]
    probe = loop_run(copy.deepcopy(model), batches, cpu_sample_every=1)
    return model, batches, limit_between(probe.history), whole_batch_parameters(model, batches)


def test_a_batch_encoding_is_rescued_by_micro_batches_and_trains_like_whole_batches(gpt2):
    model, batches, limit, reference = gpt2
    trained = copy.deepcopy(model)
    guard = loop_run(trained, batches, cpu_hard_limit=limit)
    rescued_by_micro_batches(guard)
    assert (guard.history["peak_bytes"] <= limit).all()
    assert largest_difference(trained, reference) < 1e-6
    caveat = [s for s in guard.said if "micro-batching weights" in s]
    assert len(caveat) == 1 and "labelled tokens (labels not -100, counted after GPT2LMHeadModel's" in caveat[0]


def test_weighting_padded_micro_batches_by_samples_would_drift(gpt2):
    """What the token weighting prevents (and proof that the comparison above can fail)."""
    model, batches, limit, reference = gpt2
    by_samples = copy.deepcopy(model)
    guard = loop_run(by_samples, batches, cpu_hard_limit=limit,
                     microbatch_weight=lambda batch: len(batch["input_ids"]))
    rescued_by_micro_batches(guard)
    assert largest_difference(by_samples, reference) > 1e-3


def test_micro_batches_without_a_labelled_token_run_joined_and_the_step_stays_exact():
    model, make = build("gpt2")
    batches = [make(i, batch_size=BATCH, padded=True) for i in range(STEPS)]
    for batch in batches:
        batch["labels"][3] = -100  # nothing to predict in row 3
        batch["labels"][5, 1:] = -100  # only the first token: nothing to predict after the causal shift either
    reference = whole_batch_parameters(model, batches)
    trained = copy.deepcopy(model)
    guard = MemGuard(trained, sgd(trained), mitigations=("microbatch",), explain=False)
    guard.load_state_dict({"ladder": {"levels": {"microbatch": 3}}})  # as resumed at 8 micro-batches of one row
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches:
            guard.step(batch, loss_of)
    guard.close()
    assert guard.history["micro_batches"].max() == BATCH - 2  # rows 3 and 5 ran with rows 2 and 4
    said = [str(w.message) for w in caught if "joined to its neighbour" in str(w.message)]
    assert len(said) == 1
    assert all(torch.isfinite(p).all() for p in trained.parameters())
    assert largest_difference(trained, reference) < 1e-6


def trained_in_parts(model, batches, reference, weight) -> tuple[float, list[str]]:
    """A copy of ``model`` trained on ``batches`` as four micro-batches each, weighted by ``weight``: its largest
    difference from whole-batch training (``reference``), and the warnings."""
    trained = copy.deepcopy(model)
    guard = MemGuard(trained, sgd(trained), mitigations=("microbatch",), explain=False, microbatch_weight=weight,
                     cpu_sample_every=1)
    guard.load_state_dict({"ladder": {"levels": {"microbatch": 2}}})  # as resumed at 4 micro-batches
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches:
            guard.step(batch, loss_of)
    guard.close()
    assert guard.history.groupby("step")["micro_batches"].max().tolist() == [4] * STEPS
    return largest_difference(trained, reference), [str(w.message) for w in caught]


@pytest.mark.parametrize("name", MORE_FAMILIES)
def test_padded_batches_of_the_further_families_in_four_micro_batches_train_like_whole_batches(name):
    """Whisper (an encoder-decoder: its labels count unshifted), a LoRA on Llama (the causal shift read through peft's
    wrapper), Qwen2 and Mistral, on rows of different lengths: each micro-batch weighs its share of the labelled
    tokens, so four of them end where whole batches do — and weighting by samples would not."""
    model, make = build(name)
    batches = [make(i, batch_size=BATCH, padded=True, encoding=name == "whisper") for i in range(STEPS)]
    with one_intra_op_thread():
        reference = whole_batch_parameters(model, batches)
        difference, said = trained_in_parts(model, batches, reference, None)
        by_samples, _ = trained_in_parts(model, batches, reference, lambda batch: len(batch["labels"]))
    assert difference < 1e-6
    assert by_samples > 1e-4  # the comparison can fail: a hundred times the tolerance
    caveat = [s for s in said if "micro-batching weights" in s]
    assert len(caveat) == 1 and "labelled tokens (labels not -100" in caveat[0]
    assert ("causal-LM shift" in caveat[0]) == (name != "whisper"), caveat[0]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_ctc_loss_in_four_micro_batches_adds_up_to_the_whole_batch_loss_with_the_weights_of_its_reduction(reduction):
    """Wav2Vec2's CTC loss has labels padded with -100 but is no mean over them: with ``ctc_loss_reduction="mean"``
    each sample's loss is divided by its target length and the samples averaged (micro-batches weigh their share of
    the samples), with ``"sum"`` (transformers' default) the samples' losses are added (micro-batches are added
    unweighted). Weighting by labelled tokens, the rule for transformers' token losses, changes both. The losses are
    compared, not trained parameters: a summed CTC loss is in the hundreds, and SGD on it diverges."""
    model, make = build("wav2vec2")
    model.config.ctc_loss_reduction = reduction
    rung = MicroBatching(model)
    rung.set_level(2)
    assert f"CTC loss is a {'sum' if reduction == 'sum' else 'mean'} over the samples" in rung.notices[0]
    batch = make(0, batch_size=BATCH)  # rows of 16, 11, 14, 9, 12, 15, 10 and 13 labels
    with torch.no_grad(), one_intra_op_thread():
        whole = float(loss_of(model, batch))
        parts = [(weight, float(loss_of(model, part))) for part, weight in rung.split(batch, 4)]
        tokens = [float((part["labels"] != -100).sum()) for part, _ in rung.split(batch, 4)]
    assert [weight for weight, _ in parts] == ([1.0] * 4 if reduction == "sum" else [0.25] * 4)
    assert sum(weight * loss for weight, loss in parts) == pytest.approx(whole, rel=1e-5)
    by_tokens = sum(count / sum(tokens) * loss for count, (_, loss) in zip(tokens, parts))
    assert abs(by_tokens - whole) > 1e-3 * abs(whole)  # the comparison can fail: a hundred times the tolerance


def test_a_contrastive_model_is_told_that_micro_batches_change_its_loss_and_they_do():
    """CLIP's loss scores each image against every text of the batch: no weights make micro-batches exact. The rung
    says so first, and calls the split inexact (so the guard uses it for memory only, never for speed)."""
    model, make = build("clip")
    rung = MicroBatching(model)
    rung.set_level(1)
    assert rung.notices[0].startswith("CLIPModel is trained with a contrastive loss"), rung.notices
    assert rung.inexact_reason() == rung.notices[0]
    batch = make(0, batch_size=BATCH)
    with torch.no_grad(), one_intra_op_thread():
        whole = float(loss_of(model, batch))
        parts = sum(weight * float(loss_of(model, part)) for part, weight in rung.split(batch, 2))
    assert abs(parts - whole) > 1e-2 * whole


@pytest.mark.skipif("mixtral" not in MOE, reason="this transformers has no Mixtral")
def test_a_lora_on_a_mixture_of_experts_is_told_that_its_router_loss_is_taken_per_micro_batch():
    """peft's wrapper hands the model's arguments on as ``**kwargs``: the router loss and the causal shift are read
    from the Mixtral inside, named as such. And the notice is true: the weighted micro-losses are not the loss."""
    mixtral = build("mixtral")[0]
    # a coefficient that makes the router loss visible in the loss (transformers' default, 0.001, hides it in rounding)
    mixtral.config.router_aux_loss_coef = mixtral.router_aux_loss_coef = 0.5
    model = with_lora(mixtral)
    rung = MicroBatching(model, warn=lambda text: None)
    rung.set_level(1)
    assert "MixtralForCausalLM adds a router load-balancing loss" in rung.notices[0], rung.notices
    batch = make_batch("mixtral", 0, batch_size=4)
    rung.observe_batch(batch)  # engaged before it: the weight is said with the first batch
    assert any("counted after MixtralForCausalLM's causal-LM shift" in notice for notice in rung.notices)
    with torch.no_grad():
        whole = float(loss_of(model, batch))
        parts = sum(weight * float(loss_of(model, part)) for part, weight in rung.split(batch, 2))
    assert abs(parts - whole) > 1e-4



def weighted_parts_and_whole(model, rung: MicroBatching, batch, parts: int = 4) -> tuple[float, float]:
    with torch.no_grad():
        whole = float(loss_of(model, batch))
        return sum(weight * float(loss_of(model, part)) for part, weight in rung.split(batch, parts)), whole


@pytest.mark.skipif(not SWITCH or "mixtral" not in MOE, reason="this transformers has no SwitchTransformers or Mixtral")
def test_a_router_loss_is_read_from_the_batch_where_it_carries_the_flag():
    """The batch's ``output_router_logits`` is what the forward uses: SwitchTransformers' router losses are on only
    there (its forward's default is off), and a Mixtral whose config turns its loss on trains exactly where the
    batch turns it off. Said where the weighted micro-losses are not the loss, and only there."""
    switch = build("switch")[0]
    for flag in (True, False):
        batch = {**make_batch("switch", 0), "output_router_logits": flag}
        rung = MicroBatching(switch)
        rung.observe_batch(batch)
        rung.set_level(2)
        parts, whole = weighted_parts_and_whole(switch, rung, batch)
        said = [notice for notice in rung.notices if "router" in notice]
        if flag:
            assert said and said[0].startswith("SwitchTransformersForConditionalGeneration adds router load-balancing "
                                               "and z-losses (output_router_logits=True in the batch"), rung.notices
            assert "output_router_logits=False in the batch" in said[0] and rung.inexact_reason() == said[0]
            assert abs(parts - whole) > 1e-4
        else:
            assert not said and rung.inexact_reason() is None
            assert parts == pytest.approx(whole, abs=1e-6)
    mixtral = build("mixtral")[0]  # output_router_logits=True in its config
    mixtral.config.router_aux_loss_coef = mixtral.router_aux_loss_coef = 0.5  # a loss rounding does not hide
    batch = {**make_batch("mixtral", 0), "output_router_logits": False}
    rung = MicroBatching(mixtral)
    rung.observe_batch(batch)
    rung.set_level(2)
    assert rung.inexact_reason() is None and not any("router" in notice for notice in rung.notices)
    parts, whole = weighted_parts_and_whole(mixtral, rung, batch)
    assert parts == pytest.approx(whole, abs=1e-6)


def test_the_estimate_counts_a_batch_encoding():
    model, make = build("gpt2")
    as_dict, as_encoding = make(0), make(0, encoding=True)
    estimated = estimate_memory(model, as_encoding, loss_fn=loss_of)
    assert estimated.batch_bytes > 0
    assert estimated.batch_bytes == estimate_memory(model, as_dict, loss_fn=loss_of).batch_bytes


# --- under a Trainer --------------------------------------------------------------------------------------------------
def fit(module, callbacks, root):
    trainer = pl.Trainer(callbacks=callbacks, default_root_dir=str(root), logger=False,
                         **trainer_kwargs(max_steps=STEPS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own notes on workers and logging
        trainer.fit(module)
    return trainer


def test_under_a_trainer_a_batch_encoding_is_rescued_by_micro_batches_and_trains_like_whole_batches(tmp_path):
    def module():
        return ZooModule("gpt2", n_batches=STEPS, batch_size=BATCH, padded=True, encoding=True, lr=LR)

    reference = module()
    fit(reference, [], tmp_path / "whole")
    probe = MemGuardCallback(mitigations=("microbatch",), cpu_sample_every=1, explain=False)
    fit(module(), [probe], tmp_path / "probe")
    limit = limit_between(probe.history)
    guarded = module()
    guard = MemGuardCallback(mitigations=("microbatch",), cpu_hard_limit=limit, explain=False, plan_at_start=False)
    trainer = fit(guarded, [guard], tmp_path / "split")
    assert trainer.global_step == STEPS
    rescued_by_micro_batches(guard)
    assert largest_difference(guarded, [p.detach() for p in reference.parameters()]) < 1e-6


class OnlyTwoSamplesFit(ZooModule):
    """A zoo model on a device where only 2 samples of a batch fit: a larger batch raises CUDA's out-of-memory error."""

    def training_step(self, batch, batch_idx):
        if len(batch["input_ids"]) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (only 2 samples fit)")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_a_learning_rate_search_on_padded_batches_that_do_not_fit_finds_what_it_finds_where_they_do(name, tmp_path):
    """``Tuner.lr_find`` before the fit, on padded batches of 8: its trials run as micro-batches weighted by labelled
    tokens, so the losses it records are those of whole batches on a device where they fit."""
    def search(model, guard, root):
        trainer = pl.Trainer(**trainer_kwargs(max_steps=2, callbacks=[guard] if guard else [], logger=False,
                                              default_root_dir=str(root)))
        tuner = lightning_class("tuner", "Tuner")(trainer)
        found = tuner.lr_find(model, num_training=12, min_lr=1e-5, max_lr=1e-1, early_stop_threshold=None)
        trainer.fit(model)
        assert trainer.global_step == 2
        return found.results["loss"]

    losses = search(ZooModule(name, n_batches=16), None, tmp_path / "fits")
    guard = MemGuardCallback(mitigations=("microbatch",), budget="4GiB", plan_at_start=False, explain=False)
    split = search(OnlyTwoSamplesFit(name, n_batches=16), guard, tmp_path / "split")
    torch.testing.assert_close(split, losses, atol=1e-5, rtol=1e-5)
    assert guard.levels["microbatch"] == 2  # 4 parts of 2 samples


def test_where_nothing_fits_under_the_aim_the_first_step_runs_at_the_lowest_predicted_peak_a_split(tmp_path):
    """Every block checkpointed with one-row micro-batches is predicted at 96 % of the hard limit: over what a plan
    aims at (95 %), under the limit, and the lowest of any configuration; a whole batch with every block checkpointed
    is 1.5x over it. The plan sets that split before step 0 (said not to fit its aim), so no step runs out of memory
    (rescue is off: one would end the fit), where a plan of the lowest whole batch ran out at step 0."""
    from lightning_memguard.estimate.plan import ladder_peak_model

    model, make = build("llama")
    peaks = ladder_peak_model(model, make(0, batch_size=BATCH), target="cpu", loss_fn=loss_of,
                              optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9))
    n_blocks = peaks.n_blocks
    lowest = peaks.peak({"checkpointing": n_blocks, "microbatch": 3})  # 8 rows: 3 halvings to one row
    limit = int(lowest / 0.96)
    assert peaks.peak({"checkpointing": n_blocks}) > limit
    assert peaks.peak({"checkpointing": n_blocks, "microbatch": 2}) > lowest
    with one_intra_op_thread():
        run = zoo_run("lightning", "llama", tmp_path, STEPS, batch_size=BATCH, budget=limit, cpu_hard_limit=limit,
                      rescue_oom=False, mitigations=("checkpointing", "microbatch"), explain=False, cpu_sample_every=1)
    assert run.steps_done == STEPS
    events = run.guard.events
    plan = events[events["action"] == "plan"]
    assert set(plan["step"]) == {0} and "the lowest of any configuration estimated" in plan["reason"].iloc[0]
    assert any("the lowest of any configuration estimated" in said for said in run.said)  # the plan does not fit
    assert run.guard.levels == {"checkpointing": n_blocks, "microbatch": 3}
    assert (run.guard.history.groupby("step")["micro_batches"].max() == BATCH).all()  # from step 0 on
    assert (run.guard.history["peak_bytes"] <= limit).all()
    reference = train_unguarded("llama", STEPS, batch_size=BATCH)
    for key, value in run.model.state_dict().items():
        torch.testing.assert_close(value, reference[key], atol=1e-6, rtol=1e-5, msg=key)


class SwitchWithItsRouterLossOnInTheCall(ZooModule):
    """SwitchTransformers as users often train it: the batch as a tokenizer gives it, the router losses switched on in
    the training step's own call."""

    def __init__(self, **kw):
        super().__init__("switch", **kw)
        for batch in self.batches:
            del batch["output_router_logits"]

    def training_step(self, batch, batch_idx):
        return self.model(**batch, output_router_logits=True).loss


@pytest.mark.skipif(not SWITCH, reason="this transformers has no SwitchTransformers")
def test_a_router_loss_switched_on_in_the_training_steps_call_is_told_when_the_split_step_first_calls_it(tmp_path):
    """Neither the batch nor the config shows the flag: the split step's first call of the model does (read once by a
    hook that removes itself), and the user is told then that the router losses are taken per micro-batch; the
    split is inexact from then on (no speed trial would time it)."""
    probe = MemGuardCallback(mitigations=("microbatch",), cpu_sample_every=1, explain=False)
    fit(SwitchWithItsRouterLossOnInTheCall(n_batches=STEPS, batch_size=BATCH), [probe], tmp_path / "probe")
    module = SwitchWithItsRouterLossOnInTheCall(n_batches=STEPS, batch_size=BATCH)
    guard = MemGuardCallback(mitigations=("microbatch",), budget=limit_between(probe.history), explain=False)
    rung = guard.engine.ladder
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path / "split"), logger=False,
                         **trainer_kwargs(max_steps=STEPS))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    assert trainer.global_step == STEPS and guard.levels["microbatch"] >= 1
    router = [str(w.message) for w in caught if "adds router load-balancing and z-losses" in str(w.message)]
    assert len(router) == 1 and "(output_router_logits=True in the training step's call" in router[0], router
    assert "output_router_logits=False in the training step's call" in router[0]
    assert rung.rungs["microbatch"].inexact_reason() is not None
    assert not module.model._forward_pre_hooks  # the hook took itself off
    # engaged but never called (the fit ended first): the fit's end takes it off
    unused = MicroBatching(module.model)
    unused.set_level(1)
    assert len(module.model._forward_pre_hooks) == 1
    unused.close()
    assert not module.model._forward_pre_hooks


def tiny_time_series_transformer():
    torch.manual_seed(0)
    config = transformers.TimeSeriesTransformerConfig(
        prediction_length=8, context_length=16, lags_sequence=[1, 2, 3], num_time_features=1, input_size=1,
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        encoder_layerdrop=0.0, decoder_layerdrop=0.0, scaling="mean")
    return transformers.TimeSeriesTransformerForPrediction(config)


def time_series_batch(rows: int = 8, past: int = 19, future: int = 8) -> dict:
    """Rows whose future is partly unobserved, by different amounts (``future_observed_mask``, as a series ending
    early is given)."""
    g = torch.Generator().manual_seed(0)
    observed = torch.ones(rows, future)
    for row in range(1, rows):
        observed[row, future - row % future:] = 0
    return dict(past_values=torch.rand(rows, past, generator=g) + 0.5,
                past_time_features=torch.randn(rows, past, 1, generator=g), past_observed_mask=torch.ones(rows, past),
                future_values=torch.rand(rows, future, generator=g) + 0.5,
                future_time_features=torch.randn(rows, future, 1, generator=g), future_observed_mask=observed)


def tiny_segformer():
    torch.manual_seed(0)
    config = transformers.SegformerConfig(
        num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[2, 4], mlp_ratios=[2, 2], hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, drop_path_rate=0.0, decoder_hidden_size=32,
        num_labels=5)
    return transformers.SegformerForSemanticSegmentation(config).eval()  # BatchNorm's running statistics: exact


def segmentation_batch(rows: int = 8) -> dict:
    """Label maps whose pixels the loss ignores (255, SegFormer's semantic_loss_ignore_index) differ by row."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 5, (rows, 32, 32), generator=g)
    for row in range(rows):
        labels[row, : 4 * row] = 255
    return {"pixel_values": torch.randn(rows, 3, 32, 32, generator=g), "labels": labels}


@pytest.mark.parametrize("family", ["time series", "segmentation"])
def test_micro_batches_weigh_what_a_time_series_or_segmentation_loss_averages_over(family):
    """A time-series transformer's loss is a mean over the observed future points (``future_observed_mask``), a
    segmentation model's over the pixels not labelled ``config.semantic_loss_ignore_index`` (255): each micro-batch
    is weighted by its share of those (not of the samples, nor of the labels not -100), so the weighted micro-losses
    add up to the whole batch's loss."""
    model, batch = ((tiny_time_series_transformer(), time_series_batch()) if family == "time series"
                    else (tiny_segformer(), segmentation_batch()))
    rung = MicroBatching(model)
    rung.observe_batch(batch)
    rung.set_level(2)
    said = "observed future time points (future_observed_mask)" if family == "time series" else "labels not 255"
    assert any(said in notice for notice in rung.notices), rung.notices
    counted = (batch["future_observed_mask"].sum(dim=1) if family == "time series"
               else (batch["labels"] != 255).flatten(1).sum(dim=1)).reshape(4, 2).sum(dim=1)
    split = rung.split(batch, 4)
    assert [weight for _, weight in split] == pytest.approx((counted / counted.sum()).tolist())
    assert counted.min() < counted.max()  # not the samples' shares
    with torch.no_grad():
        whole = float(model(**batch).loss)
        parts = sum(weight * float(model(**part).loss) for part, weight in split)
    assert parts == pytest.approx(whole, rel=1e-6)


@pytest.mark.skipif(not SWITCH, reason="this transformers has no SwitchTransformers")
def test_the_router_flags_hook_reads_the_models_own_call_not_a_copys():
    """A copy of the model (an estimate's, whose warnings are silenced) carries the hook: its call is not the one
    read."""
    model = build("switch")[0]
    batch = make_batch("switch", 0)
    del batch["output_router_logits"]
    rung = MicroBatching(model)
    rung.observe_batch(batch)
    rung.set_level(1)
    with torch.no_grad():
        copy.deepcopy(model)(**batch, output_router_logits=True)
        assert rung.inexact_reason() is None and len(model._forward_pre_hooks) == 1
        model(**batch, output_router_logits=True)
    assert "in the training step's call" in rung.inexact_reason() and not model._forward_pre_hooks


class LogsWithItsBatchSize(ZooModule):
    """GPT-2 logging its loss with a constant ``batch_size=`` of the user's (as ``batch_size=self.hparams.batch_size``
    is), per step and as the epoch's mean."""

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=True, on_epoch=True, batch_size=BATCH)
        return loss


def test_a_loss_logged_with_a_constant_batch_size_is_the_whole_batchs_in_micro_batches(tmp_path):
    """Rescued by micro-batches under a CPU hard limit, each part's ``training_step`` logs with the user's constant
    ``batch_size=``: the step's value and the epoch's mean are the whole batches' (unsplit, each batch weighs
    ``BATCH`` in the mean; split, the batch weighs that once, not once a part)."""
    csv_logger = lightning_class("loggers", "CSVLogger")

    def logged(callbacks, name):
        module = LogsWithItsBatchSize("gpt2", n_batches=STEPS, batch_size=BATCH, padded=True, lr=LR)
        trainer = pl.Trainer(callbacks=callbacks, default_root_dir=str(tmp_path),
                             logger=csv_logger(str(tmp_path), name=name, version=""),
                             **trainer_kwargs(max_steps=STEPS))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's own notes on workers and logging
            trainer.fit(module)
        return pd.read_csv(tmp_path / name / "metrics.csv")

    want = logged([], "whole")
    probe = MemGuardCallback(mitigations=("microbatch",), cpu_sample_every=1, explain=False)
    logged([probe], "probe")
    guard = MemGuardCallback(mitigations=("microbatch",), cpu_hard_limit=limit_between(probe.history),
                             explain=False, plan_at_start=False)
    got = logged([guard], "split")
    rescued_by_micro_batches(guard)
    for key in ("train_loss_step", "train_loss_epoch"):
        values = [torch.tensor(frame[key].dropna().to_numpy()) for frame in (got, want)]
        assert len(values[0]) == (STEPS if key.endswith("step") else 1), (key, values)
        torch.testing.assert_close(values[0], values[1], rtol=1e-5, atol=0, msg=key)


class TokenBatch:
    """A padded token batch in a class of the user's own (as Lightning moves one, by its ``to``), registered with
    torch's pytree as for ``torch.compile``; ``note`` is a leaf every part keeps."""

    def __init__(self, input_ids, attention_mask, labels, note: str = "synthetic") -> None:
        self.input_ids, self.attention_mask, self.labels, self.note = input_ids, attention_mask, labels, note

    def to(self, *args, **kwargs) -> "TokenBatch":
        return TokenBatch(*(t.to(*args, **kwargs) for t in (self.input_ids, self.attention_mask, self.labels)),
                          self.note)


def token_batch_loss(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    assert batch.note == "synthetic"
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss


@pytest.mark.parametrize("door", DOORS)
def test_padded_token_batches_of_a_class_registered_with_pytree_train_in_micro_batches_like_whole_batches(door,
                                                                                                      tmp_path):
    """GPT-2's padded batches in :class:`TokenBatch`, under a budget of 0.6x the monitored peak: each part is a
    ``TokenBatch`` of its rows, weighed by its labelled tokens (by samples, padded parts drift: see above)."""
    with pytree_registered(TokenBatch, lambda b: ([b.input_ids, b.attention_mask, b.labels], b.note),
                           lambda children, note: TokenBatch(*children, note)):
        data = [TokenBatch(*(make_batch("gpt2", i, batch_size=BATCH)[key]
                             for key in ("input_ids", "attention_mask", "labels"))) for i in range(STEPS)]
        probed = probe(door, build("gpt2")[0], data, tmp_path / "probe", loss=token_batch_loss)
        result = run(door, build("gpt2")[0], data, tmp_path, loss=token_batch_loss, lr=LR, mitigations=("microbatch",),
                     budget=int(0.6 * probed.highest()), explain=False)
        reference = train_model_unguarded(build("gpt2")[0], data, loss=token_batch_loss, lr=LR)
    assert result.guard.history["micro_batches"].max() > 1
    assert largest_difference(result.model, list(reference.parameters())) < 1e-6
