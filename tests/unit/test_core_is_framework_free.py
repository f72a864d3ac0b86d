"""The core (sources, snapshot, policy, history, estimate, plan, recorder, tensor diff) must not import Lightning:
it is what makes it testable with plain numbers and usable outside a Trainer."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_memguard"
CORE = ["snapshot.py", "checks.py", "history.py", "policy.py", "estimate.py", "cuda_kernels.py", "plan.py",
        "recorder.py", "keys.py", "summary.py", "tensor_diff.py", "explain.py", "report.py", "plot.py",
        "mitigations/checkpointing.py", "mitigations/offload.py", "mitigations/microbatch.py",
        *[f"sources/{p.name}" for p in (PACKAGE / "sources").glob("*.py")]]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("name", CORE)
def test_core_module_imports_no_lightning(name):
    assert not imported_modules(PACKAGE / name) & {"lightning", "pytorch_lightning", "lightning_fabric"}
