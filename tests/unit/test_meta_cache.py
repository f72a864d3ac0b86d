"""The meta kernels' memo: a call seen before is answered with tensors like the kernel's (fresh storages of the same
size), in-place calls return what they wrote into, views and metadata changes run every time, and the demo models'
estimates are byte-identical with and without it."""

import pytest
import torch

from lightning_memguard.commands.demo import DemoTransformer, SmallCNN, TinyGPT
from lightning_memguard.estimate.meta_cache import call_meta, meta_cache_enabled, meta_cache_stats
from lightning_memguard.mitigations.checkpointing import find_blocks
from tests.helpers import assert_same_estimate, estimates_with_and_without_meta_memo
from tests.models import BlockStack

aten = torch.ops.aten


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def described(t: torch.Tensor):
    return t.dtype, t.shape, t.stride(), t.storage_offset(), t.untyped_storage().nbytes()


def test_a_repeated_op_gets_new_tensors_like_the_kernels_without_running_it_again():
    a, b = meta(8, 4), meta(4, 3)
    with meta_cache_enabled(True):
        first = call_meta(aten.mm.default, (a, b), {})
        second = call_meta(aten.mm.default, (meta(8, 4), meta(4, 3)), {})
        assert meta_cache_stats()["hits"] == 1
    assert described(second) == described(first) == described(aten.mm.default(a, b))
    assert second.untyped_storage()._cdata != first.untyped_storage()._cdata  # a new allocation, as the kernel's


def test_strides_and_dtypes_are_part_of_the_call():
    with meta_cache_enabled(True):
        call_meta(aten.add.Tensor, (meta(4, 6), meta(4, 6)), {})
        transposed = call_meta(aten.add.Tensor, (meta(6, 4).t(), meta(6, 4).t()), {})
        half = call_meta(aten.add.Tensor, (meta(4, 6, dtype=torch.bfloat16), meta(4, 6, dtype=torch.bfloat16)), {})
        assert meta_cache_stats()["hits"] == 0
    assert transposed.stride() == (1, 4) and half.dtype == torch.bfloat16


def test_a_view_runs_every_time_and_shares_its_input_storage():
    x = meta(4, 6)
    with meta_cache_enabled(True):
        views = [call_meta(aten.transpose.int, (x, 0, 1), {}) for _ in range(2)]
        assert meta_cache_stats() == {"calls": 2, "hits": 0, "misses": 0, "entries": 0}
    for view in views:
        assert view.untyped_storage()._cdata == x.untyped_storage()._cdata and view.stride() == (1, 6)


def test_an_op_whose_result_shares_its_input_storage_undeclared_runs_every_time():
    # _unsafe_view declares no alias in its schema, but returns a view (autograd's reshapes end in it)
    x = meta(4, 6)
    with meta_cache_enabled(True):
        for _ in range(2):
            out = call_meta(aten._unsafe_view.default, (x, [24]), {})
            assert out.untyped_storage()._cdata == x.untyped_storage()._cdata
        assert meta_cache_stats()["hits"] == 0


def test_an_in_place_op_returns_the_tensor_it_wrote_into():
    with meta_cache_enabled(True):
        for _ in range(2):
            x = meta(4, 6)
            assert call_meta(aten.mul_.Tensor, (x, meta(6)), {}) is x
        params = [meta(3), meta(5)]
        for _ in range(2):
            assert call_meta(aten._foreach_add_.Scalar, (params, 1.0), {}) is None
        out = meta(4, 6)
        for _ in range(2):
            assert call_meta(aten.add.out, (meta(4, 6), meta(4, 6)), {"out": out}) is out
        assert meta_cache_stats()["hits"] == 3


def test_an_in_place_op_that_changes_metadata_runs_every_time():
    with meta_cache_enabled(True):
        for _ in range(2):
            x = meta(4)
            call_meta(aten.resize_.default, (x, [2, 8]), {})
            assert x.shape == (2, 8) and x.untyped_storage().nbytes() == 64
        out = meta(0)  # out= resizes an empty output: the call changed it, so it is not kept
        for _ in range(2):
            assert call_meta(aten.add.out, (meta(4, 6), meta(4, 6)), {"out": out}).shape == (4, 6)
            out.resize_(0)
        assert meta_cache_stats()["hits"] == 0


def test_a_call_that_raises_raises_every_time():
    with meta_cache_enabled(True):
        for _ in range(2):
            with pytest.raises(RuntimeError):
                call_meta(aten.mm.default, (meta(8, 4), meta(5, 3)), {})
            with pytest.raises(RuntimeError):  # an in-place op cannot broadcast what it writes into
                call_meta(aten.add_.Tensor, (meta(4), meta(3, 4)), {})
        assert meta_cache_stats()["entries"] == 0


def test_a_foreach_op_runs_once_per_distinct_item_and_gives_every_item_what_the_kernel_does():
    # an optimizer's lists repeat the same shapes: two distinct kinds among five items
    shapes = [(3, 4), (5,), (3, 4), (3, 4), (5,)]
    with meta_cache_enabled(True):
        roots = call_meta(aten._foreach_sqrt.default, ([meta(*s) for s in shapes],), {})
        sums = call_meta(aten._foreach_add.List, ([meta(*s) for s in shapes], [meta(*s) for s in shapes]), {})
        written = [meta(*s) for s in shapes]
        assert call_meta(aten._foreach_addcdiv_.ScalarList, (written, [meta(*s) for s in shapes],
                                                              [meta(*s) for s in shapes], [0.1] * 5), {}) is None
        assert [t.shape for t in written] == [torch.Size(s) for s in shapes]
        with pytest.raises(RuntimeError):  # a mismatch at an index of an already seen kind raises still
            call_meta(aten._foreach_add_.List, ([meta(3, 4), meta(3, 4)], [meta(3, 4), meta(2, 4)]), {})
    kernels = (aten._foreach_sqrt.default([meta(*s) for s in shapes]),
               aten._foreach_add.List([meta(*s) for s in shapes], [meta(*s) for s in shapes]))
    for outputs, expected in zip((roots, sums), kernels):
        assert [described(t) for t in outputs] == [described(t) for t in expected]
        assert len({t.untyped_storage()._cdata for t in outputs}) == 5  # each its own allocation


def test_switched_off_every_kernel_runs():
    with meta_cache_enabled(False):
        for _ in range(2):
            call_meta(aten.mm.default, (meta(8, 4), meta(4, 3)), {})
        assert meta_cache_stats() == {"calls": 2, "hits": 0, "misses": 0, "entries": 0}


# the demo models the project trains, and the test stack: every estimate a plan makes, on meta for a CUDA target and
# in bf16 for a CPU target (its mixed precision runs on meta too)
DEMO = {
    "DemoTransformer": lambda: DemoTransformer(nlayers=2, batch_size=4, seq_len=16),
    "TinyGPT": lambda: TinyGPT(d_model=64, nlayers=3, seq_len=16, batch_size=4),
    "SmallCNN": lambda: SmallCNN(),
    "BlockStack": lambda: BlockStack(width=32, depth=4, batch_size=16, optimizer="adam"),
}


@pytest.mark.parametrize("target", ["cuda", "cpu"])
@pytest.mark.parametrize("name", list(DEMO))
def test_the_demo_models_estimates_are_byte_identical_with_the_memo(name, target):
    model = DEMO[name]()
    batch = next(iter(model.train_dataloader()))
    # a CPU target runs fp32 on CPU, where there are no meta kernels: its mixed precision runs on meta
    precisions = ("32-true", "bf16-mixed") if target == "cuda" else ("bf16-mixed",)
    pairs = estimates_with_and_without_meta_memo(model, batch, len(find_blocks(model)), precisions, target=target)
    for memo, no_memo in pairs:
        assert memo.path == "meta"
        assert_same_estimate(memo, no_memo)
