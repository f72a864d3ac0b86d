"""Evaluation rescue and the rare long batch on the zoo's GPT-2, a transformers model built from a tiny config with
random weights: padded ``BatchEncoding`` batches with attention masks and labels -100 on the padding.

- Evaluation: validation inside a fit (``val_loss`` logged on_epoch, read back from a ``CSVLogger``), predict
  (``predict_step`` returns the model's ``ModelOutput``) and the plain loop's ``MemGuard.evaluate``, with evaluation
  batches larger than training's, under a ``cpu_hard_limit`` between the unsplit evaluation peak and the training
  peak: each batch runs in parts after its OOM, and what the user gets equals an unguarded, unsplit run's.
- A rare long batch: one batch in six has four times the tokens, under a limit that batch alone does not fit whole.
  With a limit halfway, the prediction is right: the long batches, only they, run split, no OOM. With GPT-2's eager
  attention (T x T scores kept for the backward) under a tighter limit, the linear prediction falls short: the first
  long batch runs out of memory in the predicted parts and is rescued once (that batch only), and the second starts
  in the parts it needed. The ladder never moves, the normal batches run whole, and training equals an unguarded
  run's (micro-batches weighted by labelled tokens).
- A padded batch's parts hold unequal labelled tokens: they are weighed by those (after GPT-2's causal shift), as a
  transformers loss averages over them, so the plain loop's combined ``ModelOutput.loss`` and Lightning's logged
  ``val_loss`` equal the unsplit batch's.

Every limit lies between peaks probed from monitor-only runs of the same model and data, never copied."""

from __future__ import annotations

import os
import warnings

import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_memguard import MemGuard, MemGuardCallback
from tests.helpers import limit_between, probe, run, train_unguarded
from tests.models import lightning_class, pl, trainer_kwargs
from tests.zoo.models import VOCAB, ZooModule, build, loss_of, make_batch

transformers = pytest.importorskip("transformers")
CSVLogger = lightning_class("loggers", "CSVLogger")

TRAIN, VAL, TRAIN_STEPS = 4, 48, 4  # samples a batch: evaluation batches far larger than training's


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The zoo's tensors are tiny: a second intra-op thread only adds synchronisation (see test_zoo_guard)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rows(history: pd.DataFrame, phase: str) -> pd.DataFrame:
    return history[history["phase"] == phase]


def training_peak(history: pd.DataFrame) -> int:
    return int(history[history["phase"].isin(["batch_start", "after_forward", "after_backward",
                                              "after_optimizer_step"])]["peak_bytes"].max())


def assert_split_then_remembered(guard, phase: str, batches: int, limit: int, first_split: int = 0) -> None:
    """The loop's batch ``first_split`` ran out of memory and was split, the batches before it ran whole (under the
    limit), and every later batch started in at least as many parts (one that needs more splits further)."""
    measured = rows(guard.history, phase)
    assert len(measured) == batches
    parts = measured["micro_batches"].tolist()
    assert parts[:first_split] == [1] * first_split and parts[first_split] >= 2
    assert all(later >= earlier for earlier, later in zip(parts[first_split:], parts[first_split + 1:]))
    events = guard.events
    split = events[(events["action"] == "eval_split") & (events["phase"] == phase)]
    assert len(split) >= 1 and int(split["level"].iloc[-1]) == parts[-1]
    assert split["reason"].iloc[0].startswith(f"out of memory in {phase} batch of {VAL} samples")
    assert "gave_up" not in set(events["action"]) and not {"apply", "rescue"} & set(events["action"])
    assert (measured["peak_bytes"] <= limit).all()


def assert_same_model_output(got, want, loss: bool = True) -> None:
    """The combined parts' output: a ``ModelOutput`` of the same class, the same keys, the unsplit logits (and, with
    ``loss``, the unsplit loss)."""
    assert type(got) is type(want) and isinstance(got, transformers.utils.ModelOutput)
    assert list(got.keys()) == list(want.keys())
    assert got.logits.shape == want.logits.shape
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)
    if loss:
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)


# --- evaluation under a Trainer ---------------------------------------------------------------------------------------
class Evaluated(ZooModule):
    """GPT-2 trained on small padded ``BatchEncoding`` batches, validated (``val_loss`` on_epoch) and predicted on
    batches of ``VAL`` samples: ``predict_step`` returns the model's own ``ModelOutput``. The validation rows are
    unpadded: Lightning weighs each part's ``val_loss`` by its samples, which is the unsplit token mean only where
    every row has as many labelled tokens (padded rows: the tests below)."""

    def __init__(self, val_padded: bool = False) -> None:
        super().__init__("gpt2", n_batches=TRAIN_STEPS, batch_size=TRAIN, padded=True, encoding=True)
        self.val_batches = [half_padded(padded_batch(100 + i, VAL, 16)) if val_padded
                            else make_batch("gpt2", 100 + i, batch_size=VAL, padded=False, encoding=True)
                            for i in range(2)]
        self.predict_batches = [make_batch("gpt2", 200 + i, batch_size=VAL, padded=True, encoding=True)
                                for i in range(2)]

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)  # on_epoch: a mean weighted by each batch's (part's) samples

    def predict_step(self, batch, batch_idx):
        return self.model(**batch)

    def val_dataloader(self):
        return DataLoader(self.val_batches, batch_size=None, shuffle=False)

    def predict_dataloader(self):
        return DataLoader(self.predict_batches, batch_size=None, shuffle=False)


def fit_and_predict(module, root, callback=None, predict_callback=None, predict: bool = True):
    """A one-epoch fit (validation at its end, no sanity check) with a CSVLogger, then predict; returns the fit's
    metrics.csv and the predictions."""
    logger = CSVLogger(str(root), name="csv")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own notes on workers and logging
        trainer = pl.Trainer(**trainer_kwargs(max_steps=-1, max_epochs=1, num_sanity_val_steps=0, logger=logger,
                                              default_root_dir=str(root),
                                              callbacks=[callback] if callback is not None else []))
        trainer.fit(module)
        assert trainer.global_step == TRAIN_STEPS
        predictions = None
        if predict:
            predictor = pl.Trainer(**trainer_kwargs(
                logger=False, default_root_dir=str(root),
                callbacks=[predict_callback] if predict_callback is not None else []))
            predictions = predictor.predict(module)
    return pd.read_csv(os.path.join(logger.log_dir, "metrics.csv")), predictions


def logged_val_loss(metrics: pd.DataFrame) -> torch.Tensor:
    return torch.tensor(metrics.dropna(subset=["val_loss"])["val_loss"].to_numpy())


@pytest.fixture(scope="module")
def lightning_probe(tmp_path_factory):
    """A monitor-only fit and predict of ``Evaluated``: its fit and predict histories, its metrics and predictions."""
    fit_guard = MemGuardCallback(mitigations=(), cpu_sample_every=1, explain=False)
    predict_guard = MemGuardCallback(mitigations=(), cpu_sample_every=1, explain=False)
    metrics, predictions = fit_and_predict(Evaluated(), tmp_path_factory.mktemp("probe"), fit_guard, predict_guard)
    assert fit_guard.events.empty and predict_guard.events.empty
    return fit_guard.history, predict_guard.history, metrics, predictions


def test_gpt2_validation_and_predict_are_split_after_their_oom_and_equal_an_unguarded_run(tmp_path,
                                                                                          lightning_probe):
    fit_history, predict_history, _, _ = lightning_probe
    validation = rows(fit_history, "validation")
    assert len(validation) == 2 and (validation["micro_batches"] == 1).all()
    val_peak, train_peak = int(validation["peak_bytes"].max()), training_peak(fit_history)
    assert val_peak > train_peak  # the evaluation batches are the larger step
    limit = limit_between(val_peak, train_peak)
    # predict keeps every batch's outputs: the second batch starts higher; a limit between its peak and what the
    # first batch's outputs hold lets the first run whole and the second run out of memory
    predict_peaks = rows(predict_history, "predict")
    assert (predict_peaks["micro_batches"] == 1).all()
    first_peak, second_peak = (int(p) for p in predict_peaks["peak_bytes"])
    predict_limit = limit_between(second_peak, first_peak)
    assert second_peak > predict_limit > first_peak

    fit_guard = MemGuardCallback(cpu_hard_limit=limit, mitigations=(), explain=False)
    predict_guard = MemGuardCallback(cpu_hard_limit=predict_limit, mitigations=(), explain=False)
    module = Evaluated()
    metrics, predictions = fit_and_predict(module, tmp_path / "guarded", fit_guard, predict_guard)

    assert_split_then_remembered(fit_guard, "validation", 2, limit)
    assert_split_then_remembered(predict_guard, "predict", 2, predict_limit, first_split=1)
    assert "validation_step" not in vars(module) and "predict_step" not in vars(module)  # unwrapped

    want_metrics, want_predictions = fit_and_predict(Evaluated(), tmp_path / "reference")
    got, want = logged_val_loss(metrics), logged_val_loss(want_metrics)
    assert len(got) == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert len(predictions) == len(want_predictions) == 2
    for output, expected in zip(predictions, want_predictions):
        assert_same_model_output(output, expected)




def test_gpt2_padded_validation_in_parts_logs_the_unsplit_val_loss(tmp_path):
    probe_guard = MemGuardCallback(mitigations=(), cpu_sample_every=1, explain=False)
    fit_and_predict(Evaluated(val_padded=True), tmp_path / "probe", probe_guard, predict=False)
    limit = limit_between(int(rows(probe_guard.history, "validation")["peak_bytes"].max()),
                          training_peak(probe_guard.history))
    guard = MemGuardCallback(cpu_hard_limit=limit, mitigations=(), explain=False)
    metrics, _ = fit_and_predict(Evaluated(val_padded=True), tmp_path / "guarded", guard, predict=False)
    assert_split_then_remembered(guard, "validation", 2, limit)
    want, _ = fit_and_predict(Evaluated(val_padded=True), tmp_path / "reference", predict=False)
    torch.testing.assert_close(logged_val_loss(metrics), logged_val_loss(want), rtol=1e-5, atol=0)


# --- evaluation in the plain loop -------------------------------------------------------------------------------------
def padded_batch(seed: int, samples: int, tokens: int, encoding: bool = True):
    """A GPT-2 batch of ``samples`` rows of ``tokens`` tokens whose rows end in padding of random lengths (at most
    half the row; the first row unpadded), masked 0 and labelled -100: the parts of a split batch hold different
    numbers of labelled tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (samples, tokens), generator=g)
    lengths = tokens - torch.randint(0, tokens // 2 + 1, (samples,), generator=g)
    lengths[0] = tokens
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).long()
    batch = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
             "labels": ids.masked_fill(mask == 0, -100)}
    return transformers.BatchEncoding(batch) if encoding else batch


def half_padded(batch):
    """``batch`` with the rows of its second half cut to their first 4 tokens (the rest padding, labels -100): the
    halves of the batch hold very different numbers of labelled tokens."""
    half = len(batch["input_ids"]) // 2
    batch["attention_mask"][half:, 4:] = 0
    batch["input_ids"][half:, 4:] = 0
    batch["labels"][half:, 4:] = -100
    return batch


def model_output(model, batch):
    """An evaluation function without side effects: the model's own ``ModelOutput`` (without the key-value cache,
    which an evaluation does not use: whole-batch outputs are what no split can shrink)."""
    return model(**batch, use_cache=False)


def loop_train_then_evaluate(root, val_batches, **settings):
    model, make = build("gpt2")
    guard = MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), log_dir=str(root),
                     tensorboard=False, explain=False, mitigations=(), **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for index in range(TRAIN_STEPS):
                guard.step(make(index, batch_size=TRAIN, encoding=True), loss_of)
            outputs = [guard.evaluate(batch, model_output) for batch in val_batches]
        finally:
            guard.close()
    return guard, outputs


def unguarded_outputs(val_batches):
    model, make = build("gpt2")
    train_unguarded(model, [make(index, batch_size=TRAIN, encoding=True) for index in range(TRAIN_STEPS)],
                    loss=loss_of)
    with torch.no_grad():
        return [model_output(model, batch) for batch in val_batches]


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory):
    """GPT-2 trained, then evaluated on two padded batches in the plain loop: under a limit between the probed
    unsplit evaluation peak and the training peak, and unguarded. Returns the guard, its outputs, the unguarded
    outputs and the limit."""
    val_batches = [half_padded(padded_batch(300 + i, VAL, 16)) for i in range(2)]
    probed, _ = loop_train_then_evaluate(tmp_path_factory.mktemp("probe"), val_batches, cpu_sample_every=1)
    assert probed.events.empty
    validation = rows(probed.history, "validation")
    assert (validation["micro_batches"] == 1).all()
    val_peak, train_peak = int(validation["peak_bytes"].max()), training_peak(probed.history)
    assert val_peak > train_peak
    limit = limit_between(val_peak, train_peak)
    guard, outputs = loop_train_then_evaluate(tmp_path_factory.mktemp("guarded"), val_batches, cpu_hard_limit=limit)
    return guard, outputs, unguarded_outputs(val_batches), limit


def test_gpt2_in_the_plain_loop_evaluates_in_parts_with_the_logits_of_an_unsplit_run(loop_runs):
    guard, outputs, expected, limit = loop_runs
    assert_split_then_remembered(guard, "validation", 2, limit)
    assert rows(guard.history, "validation")["step"].tolist() == [TRAIN_STEPS - 1] * 2
    for output, want in zip(outputs, expected):
        assert_same_model_output(output, want, loss=False)  # the loss: see the next test


def test_gpt2_in_the_plain_loop_a_padded_batch_in_parts_gives_the_unsplit_loss(loop_runs):
    _, outputs, expected, _ = loop_runs
    for output, want in zip(outputs, expected):
        torch.testing.assert_close(output.loss, want.loss, rtol=1e-5, atol=0)


# --- a rare long batch ------------------------------------------------------------------------------------------------
N_BATCHES, LONG_EVERY, LONG_TIMES, ROWS = 12, 6, 4, 8
LONG = [i for i in range(N_BATCHES) if i % LONG_EVERY == LONG_EVERY - 2]  # steps 4 and 10


def long_batch_data() -> list:
    """Padded GPT-2 ``BatchEncoding`` batches of ``ROWS`` rows of 16 tokens; those at ``LONG`` have four times the
    tokens. Rows end in padding of random lengths (labels -100), so micro-batches must weigh labelled tokens."""
    return [padded_batch(400 + i, ROWS, 16 * (LONG_TIMES if i in LONG else 1)) for i in range(N_BATCHES)]


def gpt2(attention: str = "sdpa"):
    """The zoo's GPT-2 with ``attention``: ``"sdpa"`` (the default) or ``"eager"`` (scores, their softmax and the
    mask kept as T x T tensors for the backward: more memory growing with the square of the tokens)."""
    model = build("gpt2")[0]
    if attention != "sdpa":
        model.config._attn_implementation = attention
    return model


def probed_long_batch(door: str, root, attention: str = "sdpa") -> tuple[int, int, int]:
    """From a monitor-only run: the highest peak of a normal step, the lowest of a long one, and what every step
    holds at its start once the optimizer state exists."""
    peaks = probe(door, gpt2(attention), long_batch_data(), root, loss=loss_of, logger=False)
    per_step = peaks.per_step()
    return int(per_step.drop(LONG).max()), int(per_step[LONG].min()), peaks.allocated("batch_start", 1)


def long_batch_run(door: str, root, limit: int, attention: str = "sdpa", **settings):
    return run(door, gpt2(attention), long_batch_data(), root, loss=loss_of, logger=False, cpu_hard_limit=limit,
               mitigations=("microbatch",), explain=False, **settings)


def assert_long_batches_only_split_and_trained_like_unguarded(result, limit: int) -> pd.Series:
    """Every step ran, the long batches — only they — in parts, the ladder never moved, every peak under the limit,
    and the parameters those of unguarded whole-batch training (the micro-batches weighted by labelled tokens).
    Returns the parts of each step."""
    history = result.guard.history
    assert result.steps_done == N_BATCHES and result.steps_seen() == list(range(N_BATCHES))
    assert "gave_up" not in set(result.guard.events["action"])
    parts = history.groupby("step")["micro_batches"].max()
    assert sorted(parts[parts > 1].index) == LONG and (parts.drop(LONG) == 1).all()
    assert result.guard.levels["microbatch"] == 0  # no lasting slowdown
    assert (history["peak_bytes"] <= limit).all()
    expected = train_unguarded(build("gpt2")[0], long_batch_data(), loss=loss_of)
    for (name, got), want in zip(result.model.state_dict().items(), expected.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)  # the zoo's micro-batch tolerance
    return parts


@pytest.mark.parametrize("door", ["loop", "lightning"])
def test_a_rare_long_gpt2_batch_predicted_not_to_fit_runs_split_that_batch_only(door, tmp_path):
    normal, long, _ = probed_long_batch(door, tmp_path / "probe")
    limit = limit_between(long, normal)
    assert long > limit and normal < 0.9 * limit  # the long batch alone does not fit whole; the others stay under

    result = long_batch_run(door, tmp_path / "run", limit)

    events, history = result.guard.events, result.guard.history
    assert events["action"].tolist() == ["predicted_split"] * len(LONG) and events["step"].tolist() == LONG
    assert history["num_ooms"].max() == 0
    reason = events["reason"].iloc[0]
    assert f"{LONG_TIMES:.1f}x the" in reason and f"of step {LONG[0] - 1} (the last step measured whole)" in reason
    assert "this batch only" in reason
    parts = assert_long_batches_only_split_and_trained_like_unguarded(result, limit)
    assert [parts[step] for step in LONG] == [2 ** int(level) for level in events["level"]]


@pytest.mark.parametrize("door", ["loop", "lightning"])
def test_a_long_gpt2_batch_the_linear_prediction_misses_is_rescued_once_then_split_before_it_runs(door, tmp_path):
    """GPT-2 with eager attention: the long batch's T x T scores make its memory grow faster than its elements, so
    the prediction (linear in the elements, from the short batches) falls short."""
    normal, long, held = probed_long_batch(door, tmp_path / "probe", "eager")
    # what every step holds and a quarter of what the long step adds to it: by the linear prediction four
    # micro-batches of the long batch fit under it; the attention scores (and the gradients every micro-batch after
    # the first keeps) make them need more; eight fit
    limit = held + (long - held) // 4
    assert normal < 0.9 * limit and long > limit

    # threshold 1: the limit is the capacity, and only running out of it moves the ladder
    result = long_batch_run(door, tmp_path / "run", limit, "eager", threshold=1.0)

    events, history = result.guard.events, result.guard.history
    first_long, second_long = (events[events["step"] == step] for step in LONG)
    assert len(events) == len(first_long) + len(second_long)  # nothing happened at a normal batch
    actions = first_long["action"].tolist()
    assert actions[0] == "predicted_split" and actions[1:] == ["rescue_split"]  # fell short: rescued once
    rescue = first_long.iloc[1]
    assert rescue["rung"] == "microbatch" and "this batch only (the levels stay)" in rescue["reason"]
    parts = assert_long_batches_only_split_and_trained_like_unguarded(result, limit)
    assert parts[LONG[0]] == 2 * 2 ** int(first_long["level"].iloc[0])  # twice the parts of the split that failed
    # the second long batch starts in the parts the first needed: no OOM, no rescue
    assert second_long["action"].tolist() == ["predicted_split"]
    assert "as that one needed" in second_long["reason"].iloc[0] and parts[LONG[1]] == parts[LONG[0]]
    ooms = history.groupby("step")["num_ooms"].max()
    assert ooms[LONG[0]] == 1 and ooms[LONG[1]] == ooms.max() == 1  # the run's one OOM came with the first long batch
