"""What the step-0 ``cannot_help`` advises where parameters, gradients and optimizer state alone are over the
capacity: the remedies for the parts large enough to close the gap, so that a LoRA whose frozen base does not fit is
not told to freeze layers or change its optimizer."""

from lightning_memguard.base.advice import what_would_help
from lightning_memguard.base.snapshot import MiB

OPTIMIZER = "an optimizer with less state"
TRAINABLE = "fewer trainable parameters"
WEIGHTS = "lighter weights"

ADAMW = {"parameters": 100 * MiB, "gradients": 100 * MiB, "optimizer_state": 200 * MiB}  # every parameter trained
LORA = {"parameters": 100 * MiB, "gradients": 2 * MiB, "optimizer_state": 4 * MiB}  # a frozen base, small adapters


def named(text: str) -> set[str]:
    return {words for words in (OPTIMIZER, TRAINABLE, WEIGHTS) if words in text}


def test_every_part_that_could_close_the_gap_alone_is_named():
    assert named(what_would_help(ADAMW, 50 * MiB)) == {OPTIMIZER, TRAINABLE, WEIGHTS}
    # 150 MiB over: the weights (100 MiB) cannot close it, the optimizer state (200 MiB) can
    assert named(what_would_help(ADAMW, 150 * MiB)) == {OPTIMIZER, TRAINABLE}
    # 250 MiB over: only fewer trainable parameters (their gradients and state, 300 MiB) can
    assert named(what_would_help(ADAMW, 250 * MiB)) == {TRAINABLE}


def test_a_frozen_base_over_the_capacity_is_told_of_lighter_or_sharded_weights_only():
    text = what_would_help(LORA, 20 * MiB)
    assert named(text) == {WEIGHTS} and "sharding the parameters (FSDP)" in text


def test_where_no_part_alone_is_enough_all_are_named_and_a_larger_capacity_always():
    assert named(what_would_help(LORA, 500 * MiB)) == {OPTIMIZER, TRAINABLE, WEIGHTS}
    for excess in (0, 20 * MiB, 500 * MiB):
        assert what_would_help(LORA, excess).endswith(", or a larger capacity")


def test_a_model_fsdp2_already_shards_is_told_of_more_ranks_and_cpu_offloading_not_of_sharding():
    sharded = {**ADAMW, "sharded_over": 8}
    for text in (what_would_help(sharded, 50 * MiB), what_would_help(ADAMW, 50 * MiB, sharded_over=8)):
        assert named(text) == {OPTIMIZER, TRAINABLE, WEIGHTS}
        assert "more ranks to shard over (now 8" in text and "CPUOffloadPolicy" in text
        assert "sharding the parameters (FSDP)" not in text and "DeepSpeed" not in text
        assert text.count("more ranks to shard over") == 1
    # more ranks divide every part: named wherever the state is over, beside the parts that alone could close it
    for excess in (150 * MiB, 250 * MiB):
        assert "more ranks to shard over" in what_would_help(sharded, excess)
    assert named(what_would_help(sharded, 250 * MiB)) == {TRAINABLE}


def test_a_ddp_rank_whose_buckets_close_the_gap_is_told_of_gradient_as_bucket_view_first():
    ddp = {**ADAMW, "ddp_buckets": 100 * MiB}  # DistributedDataParallel's second copy of the gradients
    text = what_would_help(ddp, 80 * MiB)
    assert text.startswith("gradient_as_bucket_view=True") and "DDPStrategy(gradient_as_bucket_view=True)" in text
    assert named(text) == {OPTIMIZER, TRAINABLE, WEIGHTS}  # the other parts large enough are named after it
    assert "gradient_as_bucket_view" not in what_would_help(ddp, 150 * MiB)  # more than the buckets hold
    assert "gradient_as_bucket_view" not in what_would_help(ADAMW, 80 * MiB)  # one process has no buckets


def test_an_optimizer_state_zero_redundancy_already_shards_is_told_of_more_ranks_not_of_sharding_it():
    """Beside DDP, torch's ZeroRedundancyOptimizer keeps each rank's share of the state: sharding the state is done,
    more ranks divide it further, and FSDP would shard the parameters and gradients too."""
    for text in (what_would_help({**ADAMW, "state_sharded_over": 4}, 150 * MiB),
                 what_would_help(None, 0, state_sharded_over=4)):  # sizes unknown: every remedy
        assert OPTIMIZER in text and "more ranks (ZeroRedundancyOptimizer shards the optimizer state over 4" in text
        assert "torch's ZeroRedundancyOptimizer beside DDP" not in text and "ZeRO-Offload" in text
    assert "FSDP in place of DDP and ZeroRedundancyOptimizer" in what_would_help(None, 0, state_sharded_over=4)
    # over by more than the state: no remedy of the state's is named
    text = what_would_help({**ADAMW, "state_sharded_over": 4}, 250 * MiB)
    assert named(text) == {TRAINABLE} and "more ranks" not in text
