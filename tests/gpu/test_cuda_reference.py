"""The CUDA reference's probe (benchmarks/cuda_reference.py: torch's own counters, nothing of MemGuard's) on this
GPU (skipped without CUDA): MemGuard's measurement of the same steps agrees with it, and where this machine is the
reference's (same device and torch), the committed reference is what this machine measures (the newest in
benchmarks/cuda_reference.json, another GPU's beside it)."""

import json
from pathlib import Path

import pytest
import torch

from lightning_memguard import MemGuardCallback
from tests.models import pl, trainer_kwargs

pytestmark = pytest.mark.gpu

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
#: the reference (the newest measurement) and those of other GPUs kept beside it (cuda_reference_<gpu>.json)
REFERENCES = sorted(BENCHMARKS.glob("cuda_reference*.json"))
PHASES = ("after_forward", "after_backward", "after_optimizer_step")
SMALL_CASES = [{"model": "BlockStack", "kwargs": {"width": 128, "depth": 8, "batch_size": 256}, "precision": p}
               for p in ("32-true", "bf16-mixed")] + [{"model": "TinyGPT", "kwargs": {"d_model": 128, "nlayers": 4,
                                                                                        "seq_len": 64},
                                                       "precision": "bf16-mixed"}]


@pytest.fixture
def cuda_reference(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its neighbours (reference_models, _common)
    import cuda_reference

    return cuda_reference


@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: f"{c['model']}-{c['precision']}")
def test_memguard_measures_what_the_reference_probe_measures(cuda_reference, case, tmp_path):
    probed = cuda_reference.measure_case(case)
    from reference_models import build_case

    guard = MemGuardCallback(mitigations=(), explain=False)
    pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
               **trainer_kwargs(accelerator="cuda", max_steps=5, precision=case["precision"])).fit(build_case(case))
    history = guard.history[guard.history["step"].isin([2, 3, 4])]
    for phase in PHASES:
        measured = history[history["phase"] == phase]["peak_bytes"].median()
        assert measured == pytest.approx(probed[phase], abs=2**20), phase


def test_the_reference_is_what_this_gpu_measures_where_it_was_measured_here(cuda_reference):
    env = cuda_reference.environment()
    cases = [c for path in REFERENCES for c in json.loads(path.read_text())["models"]
             if c["device"] == env["device"] and c["torch"] == env["torch"] and c["peak"] < 2**30]
    if not cases:
        pytest.skip(f"no reference case was measured on {env['device']} with torch {env['torch']}")
    for case in cases[:4]:
        measured = cuda_reference.measure_case({k: case[k] for k in ("model", "kwargs", "precision")})
        torch.cuda.empty_cache()
        for phase in PHASES:
            assert measured[phase] == pytest.approx(case[phase], rel=0.01), (case["model"], case["precision"], phase)
