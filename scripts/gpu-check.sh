#!/usr/bin/env bash
# Issue 12's one prepared GPU check, under 10 minutes on one H200, printing ONE JSON (stdout):
#   1. greedy equality on cuda (tests/test_gpu.py: tiny + SmolLM2 vs transformers generate() on
#      the same GPU, CUDA graphs on/off, cuda_ipc between two actors, 1P+1D over cuda_ipc)
#   2. `raypd serve` SmolLM2 1P+1D on the one GPU over cuda_ipc, one chat answer (Paris)
#   3. `raypd bench engine` on random:llama3-8b in bf16 (prefill 2048, decode batch 1/16/64)
#   4. `raypd bench transfer --device cuda` (cuda_ipc vs device copy_, share of TTFT at 4k)
# Targets: transfer >= 0.5x device copy; decode b64 within 2x of the weights-read bound;
# transfer <= 3% of TTFT at 4k. Exit 0 only when every check and target passes; 2: no GPU.
# Step outputs and logs go to $OUT/gpu-check (the device tool's folder) or .gpu-check/.
# No internet is assumed: it uses a Python whose torch sees the GPU, installs only what is
# missing from the machine's own pip sources, and reports what it could not install.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WORK="${OUT:-$ROOT/.gpu-check}/gpu-check"
mkdir -p "$WORK"
HELPER="$ROOT/scripts/gpu_check.py"
SYS_PY="$(command -v python3 || true)"
BUDGET_S="${GPU_CHECK_BUDGET_S:-560}"    # skip steps that would start after this
PORT="${GPU_CHECK_PORT:-8123}"
MODEL="${GPU_CHECK_MODEL:-random:llama3-8b}"                 # the benches' model
SERVE_CONFIG="${GPU_CHECK_SERVE_CONFIG:-configs/serve-one-gpu.yaml}"
CHAT_TIMEOUT="${GPU_CHECK_CHAT_TIMEOUT:-160}"
# GPU_CHECK_DRY_RUN=1: skip the GPU checks of steps 0-1 (tries the plumbing on a CPU machine;
# every GPU step then fails and says why)
DRY="${GPU_CHECK_DRY_RUN:-0}"
START=$(date +%s)
say() { echo "gpu-check [$(( $(date +%s) - START ))s]: $*" >&2; }
STEPS=()
record() { STEPS+=("\"$1\": {\"rc\": $2, \"seconds\": $3}"); }

# ---- 0. fail fast, before installing anything, where there is no GPU ----------------------
if [ "$DRY" != 1 ] && { ! command -v nvidia-smi >/dev/null 2>&1 || \
    ! nvidia-smi -L 2>/dev/null | grep -q "GPU"; }; then
  if [ -n "$SYS_PY" ]; then
    "$SYS_PY" "$HELPER" no-gpu "nvidia-smi finds no GPU on $(hostname)"
  else
    echo '{"ok": false, "error": "no GPU: nvidia-smi finds no GPU (and there is no python3)"}'
  fi
  exit 2
fi
[ "$DRY" = 1 ] && say "DRY RUN: no GPU check" || say "$(nvidia-smi -L | head -4 | tr '\n' ' ')"

# ---- 1. a Python whose torch sees the GPU, with what the checks import -------------------
has_cuda_torch() {
  [ "$DRY" = 1 ] && { "$1" -c 'import torch' >/dev/null 2>&1; return; }
  "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}
PY=""
for cand in "$ROOT/.venv/bin/python" "$ROOT/.venv-gpu/bin/python" "$SYS_PY"; do
  if [ -n "$cand" ] && [ -x "$cand" ] && has_cuda_torch "$cand"; then PY="$cand"; break; fi
done
if [ -z "$PY" ]; then     # the repo's own set-up (its pinned torch may be a CPU build)
  say "no Python with a CUDA torch; trying scripts/setup.sh"
  bash scripts/setup.sh > "$WORK/install.log" 2>&1
  if has_cuda_torch "$ROOT/.venv/bin/python"; then PY="$ROOT/.venv/bin/python"; fi
fi
if [ -z "$PY" ]; then
  "${SYS_PY:-python3}" "$HELPER" no-gpu "a GPU is present but no installable torch sees it \
(tried .venv, .venv-gpu, $SYS_PY and scripts/setup.sh; see $WORK/install.log)"
  exit 3
fi
if ! "$PY" "$HELPER" env "$WORK/install.json"; then
  if [ "$PY" = "$SYS_PY" ]; then     # keep the system's CUDA torch, add the rest beside it
    "$SYS_PY" -m venv --system-site-packages "$ROOT/.venv-gpu" && PY="$ROOT/.venv-gpu/bin/python"
  fi
  missing=$("$PY" -c "import json; print(' '.join(json.load(open('$WORK/install.json'))['missing']))")
  say "installing what is missing: $missing"
  # shellcheck disable=SC2086
  "$PY" -m pip install $missing >> "$WORK/install.log" 2>&1 || say "pip could not install all of: $missing"
  "$PY" "$HELPER" env "$WORK/install.json" || say "still missing (reported in the JSON): $(
    "$PY" -c "import json; print(' '.join(json.load(open('$WORK/install.json'))['missing']))")"
fi
say "python: $PY"
export RAY_ENABLE_AUTO_CONNECT=0 RAYPD_TEST_THREADS=8 TOKENIZERS_PARALLELISM=false
RAYPD=("$PY" -m raypd.cli)

run_step() {    # name timeout_s command...: logs to $WORK/name.log, records rc and seconds
  local name=$1 limit=$2; shift 2
  local now=$(( $(date +%s) - START ))
  if (( now + 30 > BUDGET_S )); then say "skip $name (budget)"; record "$name" 124 0; return; fi
  (( limit > BUDGET_S - now )) && limit=$(( BUDGET_S - now ))
  say "$name (limit ${limit}s)"
  local t=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  record "$name" "$rc" "$(( $(date +%s) - t ))"
  say "$name: rc $rc"
}

# ---- 2. the checks ---------------------------------------------------------------------
run_step pytest 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  --junitxml="$WORK/pytest.xml"

if (( $(date +%s) - START + 60 < BUDGET_S )); then
  say "serve: SmolLM2 1P+1D on one GPU over cuda_ipc ($SERVE_CONFIG)"
  "${RAYPD[@]}" serve --config "$SERVE_CONFIG" --port "$PORT" > "$WORK/serve.log" 2>&1 &
  SERVE_PID=$!
  run_step chat $(( CHAT_TIMEOUT + 10 )) "$PY" "$HELPER" chat "http://127.0.0.1:$PORT" \
    "$WORK/chat.json" --timeout "$CHAT_TIMEOUT"
  kill -INT "$SERVE_PID" 2>/dev/null
  for _ in $(seq 20); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL "$SERVE_PID" 2>/dev/null; wait "$SERVE_PID" 2>/dev/null
else
  record chat 124 0
fi

run_step bench_engine 170 "${RAYPD[@]}" bench engine --model "$MODEL" --device cuda \
  --dtype bfloat16 --repeats 3 --json "$WORK/bench_engine.json"
run_step bench_transfer 200 "${RAYPD[@]}" bench transfer --device cuda \
  --model "$MODEL" --ttft-prompt-tokens 4096 --json "$WORK/bench_transfer.json"

# ---- 3. one JSON ------------------------------------------------------------------------
( IFS=,; echo "{\"total_seconds\": $(( $(date +%s) - START ))${STEPS[*]:+,${STEPS[*]}}}" ) \
  > "$WORK/steps.json"
"$PY" "$HELPER" assemble "$WORK" | tee "$WORK/report.json"
exit "${PIPESTATUS[0]}"
