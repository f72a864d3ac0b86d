"""The tests' own layout: no module under tests/ imports a test module. What tests share lives in tests/helpers.py,
tests/ranks.py (the multi-process tests'), tests/models.py or tests/zoo/models.py, so running, moving or deleting
one test file never changes another."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def is_test_module(dotted: str) -> bool:
    return dotted.split(".")[-1].startswith("test_")


def imported_modules(path: Path, tests: Path = TESTS) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every module ``path`` (a file under the package directory ``tests``) imports,
    relative imports resolved against its package; for ``from X import name`` both ``X`` and ``X.name`` (``name`` may
    be a module)."""
    package = path.relative_to(tests.parent).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def imports_of_test_modules(tests: Path) -> list[str]:
    return [f"{path.relative_to(tests.parent)}:{line} imports {name}"
            for path in sorted(tests.rglob("*.py")) for line, name in imported_modules(path, tests)
            if name.startswith(f"{tests.name}.") and is_test_module(name)]


def test_the_check_finds_a_test_module_imported_absolutely_relatively_or_from_its_package(tmp_path):
    module = tmp_path / "tests" / "unit" / "test_x.py"
    module.parent.mkdir(parents=True)
    module.write_text("import os\nfrom tests.models import Stack\nfrom tests.unit.test_engine import DEPTH\n"
                      "from .test_monitor import r\nfrom . import test_cli\nimport tests.integration.test_ddp\n"
                      "from ..helpers import run\n")
    assert imports_of_test_modules(tmp_path / "tests") == [
        "tests/unit/test_x.py:3 imports tests.unit.test_engine",
        "tests/unit/test_x.py:4 imports tests.unit.test_monitor",
        "tests/unit/test_x.py:5 imports tests.unit.test_cli",
        "tests/unit/test_x.py:6 imports tests.integration.test_ddp",
    ]


def test_no_module_under_tests_imports_a_test_module():
    offending = imports_of_test_modules(TESTS)
    where = "tests/helpers.py, tests/ranks.py or tests/models.py"
    assert offending == [], f"move what they share to {where}:\n" + "\n".join(offending)
