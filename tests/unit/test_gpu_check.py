"""The GPU check and the CUDA reference, as far as a machine without a GPU can check them: the one command fails
fast without CUDA, lists every step, each step's script exists and answers --help, the step runner logs, stops and
reports for real; the reference holds every case the measuring script measures, each with its device, torch version
and date, and the reference models build and train."""

import datetime
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def load(name: str):
    """A benchmark script as a module (benchmarks/ is no package), under a name of its own."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


gpu_check = load("gpu_check")
cuda_reference = load("cuda_reference")


def run(args, **kwargs):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **kwargs.pop("env", {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env,
                          **kwargs)


def test_without_cuda_it_fails_fast_in_one_line_and_writes_nothing(tmp_path):
    done = run(["benchmarks/gpu_check.py", "--out", str(tmp_path / "out")], env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "no CUDA device here" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_dry_run_lists_every_check_of_the_project_in_order(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ["pytest-gpu", "cuda-reference", "estimate-accuracy",
                                                       "mitigation-0.8", "mitigation-0.5", "mitigation-0.33",
                                                       "overhead", "cuda-calls", "per-rank-fsdp", "plan-time"]
    assert "-m pytest -m gpu" in lines[0] and "--budget-share 0.33" in lines[5]
    assert f"--out {BENCHMARKS / 'cuda_reference.json'}" in lines[1]  # the reference is refreshed in place
    assert lines[-1] == f"results would go to {tmp_path}"


def test_only_skip_and_keep_reference_choose_the_steps_and_where_the_reference_goes(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--only", "cuda-reference", "--only",
                           "estimate-accuracy", "--skip", "estimate-accuracy", "--keep-reference"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("cuda-reference") and str(tmp_path / "cuda_reference.json") in \
        lines[0]


def test_several_steps_after_one_only_or_skip_flag_count_as_the_flag_repeated(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--only", "pytest-gpu", "estimate-accuracy",
                           "overhead", "--skip", "overhead", "cuda-reference"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ["pytest-gpu", "estimate-accuracy"]
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--skip", "pytest-gpu", "cuda-reference",
                           "--skip", "overhead"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ["estimate-accuracy", "mitigation-0.8", "mitigation-0.5",
                                                       "mitigation-0.33", "cuda-calls", "per-rank-fsdp", "plan-time"]


@pytest.mark.parametrize("argv", [["--minutes", "0"], ["--only", "lint"], ["--skip", "everything"],
                                  ["--only", "overhead", "lint"], ["--only"], ["--skip"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(argv)
    assert exit_info.value.code == 2


@pytest.mark.parametrize("script", sorted({str(s.script.relative_to(ROOT)) for s in
                                           gpu_check.build_steps(Path("ref.json")) if s.script}))
def test_every_benchmark_step_exists_and_answers_help(script):
    assert (ROOT / script).is_file()
    done = run([script, "--help"])
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr[-2000:]


def test_the_pytest_step_selects_the_gpu_tests():
    done = run(["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/gpu"])
    assert done.returncode == 0, done.stdout[-2000:]
    collected = [line for line in done.stdout.splitlines() if line.startswith("tests/gpu/")]
    assert len(collected) >= 10


def test_a_step_is_run_logged_and_stopped_when_its_time_is_up(tmp_path):
    python = sys.executable
    ok = gpu_check.run_step(gpu_check.Step("ok", [python, "-c", "print('measured 42 MiB')"], 1), tmp_path, 60)
    failed = gpu_check.run_step(gpu_check.Step("fails", [python, "-c", "raise SystemExit(3)"], 1), tmp_path, 60)
    slow = gpu_check.run_step(gpu_check.Step("slow", [python, "-c", "import time; print('started', flush=True); "
                                                                    "time.sleep(60)"], 1), tmp_path, 3)
    assert ok["result"] == "passed" and "measured 42 MiB" in (tmp_path / "ok.log").read_text()
    assert failed["result"] == "failed (exit code 3)"
    assert slow["result"].startswith("stopped after") and slow["minutes"] < 0.5
    assert "started" in (tmp_path / "slow.log").read_text()  # what it wrote before it was stopped is kept

    started = datetime.datetime(2026, 11, 23, 9, 30)
    info = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "commit": "abc1234"}
    path = gpu_check.write_results(tmp_path, info, [ok, failed, slow], started)
    text = path.read_text()
    assert text.startswith("# GPU check: NVIDIA H100 80GB HBM3, 2026-11-23")
    assert "| ok | `python -c print('measured 42 MiB')` | passed |" in text and "measured 42 MiB" in text
    assert "| fails |" in text and "failed (exit code 3)" in text
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["environment"] == info and [row["step"] for row in saved["steps"]] == ["ok", "fails", "slow"]


# --- the reference ----------------------------------------------------------------------------------------------

REFERENCE = json.loads((BENCHMARKS / "cuda_reference.json").read_text())
PHASES = ("after_forward", "after_backward", "after_optimizer_step")


def key(case):
    return case["model"], json.dumps(case["kwargs"], sort_keys=True), case["precision"]


def reference_models():
    return load("reference_models")


def test_the_reference_holds_the_cases_the_script_measures_each_with_device_torch_and_date():
    models = reference_models()
    assert sorted(map(key, REFERENCE["models"])) == sorted(map(key, models.reference_cases("demo")))
    zoo = {key(case) for case in models.reference_cases("zoo")}
    assert all(models.is_zoo(name) for name, *_ in zoo) and {key(c) for c in REFERENCE["zoo_models"]} <= zoo
    for case in REFERENCE["models"] + REFERENCE["zoo_models"]:
        assert case["device"] and case["torch"] and datetime.date.fromisoformat(case["date"])
        assert case["peak"] == max(case[phase] for phase in PHASES) > 0
    assert REFERENCE["kernels"]["device"] and REFERENCE["how"]


def test_the_probe_summary_is_the_median_of_steps_2_to_4():
    rows = [{"step": s, "after_forward": 100 + s, "after_backward": [0, 0, 90, 70, 80][s], "after_optimizer_step": 5}
            for s in range(5)]
    assert cuda_reference.summarise(rows) == {"after_forward": 103, "after_backward": 80, "after_optimizer_step": 5,
                                              "peak": 103}
    with pytest.raises(ValueError, match="steps"):
        cuda_reference.summarise(rows[:4])  # the run stopped after step 3


def test_the_probe_summary_keeps_the_requested_bytes_where_they_were_read():
    # requested bytes (before the allocator's rounding and unsplit blocks) say which part of a gap is the allocator's
    rows = [{"step": s, "after_forward": 100, "after_forward_requested": 90 + s, "after_backward": 80,
             "after_backward_requested": 70, "after_optimizer_step": 5, "after_optimizer_step_requested": 4}
            for s in range(5)]
    summary = cuda_reference.summarise(rows)
    assert summary["peak"] == 100 and summary["after_forward_requested"] == 93
    assert summary["after_backward_requested"] == 70 and summary["after_optimizer_step_requested"] == 4


@pytest.mark.parametrize("name", ["zoo:gpt2", "zoo:llama", "zoo:t5", "zoo:resnet"])
def test_a_zoo_reference_case_builds_at_its_size(name):
    models = reference_models()
    case = next(c for c in models.reference_cases("zoo") if c["model"] == name and c["kwargs"])
    module = models.build_case(case)
    config = module.model.config
    assert all(getattr(config, k) == v for k, v in case["kwargs"]["config"].items())
    batch = next(iter(module.train_dataloader()))
    first = next(iter(batch.values()))
    assert first.shape[0] == case["kwargs"]["batch_size"]
    if "seq_len" in case["kwargs"]:
        assert first.shape[1] == case["kwargs"]["seq_len"] and int(first.max()) < case["kwargs"]["vocab_size"]
        assert config.vocab_size == case["kwargs"]["vocab_size"] and "attention_mask" not in batch  # the meta path
    else:
        assert first.shape[-1] == case["kwargs"]["image_size"]


@pytest.mark.parametrize("name", ["zoo:gpt2", "zoo:t5", "zoo:vit"])
def test_a_tiny_zoo_reference_case_trains_with_its_own_loss(name):
    models = reference_models()
    module = models.build_case({"model": name, "kwargs": {}, "precision": "32-true"})
    batch = next(iter(module.train_dataloader()))
    module.log = lambda *args, **kwargs: None  # no Trainer here
    loss = module.training_step(batch, 0)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in module.parameters() if p.requires_grad)
