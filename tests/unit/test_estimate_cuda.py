"""estimate_memory(target="cuda") on a machine without a GPU, against CUDA ground truth measured on an H100
(shared/cuda_reference.json: per-phase max_memory_allocated of real Lightning steps of this project's demo models)."""

import json
import os
import warnings

import pytest
import torch

from lightning_memguard import estimate_memory, plan_configuration
from lightning_memguard.base.snapshot import GiB
from lightning_memguard.commands.demo import DemoTransformer, SmallCNN, TinyGPT
from lightning_memguard.estimate import EstimateFallbackWarning
from tests.helpers import ESTIMATE_PHASES, KNOWN_ESTIMATE_MISSES
from tests.models import BlockStack

REFERENCE = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "cuda_reference.json")
MODELS = {"BlockStack": BlockStack, "DemoTransformer": DemoTransformer, "TinyGPT": TinyGPT, "SmallCNN": SmallCNN}


@pytest.fixture(autouse=True)
def _as_on_a_machine_without_a_gpu(monkeypatch):
    """The reference is an H100's: estimate as this machine does (no GPU: Hopper's workspaces), even on another GPU
    or with torch's workspace settings in the environment."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("CUBLAS_WORKSPACE_CONFIG", "TORCH_CUBLASLT_UNIFIED_WORKSPACE", "CUBLASLT_WORKSPACE_SIZE",
                 "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)


def reference_cases():
    if not os.path.exists(REFERENCE):
        return []
    with open(REFERENCE) as f:
        cases = json.load(f)["models"]
    params = []
    for case in cases:  # every model at both sizes, in both precisions
        small = case["peak"] < 0.5 * GiB
        key = (case["model"], case["precision"])
        marks = [pytest.mark.xfail(strict=True, reason="known miss, see benchmarks/RESULTS.md")] \
            if small and key in KNOWN_ESTIMATE_MISSES else []
        size = "small" if small else "large"
        params.append(pytest.param(case, id=f"{case['model']}-{size}-{case['precision']}", marks=marks))
    return params


@pytest.mark.skipif(not os.path.exists(REFERENCE), reason="benchmarks/cuda_reference.json is missing")
@pytest.mark.parametrize("case", reference_cases())
def test_reference_cases_within_5_percent(case):
    torch.manual_seed(0)
    model = MODELS[case["model"]](**case["kwargs"])
    batch = next(iter(model.train_dataloader()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimate = estimate_memory(model, batch, precision=case["precision"], target="cuda")
    assert estimate.path == "meta" and estimate.target == "cuda"
    assert estimate.peak_bytes == pytest.approx(case["peak"], rel=0.05)
    for phase, column in ESTIMATE_PHASES.items():
        assert estimate.phase_peaks[phase] == pytest.approx(case[column], rel=0.05), phase


def test_the_runtime_allocations_are_their_own_category_and_the_model_is_not_touched():
    model = BlockStack(width=64, depth=4, batch_size=32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    estimate = estimate_memory(model, next(iter(model.train_dataloader())), target="cuda")
    # the cuBLAS workspaces of the training and the backward thread's handles, and the forward's cuBLASLt one
    assert estimate.runtime_bytes == 65 * 2**20
    frame = estimate.to_dataframe().set_index("name")
    assert frame.loc["runtime", "bytes"] == estimate.runtime_bytes
    assert estimate.peak_bytes > estimate.runtime_bytes + estimate.parameters_bytes
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("variable", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
@pytest.mark.parametrize("settings, unmodelled", [
    ("expandable_segments:True", "expandable_segments:True"),
    (" max_split_size_mb : 128 , pinned_use_cuda_host_register:True", "max_split_size_mb:128"),
    ("roundup_power2_divisions:[256:1,512:2,>:4],garbage_collection_threshold:0.6",
     "roundup_power2_divisions:[256:1,512:2,>:4],garbage_collection_threshold:0.6"),
    ("backend:cudaMallocAsync", "backend:cudaMallocAsync"),
    ("expandable_segments:False,backend:native,per_process_memory_fraction:0.5", None),  # the policy modelled
])
def test_allocator_options_the_model_does_not_replay_leave_no_reserved_figure(monkeypatch, variable, settings,
                                                                                unmodelled):
    """Read from the environment when the estimate is made (either name): a wrong number of segments would mislead a
    plan under a cap, none leaves it the allocated peaks; the allocated bytes are the same either way."""
    model = BlockStack(width=32, depth=2, batch_size=8)
    batch = next(iter(model.train_dataloader()))
    default = estimate_memory(model, batch, target="cuda")
    assert default.reserved_bytes > default.peak_bytes and default.notes == ()
    monkeypatch.setenv(variable, settings)
    estimate = estimate_memory(model, batch, target="cuda")
    assert estimate.phase_peaks == default.phase_peaks
    if unmodelled is None:
        assert estimate.reserved_bytes == default.reserved_bytes and estimate.notes == ()
    else:
        (note,) = estimate.notes
        assert estimate.reserved_bytes is None and f"runs with {unmodelled} (PYTORCH_CUDA_ALLOC_CONF or " in note
        assert f"note: {note}" in str(estimate)


class Convolutions(torch.nn.Module):
    def __init__(self, bias_free_head=False, head=True):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.head = torch.nn.Linear(8, 4, bias=not bias_free_head) if head else None

    def forward(self, x):
        x = self.conv(x).mean(dim=(2, 3))
        return self.head(x) if self.head is not None else x


@pytest.mark.parametrize("model, checkpointed, expected_mib", [
    (Convolutions(head=False), 0, 0),  # cuDNN only: no cuBLAS handle gets a workspace
    (Convolutions(bias_free_head=True), 0, 64),  # mm forward and backward: two threads' cuBLAS workspaces
    (Convolutions(), 0, 65),  # a biased Linear runs on cuBLASLt in the forward: its 1 MiB workspace too
    (BlockStack(width=32, depth=2, batch_size=8), 2, 66),  # recomputed in backward: the Lt workspace there too
])
def test_the_workspaces_follow_the_threads_that_run_matmuls(model, checkpointed, expected_mib):
    batch = torch.randn(4, 3, 8, 8) if isinstance(model, Convolutions) else next(iter(model.train_dataloader()))
    estimate = estimate_memory(model, batch, target="cuda", checkpointed_blocks=checkpointed)
    assert estimate.runtime_bytes == expected_mib * 2**20
    assert estimate_memory(model, batch, target="cpu", checkpointed_blocks=checkpointed).runtime_bytes == 0


class DropoutAttention(torch.nn.Module):
    """Self-attention with attention dropout: on CPU that runs SDPA's math path, which keeps the attention matrix."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.qkv, self.heads = torch.nn.Linear(d, 3 * d), heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)


def test_fused_attention_keeps_no_attention_matrix_on_cuda():
    model = DropoutAttention()
    batch = torch.randn(8, 256, 64)
    cpu = estimate_memory(model, batch, target="cpu")
    cuda = estimate_memory(model, batch, target="cuda")
    probabilities = 8 * 4 * 256 * 256 * 4  # the fp32 attention matrix (and as much again for the dropout mask)
    assert cpu.activations_bytes - cuda.activations_bytes > probabilities
    lse = 8 * 4 * 256 * 4
    out = 8 * 256 * 64 * 4
    assert cuda.activations_bytes <= 3 * out + out + lse + 8 * 256 * 64 * 4 + 4096  # qkv, output, lse, input


def test_a_gpt2_sized_model_is_estimated_on_meta_without_running_it():
    model = TinyGPT(d_model=768, nhead=12, nlayers=12, seq_len=1024, batch_size=8, vocab_size=50257)
    batch = next(iter(model.train_dataloader()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.05)
    estimate = estimate_memory(model, batch, optimizer=optimizer, target="cuda", variants=True)
    assert estimate.path == "meta"
    params = sum(p.numel() for p in model.parameters()) * 4
    assert estimate.parameters_bytes == pytest.approx(params, rel=0.01)
    assert estimate.optimizer_state_bytes == pytest.approx(2 * params, rel=0.01)  # AdamW: two moments
    assert optimizer.state == {}  # the user's optimizer was copied, not stepped
    variants = estimate.variants.set_index("config")
    assert variants.loc["amp (bf16-mixed)", "peak_bytes"] < estimate.peak_bytes
    checkpointed = variants.filter(like="checkpoint", axis=0)["peak_bytes"].tolist()
    assert checkpointed == sorted(checkpointed, reverse=True) and checkpointed[-1] < 0.7 * estimate.peak_bytes


def test_an_optimizer_instance_keeps_its_class_and_group_hyperparameters():
    model = BlockStack(width=32, depth=2)
    batch = next(iter(model.train_dataloader()))
    sgd = torch.optim.SGD([{"params": model.inp.parameters(), "momentum": 0.9},
                           {"params": [p for n, p in model.named_parameters() if not n.startswith("inp")]}], lr=0.1)
    with_momentum_on_inp = estimate_memory(model, batch, optimizer=sgd, target="cpu")
    inp = sum(p.numel() for p in model.inp.parameters()) * 4
    assert with_momentum_on_inp.optimizer_state_bytes == inp  # only the first group has momentum buffers
    assert sgd.state == {} and all(p.grad is None for p in model.parameters())
    stranger = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="not the model's"):
        estimate_memory(model, batch, optimizer=stranger)


def test_a_training_step_that_skips_the_batch_is_a_clear_error():
    class Skips(BlockStack):
        def training_step(self, batch, batch_idx):
            return None

    model = Skips(width=32, depth=2)
    for target in ("cpu", "cuda"):
        with pytest.raises(ValueError, match="returned NoneType for the example batch"):
            estimate_memory(model, next(iter(model.train_dataloader())), target=target)


def test_plan_for_cuda_uses_the_cuda_estimate_and_may_choose_amp():
    torch.manual_seed(0)
    model = TinyGPT(d_model=128, nlayers=4, seq_len=64)
    batch = next(iter(model.train_dataloader()))
    fp32 = estimate_memory(model, batch, target="cuda").peak_bytes
    amp = estimate_memory(model, batch, precision="bf16-mixed", target="cuda").peak_bytes
    plan = plan_configuration(model, batch, capacity_bytes=int((fp32 + amp) / 2 / 0.9), target="cuda")
    assert plan.fits and plan.amp and plan.checkpointed_blocks == 0
    assert plan.expected_peak_bytes == amp


def test_cross_entropy_under_autocast_keeps_half_log_probabilities_and_an_fp32_copy():
    # torch's cross_entropy passes the logits' own dtype to log_softmax, so CUDA autocast leaves it in bf16; nll_loss
    # is on autocast's fp32 list and keeps the fp32 copy it runs on. (The H100 reference's GPT-style runs agree.)
    model = torch.nn.Linear(64, 1000)
    batch = (torch.randn(256, 64), torch.randint(0, 1000, (256,)))

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    total_weight = 4  # nll_loss's saved scalar
    fp32 = estimate_memory(model, batch, loss_fn=loss_fn, target="cuda")
    assert fp32.activations_bytes == 256 * 1000 * 4 + total_weight  # the fp32 log-probabilities
    bf16 = estimate_memory(model, batch, loss_fn=loss_fn, precision="bf16-mixed", target="cuda")
    input_copy, log_probs, fp32_copy = 256 * 64 * 2, 256 * 1000 * 2, 256 * 1000 * 4
    assert bf16.activations_bytes == input_copy + log_probs + fp32_copy + total_weight


@pytest.mark.parametrize("env, expected_mib", [
    ({}, 65),  # Hopper's default (no GPU here): 32 MiB per thread's handle, 1 MiB for the forward's cuBLASLt
    ({"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}, 2 * 8.125 + 1),  # the default on other GPUs, set explicitly
    ({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}, 64),  # cuBLASLt shares the cuBLAS workspace
    ({"CUBLASLT_WORKSPACE_SIZE": "4096"}, 68),  # a 4 MiB cuBLASLt workspace
    ({"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, 2 * 0.125 + 0.125),  # a tiny cuBLAS workspace caps cuBLASLt's
])
def test_the_workspace_sizes_follow_torchs_settings(monkeypatch, env, expected_mib):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model = BlockStack(width=32, depth=2, batch_size=8)
    estimate = estimate_memory(model, next(iter(model.train_dataloader())), target="cuda")
    assert estimate.runtime_bytes == int(expected_mib * 2**20)


@pytest.mark.parametrize("inplace", [False, True])
def test_dropout_keeps_a_one_byte_mask_on_cuda_where_meta_and_cpu_keep_a_noise_tensor(inplace):
    # torch runs a training dropout as one fused kernel on CUDA (native_dropout, which saves a bool mask) and as
    # input * noise elsewhere, meta included (the noise, of the input's dtype, is saved); the in-place form is the
    # composite on CUDA too. Lightning's demo Transformer (dropout 0.2) was ~13 % high in fp32 from this.
    model = torch.nn.Sequential(torch.nn.Linear(64, 512, bias=False), torch.nn.Dropout(0.25, inplace=inplace))
    batch = torch.randn(256, 64)
    elements = 256 * 512
    assert estimate_memory(model, batch, target="cpu").activations_bytes == 4 * elements
    fp32 = estimate_memory(model, batch, target="cuda")
    assert fp32.activations_bytes == (4 * elements if inplace else elements)
    bf16 = estimate_memory(model, batch, precision="bf16-mixed", target="cuda")
    input_copy = 256 * 64 * 2  # autocast's bf16 copy of the input, kept for the weight's gradient
    assert bf16.activations_bytes == input_copy + (2 * elements if inplace else elements)
    model[1].p = 0.0  # torch skips a dropout of p=0 on every device: nothing kept
    assert estimate_memory(model, batch, target="cuda").activations_bytes == 0


class PaddedTokens(torch.nn.Module):
    """Asks questions about its batch (is the mask all ones? are the positions in order?) and keeps a mask computed
    from the batch alone for its backward, as transformers models do."""

    def __init__(self, vocab=100, width=64):
        super().__init__()
        self.embed, self.width = torch.nn.Embedding(vocab, width), width

    def forward(self, ids, mask):
        positions = torch.arange(ids.shape[1], device=self.embed.weight.device)
        if bool((positions[1:] > positions[:-1]).all()) and not bool(mask.all()):
            keep = mask[..., None].expand(-1, -1, self.width).float()  # from the batch alone
        else:
            keep = torch.ones((), device=mask.device)
        return (self.embed(ids) * keep).sum()  # the product keeps `keep` for the embedding's gradient


def padded_tokens_batch(batch=8, seq=32):
    ids = torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1:, seq // 2:] = 0
    return ids, mask


def test_questions_about_the_batch_are_answered_on_meta_and_its_masks_are_device_memory():
    model, (ids, mask) = PaddedTokens(), padded_tokens_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", EstimateFallbackWarning)
        meta = estimate_memory(model, (ids, mask), loss_fn=lambda m, b: m(*b), target="cuda")
    cpu = estimate_memory(model, (ids, mask), loss_fn=lambda m, b: m(*b), target="cuda", path="cpu")
    assert meta.path == "meta" and cpu.path == "cpu"
    # the float mask the product keeps is on the GPU in a CUDA run: an activation, rounded as the allocator does
    keep = 8 * 32 * 64 * 4
    assert meta.activations_bytes == cpu.activations_bytes == keep
    assert meta.phase_peaks == cpu.phase_peaks
    assert meta.batch_bytes == 2 * 8 * 32 * 8


class Routed(torch.nn.Module):
    """Picks an expert from its router's output: a value computed from the weights decides the control flow."""

    def __init__(self, width=16, stale=False):
        super().__init__()
        self.router, self.stale = torch.nn.Linear(width, 2), stale
        self.experts = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(2))

    def forward(self, x):
        if self.stale:  # a batch-side tensor overwritten in place with the router's choice, then read
            choice = torch.zeros(x.shape[0], dtype=torch.long)
            choice.copy_(self.router(x).argmax(-1))
            return self.experts[int(choice[0])](x).sum()
        return self.experts[self.router(x).mean(0).argmax().item()](x).sum()


@pytest.mark.parametrize("stale", [False, True], ids=["item", "stale-batch-tensor"])
def test_a_value_computed_from_the_weights_falls_back_to_cpu_with_one_warning_naming_it(stale):
    model, batch = Routed(stale=stale), torch.randn(8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimate = estimate_memory(model, batch, target="cuda")
    fallbacks = [w for w in caught if issubclass(w.category, EstimateFallbackWarning)]
    assert estimate.path == "cpu" and len(fallbacks) == 1
    text = str(fallbacks[0].message)
    assert "aten::_local_scalar_dense" in text and "ran the step on CPU" in text
    assert "test_estimate_cuda.py" in text and "in forward" in text  # where the model asked
    with pytest.raises(ValueError, match="reads a value computed from the weights.*_local_scalar_dense"):
        estimate_memory(model, batch, target="cuda", path="meta")
    with torch.device("meta"):
        on_meta = Routed(stale=stale)
    with pytest.raises(ValueError, match="give a copy of the model on CPU"):
        estimate_memory(on_meta, batch, target="cuda")


def test_a_plan_for_a_model_that_falls_back_warns_once():
    model, batch = Routed(), torch.randn(256, 16)
    peak = estimate_memory(model, batch, target="cuda", path="cpu").peak_bytes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_configuration(model, batch, capacity_bytes=peak // 2, target="cuda", blocks={torch.nn.Linear})
    assert not plan.fits and len(plan.reason.split(";")) > 2  # several estimates were made
    assert len([w for w in caught if issubclass(w.category, EstimateFallbackWarning)]) == 1


def test_the_cpu_fallback_of_a_cuda_estimate_keeps_no_attention_matrix_either():
    model, batch = DropoutAttention(), torch.randn(8, 256, 64)
    meta = estimate_memory(model, batch, target="cuda")
    cpu = estimate_memory(model, batch, target="cuda", path="cpu")
    # the CPU's fused kernel keeps what CUDA's efficient attention keeps, but a log-sum-exp not padded to 32 rows
    assert cpu.activations_bytes == pytest.approx(meta.activations_bytes, rel=0.01)
    assert cpu.peak_bytes == pytest.approx(meta.peak_bytes, rel=0.01)


def test_module_attribution_uses_hooks_on_the_model_only():
    from torch.nn.modules import module as torch_module

    seen = []

    def loss_fn(model, batch):  # during the forward: no global module hooks, the model's own are there
        seen.append((len(torch_module._global_forward_hooks), len(torch_module._global_forward_pre_hooks),
                     len(model.inp._forward_pre_hooks)))
        return model.training_step(batch, 0)

    model = BlockStack(width=32, depth=2)
    estimate = estimate_memory(model, next(iter(model.train_dataloader())), loss_fn=loss_fn, target="cuda")
    # one forward, measured: the measured step replays its record (estimate/step_replay.py)
    assert seen == [(0, 0, 1)]
    assert set(estimate.modules["module"]) >= {"blocks.0.up", "blocks.1.up", "blocks.1.down"}
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_integer_buffers_keep_their_values_on_meta():
    # BatchNorm with a cumulative average reads its batch counter (an integer buffer): not a weight, so it has a value
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32, momentum=None))
    with warnings.catch_warnings():
        warnings.simplefilter("error", EstimateFallbackWarning)
        meta = estimate_memory(model, torch.randn(64, 16), target="cuda")
    cpu = estimate_memory(model, torch.randn(64, 16), target="cuda", path="cpu")
    assert meta.path == "meta" and meta.phase_peaks == cpu.phase_peaks
    assert int(model[1].num_batches_tracked) == 0  # the copy's counter moved, not the model's


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_cuda_estimate_run_on_cpu_agrees_with_the_one_on_meta_on_the_demo_models(name, precision):
    # fused attention's output layout included: CUDA's efficient attention (fp32) writes (b, s, h, d), so
    # nn.MultiheadAttention's reshape copies it; the CPU's kernel follows the query's layout
    torch.manual_seed(0)
    model = MODELS[name]()
    batch = next(iter(model.train_dataloader()))
    meta = estimate_memory(model, batch, precision=precision, target="cuda")
    cpu = estimate_memory(model, batch, precision=precision, target="cuda", path="cpu")
    assert (meta.path, cpu.path) == ("meta", "cpu") and meta.runtime_bytes == cpu.runtime_bytes
    for phase, peak in meta.phase_peaks.items():
        assert peak - meta.runtime_bytes == pytest.approx(cpu.phase_peaks[phase] - cpu.runtime_bytes, rel=0.01), phase
