"""The simulator's hidden cost model: what a prefill step, a decode step, a KV transfer and an
adapter load cost. Only the simulator charges time with it; policies never see it (they see the
workers' load reports, whose speeds the simulated workers fit from the steps charged here).

Prefill step (chunks of (new tokens u, tokens computed before c); T = sum(u)):
    fit_s = step_overhead_s + T / tok_s + step_tok_sq_s * T^2
            + sum(u * (c + u/2)) / (tok_s * attn_ctx_tokens)
(the T^2 term lets a calibration with batched prefill steps tell a step's size from
per-sequence attention, which one sequence a step cannot; on this machine's calibrations it
fitted to 0, the batched points going to the attention term; 0 on the GPU rooflines).
With a measured table `solo_s` (seconds of one cold sequence of n tokens alone: cpu-here),
a chunk alone costs what the table says (interpolated: S(c + u) - S(c) + overhead, S(0) =
overhead; tokens past the table at the fit's cost) and a step of several chunks the sum of those
times fit_s(step) / sum(fit_s(chunk alone)): solo costs measured, batching from the fit
(on this machine the per-token cost is flat to 512 tokens and then rises faster than the
fit's form can follow: the fit came out 8-10% short at 1024 tokens in three calibrations).
P's handoff work: after a step, its loop stages each prompt the step finished
(stage_s_per_token x its tokens, one after the other: a prompt's prefill ends when it is
staged); cpu-here measures it (`simulate --validate`'s probe), 0 elsewhere.
Decode step of `batch` sequences holding `ctx` tokens in all:
    step_s = base_s + per_seq_s * batch + per_ctx_token_s * ctx
Mixed step (a colocated GPU's chunked prefill with `batch` decode tokens riding along, as
vLLM v1 and Sarathi-Serve schedule; raypd/sim/colocated_sim.py):
    mixed_step_s = max(prefill.step_s(chunks) + batch / tok_s + per_ctx_token_s * ctx,
                       decode.step_s(batch, ctx))
the decode tokens share the prefill step's weight read and overhead, and add their linear
FLOPs at the prefill rate and their KV reads; never faster than the decode step alone.
Transfer of n bytes over a link: latency_s + n / (gbps * 1e9).
Shared host (`SharedHost`, cpu-here: a prefill and a decode worker on the same cores and
memory): a decode step that overlaps a prefill step runs `decode_x` times slower over the
overlap, a prefill step `prefill_x` times slower while the decode worker's batch lasts, a
handoff's bytes `handoff_x` times longer and its latency `handoff_s` longer, P's staging
`stage_x` times longer, a prefill step that starts while the pages of the prompts it just
finished move to the decode worker (the link's seconds of their bytes) `send_s_per_token` x
their tokens longer (the decode worker receives and verifies them on the same cores while it
decodes), and the decode worker's running batch `land_s_per_token` x a landing prompt's
tokens later, each a function of the decode worker's batch (`HostSlowdown`); `raypd simulate
--validate` measures them at PROBE_BATCHES on the real cluster before its replay
(raypd/bench/sim_validation.py probe_shared_host); none elsewhere.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from protocol.step_rates import DEFAULT_BATCHED_TOKENS


@dataclass(frozen=True)
class PrefillCost:
    tok_s: float = 8_000.0             # linear-layer rate at zero context
    attn_ctx_tokens: float = 32_768.0  # context at which a token costs twice as much; 0: off
    step_overhead_s: float = 0.02      # fixed cost of one prefill step
    chunk_tokens: int = 8192           # chunked prefill: new tokens per step at most
    step_tok_sq_s: float = 0.0         # seconds per (step tokens)^2

    solo_s: tuple[tuple[int, float], ...] = ()   # (n, s) one cold sequence alone, measured
    # P's handoff work (module doc): staging a finished prompt's KV on the loop thread before
    # the next step; 0: none
    stage_s_per_token: float = 0.0

    def prefill_s(self, num_tokens: int, num_cached_tokens: int = 0) -> float:
        """Chunked prefill of tokens [num_cached_tokens, num_tokens) alone on a worker."""
        t, done = 0.0, num_cached_tokens
        while done < num_tokens:
            c = min(self.chunk_tokens, num_tokens - done)
            t += self.step_s([(c, done)])
            done += c
        return t

    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        fit = self.fit_s(chunks)
        if not self.solo_s or not chunks:
            return fit
        solo = sum(self._solo_chunk_s(u, c) for u, c in chunks)
        if len(chunks) == 1:
            return solo
        return solo * fit / sum(self.fit_s([ch]) for ch in chunks)

    def _solo_curve(self, n: float) -> float:
        """Seconds of one cold sequence of n tokens alone, n within the table: linear between
        its points and from (0, overhead) (cpu_cost_model makes the table monotone)."""
        xs = [0] + [p[0] for p in self.solo_s]
        ys = [self.step_overhead_s] + [p[1] for p in self.solo_s]
        assert 0 <= n <= xs[-1], (n, xs[-1])
        i = min(bisect.bisect_right(xs, n), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def _solo_chunk_s(self, u: int, c: int) -> float:
        """Chunk of u new tokens after c: the table's S(c + u) - S(c) for the part within the
        table, the fit's cost of the same tokens at their context past it, one overhead."""
        last, end = self.solo_s[-1][0], c + u
        t = self.step_overhead_s
        if c < last:
            t += self._solo_curve(min(end, last)) - self._solo_curve(c)
        if end > last:
            b0 = max(c, last)
            t += self.fit_s([(end - b0, b0)]) - self.step_overhead_s
        return t

    def fit_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """The fitted form alone (module doc)."""
        t = self.step_overhead_s
        total = sum(u for u, _ in chunks)
        t += self.step_tok_sq_s * total * total
        for u, c in chunks:
            t += u / self.tok_s
            if self.attn_ctx_tokens > 0:
                t += u * (c + u / 2.0) / (self.tok_s * self.attn_ctx_tokens)
        return t


@dataclass(frozen=True)
class DecodeCost:
    base_s: float = 0.008
    per_seq_s: float = 0.0002
    per_ctx_token_s: float = 2e-8

    def step_s(self, batch: int, ctx_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.base_s + self.per_seq_s * batch + self.per_ctx_token_s * ctx_tokens


@dataclass(frozen=True)
class LinkCost:
    gbps: float = 25.0
    latency_s: float = 0.0005

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / (self.gbps * 1e9) if nbytes > 0 else 0.0


@dataclass(frozen=True)
class HostSlowdown:
    """What sharing a host costs while the decode worker runs `batch` sequences (module doc):
    prefill steps `prefill_x` slower, decode steps `decode_x` slower while a prefill step
    runs, a handoff's bytes on the link `handoff_x` longer and its latency `handoff_s`
    longer (the RPCs wait for busy workers), P's staging `stage_x`
    longer, the prefill step that starts while the pages of the prompts P just finished move
    to D `send_s_per_token` longer per token sent, D's running batch `land_s_per_token` later
    per token of each prompt that lands on it."""
    batch: float = 0
    prefill_x: float = 1.0
    decode_x: float = 1.0
    handoff_x: float = 1.0
    handoff_s: float = 0.0
    stage_x: float = 1.0
    send_s_per_token: float = 0.0
    land_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        xs = (self.prefill_x, self.decode_x, self.handoff_x, self.stage_x)
        if not all(x >= 1.0 for x in xs) or min(self.send_s_per_token, self.land_s_per_token,
                                                 self.handoff_s) < 0:
            raise ValueError(f"shared-host slowdowns are >= 1, send and land costs >= 0: "
                             f"{self}")


NO_SLOWDOWN = HostSlowdown()
_FIELDS = ("prefill_x", "decode_x", "handoff_x", "handoff_s", "stage_x", "send_s_per_token",
           "land_s_per_token")


@dataclass(frozen=True)
class SharedHost:
    """Slowdowns of a prefill and a decode worker sharing one host (module doc), measured at
    one or more decode batches (`points`, batches >= 1 and distinct; none: no slowdown).
    Between two batches the figures are linear, below the first and past the last they stay
    its; an idle decode worker (batch 0) slows nothing."""
    points: tuple[HostSlowdown, ...] = ()

    def __post_init__(self) -> None:
        batches = [p.batch for p in self.points]
        if any(b < 1 for b in batches) or len(set(batches)) != len(batches):
            raise ValueError(f"shared-host batches are distinct and >= 1: {batches}")
        object.__setattr__(self, "points", tuple(sorted(self.points, key=lambda p: p.batch)))

    def at(self, batch: float) -> HostSlowdown:
        pts = self.points
        if batch <= 0 or not pts:
            return NO_SLOWDOWN
        if batch <= pts[0].batch:
            return pts[0]
        for a, b in zip(pts, pts[1:], strict=False):
            if batch <= b.batch:
                f = (batch - a.batch) / (b.batch - a.batch)
                return HostSlowdown(batch, **{k: getattr(a, k) + f * (getattr(b, k)
                                                                      - getattr(a, k))
                                              for k in _FIELDS})
        return pts[-1]


@dataclass(frozen=True)
class CostModel:
    label: str = "synthetic"
    prefill: PrefillCost = PrefillCost()
    decode: DecodeCost = DecodeCost()
    link: LinkCost = LinkCost()
    kv_bytes_per_token: int = 46_080   # SmolLM2-135M, fp32 (2 x 30 layers x 3 kv heads x 64 x 4)
    kv_capacity_tokens: int = 4_194_304   # KV tokens one worker's pool holds
    lora_load_s: float = 0.2
    shared_host: SharedHost = SharedHost()
    notes: dict = field(default_factory=dict)   # where the figures come from (stated in output)

    def to_dict(self) -> dict:
        return asdict(self)

    def mixed_step_s(self, chunks: Sequence[tuple[int, int]], batch: int,
                     ctx_tokens: int) -> float:
        """One engine step of prefill `chunks` (new tokens, tokens before) and `batch` decode
        tokens over `ctx_tokens` of context (module doc); either part may be empty."""
        if not chunks:
            return self.decode.step_s(batch, ctx_tokens)
        t = self.prefill.step_s(chunks)
        if batch <= 0:
            return t
        t += batch / self.prefill.tok_s + self.decode.per_ctx_token_s * ctx_tokens
        return max(t, self.decode.step_s(batch, ctx_tokens))

    def scaled(self, prefill_k: float, decode_k: float) -> CostModel:
        """The same shapes with every prefill second x prefill_k and every decode second x
        decode_k (re-anchoring a calibration's level to a later measurement)."""
        assert prefill_k > 0 and decode_k > 0, (prefill_k, decode_k)
        p, d = self.prefill, self.decode
        return replace(self, prefill=replace(
            p, tok_s=p.tok_s / prefill_k, step_overhead_s=p.step_overhead_s * prefill_k,
            step_tok_sq_s=p.step_tok_sq_s * prefill_k,
            solo_s=tuple((n, t * prefill_k) for n, t in p.solo_s)),
            decode=replace(d, base_s=d.base_s * decode_k, per_seq_s=d.per_seq_s * decode_k,
                           per_ctx_token_s=d.per_ctx_token_s * decode_k))


# ---- where the figures come from: GPU rooflines and this machine's own measurements --------
@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float          # parameters
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


MODELS = {
    "smollm2-135m": ModelShape("smollm2-135m", 134.5e6, 30, 576, 3, 64, 2),
    "llama3-8b": ModelShape("llama3-8b", 8.03e9, 32, 4096, 8, 128, 2),
}


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_tflops: float     # dense
    hbm_tbps: float
    hbm_gb: float


GPUS = {
    "h100": GPUSpec("h100", 989.0, 3.35, 80.0),    # SXM5
    "h200": GPUSpec("h200", 989.0, 4.8, 141.0),
}
LINKS = {  # GB/s one way, latency s
    "nvlink": LinkCost(450.0, 5e-6),
    "pcie5": LinkCost(64.0, 1e-5),
    "400g": LinkCost(50.0, 2e-5),
}
# efficiency factors of the roofline (stated in every output that uses it)
ROOFLINE_EFFICIENCY = {"prefill_mfu": 0.5, "decode_mbu": 0.7, "decode_mfu": 0.4,
                       "link_efficiency": 0.8, "step_overhead_s": 0.003,
                       "kv_memory_fraction": 0.9}


def gpu_cost_model(gpu: str = "h100", model: str = "llama3-8b", link: str = "400g",
                   chunk_tokens: int = 8192) -> CostModel:
    """Roofline: prefill is compute-bound at prefill_mfu of the bf16 peak (2 x params FLOPs a
    token for the linear layers, 4 x layers x hidden x context a token for attention); a decode
    step reads the weights and the batch's KV at decode_mbu of the HBM bandwidth, plus its
    linear FLOPs at decode_mfu, plus a fixed step overhead; the KV pool is kv_memory_fraction of what the weights
    leave of HBM; P -> D transfers on `link` at link_efficiency."""
    g, m, e = GPUS[gpu], MODELS[model], ROOFLINE_EFFICIENCY
    flops = g.bf16_tflops * 1e12 * e["prefill_mfu"]
    tok_s = flops / (2 * m.params)
    # attention FLOPs a token at context c: 4 * layers * hidden * c; equal to the linear part
    # (2 * params) at c = params / (2 * layers * hidden)
    attn_ctx = m.params / (2 * m.layers * m.hidden)
    bw = g.hbm_tbps * 1e12 * e["decode_mbu"]
    per_ctx = m.kv_bytes_per_token / bw
    base = max(m.weight_bytes / bw, 0.0) + e["step_overhead_s"]
    per_seq = 2 * m.params / (g.bf16_tflops * 1e12 * e["decode_mfu"])
    lk = LINKS[link]
    kv_tokens = int((g.hbm_gb * 1e9 - m.weight_bytes) * e["kv_memory_fraction"]
                    / m.kv_bytes_per_token)
    return CostModel(
        label=f"roofline {gpu} {model}",
        prefill=PrefillCost(tok_s, attn_ctx, e["step_overhead_s"], chunk_tokens),
        decode=DecodeCost(base, per_seq, per_ctx),
        link=LinkCost(lk.gbps * e["link_efficiency"], lk.latency_s + HANDOFF_LATENCY_S),
        kv_bytes_per_token=m.kv_bytes_per_token, kv_capacity_tokens=kv_tokens,
        notes={"gpu": asdict(g), "model": asdict(m), "link": link,
               "efficiency": dict(e), "source": "roofline",
               "handoff_latency": {"s": HANDOFF_LATENCY_S, "source": HANDOFF_SOURCE}})


# What a request spends between its prefill's end and its first token besides its KV's bytes on
# the link: D's admission and plan, P's staging, the pull's round trips, the first token's way
# back through the router (raypd's control plane over Ray). Every cost model carries it.
HANDOFF_LATENCY_S = 0.129
HANDOFF_SOURCE = ("measured by `raypd simulate --validate`'s probe on the cpu-here machine "
                  "(2 cores, Ray 2.60, SmolLM2-135M, 1024-token prompts), 2026-12-02: median "
                  "0.153 s from prefill end to first token over 8 requests alone, less the KV's "
                  "own transfer at the cpu-here link (probes on other cluster starts gave "
                  "0.05-0.13 s); not measured on a GPU host (the same RPCs run on its CPU, its "
                  "staging copy is a device copy)")

# stated defaults for cpu-here when no `raypd bench engine` JSON is given: one measurement of
# today's workers, not a calibration of the machine the simulator runs on (give --engine-json,
# or let `simulate --validate` calibrate, for that; nothing compares against these). Measured
# 2026-12-07 by `simulate --validate`'s calibration on an AMD EPYC (family 26 model 2, Zen 5;
# 2 cores, AVX512-BF16, no AMX) shared with other work: SmolLM2-135M in bfloat16 (KV too),
# the workers' 512-token step budget (longer prompts in chunks), 2 torch threads (a busy
# worker's with the other idle), in a Ray task placed as the workers are; medians of 3.
CPU_DEFAULTS = {
    "prefill_tok_s": {"128": 2327.5, "512": 2890.0, "1024": 2707.1, "2048": 2052.4},
    "prefill_batch_s": [{"batch": 4, "tokens": 128, "step_s": 0.1845},
                        {"batch": 2, "tokens": 256, "step_s": 0.1835}],
    "decode_step_ms_grid": [{"batch": 1, "context": 128, "step_ms": 9.38},
                            {"batch": 1, "context": 1024, "step_ms": 8.67},
                            {"batch": 4, "context": 512, "step_ms": 12.36},
                            {"batch": 16, "context": 128, "step_ms": 13.69},
                            {"batch": 16, "context": 512, "step_ms": 17.31}],
    "decode_step_ms_b1": 9.38, "decode_step_ms_b16": 13.69,
    "dtype": "bfloat16", "kv_dtype": "bfloat16", "max_num_batched_tokens": 512, "threads": 2,
    "cpu": "AMD EPYC family 26 model 2 (Zen 5), 2 cores"}


def _chunked_row(n: int, budget: int) -> tuple[float, float, float, float]:
    """The fit's terms (steps, tokens, attention u * (c + u / 2), step tokens^2) of one cold
    n-token prompt prefilled in chunks of at most `budget` tokens."""
    chunks = [(min(budget, n - done), done) for done in range(0, n, budget)]
    return (float(len(chunks)), float(n), sum(u * (c + u / 2.0) for u, c in chunks),
            float(sum(u * u for u, _ in chunks)))


def cpu_cost_model(bench_engine: dict | None = None, model: str = "smollm2-135m",
                   kv_capacity_tokens: int = 65_536,
                   chunk_tokens: int = DEFAULT_BATCHED_TOKENS["cpu"]) -> CostModel:
    """This machine, from `raypd bench engine` JSON: prefill seconds fitted to its prefill
    tok/s at each prompt length (overhead + linear + attention terms, per chunk of the JSON's
    own `max_num_batched_tokens` where it states one: a longer prompt ran in chunks; one
    sequence's cost within one step from the measured table itself, `PrefillCost.solo_s`;
    `chunk_tokens` is the simulated workers' step budget), decode step time fitted
    to its `decode_step_ms_grid` (`bench engine --calibration`: batch and context) or, from a
    plain bench, its batch-1 and batch-16 step times; without a JSON, CPU_DEFAULTS (said in the
    notes)."""
    from kvcache.kv_sizing import KV_DTYPE_BYTES
    from protocol.step_rates import nnls

    src = bench_engine or CPU_DEFAULTS
    # the calibration's own step budget (prompts past it ran in chunks: one row term per
    # chunk, as PrefillCost.prefill_s charges them); a JSON that does not say: one step each
    measured_budget = int(src.get("max_num_batched_tokens") or 0) or None
    rows, ys = [], []
    for n, tok_s in src["prefill_tok_s"].items():   # one sequence of n tokens
        n = int(n)
        rows.append(_chunked_row(n, measured_budget or n))
        ys.append(n / float(tok_s))
    batched = src.get("prefill_batch_s") or []       # b sequences of n tokens, one step
    for p in batched:
        b, n = p["batch"], p["tokens"]
        rows.append((1.0, b * n, b * n * n / 2.0, float((b * n) ** 2)))
        ys.append(p["step_s"])
    sq = 0.0
    if batched and len(rows) >= 4:   # attention (per sequence) and step size apart
        c0, c1, c2, sq = nnls(rows, ys)
    elif len(rows) >= 3:     # overhead, linear and attention terms need three lengths
        c0, c1, c2 = nnls([r[:3] for r in rows], ys)
    else:                    # fewer (a --quick bench): the mean rate only, said in the notes
        c0, c1, c2 = 0.0, 0.0, 0.0
    c1 = c1 or sum(ys) / sum(r[1] for r in rows)
    grid = src.get("decode_step_ms_grid")
    if grid:   # `bench engine --calibration`: step time vs batch and context, fitted
        base, per_seq, per_ctx = nnls([(1.0, g["batch"], g["batch"] * g["context"])
                                       for g in grid], [g["step_ms"] / 1e3 for g in grid])
    else:      # two batch sizes at one context: no context term
        t1, t16 = src["decode_step_ms_b1"] / 1e3, src["decode_step_ms_b16"] / 1e3
        per_seq = max(0.0, (t16 - t1) / 15)
        base, per_ctx = max(t1 - per_seq, 0.0), 0.0
    m = MODELS[model]
    solo, top = [], c0     # one step each, made monotone (a noisy point never makes the
    one_step = min(chunk_tokens, measured_budget or chunk_tokens)   # tokens after it cheaper
    for n, t in sorted((int(n), int(n) / float(v)) for n, v in src["prefill_tok_s"].items()
                       if int(n) <= one_step):                       # than nothing)
        top = max(top, t)
        solo.append((n, top))
    return CostModel(
        label="cpu-here " + ("measured" if bench_engine else "stated defaults"),
        prefill=PrefillCost(1.0 / c1, (c1 / c2) if c2 > 0 else 0.0, c0, chunk_tokens, sq,
                            tuple(solo)),
        decode=DecodeCost(base, per_seq, per_ctx),
        link=LinkCost(1.0, HANDOFF_LATENCY_S),   # KV in the calibrated pool's dtype
        kv_bytes_per_token=m.kv_bytes_per_token * KV_DTYPE_BYTES.get(
            src.get("kv_dtype", "float32"), 4) // m.dtype_bytes,
        kv_capacity_tokens=kv_capacity_tokens,
        notes={"prefill_fit": "overhead + linear + step tokens^2 + attention" if batched else
               "overhead + linear + attention" if len(rows) >= 3 else
               f"mean rate only ({len(rows)} prompt length(s) measured)",
               "source": "raypd bench engine JSON" if bench_engine else
               "no bench engine JSON given: stated defaults CPU_DEFAULTS",
               "handoff_latency": {"s": HANDOFF_LATENCY_S, "source": HANDOFF_SOURCE},
               "inputs": {
                   k: src[k] for k in ("prefill_tok_s", "prefill_batch_s", "decode_step_ms_b1",
                                       "decode_step_ms_b16", "decode_step_ms_grid")
                   if k in src},
               "decode_fit": "base + per_seq x batch + per_ctx_token x context" if grid else
               "base + per_seq x batch (no context term: two batch sizes measured)",
               "link": "object store on one host: 1 GB/s, 2 ms (stated)",
               "solo_prefill": "one sequence: the measured prefill_tok_s table, interpolated"})
