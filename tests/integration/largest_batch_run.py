"""Run by test_largest_batch_size.py in a subprocess (Lightning starts the second rank by running this module again;
a hang is the test's timeout, not a stuck test run): two gloo ranks fit :class:`SizedStack` with LargestBatchSize
and MemGuardCallback under one budget, under ``ddp`` or ``ModelParallelStrategy`` (FSDP2 over both ranks). Each
rank writes what it chose and the sizes its batches had to ``sizes.rank<N>.json`` in the root."""

import json
import os
import sys
import warnings

from lightning_memguard import LargestBatchSize, MemGuardCallback
from tests.models import SizedStack, pl, trainer_kwargs, two_rank_strategy

if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    strategy_name, root, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model, finder = SizedStack(batch_size=8), LargestBatchSize()
    trainer = pl.Trainer(callbacks=[finder, MemGuardCallback(budget=budget)], default_root_dir=root, logger=False,
                         **trainer_kwargs(strategy=two_rank_strategy(strategy_name), devices=2, max_steps=3))
    trainer.fit(model)
    with open(os.path.join(root, f"sizes.rank{trainer.global_rank}.json"), "w") as file:
        json.dump({"chosen": finder.batch_size, "model": model.batch_size, "seen": model.seen}, file)
