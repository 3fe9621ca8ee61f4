#!/usr/bin/env bash
# Shared set-up for run.sh and test.sh: create .venv if missing, install raypd into it.
# Re-installs only when pyproject.toml changed (a stamp file keeps its hash).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  echo "raypd: creating $ROOT/.venv" >&2
  "$PY" -m venv "$ROOT/.venv"
fi
stamp="$ROOT/.venv/.raypd-installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "raypd: installing dependencies (torch 2.13.0 CPU, ray, transformers, ...)" >&2
  "$ROOT/.venv/bin/python" -m pip install -q --upgrade pip >&2
  # Bytecode: compiled on first import (half the install time) where Python may write it;
  # with PYTHONDONTWRITEBYTECODE set, compiled here, or every process that imports a module
  # (every Ray worker) would compile it again.
  nocompile=--no-compile
  [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] && nocompile=
  "$ROOT/.venv/bin/python" -m pip install -q $nocompile -e "$ROOT[dev]" >&2
  echo "$want" > "$stamp"
fi
export PATH="$ROOT/.venv/bin:$PATH"
