"""Messages between ranks through the process group's store: what one posts the others read, a new run withdraws an
old one, and without a process group nothing is posted or read (never an error)."""

from lightning_memguard.base.host import Host
from lightning_memguard.base.posts import post, read_post, withdraw
from lightning_memguard.guard.ranks import Ranks
from tests.ranks import gloo_group


def test_without_a_process_group_nothing_is_posted_or_read():
    post("lightning_memguard/test", "hello")
    assert read_post("lightning_memguard/test") is None


def test_a_post_is_read_back_until_a_new_run_withdraws_it(tmp_path):
    with gloo_group(0, tmp_path, world_size=1):
        assert read_post("lightning_memguard/test") is None
        post("lightning_memguard/test", "rank 1: out of memory")
        assert read_post("lightning_memguard/test") == "rank 1: out of memory"
        withdraw("lightning_memguard/test")
        assert read_post("lightning_memguard/test") is None


def test_a_rank_that_gave_up_is_read_by_the_others_and_a_new_run_starts_without_it(tmp_path):
    with gloo_group(0, tmp_path, world_size=1):
        ranks = Ranks(rank=1, world_size=2, reduce_max=lambda numbers: numbers)  # as rank 1 of two sees it
        ranks.say_gave_up("lightning-memguard could not rescue step 3")
        assert Ranks(rank=0, world_size=2).peer_report() == "rank 1: lightning-memguard could not rescue step 3"
        Ranks.of(Host(rank=0, world_size=2, reduce_max=lambda numbers: numbers))
        assert Ranks(rank=0, world_size=2).peer_report() is None
        assert Ranks(rank=0, world_size=1).peer_report() is None  # one process: nobody to hear from


def test_a_collective_error_gets_the_peers_report_and_a_ctrl_c_asks_for_none(tmp_path):
    from lightning_memguard.guard.engine import MemGuardEngine
    from lightning_memguard.guard.settings import GuardSettings

    with gloo_group(0, tmp_path, world_size=1):
        Ranks(rank=1, world_size=2).say_gave_up("lightning-memguard could not rescue step 3")
        engine = MemGuardEngine(GuardSettings())
        engine.ranks = Ranks(rank=0, world_size=2, reduce_max=lambda numbers: numbers)  # as rank 0 of two sees it
        interrupt = KeyboardInterrupt()
        engine.on_exception(interrupt)
        assert not getattr(interrupt, "__notes__", None)  # the user stopped it: no peer's report is added
        closed = RuntimeError("Connection closed by peer")
        engine.on_exception(closed)
        assert closed.__notes__ == ["lightning-memguard: rank 1: lightning-memguard could not rescue step 3"]
