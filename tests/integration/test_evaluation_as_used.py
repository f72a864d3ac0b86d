"""Evaluation loops as users write them, through a real Trainer, under a CPU hard limit that an unsplit evaluation
batch does not fit and half of one does: what the user gets from a split batch equals an unguarded, unsplit run's.

- Generation: ``validation_step`` and ``predict_step`` call ``generate`` (greedy, ``max_new_tokens``) on the zoo's
  GPT-2 (a decoder: prompt and continuation) and T5 (an encoder-decoder). The end-of-sequence ids are chosen so that
  every row of a batch's first half ends at its first new token and some rows of its second half never end: the
  parts generate rows of different lengths, which ``generate`` pads, in a whole batch, with the pad id on the right.
  Validation has two dataloaders, an ``Accuracy`` updated in the step and logged on_epoch, outputs read in
  ``on_validation_batch_end``; predict returns a tuple of tokens and strings, written by ``BasePredictionWriter``
  callbacks at every batch and at the epoch's end.

Every hard limit lies between peaks probed from monitor-only runs of the same model and data, never copied."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_memguard import MemGuardCallback, MemGuardWarning
from tests.helpers import limit_between, one_intra_op_thread
from tests.models import lightning_class, pl, trainer_kwargs
from tests.zoo.models import build, make_batch

transformers = pytest.importorskip("transformers")
torchmetrics = pytest.importorskip("torchmetrics")
BasePredictionWriter = lightning_class("callbacks", "BasePredictionWriter")

ROWS, NEW, PAD = 32, 8, 0  # samples an evaluation batch, tokens generated at most, the pad id
TRAINING = ("batch_start", "after_forward", "after_backward", "after_optimizer_step")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_intra_op_thread():
        yield


class Generating(pl.LightningModule):
    """A zoo model trained on two small batches, validated on two dataloaders and predicted by greedy generation."""

    def __init__(self, name: str, rows: int = ROWS, eos=None) -> None:
        super().__init__()
        self.name, self.eos = name, eos
        self.model, _ = build(name)
        self.model.eval()  # no dropout: generation is the same in every run
        # as users set them for generate: the tokens that end a sequence, and what pads a row that ended early
        self.model.generation_config.eos_token_id, self.model.generation_config.pad_token_id = eos, PAD
        self.start = 1 if self.model.config.is_encoder_decoder else make_batch(name, 0).get("input_ids").shape[1]
        self.train_batches = [make_batch(name, i, batch_size=4) for i in range(2)]
        self.val_batches = [[make_batch(name, seed + i, batch_size=rows, padded=False) for i in range(2)]
                            for seed in (100, 300)]
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=128, average="micro")
        self.generated = torchmetrics.SumMetric()  # tokens generated, as a BLEU counts n-grams
        self.seen = []  # what on_validation_batch_end received

    def generate(self, batch):
        return self.model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                   max_new_tokens=NEW, do_sample=False)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        # the weights stay as built: the end ids chosen from them end the rows they were chosen for
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(self.train_batches, batch_size=None)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        tokens = self.generate(batch)
        # numbers of each row's own tokens: a part's rows are as long as its longest, not as the batch's longest
        self.accuracy.update(tokens[:, self.start], batch["input_ids"][:, 0])
        self.generated.update((tokens[:, self.start:] != PAD).sum())
        self.log("val_acc", self.accuracy, on_epoch=True)
        self.log("generated", self.generated, on_epoch=True)
        return {"tokens": tokens, "text": decoded(tokens)}

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.seen.append((dataloader_idx, batch_idx, outputs["tokens"], outputs["text"]))

    def val_dataloader(self):
        return [DataLoader(batches, batch_size=None) for batches in self.val_batches]

    def predict_step(self, batch, batch_idx):
        tokens = self.generate(batch)
        return tokens, decoded(tokens)

    def predict_dataloader(self):
        return DataLoader(self.val_batches[0], batch_size=None)


def decoded(tokens: torch.Tensor) -> list[str]:
    """Each row as a tokenizer's ``batch_decode(..., skip_special_tokens=True)`` reads it: without the padding."""
    return [" ".join(str(token) for token in row.tolist() if token != PAD) for row in tokens]


class Writer(BasePredictionWriter):
    def __init__(self, interval: str) -> None:
        super().__init__(interval)
        self.written = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.written.append(prediction)

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.written.append(predictions)


def ending_ids(name: str) -> list[int]:
    """End-of-sequence ids that end every row of the first evaluation batch's first half at its first new token: the
    first tokens those rows generate unended."""
    module = Generating(name)
    with torch.no_grad():
        tokens = module.generate(module.val_batches[0][0])
    return sorted(set(tokens[: ROWS // 2, module.start].tolist()) - {PAD})


def evaluate(name: str, root, guard=None, rows: int = ROWS, eos=None, fit: bool = True):
    """Fits (validation at its end) or validates, then predicts; returns the module, the callback metrics, the
    predictions, the writers' predictions, the fit's or validation's history (where ``guard``) and MemGuard's
    warnings."""
    module = Generating(name, rows, eos)
    writers = [Writer("batch"), Writer("epoch")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # Lightning's notes on workers are left out below
        trainer = pl.Trainer(**trainer_kwargs(max_steps=2, logger=False, num_sanity_val_steps=0,
                                              default_root_dir=str(root),
                                              callbacks=writers + ([guard] if guard is not None else [])))
        trainer.fit(module) if fit else trainer.validate(module, verbose=False)
        history = guard.history if guard is not None else None
        metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
        predictions = trainer.predict(module)
    said = [str(w.message) for w in caught if issubclass(w.category, MemGuardWarning)]
    return module, metrics, predictions, [w.written for w in writers], history, said


def assert_same(got, want) -> None:
    """Equal values in equal containers; tensors of one shape."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for got_item, want_item in zip(got, want):
            assert_same(got_item, want_item)
    else:
        assert got == want


@pytest.mark.parametrize("name, fit", [("gpt2", True), ("t5", False)])
def test_generation_in_a_split_evaluation_batch_equals_the_unsplit_batchs(tmp_path, name, fit):
    eos = ending_ids(name)
    with torch.no_grad():  # the parts generate rows of different lengths: the first half's end at once
        module = Generating(name, eos=eos)
        whole = module.generate(module.val_batches[0][0])
        halves = [module.generate({k: v[rows] for k, v in module.val_batches[0][0].items()})
                  for rows in (slice(0, ROWS // 2), slice(ROWS // 2, ROWS))]
    assert halves[0].shape[1] < halves[1].shape[1] == whole.shape[1]

    peaks = {}
    for rows in (ROWS, ROWS // 2):
        probe = MemGuardCallback(mitigations=(), cpu_sample_every=1, explain=False)
        _, _, _, _, history, _ = evaluate(name, tmp_path / f"probe{rows}", probe, rows, eos, fit)
        peaks[rows] = (int(history[history["phase"] == "validation"]["peak_bytes"].max()),
                       int(history[history["phase"].isin(TRAINING)]["peak_bytes"].max() if fit else 0))
    unsplit, half = peaks[ROWS][0], max(peaks[ROWS // 2][0], peaks[ROWS][1])
    assert half < unsplit, f"half a batch ({half}) must fit where the whole ({unsplit}) does not"
    limit = limit_between(unsplit, half)

    want = evaluate(name, tmp_path / "unguarded", eos=eos, fit=fit)
    guard = MemGuardCallback(cpu_hard_limit=limit, mitigations=(), explain=False)
    got = evaluate(name, tmp_path / "guarded", guard, eos=eos, fit=fit)
    assert not [said for said in got[5] if "list of the parts'" in said]  # no output came back as its parts'
    validation = got[4][got[4]["phase"] == "validation"]
    assert len(validation) == 4 and (validation["micro_batches"] >= 2).all()
    assert (guard.history["micro_batches"] >= 2).all() and len(guard.history) == 2  # the predict batches
    assert set(guard.events["action"]) == {"eval_split"}

    assert got[1] == want[1] and set(want[1]) == {f"{key}/dataloader_idx_{i}"
                                                        for key in ("val_acc", "generated") for i in (0, 1)}
    assert [seen[:2] for seen in got[0].seen] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_same(got[0].seen, want[0].seen)  # tokens padded with the pad id, as generate pads the whole batch
    assert_same(got[2], want[2])
    assert_same(got[3], want[3])  # the writers', at every batch and at the epoch's end


# --- a step that appends to a list: a part that ran is not run again --------------------------------------------------
WIDTH = 256


class Appending(pl.LightningModule):
    """Validates batches whose first half is short rows and second half long ones (``steps`` a row; a part's memory
    grows with its longest row), appending each step's predictions to a list — Lightning's own pattern since
    ``validation_epoch_end`` went — and counting the samples seen in a dict."""

    def __init__(self, rows: int = ROWS, steps: tuple = (1, 4)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(WIDTH, WIDTH)
        g = torch.Generator().manual_seed(1)
        lengths = torch.tensor([steps[0]] * (rows - rows // 2) + [steps[1]] * (rows // 2))
        self.val_batches = [{"x": torch.randn(rows, WIDTH, generator=g), "steps": lengths} for _ in range(2)]
        self.validation_step_outputs = []
        self.seen = {"samples": 0}

    def validation_step(self, batch, batch_idx):
        hidden = self.layer(batch["x"]).repeat(1, 4 * int(batch["steps"].max()))
        self.validation_step_outputs.append(hidden[:, 0].clone())  # appended before the part's OOM: cut back
        self.log("val_energy", hidden.pow(2).mean())  # the long rows' half runs out of memory here
        self.seen["samples"] += len(batch["x"])  # what no savepoint puts back: counted where a part ran to its end

    def val_dataloader(self):
        return DataLoader(self.val_batches, batch_size=None)


def validate(module, root, guard=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(**trainer_kwargs(logger=False, default_root_dir=str(root),
                                              callbacks=[guard] if guard is not None else []))
        trainer.validate(module, verbose=False)
    return float(trainer.callback_metrics["val_energy"])


def test_the_parts_that_ran_before_a_part_ran_out_of_memory_are_not_run_again(tmp_path):
    peaks = []
    for rows in (ROWS // 2, ROWS // 4):  # the long rows' half of a batch, and their quarter
        probe = MemGuardCallback(mitigations=(), cpu_sample_every=1, explain=False)
        validate(Appending(rows, steps=(4, 4)), tmp_path / f"probe{rows}", probe)
        peaks.append(int(probe.history["peak_bytes"].max()))
    limit = limit_between(*peaks)  # the whole batch and its long half run out of memory; their quarters fit

    want_module, got_module = Appending(), Appending()
    want = validate(want_module, tmp_path / "unguarded")
    guard = MemGuardCallback(cpu_hard_limit=limit, mitigations=(), explain=False)
    got = validate(got_module, tmp_path / "guarded", guard)
    # the whole batch, then its second half, ran out of memory: the first half ran once, in the attempt of 2 parts,
    # and what the failed half appended to the module's list was cut back
    assert list(guard.events["level"]) == [2, 4] and list(guard.history["micro_batches"]) == [4, 4]
    assert got_module.seen == want_module.seen == {"samples": 2 * ROWS}
    # the same outputs, in order, each once; a Linear over 8 rows may round otherwise than over 32 (the CPU's matrix
    # kernels block the rows differently on some machines: 4.8e-7 off on one), so to rounding, not bit for bit
    torch.testing.assert_close(torch.cat(got_module.validation_step_outputs),
                               torch.cat(want_module.validation_step_outputs), rtol=1e-5, atol=1e-6)
    assert got == pytest.approx(want, rel=1e-6)
