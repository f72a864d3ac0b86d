"""LargestBatchSize: the batch size the estimate finds is set where BatchSizeFinder sets it (the model, a
datamodule), the dataloaders are rebuilt at it, and the fit then runs under MemGuardCallback with the same budget
without the guard having anything to do — in one process, and on two gloo ranks under ``ddp`` and
``ModelParallelStrategy`` (FSDP2), where both ranks take the same size."""

import json

import pandas as pd
import pytest

from lightning_memguard import LargestBatchSize, MemGuardCallback
from tests.helpers import fit_module
from tests.models import BlockStack, SizedData, SizedStack, pl, trainer_kwargs
from tests.spawn import launch_rank_script

BUDGET = 16 * 2**20  # parameters, gradients and Adam's state of the stack ~4 MiB: the batch fills the rest


def _assert_fits_without_the_guard_acting(guard: MemGuardCallback, size: int) -> None:
    """The guard saw no crossing, no out-of-memory error and no rung; the step filled the budget's threshold to within
    a few samples (the largest size, not a timid one)."""
    assert guard.events.empty, guard.events
    peak = guard.history["peak_bytes"].max()
    limit = guard.settings.threshold * BUDGET
    assert 0.97 * limit < peak <= limit, (peak, limit, size)


@pytest.mark.slow
def test_the_size_is_set_on_the_model_and_its_dataloader_yields_it_without_the_guard_acting(tmp_path):
    model, finder, guard = SizedStack(batch_size=8), LargestBatchSize(budget=BUDGET), MemGuardCallback(budget=BUDGET)
    fit_module(model, [finder, guard], tmp_path, max_steps=3)
    assert finder.batch_size > 64
    assert model.batch_size == finder.batch_size
    assert model.seen == [finder.batch_size] * 3
    _assert_fits_without_the_guard_acting(guard, finder.batch_size)


@pytest.mark.slow
def test_the_size_is_set_on_the_datamodule_under_the_guards_budget(tmp_path):
    model, data = SizedStack(), SizedData(batch_size=8)
    finder, guard = LargestBatchSize(), MemGuardCallback(budget=BUDGET)  # no budget of its own: the guard's
    trainer = pl.Trainer(callbacks=[finder, guard], default_root_dir=str(tmp_path),
                         **trainer_kwargs(logger=False, max_steps=3))
    trainer.fit(model, datamodule=data)
    assert data.batch_size == finder.batch_size > 64
    assert model.seen == [finder.batch_size] * 3
    _assert_fits_without_the_guard_acting(guard, finder.batch_size)


@pytest.mark.slow
def test_the_size_is_set_in_the_models_hparams_and_the_dataloader_is_rebuilt_at_it(tmp_path):
    model = BlockStack(batch_size=8, optimizer="adam", log_loss=False)  # its dataloader reads hparams.batch_size
    finder = LargestBatchSize(budget=BUDGET)
    trainer = fit_module(model, finder, tmp_path, max_steps=1)
    assert model.hparams.batch_size == finder.batch_size > 64
    assert trainer.train_dataloader.batch_size == finder.batch_size


def test_an_estimate_that_cannot_answer_keeps_the_batch_size_with_one_warning(tmp_path):
    model = SizedStack(batch_size=8)
    with pytest.warns(UserWarning, match="LargestBatchSize kept batch_size=8: not even one sample fits") as caught:
        fit_module(model, LargestBatchSize(budget="1MiB"), tmp_path, max_steps=1)
    assert len([w for w in caught if "LargestBatchSize" in str(w.message)]) == 1
    assert model.seen == [8]


@pytest.mark.parametrize("arguments, says", [
    (dict(budget="lots"), "budget='lots'"),
    (dict(batch_arg_name="batch size"), "batch_arg_name='batch size' must be an attribute name"),
    (dict(threshold=0), "threshold=0"),
    (dict(max_size=0), "max_size=0"),
])
def test_a_bad_argument_is_a_value_error_at_construction(arguments, says):
    with pytest.raises(ValueError, match=says):
        LargestBatchSize(**arguments)


@pytest.mark.parametrize("model, finder, trainer, says", [
    (SizedStack, LargestBatchSize(budget=BUDGET), {},
     "no 'batch_size' to set: .* model.batch_size, model.hparams.batch_size, datamodule.batch_size and "
     "datamodule.hparams.batch_size"),
    (lambda: SizedStack(batch_size=8), LargestBatchSize(), {}, "on CPU needs a budget"),
    (lambda: SizedStack(batch_size=8), LargestBatchSize(budget=BUDGET), {"precision": "bf16-true"},
     "precision='bf16-true' is not one the estimate models"),
])
def test_a_trainer_it_cannot_serve_is_a_value_error_before_the_first_step(tmp_path, model, finder, trainer, says):
    model = model()
    with pytest.raises(ValueError, match=says):
        fit_module(model, finder, tmp_path, **trainer)
    assert model.seen == []


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_on_two_ranks_both_take_the_same_size_and_fit_it_without_the_guard_acting(tmp_path, strategy):
    launch_rank_script("tests.integration.largest_batch_run", strategy, tmp_path, BUDGET, timeout_s=300)
    ranks = [json.loads((tmp_path / f"sizes.rank{rank}.json").read_text()) for rank in (0, 1)]
    size = ranks[0]["chosen"]
    assert size > 64 and ranks[1]["chosen"] == size
    assert all(rank["model"] == size and rank["seen"] == [size] * 3 for rank in ranks), ranks
    for name in ("memguard_events.csv", "memguard_events.rank1.csv"):
        assert pd.read_csv(tmp_path / name).empty, name
    for name in ("memguard_history.csv", "memguard_history.rank1.csv"):
        assert pd.read_csv(tmp_path / name)["peak_bytes"].max() <= 0.9 * BUDGET, name
