"""The recovery installed on a DistributedDataParallel module does not keep it alive: a module a fit is done with is
freed with its gradient buckets and its process group's handle, not held to the end of the process. The news element
it carries in a bucket's all-reduce comes back as said and changes no gradient, and so does the rescue flag, once, in
the reduction after it was said. A rank may run a batch again alone only where its attempt issued no collective: DDP's
buckets rebuilt, no buffer broadcast in its forward, and at a batch that reduces, before its DDP forward ended."""

import gc
import weakref

import torch
from torch import nn

from lightning_memguard.adapters.ddp_recovery import DDPRecovery
from tests.ranks import gloo_group


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


def test_the_news_element_rides_the_smallest_bucket_and_leaves_the_gradients_bit_for_bit(tmp_path):
    with gloo_group(0, tmp_path, world_size=1):
        torch.manual_seed(0)
        # one process: DDP keeps one bucket (two ranks rebuild into several: tests/integration/test_quiet_steps.py)
        plain, carried = _twin_ddp_modules(64)
        recovery = DDPRecovery(carried)
        heard = []
        for step, news in enumerate([False, True, True, False]):
            x = torch.randn(8, 64)
            recovery.begin_attempt()
            recovery.say(news)
            for ddp in (plain, carried):
                ddp.zero_grad(set_to_none=True)
                ddp(x).square().mean().backward()
            assert not recovery.peer_failed()
            heard.append(recovery.heard)
            for mine, theirs in zip(carried.parameters(), plain.parameters()):
                assert torch.equal(mine.grad, theirs.grad)
        # no carrier in the first backward (no bucket sizes known) nor the second (DDP rebuilds its buckets in its
        # forward: the first one's sizes may no longer hold), so step 1's news rides step 2; then the smallest carries
        assert heard == [None, None, True, False]
        sizes = recovery._sizes  # the last backward's buckets: the same as the one before
        assert recovery._carrier == min(sizes, key=lambda index: (sizes[index].numel, index))


def test_a_rank_that_ran_out_of_memory_shadows_one_bucket_of_zeros_at_a_time(tmp_path):
    from lightning_memguard.sources.cpu import CpuTensorAccountant

    with gloo_group(0, tmp_path, world_size=1):
        torch.manual_seed(0)
        # ~2 MB of gradients in buckets of ~0.25 MB; with unused parameters looked for, DDP never rebuilds its buckets,
        # so one backward shows them as they stay
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]),
                                                  bucket_cap_mb=0.25, find_unused_parameters=True)
        recovery = DDPRecovery(ddp)
        recovery.begin_attempt()
        ddp(torch.randn(4, 256)).sum().backward()
        assert not recovery.peer_failed()
        recovery.begin_attempt()  # a new attempt, which runs out of memory in its forward: no bucket reduced yet
        buckets = {index: layout.numel * 4 for index, layout in recovery._known.items()}
        assert len(buckets) > 4
        with CpuTensorAccountant() as counted:
            recovery.shadow()
        # zeros for every bucket, reduced one after another: at most the largest bucket (and the smallest one's copy
        # with the news element) alive at once, not a copy of every gradient
        assert counted.read().peak_bytes <= max(buckets.values()) + 2 * min(buckets.values()) + 64
        assert sum(buckets.values()) > 3 * max(buckets.values())
        assert set(recovery._known) == set(buckets)  # every bucket was reduced (the hook saw each)


def _twin_ddp_modules(width: int) -> tuple[nn.Module, nn.Module]:
    """Two DistributedDataParallel modules with the same parameters: one plain, one for a recovery to carry."""
    plain = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(width, width), nn.Linear(width, 2)))
    carried = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(width, width), nn.Linear(width, 2)))
    carried.load_state_dict(plain.state_dict())
    return plain, carried


def _step(ddp: nn.Module, recovery: DDPRecovery) -> None:
    """One attempt's forward and backward, which reduces the gradients."""
    recovery.begin_attempt()
    ddp(torch.randn(8, 16)).square().mean().backward()


def test_a_rank_runs_a_batch_again_alone_only_where_its_attempt_issued_no_collective(tmp_path):
    with gloo_group(0, tmp_path, world_size=1):
        torch.manual_seed(0)
        plain = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 2)))
        # with buffers DDP broadcasts them in the first forward after each reduction (broadcast_buffers=True)
        normed = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16),
                                                                   nn.Linear(16, 2)))
        for ddp in (plain, normed):
            recovery = DDPRecovery(ddp)
            recovery.begin_attempt()
            assert not recovery.can_run_alone  # DDP has not rebuilt its buckets yet (its next forward does)
            _step(ddp, recovery)
            _step(ddp, recovery)  # this forward rebuilt them
            with ddp.no_sync():
                recovery.begin_attempt()  # a window's first batch, under no_sync
                assert not recovery.reduces and recovery.can_run_alone == (ddp is plain)
                ddp(torch.randn(8, 16))  # its forward broadcast the buffers, if any
                recovery.begin_attempt()  # the window's second batch: no broadcast now
                assert recovery.can_run_alone
            recovery.begin_attempt()  # the window's last batch, which reduces: alone only before its DDP forward ends
            assert recovery.reduces and recovery.can_run_alone
            loss = ddp(torch.randn(8, 16)).square().mean()  # the forward readied the reducer for the backward
            assert not recovery.can_run_alone
            loss.backward()


def test_the_rescue_flag_rides_the_next_reduction_once_and_leaves_the_gradients_bit_for_bit(tmp_path):
    with gloo_group(0, tmp_path, world_size=1):
        torch.manual_seed(0)
        plain, carried = _twin_ddp_modules(16)
        recovery = DDPRecovery(carried)
        rescued = []
        for step in range(4):
            x = torch.randn(8, 16)
            recovery.begin_attempt()
            if step == 2:
                recovery.say_rescued()  # a batch of this window ran again alone on this rank
            for ddp in (plain, carried):
                ddp.zero_grad(set_to_none=True)
                with ddp.no_sync():  # the window's first batch reduces nothing: the flag waits for the last
                    ddp(x).square().mean().backward()
                ddp(x).square().mean().backward()
            assert not recovery.peer_failed()
            rescued.append(recovery.rescued)
            for mine, theirs in zip(carried.parameters(), plain.parameters()):
                assert torch.equal(mine.grad, theirs.grad)
        assert rescued == [None, None, True, False]  # no carrier until a backward ran after DDP's rebuild


def test_the_copy_of_the_bucket_carrying_the_news_is_let_go_of_when_its_reduction_ends(tmp_path, monkeypatch):
    """The carrier bucket is copied with the news elements after it; the copy was let go of when the process group's
    worker thread dropped its work, at random often after the backward, so it showed in the next phase's peak. Here
    every work is kept (a worker thread slow to let go): what the step leaves allocated after the backward is not the
    copy (gradients accumulate in place, DDP's bucket is reused)."""
    from lightning_memguard.sources.cpu import CpuTensorAccountant

    kept = []
    all_reduce = torch.distributed.all_reduce

    def kept_all_reduce(*args, **kwargs):
        kept.append(all_reduce(*args, **kwargs))
        return kept[-1]

    with gloo_group(0, tmp_path, world_size=1):
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(256, 256))  # one bucket: every gradient carries
        recovery = DDPRecovery(ddp)
        grads = sum(p.numel() * p.element_size() for p in ddp.parameters())
        for _ in range(3):  # the buckets rebuilt, then a backward that knows them: the next one carries
            _step_with(ddp, recovery, torch.randn(8, 256))
        assert recovery._carrier is not None
        monkeypatch.setattr(torch.distributed, "all_reduce", kept_all_reduce)
        with CpuTensorAccountant() as counted:  # what the step leaves allocated beyond what existed before it
            _step_with(ddp, recovery, torch.randn(8, 256))
            after_backward = counted.read().allocated_bytes
        assert kept and after_backward < 0.1 * grads, (after_backward, grads)


def _step_with(ddp: nn.Module, recovery: DDPRecovery, x: torch.Tensor) -> None:
    recovery.begin_attempt()
    ddp(x).sum().backward()
