"""Mixed precision for a CPU target, estimated on meta: CPU autocast's casts and the CPU's attention kernel emulated
(CpuKernelMode), against real bf16 CPU steps under the same accounting."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_memguard import estimate_memory, plan_configuration
from lightning_memguard.commands.demo import DemoTransformer, SmallCNN, TinyGPT
from lightning_memguard.estimate import EstimateFallbackWarning
from lightning_memguard.estimate.cpu_kernels import CpuKernelMode
from tests.models import BlockStack

# the demo models at small sizes (the same ops as at their defaults; real bf16 CPU steps are slow)
DEMO = {
    "BlockStack": lambda: BlockStack(width=64, depth=4),
    "DemoTransformer": lambda: DemoTransformer(d_model=64, d_ff=128, nlayers=2, batch_size=8, seq_len=32),
    "TinyGPT": lambda: TinyGPT(d_model=64, nlayers=2, seq_len=32, batch_size=8),
    "SmallCNN": lambda: SmallCNN(channels=8, image_size=32, batch_size=8),
}


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
@pytest.mark.parametrize("name", list(DEMO))
def test_a_cpu_estimate_on_meta_agrees_with_a_real_cpu_step_on_the_demo_models(name, precision):
    torch.manual_seed(0)
    model = DEMO[name]()
    batch = next(iter(model.train_dataloader()))
    meta = estimate_memory(model, batch, precision=precision, target="cpu", path="meta")
    cpu = estimate_memory(model, batch, precision=precision, target="cpu", path="cpu")
    assert (meta.path, cpu.path) == ("meta", "cpu")
    for phase, peak in cpu.phase_peaks.items():
        assert meta.phase_peaks[phase] == pytest.approx(peak, rel=0.01), phase
    assert meta.activations_bytes == pytest.approx(cpu.activations_bytes, rel=0.01)


def test_mixed_precision_for_a_cpu_target_runs_on_meta_by_default_with_smaller_activations():
    torch.manual_seed(0)
    model = DEMO["TinyGPT"]()
    batch = next(iter(model.train_dataloader()))
    fp32 = estimate_memory(model, batch, target="cpu")
    bf16 = estimate_memory(model, batch, precision="bf16-mixed", target="cpu")
    assert (fp32.path, bf16.path) == ("cpu", "meta")
    # bf16 activations, plus the bf16 weight copies each matmul keeps (no autocast cache, as Lightning runs it)
    assert bf16.activations_bytes < fp32.activations_bytes
    assert bf16.blocks["activations_bytes"].max() < 0.7 * fp32.blocks["activations_bytes"].max()
    assert bf16.parameters_bytes == fp32.parameters_bytes  # autocast keeps fp32 weights


# (call, its arguments from a bf16 tensor x and fp32 tensors w, m): what CPU autocast makes of it
CALLS = {
    "linear": lambda x, w, m: F.linear(w, m),
    "matmul": lambda x, w, m: torch.matmul(w, m),
    "bmm": lambda x, w, m: torch.bmm(w[None], m[None]),
    "conv1d": lambda x, w, m: F.conv1d(w[None], m[:, :, None]),
    "layer_norm": lambda x, w, m: F.layer_norm(x, (8,), w[0], w[0]),
    "softmax": lambda x, w, m: F.softmax(x, -1),
    "sum": lambda x, w, m: x.sum(),
    "cross_entropy": lambda x, w, m: F.cross_entropy(x, torch.zeros(8, dtype=torch.long, device=x.device)),
    "mse_loss": lambda x, w, m: F.mse_loss(x, x),
    "prod": lambda x, w, m: torch.prod(x),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_the_emulated_casts_give_the_dtypes_of_real_cpu_autocast(call):
    def run(device, autocast):
        x = torch.randn(8, 8, device=device, dtype=torch.bfloat16, requires_grad=True)
        w, m = (torch.randn(8, 8, device=device, requires_grad=True) for _ in range(2))
        with autocast:
            return CALLS[call](x, w, m).dtype

    real = run("cpu", torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False))
    assert run("meta", CpuKernelMode(torch.bfloat16)) == real


def test_attention_on_meta_keeps_what_the_cpus_fused_kernel_keeps_not_the_probabilities():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(32, 96)

        def forward(self, x):
            q, k, v = self.qkv(x).view(4, 512, 3, 2, 16).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    x = torch.randn(4, 512, 32)
    for precision in ("32-true", "bf16-mixed"):
        meta = estimate_memory(Attention(), x, precision=precision, target="cpu", path="meta")
        cpu = estimate_memory(Attention(), x, precision=precision, target="cpu", path="cpu")
        assert meta.activations_bytes == cpu.activations_bytes
        with sdpa_kernel(SDPBackend.MATH):  # the math path, as torch takes it where the fused kernel is off
            math = estimate_memory(Attention(), x, precision=precision, target="cpu", path="meta")
        probabilities = 4 * 2 * 512 * 512 * (2 if precision == "bf16-mixed" else 4)  # b·h·s·s
        assert meta.activations_bytes < probabilities / 4 and math.activations_bytes >= probabilities


class NormalisedAcrossTime(nn.Module):
    """BatchNorm over the features of [batch, time, features] rows, as PatchTST normalises them: on the transposed
    rows, transposed back; then three projections, as attention's query, key and value."""

    def __init__(self, layout: str = "transposed"):
        super().__init__()
        self.layout = layout
        self.norm2d = nn.BatchNorm2d(16)
        self.norm = nn.BatchNorm1d(16)
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        if self.layout == "channels_last":  # an image batch in channels-last: the output keeps that format
            x = self.norm2d(x.to(memory_format=torch.channels_last)).flatten(2).transpose(1, 2)
        else:
            x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return (self.q(x) * self.k(x) + self.v(x)).sum()


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
def test_norms_on_meta_write_their_outputs_in_the_layout_the_cpus_kernels_write(layout):
    """The CPU kernel writes batch norm's output contiguous for a transposed input (channels-last for a channels-last
    one), and layer norm's input gradient contiguous, where meta's kernels keep the input's (the gradient's) strides:
    each projection after a transposed batch norm then copies its input contiguous and keeps the copy on CPU, and did
    not on meta (7-14 % under on PatchTST before); a view of layer norm's gradient needed a copy on meta only (1.4 %
    over in Swin's backward)."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, 4, 6) if layout == "channels_last" else torch.randn(8, 24, 16)
    kwargs = dict(optimizer=torch.optim.AdamW, loss_fn=lambda m, b: m(b), target="cpu")
    meta = estimate_memory(NormalisedAcrossTime(layout), x, path="meta", **kwargs)
    cpu = estimate_memory(NormalisedAcrossTime(layout), x, path="cpu", **kwargs)
    assert meta.phase_peaks["forward"] == cpu.phase_peaks["forward"]
    assert meta.activations_bytes == cpu.activations_bytes
    assert meta.phase_peaks["backward"] == pytest.approx(cpu.phase_peaks["backward"], rel=0.01)


def test_the_norms_kernels_on_meta_write_the_layouts_the_cpus_write_where_an_estimate_runs_them():
    """Op by op, under the estimate's mixed execution: batch norm's output and its backward's input gradient for a
    transposed input, and layer norm's input gradient for a transposed gradient (as Swin's pooler hands it back)."""
    from lightning_memguard.estimate.mixed import MixedExecution

    aten = torch.ops.aten

    def strides(device):
        torch.manual_seed(0)
        x = torch.randn(8, 24, 16, device=device).transpose(1, 2)  # [8, 16, 24], features second
        weight, bias = torch.ones(16, device=device), torch.zeros(16, device=device)
        running = torch.zeros(16, device=device), torch.ones(16, device=device)
        out, mean, invstd = aten.native_batch_norm(x, weight, bias, *running, True, 0.1, 1e-5)
        grad_bn = aten.native_batch_norm_backward(out, x, weight, *running, mean, invstd, True, 1e-5,
                                                  [True, True, True])[0]
        h = torch.randn(8, 16, 32, device=device)
        w32, b32 = torch.ones(32, device=device), torch.zeros(32, device=device)
        _, ln_mean, ln_rstd = aten.native_layer_norm(h, [32], w32, b32, 1e-5)
        grad = torch.randn(8, 32, 16, device=device).transpose(1, 2)
        grad_ln = aten.native_layer_norm_backward(grad, h, [32], ln_mean, ln_rstd, w32, b32, [True, True, True])[0]
        return [t.stride() for t in (out, grad_bn, grad_ln)]

    with MixedExecution():
        on_meta = strides("meta")
    assert on_meta == strides("cpu") == [(384, 24, 1), (384, 24, 1), (512, 32, 1)]


# stays here: it reads its weights' values on purpose, for the fallback the test below checks
class Routed(nn.Module):
    """Reads a value computed from its weights: the meta device cannot run it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        return (self.b(h) if h.mean() > 0 else h).float().sum()


def test_a_cpu_target_model_that_reads_weight_values_falls_back_to_a_real_mixed_step_with_one_warning():
    with pytest.warns(EstimateFallbackWarning, match="reads a value computed from the weights") as caught:
        est = estimate_memory(Routed(), torch.randn(8, 16), precision="bf16-mixed", target="cpu")
    assert est.path == "cpu"
    assert [w.filename for w in caught] == [__file__]  # the caller's line, not the package's or a decorator's


def test_plan_configuration_on_a_cpu_target_chooses_amp_from_meta_estimates():
    torch.manual_seed(0)
    model = DEMO["TinyGPT"]()
    batch = next(iter(model.train_dataloader()))
    fp32 = estimate_memory(model, batch, target="cpu").peak_bytes
    bf16 = estimate_memory(model, batch, precision="bf16-mixed", target="cpu").peak_bytes
    # room for AMP alone, not for fp32: AMP is the cheapest fit (no block recomputed)
    plan = plan_configuration(model, batch, capacity_bytes=int((bf16 + fp32) / 2 / 0.9), target="cpu")
    assert (plan.amp, plan.checkpointed_blocks, plan.fits) == (True, 0, True)
    assert plan.expected_peak_bytes == bf16


def test_a_routed_model_falls_back_once_in_a_cpu_plan():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan_configuration(Routed(), torch.randn(8, 16), capacity_bytes=1, target="cpu", allow_checkpointing=False)
    assert sum(issubclass(w.category, EstimateFallbackWarning) for w in caught) == 1
