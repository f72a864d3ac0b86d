"""A published figure as a check: torchtitan's Llama 3.1 8B under FSDP2 on 8 H100s, estimated on the meta device.

torchtitan's benchmark page
(https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md, earlier
docs/performance.md; torchtitan commit 9dec370, December 2024) reports, in its Table 1, the peak memory of one
GPU for Llama 3.1 8B, FSDP on 8 GPUs, local batch 2, selective activation checkpointing: 82.4 GiB, and 77.0 GiB with
torch.compile. Its train_configs/llama3_8b.toml at that commit: sequence length 8192, AdamW, selective checkpointing
by op; FSDP2 with parameters gathered in bf16 and gradients reduced in fp32 (the defaults), no autocast. The figure
logged is the allocator's peak reserved memory (``reserved_bytes.all.peak``).

How it is modelled here (the estimator's arguments cannot say "FSDP2 mixed precision" directly):

* the model is transformers' ``LlamaForCausalLM`` with the 8B shapes, built on meta **in bf16** and estimated with
  ``precision="32-true"``: every op then runs in bf16 as under FSDP2's ``param_dtype=bf16`` (RMSNorm upcasts to
  fp32 itself, in both models), gathered units are bf16 — ``"bf16-mixed"`` would be autocast over fp32 weights, a
  different step (shown for contrast). The sharded fp32 master parameters and AdamW state are then twice what the
  estimate counts in bf16: added by arithmetic. Their fp32 gradient shards do not exist at the peak (the gradients
  are set to None before the forward, and the peak is in the loss's backward, before any reduce-scatter);
* the loss is torchtitan's: logits upcast to fp32, cross-entropy over the 2 × 8192 tokens;
* op-level selective checkpointing is applied as torchtitan applies it, by the model itself: every decoder layer
  wrapped in torch's ``checkpoint_wrapper`` with a selective policy keeping the outputs of attention and of every
  other matmul (1st, 3rd, ... of the layer), recomputing the rest. Whole-block checkpointing (none, every other
  block — torchtitan's layer option 2 — and all) are the estimator's own, as brackets.

    python benchmarks/published_figure.py
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import _common  # noqa: F401  (puts this checkout first on sys.path)
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_memguard import estimate_memory

GiB = 2**30
RANKS, BATCH, SEQ_LEN, LAYERS = 8, 2, 8192, 32
PUBLISHED = {"FSDP": 82.4, "FSDP + torch.compile": 77.0}  # GiB, Table 1
LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=LAYERS,
                   num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192,
                   rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa")
#: what the selective policy keeps (matmuls: every other one); attention as any CUDA kernel runs it
KEPT_OPS = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_cudnn_attention.default}


def llama_8b(dtype: torch.dtype) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**LLAMA_31_8B)).to(dtype)


def loss_fn(model: LlamaForCausalLM, batch) -> torch.Tensor:
    """Next-token loss as torchtitan computes it: bf16 logits upcast to fp32 before cross-entropy; no cache."""
    tokens, labels = batch
    hidden = model.model(input_ids=tokens, use_cache=False).last_hidden_state
    logits = model.lm_head(hidden)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def selective_op_contexts():
    """One layer call's contexts for op-level selective checkpointing: keep attention's outputs and those of the
    1st, 3rd, ... matmul, recompute the rest."""
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        phase = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[phase] += 1
        keep = func in KEPT_OPS and not (func == torch.ops.aten.mm.default and counts[phase] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    forward, recompute = create_selective_checkpoint_contexts(policy)
    # On meta the estimate's CUDA kernel model is a torch function mode, active in the forward but not where backward
    # recomputes; selective checkpointing wants the same ops both times (as a GPU, with one set of kernels, runs
    # them), so the recomputation enters the forward's function modes again.
    modes = torch.overrides._get_current_function_mode_stack()

    @contextlib.contextmanager
    def recompute_like_forward():
        with contextlib.ExitStack() as stack:
            if torch._C._len_torch_function_stack() == 0:
                for mode in modes:
                    stack.enter_context(mode)
            stack.enter_context(recompute)
            yield

    return forward, recompute_like_forward()


def with_selective_op_checkpointing(model: LlamaForCausalLM) -> LlamaForCausalLM:
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer, context_fn=selective_op_contexts, preserve_rng_state=False)
    return model


def estimate(model, checkpointed_blocks: int = 0, precision: str = "32-true"):
    batch = (torch.zeros(BATCH, SEQ_LEN, dtype=torch.long), torch.zeros(BATCH, SEQ_LEN, dtype=torch.long))
    start = time.perf_counter()
    result = estimate_memory(model, batch, optimizer=torch.optim.AdamW, loss_fn=loss_fn, precision=precision,
                             checkpointed_blocks=checkpointed_blocks, strategy="fsdp", world_size=RANKS,
                             target="cuda")
    return result, time.perf_counter() - start


def breakdown(est, full_checkpointing_peak: int, selective: bool, master_in_bf16: bool) -> dict[str, float]:
    """One rank's peak (the backward's) split into: fp32 shards, gathered units, activations, logits/loss, runtime.

    The loss's saved log-softmax is the top-level module's activation; what selective checkpointing keeps lives in
    its own cache, outside autograd's saved-tensor hooks, so it is read as its peak above full checkpointing's (both
    peaks are at the same moment, the loss's backward). The logits/loss column is the rest of the peak: the fp32
    log-softmax and, at the peak, its gradient and the gradient of its input."""
    assert est.peak_phase == "backward", est.phase_peaks
    shards = est.parameters_bytes + est.optimizer_state_bytes
    master = 2 * shards if master_in_bf16 else shards  # fp32 shards counted in bf16 by the estimate: doubled
    loss_saved = int(est.modules.loc[est.modules["module"] == "", "activations_bytes"].sum())
    kept = est.activations_bytes - loss_saved + (est.peak_bytes - full_checkpointing_peak if selective else 0)
    logits = est.peak_bytes - shards - est.strategy_bytes - kept - est.runtime_bytes
    total = master + est.strategy_bytes + kept + logits + est.runtime_bytes
    return {"shards": master / GiB, "gathered": est.strategy_bytes / GiB, "activations": kept / GiB,
            "logits": logits / GiB, "runtime": est.runtime_bytes / GiB, "total": total / GiB}


def main() -> None:
    _common.quiet()
    runs = {}
    full, seconds = estimate(llama_8b(torch.bfloat16), checkpointed_blocks=LAYERS)
    runs[f"full: {LAYERS}/{LAYERS} blocks checkpointed"] = (full, seconds, False, True)
    selective, seconds = estimate(with_selective_op_checkpointing(llama_8b(torch.bfloat16)))
    runs["selective op (torchtitan's policy)"] = (selective, seconds, True, True)
    for blocks, name in ((LAYERS // 2, f"every other block: {LAYERS // 2}/{LAYERS}"), (0, "none")):
        runs[name] = (*estimate(llama_8b(torch.bfloat16), checkpointed_blocks=blocks), False, True)
    mixed_full, _ = estimate(llama_8b(torch.float32), checkpointed_blocks=LAYERS, precision="bf16-mixed")
    mixed, seconds = estimate(with_selective_op_checkpointing(llama_8b(torch.float32)), precision="bf16-mixed")
    print(f"Llama 3.1 8B, FSDP2 on {RANKS} ranks, {BATCH} x {SEQ_LEN} tokens a rank, AdamW, one rank's peak (GiB); "
          f"torch {torch.__version__}")
    print("| checkpointing | fp32 shards (params + AdamW) | gathered bf16 units | activations | logits / loss "
          "| cuBLAS workspaces | estimate | vs 82.4 | vs 77.0 | estimate s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = [(name, breakdown(est, full.peak_bytes, sel, bf16), sec) for name, (est, sec, sel, bf16) in runs.items()]
    rows.append(("selective op, as `bf16-mixed` (autocast over fp32 weights: not torchtitan's step)",
                 breakdown(mixed, mixed_full.peak_bytes, True, False), seconds))
    for name, parts, sec in rows:
        print(f"| {name} | {parts['shards']:.1f} | {parts['gathered']:.1f} | {parts['activations']:.1f} "
              f"| {parts['logits']:.1f} | {parts['runtime']:.2f} | **{parts['total']:.1f}** "
              f"| {parts['total'] / PUBLISHED['FSDP']:.2f} | {parts['total'] / PUBLISHED['FSDP + torch.compile']:.2f} "
              f"| {sec:.1f} |")


if __name__ == "__main__":
    main()
