"""`raypd bench disagg`: a mixed load on 1 prefill + 1 decode worker against 2 colocated workers
(each prefills its own requests), same total torch threads, same seeded arrivals.

The load (`Workload`): decode-heavy requests (short prompt, long output), some started first
(a few tenths of a second apart, see `start_gap_s`) and the rest arriving as a Poisson process
over the window, plus long prompts (short output) arriving at a fixed interval while they
decode. Each request is submitted from its own thread at its scheduled time (`run_request`),
its streamed deltas time-stamped on arrival here.

Definitions (client side, all in seconds):
  TPOT of a request  (last token time - first token time) / (output tokens - 1)  (vLLM's
                     (e2e - ttft) / (output_tokens - 1)); `tpot_p99_*` is the p99 over requests
                     with >= 2 output tokens.
  ITL                every gap between two consecutive streamed deltas of one request (each
                     delta carries one token here); `itl_p99_*` is the p99 over all gaps.
  TTFT               submit -> first delta.
  throughput         output tokens of all requests / (last completion - first submission).
The setups run one after the other (2 cores), each on a fresh cluster after its own warm-up,
ABBA when `rounds` is 2. Placement: with 1 prefill + 1 decode there is no choice to make; the
colocated baseline pins each kind's requests to the two workers alternately (`PinnedDecode`),
a balanced placement, because the router's own decode choice (BasePolicy.choose_decode, fewest
running tokens by the last load report) sees a stale view while a long prefill step holds the
worker's lock; one run placed by the router is added as `coloc_router` for comparison.

Where the CPU goes (raypd/bench/proc_stats.py reads /proc):
  cpu_s_per_output_token   per setup, the CPU-seconds of each process over the timed runs over
                     their output tokens: `driver` (this process: the router, and the bench's
                     client threads, one per request, which call it in-process), each worker
                     actor (`actor:PrefillHost`, `actor:DecodeHost`, `#2` for a second of a
                     class), `raylet`, `gcs_server` and Ray's other processes (those this
                     process started, when it started Ray), and `server_total`.
  serve_threads_1, serve_threads_256   the OS threads (/proc/self/task) of the process that
                     serves HTTP with 1 and with 256 streaming completions open at once: this
                     process, with `raypd serve`'s own HTTP ingress (cluster.serve.start_server)
                     over a 1 prefill + 1 decode cluster (the main load above does not go
                     through HTTP: its client calls the router in-process). The streams are
                     raw sockets read by one selector here, so the client adds no thread; each
                     figure is the most threads seen while its streams were open (`serve_threads`
                     has how many were accepted and streaming).
  detok_chars_per_token_last100_over_first100   the characters the router's detokenizer
                     (frontend.detokenize.TextStream) decodes for the last 100 tokens of a
                     4,000-token output over those it decodes for the first 100, SmolLM2's
                     tokenizer over real English (the Python reference's help topics): 1.0
                     when a token costs the same at any length, ~n/100 when each decodes the
                     whole output so far.
"""

from __future__ import annotations

import json
import math
import os
import random
import selectors
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import ray

from cluster.pd import PDCluster, PDConfig
from frontend.detokenize import TextStream
from protocol.messages import TokenDelta
from raypd.bench import proc_stats
from raypd.bench.server_overhead import measure_server_overhead
from raypd.bench.transfer import random_prompt
from router.orchestrator import FlowConfig
from router.percentiles import percentile
from router.policies import RoutingDecision
from workers.request import SamplingParams

# The router marks a worker unhealthy when its load report takes longer than this; a report
# waits for the worker's engine step, and one long prefill step on a busy CPU takes longer than
# the default 10 s. This is a performance bench, not a fault test: allow a long step.
HEALTH_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Workload:
    window_s: float = 60.0                        # arrivals fall in [0, window_s)
    num_short: int = 24                           # decode-heavy requests
    short_at_start: int = 6                       # of those, first, start_gap_s apart
    start_gap_s: float = 0.3                      # > the router's report interval (0.1 s)
    short_prompt: tuple[int, int] = (32, 128)     # token ranges, inclusive
    short_output: tuple[int, int] = (96, 192)
    num_long: int = 6                             # long prompts, at a fixed interval
    first_long_s: float = 3.0
    long_prompt: tuple[int, int] = (1024, 2048)
    long_output: tuple[int, int] = (8, 16)


FULL = Workload()
QUICK = Workload(window_s=20.0, num_short=10, short_at_start=4, short_output=(64, 128),
                 num_long=3, first_long_s=2.0)


# the HTTP phase (raypd/bench/server_overhead.py) of a quick run
QUICK_HTTP = {"concurrency": 4, "requests_n": 8, "max_tokens": 32}

DRIVER = "driver"            # this process's label in cpu_s_per_output_token
OPEN_STREAMS = (1, 256)      # serve_threads_N: streams open at once
DETOK_MODEL = "smollm2"      # the tokenizer of the detokenizer's cost figure
DETOK_TOKENS = 4000
DETOK_WINDOW = 100


@dataclass(frozen=True)
class Job:
    at_s: float
    kind: str            # "short" | "long"
    prompt: list[int]
    max_tokens: int


def make_jobs(w: Workload, seed: int = 0) -> list[Job]:
    """The seeded arrival schedule, sorted by time (the same list for every setup)."""
    rng = random.Random(seed)

    def job(at: float, kind: str, prompt: tuple[int, int], output: tuple[int, int]) -> Job:
        return Job(at, kind, random_prompt(rng, rng.randint(*prompt)), rng.randint(*output))

    # a Poisson process conditioned on its count: uniform times, sorted
    later = sorted(rng.uniform(0, w.window_s) for _ in range(w.num_short - w.short_at_start))
    jobs = [job(i * w.start_gap_s, "short", w.short_prompt, w.short_output)
            for i in range(w.short_at_start)]
    jobs += [job(t, "short", w.short_prompt, w.short_output) for t in later]
    step = (w.window_s - w.first_long_s) / max(1, w.num_long)
    jobs += [job(w.first_long_s + i * step, "long", w.long_prompt, w.long_output)
             for i in range(w.num_long)]
    return sorted(jobs, key=lambda j: j.at_s)


def _drive(cluster: PDCluster, jobs: list[Job], prefix: str) -> list[dict]:
    """Submit each job from its own thread at its time; record its delta arrival times."""
    t0 = time.perf_counter() + 0.2
    records: list[dict] = [{} for _ in jobs]

    def one(i: int, job: Job) -> None:
        time.sleep(max(0.0, t0 + job.at_s - time.perf_counter()))
        rec = records[i]
        rec.update(kind=job.kind, prompt_tokens=len(job.prompt), submit=time.perf_counter(),
                   deltas=[])
        stamps = rec["deltas"]

        def on_delta(d: TokenDelta) -> None:
            if n := len(d.token_ids):
                stamps.append((time.perf_counter(), n))
        try:
            out = cluster.run_request(job.prompt, SamplingParams(max_tokens=job.max_tokens,
                                                                 ignore_eos=True),
                                      request_id=f"{prefix}{i}", on_delta=on_delta)
            rec["lifecycle"] = out.lifecycle.to_dict()
            rec["output_tokens"] = len(out.token_ids)
        except Exception as exc:   # counted and reported; the bench must still finish
            rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["done"] = time.perf_counter()

    threads = [threading.Thread(target=one, args=(i, j), daemon=True) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def summarize(records: list[dict], walls: list[float]) -> dict[str, Any]:
    """Latency and throughput figures of one setup's records, pooled over its runs (`walls`:
    each run's first submission -> last completion); see the module doc."""
    ok = [r for r in records if "error" not in r and r["deltas"]]
    out: dict[str, Any] = {"requests": len(records), "errors": len(records) - len(ok),
                           "error_samples": [r["error"] for r in records if "error" in r][:3]}
    tpot: dict[str, list[float]] = {"short": [], "long": []}
    ttft: dict[str, list[float]] = {"short": [], "long": []}
    itl: list[float] = []
    engine_tpot: list[float] = []
    multi = 0
    for r in ok:
        times = [t for t, _ in r["deltas"]]
        n = sum(k for _, k in r["deltas"])
        multi += sum(k > 1 for _, k in r["deltas"])
        ttft[r["kind"]].append(times[0] - r["submit"])
        if n >= 2:
            tpot[r["kind"]].append((times[-1] - times[0]) / (n - 1))
            itl += [b - a for a, b in zip(times, times[1:], strict=False)]
        if (lc_tpot := r["lifecycle"].get("tpot_s")) is not None:
            engine_tpot.append(lc_tpot)
    tokens = sum(r["output_tokens"] for r in ok)
    all_tpot, all_ttft = tpot["short"] + tpot["long"], ttft["short"] + ttft["long"]
    out.update({
        "output_tokens": tokens, "wall_s": sum(walls), "runs": len(walls),
        "throughput_tok_s": tokens / sum(walls),
        "tpot_p50_s": percentile(all_tpot, 50), "tpot_p99_s": percentile(all_tpot, 99),
        "tpot_mean_s": sum(all_tpot) / max(1, len(all_tpot)),
        "tpot_p99_short_s": percentile(tpot["short"], 99),
        "tpot_p99_long_s": percentile(tpot["long"], 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "itl_max_s": max(itl, default=math.nan), "itl_count": len(itl),
        "multi_token_deltas": multi,
        "ttft_p50_s": percentile(all_ttft, 50), "ttft_p99_s": percentile(all_ttft, 99),
        "ttft_p50_long_s": percentile(ttft["long"], 50),
        "ttft_p99_long_s": percentile(ttft["long"], 99),
        "ttft_p50_short_s": percentile(ttft["short"], 50),
        "engine_tpot_p99_s": percentile(engine_tpot, 99),
        # the decode worker's own view: its admission -> first token (holds P's queue + prefill)
        "engine_ttft_p50_s": percentile([r["lifecycle"]["ttft_s"] for r in ok
                                         if r["lifecycle"].get("ttft_s") is not None], 50),
        # disagg: a request prefilled by its decode worker (fallback) has no prefill_worker
        "prefilled_by_decode": sum(r["lifecycle"].get("prefill_worker") is None for r in ok),
        "retries": sum(r["lifecycle"].get("retries", 0) for r in ok),
    })
    return out


class PinnedDecode:
    """A routing policy with the decode worker fixed per request id (the balanced colocated
    baseline); everything else, and requests without a pin, go to the wrapped policy."""

    def __init__(self, policy: Any, pins: dict[str, str]) -> None:
        self._policy, self._pins = policy, pins

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    def choose_decode(self, req, workers, matches):
        wid = self._pins.get(req.request_id)
        if wid is None or all(w.worker_id != wid for w in workers):
            return self._policy.choose_decode(req, workers, matches)
        return RoutingDecision(wid, "pinned", None, matches.get(wid, 0))


def alternate_pins(jobs: list[Job], num_decode: int, prefix: str) -> dict[str, str]:
    """Each kind's requests take the decode workers in turn (a static balance of both the
    prefill and the decode work)."""
    seen: dict[str, int] = {}
    pins = {}
    for i, job in enumerate(jobs):
        k = seen[job.kind] = seen.get(job.kind, -1) + 1
        pins[f"{prefix}{i}"] = f"decode-{k % num_decode}"
    return pins


class _UnhealthyWatch:
    """Samples the router's unhealthy set: seconds each worker spent marked unhealthy."""

    def __init__(self, orchestrator: Any, every_s: float = 0.25) -> None:
        self.seconds: dict[str, float] = {}
        self._orch, self._every = orchestrator, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            for wid in list(getattr(self._orch, "unhealthy", ())):
                self.seconds[wid] = self.seconds.get(wid, 0.0) + self._every

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.seconds


def _run_once(cfg: PDConfig, jobs: list[Job], warmup: list[Job], pin: bool) -> dict[str, Any]:
    """Fresh cluster, warm-up, prefix caches dropped, the timed load; records and stats."""
    load_before = os.getloadavg()[0]
    cluster = PDCluster(cfg)
    orch = cluster.orchestrator
    try:
        if hasattr(orch.cfg, "health_timeout_s"):   # see HEALTH_TIMEOUT_S
            orch.cfg.health_timeout_s = HEALTH_TIMEOUT_S
        if pin:
            pins = {**alternate_pins(warmup, cfg.num_decode, "warm-"),
                    **alternate_pins(jobs, cfg.num_decode, "job-")}
            orch.policy = PinnedDecode(orch.policy, pins)
        _drive(cluster, warmup, "warm-")
        ray.get([w.reset_prefix_cache.remote() for w in cluster.workers])
        before = cluster.stats()
        cpu_before = proc_stats.snapshot(os.getpid())
        watch = _UnhealthyWatch(orch)
        records = _drive(cluster, jobs, "job-")
        unhealthy = watch.stop()
        cpu, cpu_exited = proc_stats.cpu_seconds(cpu_before, proc_stats.snapshot(os.getpid()),
                                                 DRIVER)
        after = cluster.stats()
        cluster.check_invariants()
    finally:
        cluster.shutdown()
    wall = max(r["done"] for r in records) - min(r["submit"] for r in records)
    workers = {
        b["worker_id"]: {"busy_s": a["busy_s"] - b["busy_s"], "steps": a["steps"] - b["steps"],
                         "busy_share": (a["busy_s"] - b["busy_s"]) / wall,
                         "requests": a["requests_finished"] - b["requests_finished"],
                         "computed_tokens": a["computed_tokens"] - b["computed_tokens"],
                         "unhealthy_s": unhealthy.get(b["worker_id"], 0.0),
                         "leases_expired": a.get("transfer_expired", 0)
                         - b.get("transfer_expired", 0)}
        for b, a in zip(before, after, strict=True)}
    return {"records": records, "wall_s": wall, "workers": workers, "cpu_s": cpu,
            "cpu_exited": cpu_exited, "loadavg_1m": [load_before, os.getloadavg()[0]]}


def _pool(runs: list[dict]) -> dict[str, Any]:
    res = summarize([r for run in runs for r in run["records"]], [run["wall_s"] for run in runs])
    res["per_run"] = [{"wall_s": run["wall_s"], "loadavg_1m": run["loadavg_1m"],
                       "workers": run["workers"], "cpu_s": run["cpu_s"],
                       "cpu_exited": run["cpu_exited"]} for run in runs]
    seconds: dict[str, float] = {}
    for run in runs:
        for label, s in run["cpu_s"].items():
            seconds[label] = seconds.get(label, 0.0) + s
    res["cpu_s_per_output_token"] = (proc_stats.per_output_token(seconds, res["output_tokens"])
                                     if res["output_tokens"] else None)
    return res


@dataclass
class _Stream:
    """One streaming completion read off a raw socket: `status` once its status line came
    back, `streaming` once it carried a data event, `ended` once the server closed it or sent
    [DONE]."""
    sock: socket.socket
    head: bytes = b""
    status: int | None = None
    streaming: bool = False
    ended: bool = False
    tail: bytes = b""          # the last bytes read: a marker split across two reads

    def feed(self, data: bytes) -> None:
        if not data:
            self.ended = True
            return
        if self.status is None:
            self.head += data
            if b"\r\n" in self.head:
                self.status = int(self.head.split(b" ", 2)[1])
        seen = self.tail + data
        self.streaming = self.streaming or b"data: " in seen
        self.ended = self.ended or b"[DONE]" in seen
        self.tail = seen[-16:]


class _OpenStreams:
    """`n` streaming completions held open on raw sockets and read by one selector in the
    calling thread, so the client adds no thread to the process whose threads are counted."""

    def __init__(self, host: str, port: int, body: dict[str, Any], n: int) -> None:
        payload = json.dumps(body).encode()
        request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                   "Connection: close\r\n\r\n").encode() + payload
        self._sel = selectors.DefaultSelector()
        self.streams: list[_Stream] = []
        for _ in range(n):
            sock = socket.create_connection((host, port), timeout=30)
            sock.sendall(request)
            sock.setblocking(False)
            self.streams.append(_Stream(sock))
            self._sel.register(sock, selectors.EVENT_READ, self.streams[-1])

    @property
    def answered(self) -> int:
        return sum(s.status is not None for s in self.streams)

    @property
    def accepted(self) -> int:
        return sum(s.status == 200 for s in self.streams)

    @property
    def streaming(self) -> int:
        return sum(s.streaming for s in self.streams)

    @property
    def ended(self) -> int:
        return sum(s.ended for s in self.streams)

    def poll(self, timeout_s: float) -> None:
        """Read whatever has arrived within `timeout_s`."""
        for key, _ in self._sel.select(timeout_s):
            stream: _Stream = key.data
            try:
                data = stream.sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self._sel.unregister(stream.sock)
            stream.feed(data)

    def close(self) -> None:
        self._sel.close()
        for s in self.streams:
            s.sock.close()


def _threads_with_open_streams(host: str, port: int, body: dict[str, Any], n: int,
                               settle_s: float, max_wait_s: float) -> dict[str, Any]:
    """Open `n` streams; sample this process's threads until every one was answered and
    `settle_s` more passed (or `max_wait_s`, or one ended); close them."""
    threads_before = proc_stats.thread_count()
    t0 = time.monotonic()
    streams = _OpenStreams(host, port, body, n)
    peak, all_answered = 0, None
    try:
        while (now := time.monotonic()) - t0 < max_wait_s and not streams.ended:
            peak = max(peak, proc_stats.thread_count())
            if all_answered is None and streams.answered == n:
                all_answered = now
            if all_answered is not None and now - all_answered >= settle_s:
                break
            streams.poll(0.1)
        return {"streams": n, "threads_peak": peak, "threads_before": threads_before,
                "answered": streams.answered, "accepted": streams.accepted,
                "streaming": streams.streaming, "ended_while_sampled": streams.ended,
                "sampled_s": time.monotonic() - t0}
    finally:
        streams.close()


def measure_serve_threads(model: str = "smollm2", streams: tuple[int, ...] = OPEN_STREAMS,
                          prompt_tokens: int = 16, max_tokens: int = 1024,
                          settle_s: float = 3.0, max_wait_s: float = 30.0,
                          seed: int = 0) -> dict[str, Any]:
    """This process's OS threads while it serves HTTP (`raypd serve`'s ingress over a 1 prefill
    + 1 decode cluster, both started here) with each count of `streams` open at once, in
    increasing order after a one-request warm-up (a pool that grew for many streams stays
    grown); see the module doc. max_inflight is set above the largest count (no 429)."""
    from urllib.parse import urlsplit

    from cluster.config import load_config
    from cluster.serve import start_server
    cfg = load_config(None, {"model.name": model, "workers.prefill.count": 1,
                             "workers.decode.count": 1, "transfer.transport": "shm",
                             "router.health_timeout_s": HEALTH_TIMEOUT_S})
    rng = random.Random(seed)
    body = {"model": cfg.served_model_name, "prompt": random_prompt(rng, prompt_tokens),
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    cluster = PDCluster(cfg.to_pd_config())
    server = None
    try:
        server = start_server(cfg, "127.0.0.1", 0, backend=cluster, api_key="",
                              max_inflight=2 * max(streams) + 1)
        url = urlsplit(server.url)
        host, port = url.hostname or "127.0.0.1", url.port or 80
        warm = _OpenStreams(host, port, {**body, "max_tokens": 4}, 1)
        deadline = time.monotonic() + 120
        while not warm.ended and time.monotonic() < deadline:
            warm.poll(0.1)
        warm.close()
        return {str(n): _threads_with_open_streams(host, port, body, n, settle_s, max_wait_s)
                for n in sorted(streams)}
    finally:
        if server is not None:
            server.stop()
        cluster.shutdown()


def real_text_token_ids(tokenizer: Any, n: int) -> list[int]:
    """The first `n` tokens of real English text (the Python reference's help topics, in
    pydoc_data, on every Python), special tokens left out."""
    from pydoc_data.topics import topics
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids: list[int] = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            ids += [t for t in tokenizer.encode(para + "\n\n", add_special_tokens=False)
                    if t not in special]
            if len(ids) >= n:
                return ids[:n]
    raise ValueError(f"the help topics hold {len(ids)} tokens, fewer than {n}")


def detok_cost_growth(tokenizer: Any, token_ids: list[int], window: int = DETOK_WINDOW,
                      stream_cls: Any = TextStream) -> dict[str, Any]:
    """Feed `token_ids` one at a time to a detokenizer (`stream_cls(tokenizer,
    skip_special_tokens=True)`, its `add(ids)` and cumulative `chars_decoded`): the characters
    it decoded for the first and the last `window` tokens, and last / first."""
    assert len(token_ids) >= 2 * window
    ts = stream_cls(tokenizer, skip_special_tokens=True)
    decoded = [0]
    for t in token_ids:
        ts.add([t])
        decoded.append(ts.chars_decoded)
    first, last = decoded[window] - decoded[0], decoded[-1] - decoded[-1 - window]
    return {"output_tokens": len(token_ids), "window": window,
            "chars_decoded_first": first, "chars_decoded_last": last,
            "chars_decoded_total": decoded[-1],
            "last_over_first": last / first if first else math.nan}


def measure_detok(model: str = DETOK_MODEL, tokens: int = DETOK_TOKENS) -> dict[str, Any]:
    """detok_cost_growth over `tokens` tokens of real text, `model`'s tokenizer (loaded as a
    worker loads it: workers/model_loader.py)."""
    from transformers import PreTrainedTokenizerFast

    from workers.model_loader import resolve_model_dir
    tokenizer = PreTrainedTokenizerFast.from_pretrained(resolve_model_dir(model))
    return {"tokenizer": model, "detokenizer": f"{TextStream.__module__}.TextStream",
            **detok_cost_growth(tokenizer, real_text_token_ids(tokenizer, tokens))}


def run_bench_disagg(quick: bool = False, model: str = "smollm2",
                     workload: Workload | None = None, engine: dict | None = None,
                     seed: int = 0, rounds: int | None = None,
                     router_baseline: bool | None = None) -> dict[str, Any]:
    """Disaggregated (1 P + 1 D) vs colocated (2 D that prefill), one after the other.

    `rounds` (default 2, quick 1): runs of each setup, in ABBA order so that a drift in the
    machine's background load hits both alike; figures pool all runs. The colocated baseline
    places requests statically balanced (`alternate_pins`); `router_baseline` (default: not
    quick) adds one colocated run placed by the router's own decode choice."""
    w = workload or (QUICK if quick else FULL)
    rounds = rounds or (1 if quick else 2)
    router_baseline = (not quick) if router_baseline is None else router_baseline
    jobs = make_jobs(w, seed)
    eng = {"model": model, **(engine or {})}
    setups = {
        # every disagg prefill on the prefill worker (no backlog rule), as recorded
        "disagg": PDConfig(engine=eng, num_prefill=1, num_decode=1, threads_per_actor=1,
                           flow=FlowConfig(transport="shm", policy="round_robin",
                                           local_prefill_when_backlogged=False)),
        "coloc": PDConfig(engine=eng, num_prefill=0, num_decode=2, threads_per_actor=1,
                          flow=FlowConfig(transport="object_store", policy="round_robin")),
    }
    names = list(setups)
    order = [n for r in range(rounds) for n in (names if r % 2 == 0 else names[::-1])]
    rng = random.Random(seed + 1)

    def warmup(num_decode: int) -> list[Job]:
        """One longest prompt and one short per decode worker (first-touch costs)."""
        return [Job(0.0, kind, random_prompt(rng, n), 2) for _ in range(num_decode)
                for kind, n in (("long", w.long_prompt[1]), ("short", w.short_prompt[0]))]

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    runs: dict[str, list[dict]] = {name: [] for name in setups}
    try:
        for name in order:
            cfg = setups[name]
            runs[name].append(_run_once(cfg, jobs, warmup(cfg.num_decode),
                                        pin=cfg.num_prefill == 0))
        router_run = _run_once(setups["coloc"], jobs, warmup(2), pin=False) \
            if router_baseline else None
        overhead = measure_server_overhead(model, **(QUICK_HTTP if quick else {}), seed=seed)
        threads = measure_serve_threads(model, seed=seed)
    finally:
        if started:
            ray.shutdown()
    d, c = _pool(runs["disagg"]), _pool(runs["coloc"])
    detok = measure_detok()
    out = {
        "tpot_p99_disagg_s": d["tpot_p99_s"], "tpot_p99_coloc_s": c["tpot_p99_s"],
        "tpot_p99_ratio": d["tpot_p99_s"] / c["tpot_p99_s"],
        "throughput_ratio": d["throughput_tok_s"] / c["throughput_tok_s"],
        "itl_p99_disagg_s": d["itl_p99_s"], "itl_p99_coloc_s": c["itl_p99_s"],
        "itl_p99_ratio": d["itl_p99_s"] / c["itl_p99_s"],
        "ttft_p50_disagg_s": d["ttft_p50_s"], "ttft_p99_disagg_s": d["ttft_p99_s"],
        "ttft_p50_coloc_s": c["ttft_p50_s"], "ttft_p99_coloc_s": c["ttft_p99_s"],
        "server_overhead_ms_per_token": overhead["server_overhead_ms_per_token"],
        "cpu_s_per_output_token": {"disagg": d["cpu_s_per_output_token"],
                                   "coloc": c["cpu_s_per_output_token"]},
        **{f"serve_threads_{n}": t["threads_peak"] for n, t in threads.items()},
        "detok_chars_per_token_last100_over_first100": detok["last_over_first"],
        "output_tokens_disagg": d["output_tokens"], "output_tokens_coloc": c["output_tokens"],
        "wall_s_disagg": d["wall_s"], "wall_s_coloc": c["wall_s"],
        "definitions": {
            "tpot": "per request (last token t - first token t) / (output tokens - 1), client "
                    "side (vLLM's (e2e - ttft) / (n - 1)); tpot_p99 = p99 over requests",
            "itl": "gaps between consecutive streamed deltas (1 token each), p99 over all gaps",
            "ttft": "client submit -> first delta",
            "throughput": "output tokens / (last completion - first submission), summed "
                          "over the setup's runs",
            "pooling": "each setup ran `rounds` times (order below); percentiles pool them",
            "health_timeout_s": f"{HEALTH_TIMEOUT_S:.0f} (router default 10 s: a long "
                                "prefill step holds the report past it; see module)",
            "cpu_s_per_output_token": "per setup and process, CPU-seconds (/proc utime + "
                                      "stime) over the timed runs / their output tokens; "
                                      "`driver` is this process: the router and the bench's "
                                      "client threads",
            "serve_threads_N": "OS threads of this process (/proc/self/task) serving `raypd "
                               "serve`'s HTTP ingress with N streams open at once (most seen "
                               "while they were open); detail in `serve_threads`",
            "detok_chars_per_token_last100_over_first100":
                "characters frontend.detokenize.TextStream decoded for the last 100 tokens "
                "of a 4,000-token output of real text over the first 100 (SmolLM2's "
                "tokenizer); detail in `detok`",
        },
        "setups": {"disagg": "1 prefill + 1 decode worker, 1 torch thread each, shm transport",
                   "coloc": "2 decode workers that prefill their own requests, 1 thread each; "
                            "requests of each kind placed alternately (balanced)",
                   "policy": "round_robin (moot with 1 prefill worker)", "order": order},
        "workload": {**asdict(w), "seed": seed, "requests": len(jobs),
                     "long_requests": sum(j.kind == "long" for j in jobs)},
        "model": model, "quick": quick,
        "disagg": d, "coloc": c, "server_overhead": overhead, "serve_threads": threads,
        "detok": detok,
    }
    if router_run is not None:
        r = _pool([router_run])
        out["coloc_router"] = r
        out["tpot_p99_ratio_vs_router_coloc"] = d["tpot_p99_s"] / r["tpot_p99_s"]
        out["throughput_ratio_vs_router_coloc"] = d["throughput_tok_s"] / r["throughput_tok_s"]
    return out


