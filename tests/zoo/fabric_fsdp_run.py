"""Run by test_zoo_fabric_fsdp.py in a subprocess (Fabric's ModelParallelStrategy starts the second rank by running
this module again; a hang is the test's timeout): two CPU gloo ranks under Lightning Fabric's
``ModelParallelStrategy`` shard a tiny Llama as torchtitan does (``fully_shard`` on every decoder layer, then the
root) in Fabric's ``parallelize_fn`` and train it with AdamW on each rank's own padded token batches.

``<root>``: an unguarded fit (the reference) in ``<root>/plain``, then, for each rung, a fit under
:class:`~lightning_memguard.FabricMemGuard` with a CPU hard limit that rank 1 alone passes once, at step
``FAILING_STEP``, in a layer's backward (``checkpointing``) or forward (``microbatch``), in ``<root>/<rung>``. Each
fit writes how it ended (``outcome.rank<N>.txt``), its gathered parameters (``parameters.rank<N>.pt``) and whether
every FSDP2 module still reduces its gradients after the guard ended (``sync.rank<N>.txt``)."""

import os
import sys
import warnings

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy

from lightning_memguard import FabricMemGuard
from tests.ranks import OneOffBallast, run_recording_outcome, save_full_parameters, step_with_one_oom
from tests.zoo.models import build, decoder_layers, fully_shard_layers, loss_of, make_batch

STEPS, FAILING_STEP = 4, 2  # the OOM after complete steps: FSDP2's sequence of collectives is known by then
LIMIT = 32 * 2 ** 20  # far above a step; the ballast alone passes it
RUNGS = {"checkpointing": "backward", "microbatch": "forward"}  # rung -> where rank 1 runs out of memory


def parallelize(model: torch.nn.Module, mesh) -> torch.nn.Module:
    return fully_shard_layers(model, mesh["data_parallel"])


def fit(fabric: Fabric, folder: str, rung: str = "") -> None:
    rank = fabric.global_rank
    os.makedirs(folder, exist_ok=True)
    model = fabric.setup_module(build("llama")[0])  # seeded: the same parameters on both ranks
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    batches = [make_batch("llama", 10 * rank + index, batch_size=8) for index in range(STEPS)]

    def train() -> None:
        if not rung:
            for batch in batches:
                optimizer.zero_grad(set_to_none=True)
                fabric.backward(loss_of(model, batch))
                optimizer.step()
            return
        ballast = OneOffBallast(decoder_layers(model.module)[1], RUNGS[rung], LIMIT)
        guard = FabricMemGuard(fabric, model, optimizer, log_dir=folder, cpu_hard_limit=LIMIT, threshold=1.0,
                               plan_at_start=False, mitigations=(rung,), explain=False)
        step_with_one_oom(guard, batches, loss_of, rank, ballast, FAILING_STEP)

    outcome = run_recording_outcome(train, folder, lambda: rank)
    groups = [group for module in model.module.modules() if hasattr(module, "_get_fsdp_state")
              for group in module._get_fsdp_state()._fsdp_param_groups]
    with open(os.path.join(folder, f"sync.rank{rank}.txt"), "w") as file:
        file.write(str(all(group.reduce_grads for group in groups)))
    if outcome == "finished":  # gathering the shards is a collective: only after both ranks finished
        save_full_parameters(model.module, folder, rank)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # two ranks on a busy machine: a second thread per rank only adds waiting
    root = sys.argv[1]
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fit(fabric, os.path.join(root, "plain"))
    for name in RUNGS:
        fit(fabric, os.path.join(root, name), name)
