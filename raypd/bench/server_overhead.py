"""What the serving path adds to each output token: TPOT through HTTP (SSE, the OpenAI
completions endpoint of `raypd serve`, in this process over a 1 prefill + 1 decode cluster)
minus the decode worker's own engine step time over the same window.

Definitions (seconds unless the key says ms):
  client TPOT of a request   (last streamed chunk - first) / (completion_tokens - 1), the
                             token count from the stream's usage chunk (vLLM's (e2e - ttft) /
                             (n - 1), measured at the HTTP client)
  engine step                the decode worker's busy seconds / engine steps over the measured
                             window (its stats before and after; every request decodes in every
                             step of the window but the first and last few)
  server_overhead_ms_per_token   p50 over requests of (client TPOT - engine step), in ms
A non-200 answer or a stream that ends without its usage is a failed request: counted, and the
figures then cover the rest.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import requests

from raypd.bench.transfer import random_prompt
from router.percentiles import percentile


def _stream_one(url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streaming completion; chunk arrival times and the usage's token count."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    rec: dict[str, Any] = {"submit": time.perf_counter(), "stamps": []}
    try:
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
            if r.status_code != 200:
                return {**rec, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
            buf = b""
            # chunk_size None: each read returns what has arrived (iter_lines would wait for
            # 512 bytes and stamp several events at once)
            for data in r.iter_content(chunk_size=None):
                now = time.perf_counter()
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        rec["stamps"].append(now)
                    if chunk.get("usage"):
                        rec["tokens"] = chunk["usage"]["completion_tokens"]
    except requests.RequestException as e:
        return {**rec, "error": f"{type(e).__name__}: {e}"}
    if "tokens" not in rec:
        rec["error"] = "stream ended without its usage"
    return rec


def _decode_stats(cluster: Any) -> tuple[float, int]:
    [d] = [s for s in cluster.stats() if s["worker_id"].startswith("decode")]
    return d["busy_s"], d["steps"]


def measure_server_overhead(model: str = "smollm2", concurrency: int = 8, requests_n: int = 16,
                            prompt_tokens: int = 256, max_tokens: int = 64,
                            seed: int = 0) -> dict[str, Any]:
    """`requests_n` streaming requests, `concurrency` at a time, through HTTP; see the module
    doc. Starts (and stops) its own cluster and server on a free port."""
    from cluster.config import load_config
    from cluster.pd import PDCluster
    from cluster.serve import start_server
    assert requests_n >= concurrency >= 1 and max_tokens >= 8
    cfg = load_config(None, {"model.name": model, "workers.prefill.count": 1,
                             "workers.decode.count": 1, "transfer.transport": "shm",
                             "router.health_timeout_s": 300.0})
    rng = random.Random(seed)
    cluster = PDCluster(cfg.to_pd_config())
    server = None
    try:
        server = start_server(cfg, "127.0.0.1", 0, backend=cluster, api_key="")
        name = cfg.served_model_name
        for _ in range(2):   # warm-up: first-touch costs of both workers and the server
            _stream_one(server.url, name, random_prompt(rng, prompt_tokens), 8)
        prompts = [random_prompt(rng, prompt_tokens) for _ in range(requests_n)]
        records: list[dict[str, Any]] = [{} for _ in prompts]
        todo = list(range(requests_n))
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop(0)
                records[i] = _stream_one(server.url, name, prompts[i], max_tokens)

        busy0, steps0 = _decode_stats(cluster)
        threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        busy1, steps1 = _decode_stats(cluster)
    finally:
        if server is not None:
            server.stop()
        cluster.shutdown()
    ok = [r for r in records if "error" not in r and r["tokens"] >= 2 and len(r["stamps"]) >= 2]
    step_s = (busy1 - busy0) / max(1, steps1 - steps0)
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1) for r in ok]
    return {
        "server_overhead_ms_per_token": percentile([(t - step_s) * 1e3 for t in tpot], 50),
        "http_tpot_p50_ms": percentile(tpot, 50) * 1e3,
        "http_tpot_p99_ms": percentile(tpot, 99) * 1e3,
        "engine_step_ms": step_s * 1e3,
        "engine_steps": steps1 - steps0,
        "http_ttft_p50_ms": percentile([r["stamps"][0] - r["submit"] for r in ok], 50) * 1e3,
        "requests": requests_n, "failed_requests": requests_n - len(ok),
        "error_samples": [r["error"] for r in records if "error" in r][:3],
        "concurrency": concurrency, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
        "setup": "1 prefill + 1 decode worker (configs/local.yaml defaults), shm transport, "
                 "in-process HTTP server, requests' SSE client in this process",
    }
