"""The words are true: the README's table of logged keys is ``KEY_TABLE`` row for row and MemGuardCallback's docstring
lists the same keys; every ``lightning_memguard.X.Y`` the README, docs/, benchmarks/ and the package's own text name
resolves, and so do the package's Sphinx roles and the folder paths they mention; the README's imports and shell
commands work; the warning category the README offers for ``filterwarnings`` is the one MemGuard warns with."""

from __future__ import annotations

import importlib
import inspect
import re
import shlex
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_memguard
from lightning_memguard.base.keys import KEY_TABLE

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
#: the README and the guide's pages in docs/: what a user reads
DOCS = README + "".join(page.read_text() for page in sorted((ROOT / "docs").glob("*.md")))
PACKAGE_FILES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "lightning_memguard").rglob("*.py"))
PROSE_FILES = sorted(p.relative_to(ROOT).as_posix() for pattern in ("README.md", "docs/*.md", "benchmarks/*.md",
                                                                    "benchmarks/*.py") for p in ROOT.glob(pattern))

# Stale words in a file, kept known while they are being fixed: xfail until fixed (none now).
STALE_NAMES: dict[str, str] = {}
STALE_ROLES: dict[str, str] = {}


def checked(files: list[str], stale: dict[str, str]) -> list:
    return [pytest.param(f, marks=pytest.mark.xfail(reason=stale[f], strict=False)) if f in stale else f
            for f in files]


def line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


# --- the logged keys: one source ---------------------------------------------------------------------------------

def readme_key_table() -> list[tuple[str, str]]:
    section = README.split("## Logged keys", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \| (.+) \|$", section, re.MULTILINE)


def markdown_table() -> str:
    return "\n".join(["| key | meaning |", "|---|---|", *(f"| `{k}` | {v} |" for k, v in KEY_TABLE.items())])


def test_the_readme_key_table_is_key_table_row_for_row():
    assert readme_key_table() == list(KEY_TABLE.items()), "the README's table should read:\n" + markdown_table()


def test_the_callback_docstring_lists_the_logged_keys_in_order():
    doc = lightning_memguard.MemGuardCallback.__doc__
    listed = re.findall(r"^\s*``(memguard/\S+)``\s", doc, re.MULTILINE)
    assert listed == list(KEY_TABLE), "MemGuardCallback's key table should list, in order:\n" + "\n".join(KEY_TABLE)


# --- dotted references and paths ---------------------------------------------------------------------------------

DOTTED = re.compile(r"lightning_memguard((?:\.[A-Za-z_]\w*)+)(?::([A-Za-z_]\w*))?")
FOLDERS = "base|sources|mitigations|estimate|monitor|guard|adapters|commands|core"  # core: not a folder, a stale word
PATH = re.compile(rf"\b(?:lightning_memguard/)?((?:{FOLDERS})/\w+\.py)\b")


def resolves(dotted: str) -> bool:
    """``package.module.attribute...``: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                found = getattr(found, name)
        except AttributeError:
            return False
        return True
    return False


def test_the_resolver_tells_a_stale_name_from_a_live_one():
    assert resolves("lightning_memguard.base.keys.METRIC_KEYS") and resolves("lightning_memguard.MemGuardCallback")
    assert not resolves("lightning_memguard.core.keys") and not resolves("lightning_memguard.rescue")
    assert not resolves("lightning_memguard.snapshot.MemorySnapshot")


@pytest.mark.parametrize("path", checked(PROSE_FILES + PACKAGE_FILES, STALE_NAMES))
def test_every_dotted_reference_resolves(path):
    text = (ROOT / path).read_text()
    stale = [f"{path}:{line_of(text, m.start())}: {m.group(0)}" for m in DOTTED.finditer(text)
             if not resolves("lightning_memguard" + m.group(1) + (f".{m.group(2)}" if m.group(2) else ""))]
    stale += [f"{path}:{line_of(text, m.start())}: {m.group(0)}" for m in PATH.finditer(text)
              if not (ROOT / "lightning_memguard" / m.group(1)).is_file()]
    assert not stale, "\n".join(stale)


ROLE = re.compile(r":(mod|class|func|meth|attr|data|exc):`~?\.?([A-Za-z_][\w.]*)`")


def role_resolves(module, role: str, name: str, source: str) -> bool:
    """An unqualified Sphinx role: a name of the module, or an attribute of one of its classes (an ``:attr:`` also
    an instance attribute the module assigns)."""
    if name.startswith(("lightning_memguard.", "torch.")):
        return name.startswith("torch.") or resolves(name)
    owners = [module] + [cls for _, cls in inspect.getmembers(module, inspect.isclass)]
    for owner in owners:
        try:
            for part in name.split("."):
                owner = getattr(owner, part)
            return True
        except AttributeError:
            continue
    return role == "attr" and re.search(rf"\bself\.{re.escape(name)}\s*[:=]", source) is not None


@pytest.mark.parametrize("path", checked([p for p in PACKAGE_FILES if not p.endswith("__main__.py")], STALE_ROLES))
def test_every_sphinx_role_in_the_package_resolves(path):
    source = (ROOT / path).read_text()
    name = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    module = importlib.import_module(name)
    stale = [f"{path}:{line_of(source, m.start())}: {m.group(0)}" for m in ROLE.finditer(source)
             if not role_resolves(module, m.group(1), m.group(2), source)]
    assert not stale, "\n".join(stale)


def test_no_sphinx_role_in_the_package_is_broken_across_lines():
    # a role split over two lines is neither rendered as a link nor checked by the test above
    opened = re.compile(r":(mod|class|func|meth|attr|data|exc):`[^`]*$", re.MULTILINE)
    broken = [f"{path}:{line_of(text, m.start())}" for path in PACKAGE_FILES
              for text in [(ROOT / path).read_text()] for m in opened.finditer(text)]
    assert not broken, broken


# --- what the README offers --------------------------------------------------------------------------------------

def test_the_names_the_docs_import_are_public():
    imported = {name.strip() for names in re.findall(r"^from lightning_memguard import (.+)$", DOCS, re.MULTILINE)
                for name in names.split("#")[0].split(",")}
    assert {"MemGuardCallback", "MemGuard", "FabricMemGuard", "estimate_memory", "plan_configuration"} <= imported
    named = set(re.findall(r"[`.](MemGuardWarning|EstimateFallbackWarning|find_blocks|METRIC_KEYS)\b", DOCS))
    assert named == {"MemGuardWarning", "EstimateFallbackWarning", "find_blocks", "METRIC_KEYS"}
    assert imported | named <= set(lightning_memguard.__all__)
    assert all(getattr(lightning_memguard, name) is not None for name in lightning_memguard.__all__)


def readme_commands() -> list[list[str]]:
    """Each ``python -m lightning_memguard ...`` of the shell blocks of the README and docs/, as argv (continuation
    lines joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", DOCS, re.DOTALL)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    words = [shlex.split(command) for line in lines for command in line.split("&&")]
    return [argv[3:] for argv in words if argv[1:3] == ["-m", "lightning_memguard"]]


def test_the_docs_commands_parse_and_name_factories_that_exist():
    from lightning_memguard.commands.cli import build_parser
    from lightning_memguard.commands.estimate_command import load_callable

    commands = readme_commands()
    assert {argv[0] for argv in commands} >= {"demo", "estimate"}
    for argv in commands:
        args = build_parser().parse_args(argv)  # exits (a SystemExit) on an option the command does not have
        if args.command == "estimate" and not args.model.startswith("my_pkg."):  # my_pkg: the reader's own
            assert callable(load_callable(args.model, "model"))


def test_find_blocks_is_what_the_readme_says(tmp_path):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            return self.inner(x)

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(Block(), Block(), Block()))
    assert [name for name, _ in lightning_memguard.find_blocks(model)] == ["1.0", "1.1", "1.2"]
    assert [name for name, _ in lightning_memguard.find_blocks(model, {nn.Linear})] == ["0", "1.0.inner",
                                                                                         "1.1.inner", "1.2.inner"]
    picked = lightning_memguard.find_blocks(model, lambda name, module: name == "1.1")
    assert [module for _, module in picked] == [model[1][1]]


def guarded_steps(log_dir: Path) -> None:
    """Two steps of a plain loop under a budget on CPU: the guard warns that it counts CPU tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    guard = lightning_memguard.MemGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), budget="1GiB",
                                        mitigations=(), log_dir=str(log_dir))
    batch = (torch.randn(4, 8), torch.randn(4, 1))
    for _ in range(2):
        guard.step(batch, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    guard.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-accounting warning is the one looked for")
def test_memguard_warns_with_memguard_warning_and_filterwarnings_silences_it(tmp_path):
    with pytest.warns(lightning_memguard.MemGuardWarning, match="live CPU tensor memory is counted"):
        guarded_steps(tmp_path / "warned")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=lightning_memguard.MemGuardWarning)
        guarded_steps(tmp_path / "silenced")
    assert not [w for w in caught if "lightning-memguard" in str(w.message)], [str(w.message) for w in caught]


# --- the README is short; the guide's pages and links hold -------------------------------------------------------

def test_the_readme_gives_the_two_commands_within_its_first_60_lines():
    head = "\n".join(README.splitlines()[:60])
    section = head.split("## Two commands on a fresh machine", 1)[1]
    commands = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)[0].strip().splitlines()
    assert commands == ["bash scripts/setup.sh && .venv/bin/python -m lightning_memguard demo",
                        "bash scripts/setup.sh && .venv/bin/python -m pytest"]


def test_every_python_command_in_the_docs_runs_as_printed_after_the_setup():
    """After ``scripts/setup.sh`` the project's interpreter is ``.venv/bin/python``; a bare ``python`` is whatever
    the reader's shell finds (often none with the package)."""
    blocks = re.findall(r"```bash\n(.*?)```", DOCS, re.DOTALL)
    bare = [line for block in blocks for line in block.splitlines() if re.search(r"(^|&& |\s)python3? ", line)]
    inline = re.findall(r"`(python3? -m lightning_memguard[^`]*)`", DOCS)
    assert not bare and not inline, bare + inline


def anchors_of(text: str) -> set[str]:
    return {re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")
            for title in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


@pytest.mark.parametrize("page", ["README.md"] + sorted(p.relative_to(ROOT).as_posix()
                                                       for p in (ROOT / "docs").glob("*.md")))
def test_every_relative_link_reaches_a_file_and_its_heading(page):
    path = ROOT / page
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists() or (anchor and anchor not in anchors_of(linked.read_text())):
            broken.append(target)
    assert not broken, broken


def test_the_settings_page_lists_every_setting_with_its_default():
    import dataclasses
    import inspect

    from lightning_memguard import GuardSettings, MemGuard

    rows = re.findall(r"^\| `(\w+)` \| `?([^|`]*)`? \|", (ROOT / "docs" / "settings.md").read_text(), re.MULTILINE)
    fields = {f.name: f.default for f in dataclasses.fields(GuardSettings)}
    # in the order a front door's signature lists them (what acts, then what is measured)
    listed = [name for name in inspect.signature(MemGuard).parameters if name in fields]
    assert [name for name, _ in rows] == listed and set(listed) == set(fields)
    for name, default in rows:
        assert default.replace('"', "'") == repr(fields[name]), name
