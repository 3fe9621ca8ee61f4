#!/usr/bin/env bash
# The main job: set up (first run only), then `raypd run` on the default SmolLM2 model.
# Extra arguments go to `raypd run` (e.g. --prefill 1 --decode 1 --trace FILE).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
if raypd run --help >/dev/null 2>&1; then
  exec raypd run "$@"
fi
# until the serving layer lands, the main job is one generation on the real model
exec raypd generate --model smollm2 --chat --prompt "What is the capital of France?" --json "$@"
