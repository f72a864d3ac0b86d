"""The data Lightning users feed, run as micro-batches by a real CPU Trainer: several training dataloaders (a
CombinedLoader's dict of batches of different sizes), an IterableDataset without a length, a last incomplete batch
that four parts do not divide, overfit_batches, a fraction of the batches, dataloaders reloaded every epoch with
another batch size, dataclass and named-tuple batches, per-sample strings and a sample count beside the tensors, and a
tensor that is not batch-major (a table all samples share). Most runs start at 4 micro-batches (as resumed at that
level); two run under a hard limit, where an OOM is rescued in parts or a batch larger than the first ones is
predicted too large. Each must end with the parameters of the same fit without a guard — or, where the batch cannot be
split right, not split it, or say once what changes."""

from __future__ import annotations

import collections
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from lightning_memguard import MemGuardCallback
from tests.helpers import budget_for_a_share_of_the_step, fit_module, probe_module
from tests.models import lightning_class, pl, trainer_kwargs

FEATURES = 8
SAMPLES = 70  # in batches of 16: four of 16, then one of 6, which four parts do not divide evenly
PARTS = 4


def regression_data(n: int = SAMPLES, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


class Regressor(pl.LightningModule):
    """A small MLP whose training step reads ``(x, y)`` from the batch with :meth:`pairs` (one pair per dataloader)
    and adds their mean-squared errors; it records the samples each training_step call saw, per pair."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))
        self.seen: list[tuple[int, ...]] = []

    def pairs(self, batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, y = batch
        return [(x, y)]

    def training_step(self, batch, batch_idx):
        pairs = self.pairs(batch)
        self.seen.append(tuple(len(x) for x, _ in pairs))
        return sum(F.mse_loss(self.net(x), y) for x, y in pairs)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(model: Regressor, root, guarded: bool, datamodule=None, **trainer):
    """Fits ``model`` for two epochs (or as ``trainer`` says); guarded: under a guard at 4 micro-batches. Returns the
    guard (``None`` unguarded) and MemGuard's warnings."""
    callbacks = []
    if guarded:
        guard = MemGuardCallback(budget="1GiB", mitigations=("microbatch",), explain=False)
        guard.load_state_dict({"ladder": {"levels": {"microbatch": 2}}})  # as resumed at 4 micro-batches
        callbacks = [guard]
    options = dict(max_steps=-1, max_epochs=2, callbacks=callbacks, logger=False, default_root_dir=str(root))
    options.update(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(**trainer_kwargs(**options)).fit(model, datamodule=datamodule)
    said = [str(w.message) for w in caught if "lightning-memguard" in str(w.message)]
    return (callbacks[0] if guarded else None), said


def fit_both(make_model, tmp_path, **trainer):
    """The same model fitted without and with the guard: (unguarded model, guarded model, guard, warnings)."""
    reference = make_model()
    fit(reference, tmp_path / "unguarded", False, **trainer)
    model = make_model()
    guard, said = fit(model, tmp_path / "guarded", True, **trainer)
    return reference, model, guard, said


def largest_difference(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def parts_per_step(guard) -> list[int]:
    return guard.history.groupby("step")["micro_batches"].max().tolist()


def whole_notes(said: list[str]) -> list[str]:
    return [message for message in said if "go whole into every micro-batch" in message]


# --- several training dataloaders -------------------------------------------------------------------------------------

class TwoLoaders(Regressor):
    """Two dataloaders in a CombinedLoader: ``a`` of 70 samples in batches of 16, ``b`` of 40 in batches of
    ``b_size``; the batch is ``{"a": (x, y), "b": (x, y)}`` and the loss a mean over each."""

    def __init__(self, mode: str, b_size: int) -> None:
        super().__init__()
        self.mode, self.b_size = mode, b_size

    def pairs(self, batch):
        return [pair for pair in (batch["a"], batch["b"]) if pair is not None]  # max_size: None once b runs out

    def train_dataloader(self):
        loaders = {"a": DataLoader(TensorDataset(*regression_data()), batch_size=16),
                   "b": DataLoader(TensorDataset(*regression_data(40, seed=2)), batch_size=self.b_size)}
        return lightning_class("utilities", "CombinedLoader")(loaders, self.mode)


@pytest.mark.parametrize("mode", ["max_size_cycle", "min_size", "max_size"])
def test_two_dataloaders_of_different_batch_sizes_train_as_whole_batches(mode, tmp_path):
    """The first dataloader's samples are split; the second's batch, of another size, goes whole into every
    micro-batch, whose weights add up to 1: the sum of the two means is the whole batch's, and the guard says once
    which tensors are not made smaller. (``max_size``: once ``b``'s 4 batches are done its entry is ``None``.)"""
    reference, model, guard, said = fit_both(lambda: TwoLoaders(mode, 12), tmp_path)
    assert largest_difference(model, reference) < 1e-6
    assert set(parts_per_step(guard)) == {PARTS}
    assert model.seen[:PARTS] == [(4, 12)] * PARTS  # a's 16 samples in fours, b's 12 whole each time
    if mode == "max_size":
        assert model.seen[4 * PARTS:5 * PARTS] == [(2,), (2,), (1,), (1,)]  # a's last 6 alone
    notes = whole_notes(said)
    assert len(notes) == 1 and "[12, 8], [12, 1]" in notes[0], said


def test_two_dataloaders_of_the_same_batch_size_are_both_split(tmp_path):
    reference, model, guard, said = fit_both(lambda: TwoLoaders("max_size_cycle", 16), tmp_path)
    assert largest_difference(model, reference) < 1e-6
    assert model.seen[:PARTS] == [(4, 4)] * PARTS
    assert not whole_notes(said)


# --- an iterable dataset, a last incomplete batch ---------------------------------------------------------------------

class Stream(IterableDataset):
    """Samples one at a time, without a ``__len__``: Lightning knows neither the epoch's length nor the batch size
    before the batch comes."""

    def __iter__(self):
        x, y = regression_data()
        for i in range(SAMPLES):
            yield x[i], y[i]


class StreamedRegressor(Regressor):
    def __init__(self, iterable: bool) -> None:
        super().__init__()
        self.iterable = iterable

    def train_dataloader(self):
        dataset = Stream() if self.iterable else TensorDataset(*regression_data())
        return DataLoader(dataset, batch_size=16, drop_last=False)


@pytest.mark.parametrize("iterable", [True, False], ids=["iterable", "map-style"])
def test_a_last_batch_of_six_runs_in_four_uneven_parts_and_trains_as_whole(iterable, tmp_path):
    reference, model, guard, said = fit_both(lambda: StreamedRegressor(iterable), tmp_path)
    assert largest_difference(model, reference) < 1e-6
    assert parts_per_step(guard) == [PARTS] * 10  # 5 batches an epoch, the last of 6 in 4 parts too
    sizes = [seen[0] for seen in model.seen]
    assert sizes == ([4] * 16 + [2, 2, 1, 1]) * 2  # each part weighted by its share of the samples


# --- overfit_batches, a fraction of the batches, reloaded dataloaders -------------------------------------------------

@pytest.mark.parametrize("option", [dict(overfit_batches=2), dict(limit_train_batches=0.5)],
                         ids=["overfit_batches", "limit_train_batches"])
def test_trainer_options_that_pick_the_batches_train_as_whole(option, tmp_path):
    reference, model, guard, said = fit_both(lambda: StreamedRegressor(False), tmp_path, max_epochs=3, **option)
    assert largest_difference(model, reference) < 1e-6
    assert parts_per_step(guard) == [PARTS] * 2 * 3  # 2 batches an epoch either way (half of 5, rounded down)


class GrowingBatches(pl.LightningDataModule):
    """A datamodule whose batch size changes every epoch (with ``reload_dataloaders_every_n_epochs=1``):
    8, then 32 (more samples than the first batch told the guard), then 3 (fewer than four parts)."""

    SIZES = (8, 32, 3)

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0

    def train_dataloader(self):
        size = self.SIZES[min(self.epoch, len(self.SIZES) - 1)]
        self.epoch += 1
        return DataLoader(TensorDataset(*regression_data(24)), batch_size=size)


def test_dataloaders_reloaded_every_epoch_with_another_batch_size_train_as_whole(tmp_path):
    reference = Regressor()
    fit(reference, tmp_path / "unguarded", False, GrowingBatches(), max_epochs=3,
        reload_dataloaders_every_n_epochs=1)
    model = Regressor()
    guard, said = fit(model, tmp_path / "guarded", True, GrowingBatches(), max_epochs=3,
                      reload_dataloaders_every_n_epochs=1)
    assert largest_difference(model, reference) < 1e-6
    sizes = [seen[0] for seen in model.seen]
    assert sizes == [2] * 12 + [6] * 4 + [1] * 24  # 3 batches of 8, then 1 of 24 (of 32), then 8 of 3 in 3 parts
    assert parts_per_step(guard) == [PARTS] * 4 + [3] * 8


def deep_net() -> nn.Module:
    """Four layers of 128 whose activations, for a batch of 1024 samples, are most of a step."""
    torch.manual_seed(0)
    layers = [nn.Linear(FEATURES, 128), nn.Tanh()]
    for _ in range(3):
        layers += [nn.Linear(128, 128), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(128, 1))


class Curriculum(Regressor):
    """Batches of 2 samples in the first epoch, then of 1024 (its dataloader reloaded every epoch)."""

    def __init__(self, sizes: tuple[int, ...] = (2, 1024)) -> None:
        super().__init__()
        self.net, self.sizes, self.epoch = deep_net(), sizes, 0

    def train_dataloader(self):
        size = self.sizes[min(self.epoch, len(self.sizes) - 1)]
        self.epoch += 1
        return DataLoader(TensorDataset(*regression_data(2048)), batch_size=size)


def test_batches_that_grow_past_the_first_ones_run_split_under_a_hard_limit_and_train_as_whole(tmp_path):
    """The first batch (2 samples) caps the rung at 2 micro-batches; the epoch after brings batches of 1024 that do
    not fit whole: each is predicted too large and runs as 4 micro-batches, no out-of-memory error."""
    limit = budget_for_a_share_of_the_step(probe_module(Curriculum((1024,)), tmp_path / "probe", max_steps=2), 0.3)
    options = dict(max_steps=-1, max_epochs=2, limit_train_batches=2, reload_dataloaders_every_n_epochs=1)
    reference = Curriculum()
    fit_module(reference, [], tmp_path / "unguarded", **options)
    model = Curriculum()
    guard = MemGuardCallback(cpu_hard_limit=limit, threshold=1.0, plan_at_start=False, mitigations=("microbatch",),
                             explain=False)
    fit_module(model, guard, tmp_path / "guarded", **options)
    assert largest_difference(model, reference) < 1e-6
    assert parts_per_step(guard) == [1, 1, 4, 4] and model.seen == [(2,), (2,)] + [(256,)] * 8
    assert guard.history["num_ooms"].max() == 0 and (guard.history["peak_bytes"] <= limit).all()
    assert guard.events["action"].tolist() == ["predicted_split"] * 2


# --- batch containers and non-tensor entries --------------------------------------------------------------------------

Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Example:
    x: torch.Tensor
    y: torch.Tensor
    source: str = "synthetic"


def pairs_as(kind: str):
    def collate(items):
        x, y = torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])
        return Pair(x, y) if kind == "namedtuple" else Example(x, y)

    return collate


class Containers(Regressor):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def pairs(self, batch):
        assert type(batch) is (Pair if self.kind == "namedtuple" else Example)  # every part keeps its type
        return [(batch.x, batch.y)]

    def train_dataloader(self):
        return DataLoader(TensorDataset(*regression_data()), batch_size=16, collate_fn=pairs_as(self.kind))


@pytest.mark.parametrize("kind", ["namedtuple", "dataclass"])
def test_named_tuple_and_dataclass_batches_train_as_whole(kind, tmp_path):
    reference, model, guard, said = fit_both(lambda: Containers(kind), tmp_path, max_epochs=1)
    assert largest_difference(model, reference) < 1e-6
    assert parts_per_step(guard) == [PARTS] * 5


@dataclasses.dataclass
class Counted:
    """A batch with its sample count, which its loss divides a sum by."""

    x: torch.Tensor
    y: torch.Tensor
    n: int


@dataclasses.dataclass
class CountedForTransformers:
    """The same, the count named as transformers names it."""

    x: torch.Tensor
    y: torch.Tensor
    num_items_in_batch: int


class SummedOverCount(Regressor):
    def __init__(self, batch_class: type) -> None:
        super().__init__()
        self.batch_class = batch_class

    def training_step(self, batch, batch_idx):
        count = batch.n if self.batch_class is Counted else batch.num_items_in_batch
        return (self.net(batch.x) - batch.y).square().sum() / count

    def train_dataloader(self):
        def collate(items):
            return self.batch_class(torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]), len(items))

        return DataLoader(TensorDataset(*regression_data()), batch_size=16, collate_fn=collate)


def test_a_sample_count_in_the_batch_is_named_once_and_num_items_in_batch_keeps_the_step_exact(tmp_path):
    """A count goes unchanged into every micro-batch: a loss that divides by it is no longer the batch's mean once
    weighted by sample shares — said once; named ``num_items_in_batch`` the micro-losses add up unweighted, exact."""
    reference, model, guard, said = fit_both(lambda: SummedOverCount(Counted), tmp_path / "n", max_epochs=1)
    notes = [message for message in said if "equals its 16 samples" in message]
    assert len(notes) == 1 and "'n'" in notes[0] and "num_items_in_batch" in notes[0], said
    assert largest_difference(model, reference) > 1e-3  # what the note warns of
    reference, model, guard, said = fit_both(lambda: SummedOverCount(CountedForTransformers), tmp_path / "items",
                                             max_epochs=1)
    assert largest_difference(model, reference) < 1e-6
    assert parts_per_step(guard) == [PARTS] * 5 and not [m for m in said if "equals its" in m]


class Named(Dataset):
    """Samples as dicts with a name and an id beside the tensors: ``default_collate`` makes the names a list of
    strings and the ids a tensor."""

    def __init__(self) -> None:
        self.x, self.y = regression_data()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "name": "sample" + "s" * (i % 5), "id": i}


class NamedRegressor(Regressor):
    """Each sample's squared error weighted by the length of its name: a names list that did not follow its samples
    into the micro-batch would not match its ``x`` (an error) or weigh the wrong samples."""

    def training_step(self, batch, batch_idx):
        assert len(batch["name"]) == len(batch["x"]) == len(batch["id"])
        self.seen.append((len(batch["x"]),))
        weights = torch.tensor([len(name) / 10 for name in batch["name"]]).unsqueeze(1)
        return (weights * (self.net(batch["x"]) - batch["y"]).square()).mean()

    def train_dataloader(self):
        return DataLoader(Named(), batch_size=16)


def test_per_sample_strings_beside_the_tensors_are_split_with_their_samples(tmp_path):
    reference, model, guard, said = fit_both(NamedRegressor, tmp_path)
    assert largest_difference(model, reference) < 1e-6
    assert parts_per_step(guard) == [PARTS] * 10
    assert "revert" not in set(guard.events["action"])  # the split never broke the step


class WithTable(Regressor):
    """A batch holding, beside the samples, a table of 100 rows all samples share (not batch-major)."""

    def __init__(self, table_first: bool) -> None:
        super().__init__()
        self.table_first = table_first

    def pairs(self, batch):
        return [(batch["x"] + batch["table"].mean(dim=0), batch["y"])]

    def train_dataloader(self):
        table = torch.randn(100, FEATURES, generator=torch.Generator().manual_seed(3))

        def collate(items):
            samples = {"x": torch.stack([x for x, _ in items]), "y": torch.stack([y for _, y in items])}
            return {"table": table, **samples} if self.table_first else {**samples, "table": table}

        return DataLoader(TensorDataset(*regression_data()), batch_size=16, collate_fn=collate)


def test_a_shared_table_after_the_samples_goes_whole_into_every_micro_batch(tmp_path):
    reference, model, guard, said = fit_both(lambda: WithTable(table_first=False), tmp_path, max_epochs=1)
    assert largest_difference(model, reference) < 1e-6
    assert parts_per_step(guard) == [PARTS] * 5
    notes = whole_notes(said)
    assert len(notes) == 1 and "[100, 8]" in notes[0], said


def test_a_shared_table_before_the_samples_turns_micro_batching_off_with_one_warning(tmp_path):
    """Its leading size (100) would be taken as the samples: the table would be cut and every micro-batch would get
    all the samples. The rung is off instead; the batches run whole and train as without a guard."""
    reference, model, guard, said = fit_both(lambda: WithTable(table_first=True), tmp_path, max_epochs=1)
    assert largest_difference(model, reference) < 1e-6
    assert parts_per_step(guard) == [1] * 5 and guard.levels["microbatch"] == 0
    off = [message for message in said if "microbatch rung is off" in message]
    assert len(off) == 1 and "leading size 100" in off[0] and "2 tensors have leading size 16" in off[0], said


class TimeMajor(pl.LightningModule):
    """A GRU as torch builds it by default (time-major): batches of ``x`` [T=12, B=16, F] and ``y`` [B], the loss on
    the last step's output. Split along its leading size, every micro-batch would hold all 16 samples and a part of
    each sequence."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.head = nn.GRU(FEATURES, 16), nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        output, _ = self.rnn(x)
        return F.mse_loss(self.head(output[-1]), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(4)
        sequences = torch.randn(64, 12, FEATURES, generator=generator)
        data = TensorDataset(sequences, sequences.sum(dim=(1, 2)).sin().unsqueeze(1))

        def collate(items):  # time-major, as nn.GRU's default reads it
            return torch.stack([x for x, _ in items], dim=1), torch.stack([y for _, y in items])

        return DataLoader(data, batch_size=16, collate_fn=collate)


def test_a_time_major_batch_turns_micro_batching_off_with_one_warning(tmp_path):
    """Its leading size (12 time steps) would be taken as the samples; the rung is off instead, the batches run whole
    and train as without a guard."""
    reference, model, guard, said = fit_both(TimeMajor, tmp_path, max_epochs=1)
    assert largest_difference(model, reference) < 1e-6
    assert parts_per_step(guard) == [1] * 4 and guard.levels["microbatch"] == 0
    off = [message for message in said if "microbatch rung is off" in message]
    assert len(off) == 1 and "time-major" in off[0] and "[12, 16, 8]" in off[0], said


class TimeMajorEveryStep(TimeMajor):
    """:class:`TimeMajor` with a target at every step: ``x`` [T=12, B=16, F] and ``y`` [T, B, 1], every tensor of
    leading size 12 — the batch's shapes look batch-major; only the GRU shows that 12 is the time steps."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        output, _ = self.rnn(x)
        return F.mse_loss(self.head(output), y)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(4)
        sequences = torch.randn(64, 12, FEATURES, generator=generator)
        data = TensorDataset(sequences, sequences.cumsum(dim=1).sum(dim=2, keepdim=True).sin())
        return DataLoader(data, batch_size=16, collate_fn=lambda items: tuple(
            torch.stack(column, dim=1) for column in zip(*items)))


class BatchMajorGRU(TimeMajorEveryStep):
    """The same data batch-major (``x`` [B=16, T=12, F], ``y`` [B, T, 1]), transposed for the time-major GRU in the
    training step: its GRU receives the samples second, and micro-batches split them."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        output, _ = self.rnn(x.transpose(0, 1))
        return F.mse_loss(self.head(output.transpose(0, 1)), y)

    def train_dataloader(self):
        loader = super().train_dataloader()
        return DataLoader(loader.dataset, batch_size=16)


def test_a_batch_every_tensor_of_which_is_time_major_turns_micro_batching_off(tmp_path):
    """Every tensor leads with the 12 time steps, which the batch's shapes cannot tell from samples: the GRU, seen
    in a forward on the meta device at the first batch, receives them as its time steps. The rung is off with one
    warning naming the layer; the batches run whole and train as without a guard."""
    reference, model, guard, said = fit_both(TimeMajorEveryStep, tmp_path, max_epochs=1)
    assert largest_difference(model, reference) < 1e-6
    assert parts_per_step(guard) == [1] * 4 and guard.levels["microbatch"] == 0
    off = [message for message in said if "microbatch rung is off" in message]
    assert len(off) == 1 and "'rnn'" in off[0] and "[12, 16, 8]" in off[0] and "time steps" in off[0], said


def test_a_batch_major_batch_transposed_for_a_time_major_layer_is_split(tmp_path):
    """The GRU reads time-major, but the model hands it the samples second: the batches split into 4 micro-batches
    and train as whole batches do."""
    reference, model, guard, said = fit_both(BatchMajorGRU, tmp_path, max_epochs=1)
    assert largest_difference(model, reference) < 1e-5
    assert parts_per_step(guard) == [4] * 4
    assert not [message for message in said if "microbatch rung is off" in message], said


# --- the OOM rescue, on a CombinedLoader's batch ----------------------------------------------------------------------

class WideTwoLoaders(TwoLoaders):
    """:class:`TwoLoaders` with deeper layers and large ``a`` batches, so that the activations are most of a step: a
    batch of ``a`` 1024 and ``b`` 32 samples."""

    def __init__(self) -> None:
        super().__init__("max_size_cycle", 32)
        self.net = deep_net()

    def train_dataloader(self):
        loaders = {"a": DataLoader(TensorDataset(*regression_data(2048)), batch_size=1024),
                   "b": DataLoader(TensorDataset(*regression_data(96, seed=2)), batch_size=32)}
        return lightning_class("utilities", "CombinedLoader")(loaders, self.mode)


def test_an_oom_on_two_dataloaders_batch_is_rescued_in_parts_and_trains_as_whole(tmp_path):
    """Under a hard limit the whole batch does not fit: its first step runs out of memory, runs again as
    micro-batches (``a`` split, ``b`` whole in each) and the fit ends where the fit without a guard does."""
    peaks = probe_module(WideTwoLoaders(), tmp_path / "probe", max_steps=-1, max_epochs=1)
    limit = budget_for_a_share_of_the_step(peaks, 0.7)
    reference = WideTwoLoaders()
    fit_module(reference, [], tmp_path / "unguarded", max_steps=-1, max_epochs=1)
    model = WideTwoLoaders()
    guard = MemGuardCallback(cpu_hard_limit=limit, threshold=1.0, plan_at_start=False, mitigations=("microbatch",),
                             explain=False)
    fit_module(model, guard, tmp_path / "guarded", max_steps=-1, max_epochs=1)
    assert largest_difference(model, reference) < 1e-6
    history = guard.history
    assert history["num_ooms"].max() >= 1 and (history["peak_bytes"] <= limit).all()
    assert history.groupby("step")["micro_batches"].max().min() > 1  # every step ran in parts
    assert all(b == 32 for _, b in model.seen)  # b whole in every part and attempt
    rescue = guard.events.iloc[0]
    assert (rescue["step"], rescue["action"], rescue["rung"]) == (0, "rescue", "microbatch")
