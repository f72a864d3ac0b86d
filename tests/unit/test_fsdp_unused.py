"""FSDP2's reduction of unused parameters switched on for split steps only (mitigations/fsdp_unused.py), on a
one-rank gloo group: on while a step runs in parts, back to how it was for a whole step and at the fit's end, and a
module the user switched on is left on; and the model's FSDP2 modules as base/sharding.py finds them for every
part of MemGuard."""

from torch import nn

from lightning_memguard.base.sharding import fsdp2_modules
from lightning_memguard.mitigations.fsdp_unused import UnusedReduced
from tests.models import TaskHeads
from tests.ranks import gloo_group, wrap_for


def _on(module) -> list[bool]:
    return [group.reduce_scatter_unused_params for group in module._get_fsdp_state()._fsdp_param_groups]


def test_split_steps_reduce_unused_parameters_and_whole_steps_as_before(tmp_path):
    with gloo_group(0, tmp_path, world_size=1):
        model = wrap_for(TaskHeads(depth=2), "fsdp")  # each block, then the root
        reduced = UnusedReduced.of(model)
        modules = [model, *model.blocks]
        assert reduced is not None and all(_on(m) == [False] for m in modules)
        reduced.split(2)
        assert all(_on(m) == [True] for m in modules)
        reduced.split(4)  # a further split (a rescue in more parts): still on
        assert all(_on(m) == [True] for m in modules)
        reduced.split(1)
        assert all(_on(m) == [False] for m in modules)
        model.blocks[0].set_reduce_scatter_unused_params(True, recurse=False)  # the user's own choice
        reduced.split(2)
        reduced.restore()
        assert _on(model.blocks[0]) == [True] and _on(model) == [False] and _on(model.blocks[1]) == [False]


def test_a_model_without_fsdp2_modules_has_nothing_to_switch():
    assert UnusedReduced.of(nn.Linear(2, 2)) is None
    assert UnusedReduced.of(None) is None


def test_a_models_fsdp2_modules_are_found_outermost_first_by_name(tmp_path):
    # what the meta copy, the ranks' recovery and the switch above each take as the model's FSDP2 modules
    with gloo_group(0, tmp_path, world_size=1):
        model = wrap_for(TaskHeads(depth=2), "fsdp")
        assert fsdp2_modules(model) == [("", model), ("blocks.0", model.blocks[0]), ("blocks.1", model.blocks[1])]
    assert fsdp2_modules(TaskHeads(depth=2)) == [] and fsdp2_modules(None) == []
