"""Training steps users write themselves, split by the micro-batch rung: a token cross-entropy over labels padded
with -100 in a plain ``(x, y)`` batch (torch's ``ignore_index`` by default) and a summed loss given
``microbatch_weight="sum"`` train as the same run unguarded through every front door; a Lightning ``training_step``
returning predictions beside its loss hands ``on_train_batch_end`` the whole batch's, and its loss logged
``on_epoch`` is the unsplit run's mean. Each run is held under a hard
limit placed from a monitor-only probe of the same model, where only micro-batches fit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memguard import MemGuardCallback
from tests.helpers import (
    DOORS,
    assert_same_parameters,
    budget_for_a_share_of_the_step,
    fit_module,
    probe,
    probe_module,
    run,
    train_unguarded,
)
from tests.models import pl

VOCAB, WIDTH, LENGTH, SAMPLES = 40, 48, 12, 16


class TokenModel(nn.Module):
    """Embedding, three residual blocks, a head over the vocabulary: logits of [B, L, V]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def padded_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(ids, labels)`` batches whose rows have 1 to ``LENGTH`` labelled tokens, -100 after: micro-batches hold
    different numbers of labels, so a share of samples is not a share of labels."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=g)
        labels = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=g)
        lengths = torch.randint(1, LENGTH + 1, (SAMPLES,), generator=g)
        labels[torch.arange(LENGTH)[None] >= lengths[:, None]] = -100
        batches.append((ids, labels))
    return batches


def token_mean(model: nn.Module, batch) -> torch.Tensor:
    """torch's cross-entropy as users write it: a mean over the labels that are not -100."""
    ids, labels = batch
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())


def token_sum(model: nn.Module, batch) -> torch.Tensor:
    ids, labels = batch
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), reduction="sum")


def limit_where_micro_batches_fit(door: str, loss, tmp_path) -> int:
    """A hard limit a third of the way from what a step holds to its probed peak: the whole batch does not fit."""
    probed = probe(door, TokenModel(), padded_batches(2), tmp_path / "probe", loss=loss)
    held = probed.allocated("batch_start", from_step=1)
    return held + (probed.highest(from_step=1) - held) // 3


@pytest.mark.parametrize("door", DOORS)
def test_a_token_mean_over_labels_padded_with_minus_100_in_a_tuple_batch_trains_as_unguarded(door, tmp_path):
    limit = limit_where_micro_batches_fit(door, token_mean, tmp_path)
    data = padded_batches(3)
    result = run(door, TokenModel(), data, tmp_path, loss=token_mean, lr=0.5, cpu_hard_limit=limit,
                 mitigations=("microbatch",), explain=False)
    assert result.guard.history["micro_batches"].max() >= 2
    # weighted by the padded labels' share, not the samples' (which trained measurably apart: 1e-2 after 3 steps)
    assert_same_parameters(result.model, train_unguarded(TokenModel(), data, loss=token_mean, lr=0.5), atol=1e-6)
    said = result.warnings_with("labels not -100 in its tensor #1 (shape [16, 12])")
    assert len(said) == 1 and "cross_entropy" in said[0]


@pytest.mark.parametrize("door", DOORS)
def test_a_summed_loss_with_microbatch_weight_sum_trains_as_unguarded(door, tmp_path):
    limit = limit_where_micro_batches_fit(door, token_sum, tmp_path)
    data = padded_batches(3)
    result = run(door, TokenModel(), data, tmp_path, loss=token_sum, lr=1e-3, cpu_hard_limit=limit,
                 mitigations=("microbatch",), microbatch_weight="sum", explain=False)
    assert result.guard.history["micro_batches"].max() >= 2
    # each micro-loss counts whole: shares of samples would have scaled the gradient down by the number of parts
    assert_same_parameters(result.model, train_unguarded(TokenModel(), data, loss=token_sum, lr=1e-3), atol=1e-6)
    assert len(result.warnings_with("losses unweighted: microbatch_weight='sum'")) == 1


class ReturnsPredictions(pl.LightningModule):
    """A training step logging its loss's epoch mean and returning ``{"loss", "preds"}``; ``on_train_batch_end``
    collects the predictions it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TokenModel()
        self.collected: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        logits = self.model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        self.log("epoch_loss", loss, on_step=False, on_epoch=True)
        return {"loss": loss, "preds": logits.argmax(-1)}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.collected.append(outputs["preds"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        ids, labels = (torch.cat(tensors) for tensors in zip(*padded_batches(3)))
        return DataLoader(TensorDataset(ids, labels), batch_size=SAMPLES)


def test_a_training_steps_extra_outputs_and_logged_epoch_mean_are_the_whole_batchs(tmp_path):
    budget = budget_for_a_share_of_the_step(probe_module(ReturnsPredictions(), tmp_path / "probe"), 0.4)
    unguarded, guarded = ReturnsPredictions(), ReturnsPredictions()
    want_mean = fit_module(unguarded, [], tmp_path / "plain", max_steps=3).callback_metrics["epoch_loss"]
    guard = MemGuardCallback(budget=budget, cpu_hard_limit=budget, mitigations=("microbatch",), explain=False)
    got_mean = fit_module(guarded, guard, tmp_path / "guarded", max_steps=3).callback_metrics["epoch_loss"]
    assert guard.history["micro_batches"].max() >= 2
    assert_same_parameters(guarded, unguarded, atol=1e-6)
    # every sample's prediction, not the last micro-batch's only
    assert [tuple(p.shape) for p in guarded.collected] == [(SAMPLES, LENGTH)] * 3
    for got, want in zip(guarded.collected, unguarded.collected):
        assert torch.equal(got, want)
    # each micro-batch's logged loss weighs its share of the labels, not the whole batch's size each
    torch.testing.assert_close(got_mean, want_mean, atol=1e-6, rtol=1e-5)
