#!/usr/bin/env bash
# The GPU machine's first contact with raypd, in one command of under 6 minutes, with no
# network: unpack the bundle (scripts/gpu-bundle.sh, carried as .gpu-bundle) into a private
# site folder on PYTHONPATH (the machine's own torch, transformers, ... stay as they are), then
# run steps (a)-(e) of scripts/gpu/first_contact.py, each with its own time limit. Writes two
# files to $OUT (first-contact.json, first-contact-logs.tar.gz) and prints the JSON last.
#   scripts/gpu-first-contact.sh [--dry-run] [--steps a,b,c,d,e]
#     --dry-run (or RAYPD_GPU_DRY_RUN=1): the same steps on the CPU with stand-ins
#     --steps: only these (letters or step names), e.g. to rerun what failed
#   RAYPD_GPU_BUNDLE (default .gpu-bundle), RAYPD_GPU_SITE (default /tmp/raypd-gpu-site),
#   RAYPD_GPU_PYTHON (default python3; in a dry run .venv's python where there is one),
#   RAYPD_GPU_BUDGET_S (default 340: the whole run, unpacking included)
# Exit: 0 every step and target passed, 1 something failed, 2 no GPU (not in a dry run).
set -uo pipefail
export RAYPD_GPU_START="$(date +%s)"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY="${RAYPD_GPU_DRY_RUN:-0}"
STEPS="a,b,c,d,e"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --steps) STEPS="$2"; shift ;;
    --steps=*) STEPS="${1#--steps=}" ;;
    *) echo "usage: $0 [--dry-run] [--steps a,b,c,d,e]" >&2; exit 64 ;;
  esac
  shift
done
PY="${RAYPD_GPU_PYTHON:-}"
if [ -z "$PY" ]; then
  PY=python3
  [ "$DRY" = 1 ] && [ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"
fi
OUT_DIR="${OUT:-$ROOT/.gpu-first-contact}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/raypd-first-contact.XXXXXX")"
BUNDLE="${RAYPD_GPU_BUNDLE:-$ROOT/.gpu-bundle}"
SITE="${RAYPD_GPU_SITE:-/tmp/raypd-gpu-site}"
mkdir -p "$OUT_DIR"

PYPATH="$ROOT"
if [ -f "$BUNDLE/manifest.json" ]; then
  if timeout 60 "$PY" scripts/gpu/unpack.py "$BUNDLE" "$SITE" "$WORK/unpack.json" >&2; then
    usable=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['usable_here'])" \
      "$WORK/unpack.json")
    # the bundle is for CPython 3.12: a dry run on another Python unpacks it but uses its own
    [ "$usable" = True ] && PYPATH="$SITE:$ROOT"
  fi
else
  echo "{\"ok\": false, \"site\": \"$SITE\", \"error\": \"no bundle at $BUNDLE (scripts/gpu-bundle.sh)\"}" \
    > "$WORK/unpack.json"
fi
export PYTHONPATH="$PYPATH${PYTHONPATH:+:$PYTHONPATH}"
DRYFLAG=()
[ "$DRY" = 1 ] && DRYFLAG=(--dry-run)
exec "$PY" scripts/gpu/first_contact.py --work "$WORK" --out "$OUT_DIR" --steps "$STEPS" \
  --budget-s "${RAYPD_GPU_BUDGET_S:-340}" --unpack-json "$WORK/unpack.json" "${DRYFLAG[@]}"
