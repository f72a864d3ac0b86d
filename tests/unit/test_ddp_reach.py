"""The last micro-batch's loss made to reach every parameter the step trains (mitigations/ddp_reach.py): what its
graph reaches, and a zero for each parameter with a gradient it misses — the gradient unchanged, its hook fired once,
as DistributedDataParallel's reducer (registered on the same hook) expects."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_memguard.mitigations.ddp_reach import (
    reached_parameters, reaching_every_parameter, waits_for_every_parameter,
)


def _two_heads():
    torch.manual_seed(0)
    trunk, first, second = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)
    return trunk, first, second, [*trunk.parameters(), *first.parameters(), *second.parameters()]


def _hook_counts(params):
    counts = {id(p): 0 for p in params}
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: counts.__setitem__(id(q), counts[id(q)] + 1))
    return counts


def test_what_a_loss_reaches_is_the_parameters_its_graph_uses():
    trunk, first, second, params = _two_heads()
    reached = reached_parameters(first(trunk(torch.randn(3, 4))).sum())
    assert reached == {id(p) for p in [*trunk.parameters(), *first.parameters()]}
    # a non-reentrant checkpoint keeps its graph: the parameters inside are reached
    x = torch.randn(3, 4)
    inside = checkpoint(lambda t: second(trunk(t)), x, use_reentrant=False).sum()
    assert reached_parameters(inside) == {id(p) for p in [*trunk.parameters(), *second.parameters()]}


def test_a_reentrant_checkpoint_hides_what_it_reaches_and_the_loss_is_left_as_it_is():
    trunk, first, second, params = _two_heads()
    second(trunk(torch.randn(3, 4))).sum().backward()  # the second head holds a gradient
    x = torch.randn(3, 4, requires_grad=True)
    loss = checkpoint(lambda t: first(trunk(t)), x, use_reentrant=True).sum()
    assert reached_parameters(loss) is None
    assert reaching_every_parameter(loss, params) is loss


def test_a_parameter_with_a_gradient_the_loss_misses_gets_a_zero_and_its_hook_fires_once():
    trunk, first, second, params = _two_heads()
    x = torch.randn(3, 4)
    (first(trunk(x)).sum() + second(trunk(x)).sum()).backward()  # an earlier part reached both heads
    before = [p.grad.clone() for p in params]
    counts = _hook_counts(params)
    loss = first(trunk(torch.randn(5, 4))).sum()  # the last part: the second head missed
    reaching = reaching_every_parameter(loss, params)
    assert reaching is not loss and torch.equal(reaching, loss)  # the same value
    reaching.backward()
    assert list(counts.values()) == [1] * len(params)  # every parameter ready once: reached or given a zero
    for p, grad in zip(second.parameters(), before[-2:]):
        assert torch.equal(p.grad, grad)  # the missed head's gradient: unchanged
    assert not any(torch.equal(p.grad, g) for p, g in zip(first.parameters(), before[2:4]))  # the reached one: grown


def test_a_loss_that_misses_nothing_or_a_parameter_without_a_gradient_is_left_as_it_is():
    trunk, first, second, params = _two_heads()
    x = torch.randn(3, 4)
    first(trunk(x)).sum().backward()  # the second head has no gradient: the whole batch does not reach it
    loss = first(trunk(x)).sum()
    assert reaching_every_parameter(loss, params) is loss
    counts = _hook_counts(params)
    loss.backward()
    assert [counts[id(p)] for p in second.parameters()] == [0, 0]  # not made ready: plain DDP would not be either


def test_the_zero_of_a_large_half_precision_parameter_is_a_zero_not_nan():
    """A float16 sum of 100,000 ones overflows to inf, and inf * 0 is nan: the term is summed in float32."""
    big = nn.Parameter(torch.ones(100_000, dtype=torch.float16))
    small = nn.Parameter(torch.ones(3, dtype=torch.float16))
    (big.sum(dtype=torch.float32) + small.sum()).backward()
    loss = (small * 2).sum()
    reaching = reaching_every_parameter(loss, [big, small])
    assert reaching.dtype == torch.float16 and torch.equal(reaching, loss)
    reaching.backward()
    assert torch.equal(big.grad, torch.ones_like(big))


def test_only_distributed_data_parallel_without_find_unused_parameters_waits_for_every_parameter():
    assert not waits_for_every_parameter(nn.Linear(2, 2))
    assert not waits_for_every_parameter(None)
