#!/usr/bin/env bash
# Builds the folder the GPU machine needs, which has no network (scripts/gpu/bundle.py says
# what and checks it): run here, where pip reaches the registries, then carry the folder.
#   scripts/gpu-bundle.sh [DIR]       DIR defaults to .gpu-bundle (git-ignored)
# On the GPU machine: the device tool's run with carry [".gpu-bundle"] and the command
#   scripts/gpu-first-contact.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"
exec "$PY" "$ROOT/scripts/gpu/bundle.py" "${1:-$ROOT/.gpu-bundle}"
