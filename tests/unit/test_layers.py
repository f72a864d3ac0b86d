"""The package's layers: each folder imports only its own modules and those of the layers below it, and nothing under
``adapters/`` (bar the plain loop) or ``commands/`` imports Lightning — what makes the guard testable with plain numbers
and usable outside a Trainer."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_memguard"
#: bottom to top; a folder may import its own modules and those of the layers below it
LAYERS = [["base"], ["sources", "mitigations"], ["estimate", "monitor"], ["guard"], ["adapters"], ["commands"]]
FREE = [folder for layer in LAYERS[:4] for folder in layer]
CORE = sorted(str(p.relative_to(PACKAGE)) for folder in FREE for p in (PACKAGE / folder).glob("*.py")) + [
    "adapters/loop.py", "adapters/torch_backend.py", "adapters/results.py", "adapters/tensorboard.py", "__init__.py"]
LIGHTNING = {"lightning", "pytorch_lightning", "lightning_fabric"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def package_imports(path: Path) -> set[str]:
    """The package's folders ``path`` imports from (relative or absolute imports)."""
    parts = path.relative_to(PACKAGE).parts
    folders = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = list(parts[:-1])[:len(parts) - node.level]
            target = base + (node.module.split(".") if node.module else [a.name for a in node.names][:1])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_memguard."):
            target = node.module.split(".")[1:]
        elif isinstance(node, ast.Import):
            target = next((a.name.split(".")[1:] for a in node.names if a.name.startswith("lightning_memguard.")), [])
        else:
            continue
        if target:
            folders.add(target[0])
    return folders


@pytest.mark.parametrize("layer", range(len(LAYERS)))
def test_each_layer_imports_only_downward(layer):
    allowed = {f for lower in LAYERS[:layer] for f in lower}
    for folder in LAYERS[layer]:
        for path in sorted((PACKAGE / folder).glob("*.py")):
            wrong = package_imports(path) - allowed - {folder}
            assert not wrong, f"{path.relative_to(PACKAGE)} imports from {sorted(wrong)}, which are not below it"


def test_the_layout_has_the_folders_a_newcomer_looks_for():
    for folder in [f for layer in LAYERS for f in layer]:
        assert (PACKAGE / folder / "__init__.py").is_file(), folder
    assert len(CORE) > 25  # the scan below really covers the core


@pytest.mark.parametrize("name", CORE)
def test_core_module_imports_no_lightning(name):
    assert not imported_modules(PACKAGE / name) & LIGHTNING


def test_a_plain_loop_runs_without_importing_lightning(tmp_path):
    """Nothing the core imports, directly or not, pulls Lightning in: a guarded plain loop in a fresh interpreter."""
    script = """
import sys, torch, torch.nn.functional as F
from lightning_memguard import MemGuard
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
guard = MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), budget="1MiB", log_dir=sys.argv[1])
for _ in range(2):
    guard.step(torch.randn(8, 16), lambda m, b: F.mse_loss(m(b), b))
guard.close()
assert len(guard.history) == 8, guard.history
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {"lightning", "pytorch_lightning", "lightning_fabric"})
print("LOADED", loaded)
"""
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script, str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout


def test_a_loop_that_only_monitors_never_loads_the_estimator(tmp_path):
    """The estimator (and its CUDA kernel model) is loaded by the first prediction, not by the guard: a plain loop
    with no budget only monitors, and in a fresh interpreter it runs without it."""
    script = """
import sys, torch, torch.nn.functional as F
from lightning_memguard import MemGuard
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
guard = MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), cpu_sample_every=1)
for _ in range(2):
    guard.step(torch.randn(8, 16), lambda m, b: F.mse_loss(m(b), b))
guard.close()
assert len(guard.history) == 8, guard.history
print("LOADED", sorted(m for m in sys.modules if m.startswith("lightning_memguard.estimate")))
import lightning_memguard
lightning_memguard.plan_configuration  # the public name still resolves, and loads it now
print("AFTER", "lightning_memguard.estimate.plan" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout and "AFTER True" in out.stdout


def test_no_source_line_is_longer_than_120_characters():
    """The project's line length (pyproject's, the style guides'), for the package, its tests and benchmarks."""
    root = PACKAGE.parent
    long_lines = [f"{path.relative_to(root)}:{number}"
                  for folder in ("lightning_memguard", "tests", "benchmarks") for path in (root / folder).rglob("*.py")
                  for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if len(line) > 120]
    assert not long_lines, f"lines over 120 characters: {long_lines}"
