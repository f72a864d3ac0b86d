"""Run by test_largest_batch_size.py in a subprocess (Lightning starts the second rank by running this module again;
a hang is the test's timeout, not a stuck test run): two gloo ranks fit :class:`SizedStack` with LargestBatchSize
and MemGuardCallback under one budget, under ``ddp`` or ``ModelParallelStrategy`` (FSDP2 over both ranks). Each
rank writes what it chose and the sizes its batches had to ``sizes.rank<N>.json`` in the root."""

import json
import os
import sys
import warnings

from lightning_memguard import LargestBatchSize, MemGuardCallback
from tests.models import SizedStack, lightning_class, pl, trainer_kwargs

if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    strategy_name, root, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
    strategy = (lightning_class("strategies", "ModelParallelStrategy")(data_parallel_size=2, tensor_parallel_size=1)
                if strategy_name == "fsdp" else strategy_name)
    model, finder = SizedStack(batch_size=8), LargestBatchSize()
    trainer = pl.Trainer(callbacks=[finder, MemGuardCallback(budget=budget)], default_root_dir=root, logger=False,
                         **trainer_kwargs(strategy=strategy, devices=2, max_steps=3))
    trainer.fit(model)
    with open(os.path.join(root, f"sizes.rank{trainer.global_rank}.json"), "w") as file:
        json.dump({"chosen": finder.batch_size, "model": model.batch_size, "seen": model.seen}, file)
