"""The recovery installed on a DistributedDataParallel module does not keep it alive: a module a fit is done with is
freed with its gradient buckets and its process group's handle, not held to the end of the process."""

import gc
import weakref

import torch
from torch import nn

from lightning_memguard.adapters.ddp_recovery import DDPRecovery
from tests.helpers import gloo_group


def test_a_ddp_module_with_a_recovery_is_freed_when_the_run_lets_it_go(tmp_path):
    with gloo_group(0, tmp_path, world_size=1):
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
        recovery = DDPRecovery(ddp)  # registers its communication hook on the module
        table = weakref.WeakKeyDictionary({ddp: recovery})  # as install() keeps the recoveries it made
        ddp(torch.ones(2, 4)).sum().backward()  # the hook ran: the reducer holds what it needs
        assert recovery.ddp is ddp
        freed = weakref.ref(ddp)
        del ddp
        gc.collect()
        assert freed() is None and len(table) == 0
        assert recovery.ddp is None  # the recovery itself outlives it harmlessly
