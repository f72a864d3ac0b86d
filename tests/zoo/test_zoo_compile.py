"""torch.compile under the guard, with a CPU budget: the model stays compiled (graphs are produced and run while
guarded), training runs, CPU memory is not counted (one warning says so and why; the history keeps its rows without
values), torch warns about no global hooks, and a later compile in the same process without MemGuard compiles.

The backend counts dynamo's graphs and their calls and runs them as captured (``backend="eager"`` with counters):
whether dynamo compiles is decided before any backend runs, so this is the question inductor would answer too, in
seconds instead of minutes.
"""

from __future__ import annotations

import os
import warnings

import pandas as pd
import pytest
import torch

from lightning_memguard import MemGuard, MemGuardCallback
from tests.helpers import CountingBackend
from tests.models import BlockStack, pl, trainer_kwargs
from tests.zoo.models import ZooModule, build, loss_of

GLOBAL_HOOKS = "global hooks"  # torch's warning when a torch.compile'd module runs with global module hooks
# GPT-2's checkpointed blocks cannot be estimated yet, compiled or not (the estimate warns): that is the
# checkpointing rung's matter, so the GPT-2 runs here leave the rung out
NO_CHECKPOINTING = ("amp", "microbatch")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def memguard_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "lightning-memguard" in str(w.message)]


def check_not_counted(history: pd.DataFrame, steps: int) -> None:
    """Rows for every step and phase, with the capacity but no allocated or peak values."""
    assert len(history) == 4 * steps
    assert history["allocated_bytes"].isna().all() and history["peak_bytes"].isna().all()
    assert history["capacity_bytes"].notna().all()


def check_later_compile_compiles(make_model, loss) -> None:
    """A model of the same classes, compiled afterwards without MemGuard: dynamo must not have cached a skip."""
    later = CountingBackend()
    model = torch.compile(make_model(), backend=later)
    loss(model).backward()
    assert later.compiled >= 1 and later.calls >= 1


class CompiledZoo(ZooModule):
    """A LightningModule that holds a compiled submodule (the zoo model)."""

    def __init__(self, backend, **kwargs) -> None:
        super().__init__("gpt2", **kwargs)
        self.model = torch.compile(self.model, backend=backend)


def test_lightning_module_holding_a_compiled_gpt2_stays_compiled_under_the_callback(tmp_path):
    backend = CountingBackend()
    module = CompiledZoo(backend)
    before = [p.detach().clone() for p in module.parameters()]
    guard = MemGuardCallback(budget="256MiB", mitigations=NO_CHECKPOINTING)
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path),
                         logger=pl.loggers.CSVLogger(str(tmp_path)), **trainer_kwargs(max_steps=3))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(module)
    assert trainer.global_step == 3
    assert backend.compiled >= 1 and backend.calls >= 3  # compiled while guarded, and the graph ran every step
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))
    notes = memguard_warnings(record)
    assert len(notes) == 1 and "model (torch.compile(module))" in notes[0] and "not counted" in notes[0]
    assert not [w for w in record if GLOBAL_HOOKS in str(w.message)]
    check_not_counted(guard.history, 3)
    # the CSV and the logger cope with the missing values: empty cells, capacity logged, no allocated curve
    written = pd.read_csv(os.path.join(trainer.log_dir, "memguard_history.csv"))
    assert len(written) == 12 and written["peak_bytes"].isna().all() and written["capacity_bytes"].notna().all()
    logged = pd.read_csv(os.path.join(trainer.logger.log_dir, "metrics.csv"))
    assert "memguard/capacity_GiB" in logged and not any("allocated" in c for c in logged.columns)

    batch = module.batches[0]
    check_later_compile_compiles(lambda: build("gpt2")[0], lambda model: loss_of(model, batch))


def test_lightning_compiled_as_a_whole_stays_compiled_under_the_callback(tmp_path):
    # trainer.fit(torch.compile(pl_module)): Lightning fits the original module with its forward and training_step
    # replaced by compiled functions (self.log is left out: dynamo cannot trace Lightning's logging, guard or not)
    backend = CountingBackend()
    module = BlockStack(log_loss=False)
    guard = MemGuardCallback(budget="64MiB", plan_at_start=True)
    trainer = pl.Trainer(callbacks=[guard], logger=False, default_root_dir=str(tmp_path), **trainer_kwargs())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(torch.compile(module, backend=backend))
    assert trainer.global_step == 4
    assert backend.compiled >= 1 and backend.calls >= 4
    # the compile note and the checkpointing rung's, both naming the compiled methods (the AMP rung's is about this
    # CPU's bf16 support, not about compiling)
    notes = [n for n in memguard_warnings(record) if "no logger" not in n and "no native bf16" not in n]
    assert len(notes) == 2 and all("compiled forward" in n and "training_step" in n for n in notes)
    assert "the checkpointing rung is off for this run: the model is compiled with torch.compile" in notes[0]
    assert not [w for w in record if GLOBAL_HOOKS in str(w.message)]
    check_not_counted(guard.history, 4)

    x = torch.randn(8, 16)
    check_later_compile_compiles(lambda: BlockStack(log_loss=False), lambda model: model(x).sum())


def test_a_plan_for_a_lightning_module_compiled_as_a_whole_leaves_the_checkpointing_rung_out(tmp_path):
    """trainer.fit(torch.compile(pl_module)) compiles its forward and training_step: the checkpointing rung did not
    see that (it looked for compiled modules only), the plan checkpointed blocks inside the compiled step, dynamo
    failed ("checkpoint not implemented for ... context_fn") and the ladder reverted every rung the plan had set,
    micro-batches included. The rung is off (one warning), the plan splits the batch, and the step stays compiled,
    training like the unguarded compiled fit."""
    backend = CountingBackend()
    torch.manual_seed(0)
    reference = BlockStack(log_loss=False, batch_size=256, n_samples=1024)
    module = BlockStack(log_loss=False, batch_size=256, n_samples=1024)
    module.load_state_dict(reference.state_dict())
    pl.Trainer(logger=False, default_root_dir=str(tmp_path / "plain"), **trainer_kwargs(max_steps=2)).fit(
        torch.compile(reference, backend="eager"))
    # measured uncompiled: 2.4 MB held across steps, a 6.5 MB step peak; 4.5 MB fits 2 micro-batches, not the batch
    guard = MemGuardCallback(budget=4_500_000, mitigations=("checkpointing", "microbatch"), plan_at_start=True,
                             explain=False)
    trainer = pl.Trainer(callbacks=[guard], logger=False, default_root_dir=str(tmp_path / "guarded"),
                         **trainer_kwargs(max_steps=2))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(torch.compile(module, backend=backend))
    assert trainer.global_step == 2 and backend.compiled >= 1
    assert any("checkpointing rung is off" in n and "training_step" in n for n in memguard_warnings(record))
    events = guard.events
    assert "revert" not in set(events["action"]) and events["action"].tolist()[0] == "plan"
    assert guard.levels["microbatch"] >= 1 and "checkpointing" not in guard.levels
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-4)


def test_plain_loop_with_a_compiled_gpt2_stays_compiled(tmp_path):
    backend = CountingBackend()
    model, make_batch = build("gpt2")
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = MemGuard(compiled, optimizer, log_dir=str(tmp_path), budget="256MiB", mitigations=NO_CHECKPOINTING)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        losses = [guard.step(make_batch(i), loss_of).item() for i in range(3)]
        guard.explain_next_step()  # the tensor diff runs on compiled code: no module hooks for it
        losses.append(guard.step(make_batch(3), loss_of).item())
        guard.close()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert backend.compiled >= 1 and backend.calls >= 4
    notes = memguard_warnings(record)
    assert len(notes) == 1 and "GPT2LMHeadModel (torch.compile(module))" in notes[0]
    assert not [w for w in record if GLOBAL_HOOKS in str(w.message)]
    check_not_counted(guard.history, 4)
    diff = pd.read_csv(tmp_path / "memguard_tensor_diff_step3.csv")
    assert (diff["change"] == "+").any() and diff["bytes"].sum() > 0

    batch = make_batch(0)
    check_later_compile_compiles(lambda: build("gpt2")[0], lambda model: loss_of(model, batch))


def test_fabric_with_a_compiled_model_stays_compiled(tmp_path):
    # Fabric compiles again what it wrapped and keeps the original apart: the guard must look at what it calls
    from lightning.fabric import Fabric

    from lightning_memguard import FabricMemGuard
    from tests.models import Block

    def make_model():
        torch.manual_seed(0)
        blocks = torch.nn.Sequential(*[Block(64) for _ in range(3)])
        return torch.nn.Sequential(torch.nn.Linear(16, 64), blocks, torch.nn.Linear(64, 1))

    backend = CountingBackend()
    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model()
    model, optimizer = fabric.setup(torch.compile(model, backend=backend), torch.optim.SGD(model.parameters(), 0.01))
    guard = FabricMemGuard(fabric, model, optimizer, log_dir=str(tmp_path), budget="64MiB")
    x = torch.randn(32, 16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(3):
            if step == 2:
                guard.explain_next_step()
            guard.step(x, lambda m, batch: m(batch).pow(2).mean())
        guard.close()
    assert backend.compiled >= 1 and backend.calls >= 3
    # the compile note alone (the AMP rung's is about this CPU's bf16 support, not about compiling)
    notes = [n for n in memguard_warnings(record) if "no logger" not in n and "no native bf16" not in n]
    assert len(notes) == 1 and "torch.compile(module)" in notes[0]
    assert not [w for w in record if GLOBAL_HOOKS in str(w.message)]
    check_not_counted(guard.history, 3)
    assert os.path.exists(tmp_path / "memguard_tensor_diff_step2.csv")
    check_later_compile_compiles(make_model, lambda m: m(x).sum())
