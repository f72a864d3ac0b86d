#!/usr/bin/env bash
# Creates .venv (seeing system packages, so a torch already installed - e.g. a CUDA build on a GPU machine - is kept)
# and installs lightning-memguard with its test extras into it. Safe to run again: when pyproject.toml has not
# changed since the last install, it installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x .venv/bin/python ] || python3 -m venv --system-site-packages .venv
py=.venv/bin/python
stamp=.venv/.memguard-installed
wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] && "$py" -c "import lightning_memguard, pytest" 2>/dev/null; then
  exit 0
fi
"$py" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true

# Install torch first, and only when none is importable: an unpinned `torch` requirement on a machine without
# torch pulls a multi-GB CUDA build; 2.13.0 is the build this project is tested with (a CPU wheel on CPU machines).
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  "$py" -m pip install --quiet "torch==2.13.0"
fi
# PYTHONWARNINGS reaches the build backend too: it silences setuptools' notice about editable installs
PYTHONWARNINGS=ignore "$py" -m pip install --quiet -e ".[dev]"
echo "$wanted" > "$stamp"
