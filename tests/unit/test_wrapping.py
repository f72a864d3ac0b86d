"""wrap_method / unwrap_method: a wrapper on one instance, wrapped once per kind, and what was there comes back."""

import copy

import torch
from torch import nn

from lightning_memguard.base.wrapping import unwrap_method, wrap_method, wrapper_of


class Doubler(nn.Module):
    def forward(self, x):
        return 2 * x


def plus(amount):
    """A wrapper factory: the wrapped method's result plus ``amount``."""
    return lambda method: (lambda *args: method(*args) + amount)


def test_the_class_method_comes_back_and_other_instances_are_untouched():
    module, other = Doubler(), Doubler()
    assert wrap_method(module, "forward", "test", plus(1))
    assert module(torch.tensor(3.0)) == 7 and other(torch.tensor(3.0)) == 6
    assert unwrap_method(module, "forward", "test")
    assert "forward" not in vars(module) and module(torch.tensor(3.0)) == 6
    assert not unwrap_method(module, "forward", "test")  # nothing left to undo


def test_a_kind_wraps_once_and_kinds_nest():
    module = Doubler()
    assert wrap_method(module, "forward", "a", plus(1))
    assert not wrap_method(module, "forward", "a", plus(100))
    assert module(torch.tensor(1.0)) == 3
    assert wrap_method(module, "forward", "b", plus(10))
    assert module(torch.tensor(1.0)) == 13
    assert not unwrap_method(module, "forward", "a")  # another kind's wrapper is on top: left as it is
    assert unwrap_method(module, "forward", "b") and module(torch.tensor(1.0)) == 3
    assert unwrap_method(module, "forward", "a") and module(torch.tensor(1.0)) == 2


def test_an_attribute_set_on_the_instance_is_wrapped_and_put_back():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    calls = []

    def scheduler_step(*args, **kwargs):  # what an LR scheduler puts on optimizer.step
        calls.append("scheduler")

    optimizer.step = scheduler_step
    wrap_method(optimizer, "step", "test", lambda method: lambda: (calls.append("guard"), method()))
    optimizer.step()
    assert calls == ["guard", "scheduler"] and wrapper_of(optimizer, "step", "test") is not None
    unwrap_method(optimizer, "step", "test")
    assert optimizer.step is scheduler_step and wrapper_of(optimizer, "step", "test") is None


def test_a_deep_copy_carries_the_wrapper_and_what_to_put_back():
    module = Doubler()
    wrap_method(module, "forward", "test", plus(1))
    twin = copy.deepcopy(module)
    assert twin(torch.tensor(1.0)) == 3
    assert unwrap_method(twin, "forward", "test") and twin(torch.tensor(1.0)) == 2
    assert module(torch.tensor(1.0)) == 3  # the original keeps its wrapper
