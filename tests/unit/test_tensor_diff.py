import pytest
import torch

from lightning_memguard.monitor.tensor_diff import TensorDiff
from tests.models import BlockStack


def test_diff_lists_a_known_tensor_and_sorts_categories():
    model = BlockStack(width=32, depth=2)
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 16)
    with TensorDiff(model, [optimizer]) as diff:
        diff.mark("start")
        known = torch.zeros(123, 457)
        loss = model(x).sum()
        diff.mark("after_forward")
        loss.backward()
        diff.mark("after_backward")
        optimizer.step()
        del known
        diff.mark("after_step")

    appeared = diff.diff("start", "after_forward")
    row = appeared[appeared["shape"] == "[123, 457]"]
    assert row[["change", "category", "dtype", "count", "bytes"]].values.tolist() == [
        ["+", "activation_or_other", "float32", 1, 123 * 457 * 4]]
    up = appeared[(appeared["module"] == "blocks.0.up") & (appeared["shape"] == "[64, 128]")]
    assert up["bytes"].sum() == 64 * 128 * 4  # the Linear's output, attributed to the module that made it

    backward = diff.diff("after_forward", "after_backward")
    grads = backward[(backward["change"] == "+") & (backward["category"] == "gradient")]
    n_params = sum(p.numel() for p in model.parameters())
    assert grads["bytes"].sum() == n_params * 4  # one gradient per parameter
    assert (backward[backward["change"] == "-"]["category"] == "activation_or_other").all()  # graph freed

    step = diff.diff("after_backward", "after_step")
    state = step[(step["change"] == "+") & (step["category"] == "optimizer_state")]
    assert state["bytes"].sum() >= 2 * n_params * 4  # Adam: exp_avg and exp_avg_sq
    gone = step[(step["change"] == "-") & (step["shape"] == "[123, 457]")]
    assert len(gone) == 1

    top = diff.consumers("after_forward")
    assert top["bytes"].is_monotonic_decreasing
    assert set(top["category"]) == {"parameter", "activation_or_other"}  # no gradients before the first backward
    assert top[top["category"] == "parameter"]["bytes"].sum() == n_params * 4


def test_unknown_mark_is_a_clear_error():
    diff = TensorDiff()
    with pytest.raises(ValueError, match="mark 'nope' was not recorded"):
        diff.diff("nope", "nope")


def test_recording_does_not_keep_a_checkpointed_recomputation_alive():
    """torch's ModuleTracker hooks the gradients of every module's outputs; a checkpointed block's recomputation
    never delivers them, so the recomputed tensors stayed alive until recording stopped. The diff must not change
    the memory it measures."""
    from lightning_memguard.mitigations.checkpointing import ActivationCheckpointing
    from lightning_memguard.sources.cpu import CpuTensorAccountant
    from tests.models import BlockStack

    def after_backward(record):
        torch.manual_seed(0)
        model = BlockStack(width=128, depth=6, batch_size=256)
        ActivationCheckpointing(model).set_level(6)
        accountant = CpuTensorAccountant()
        accountant.track(model.parameters())
        diff = TensorDiff(model)
        with accountant:
            if record:
                diff.start()
            loss = model(torch.randn(256, 16)).sum()
            loss.backward()
            del loss
            live = accountant.read(reset_peak=False).allocated_bytes
            diff.stop()
        return live

    assert after_backward(record=True) == after_backward(record=False)
