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
Tensor parallelism (GPU rooflines, `gpu_cost_model(prefill_tp=, decode_tp=)`): a worker of TP t
is t GPUs, each computing and reading 1/t, plus two all-reduces a layer (TP_ALLREDUCE and the
other TP_* figures, stated once below); its KV pool is its ranks' memory after their weights.
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
    vocab: int = 0         # the input embedding's rows (replicated on every TP rank)

    @property
    def heads(self) -> int:
        """Query heads (hidden = heads x head_dim in every shape here)."""
        return self.hidden // self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    def rank_kv_bytes_per_token(self, tp: int) -> float:
        """One TP rank's KV per token: its share of the KV heads (one replicated head when tp
        exceeds them: kvcache/kv_sizing.py rank_kv_heads)."""
        from kvcache.kv_sizing import rank_kv_heads
        return self.kv_bytes_per_token * rank_kv_heads(self.kv_heads, tp) / self.kv_heads

    def rank_weight_bytes(self, tp: int) -> float:
        """One TP rank's weights: all but the input embedding split 1/tp (the projections, the
        MLP, the lm_head by vocabulary; the k/v projections' replication past kv_heads and the
        norms are left out: under 1% here), the embedding on every rank (workers/llama.py)."""
        embed = self.vocab * self.hidden
        return ((self.params - embed) / tp + embed) * self.dtype_bytes


MODELS = {   # the published config.json shapes (vocab: vocab_size)
    "smollm2-135m": ModelShape("smollm2-135m", 134.5e6, 30, 576, 3, 64, 2, 49152),
    "llama3-8b": ModelShape("llama3-8b", 8.03e9, 32, 4096, 8, 128, 2, 128256),
    # Meta-Llama-3-70B: 80 layers, GQA 64:8; its bf16 weights (141 GB) need TP >= 2 on 80 GB
    "llama3-70b": ModelShape("llama3-70b", 70.55e9, 80, 8192, 8, 128, 2, 128256),
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


# ---- tensor parallelism on the rooflines: every figure in one place ---------------------------
@dataclass(frozen=True)
class AllReduceCost:
    """A ring all-reduce of `nbytes` over `ranks` GPUs: each rank sends (and receives)
    2 (ranks - 1) / ranks of the message over its link, plus a fixed latency a call (NCCL's
    ring); nothing on one rank."""
    gbps: float         # one GPU's one-way link bandwidth as the all-reduce uses it, GB/s
    latency_s: float    # a call's fixed cost (launch, synchronisation, the ring's hops)

    def seconds(self, nbytes: float, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return self.latency_s + 2 * (ranks - 1) / ranks * nbytes / (self.gbps * 1e9)


TP_CHOICES = (1, 2, 4, 8)      # TP sizes the planner tries (one 8-GPU NVLink node at most)
# NVLink 4 (H100 / H200 SXM: 450 GB/s a direction) at the roofline's link_efficiency, ~360 GB/s,
# about what nccl-tests report as an 8-GPU all-reduce's bus bandwidth on large messages; 8 us a
# call, NCCL's small-message latency on one NVLink node (decode's all-reduces are small)
TP_ALLREDUCE = AllReduceCost(LINKS["nvlink"].gbps * ROOFLINE_EFFICIENCY["link_efficiency"],
                             8e-6)
TP_ALLREDUCES_PER_LAYER = 2    # Megatron: after attention's o_proj and after the MLP's down_proj
MIN_KV_TOKENS = 4096           # a TP size whose ranks hold less KV than this is refused
TP_ASSUMPTIONS = (
    "a TP-t worker holds t GPUs: compute, weight reads and KV reads split 1/t over its ranks "
    "(the embedding replicated on each; one KV head a rank when t exceeds the KV heads); "
    f"{TP_ALLREDUCES_PER_LAYER} all-reduces a layer of tokens x hidden x dtype bytes, "
    "a ring over NVLink (TP_ALLREDUCE), not overlapped with compute; the KV pool is the ranks' "
    "memory after their weights; P -> D pages move rank to rank, min(P's, D's TP) links in "
    "parallel (one NIC a GPU, as DGX H100 nodes have)")


def tp_allreduce_s(m: ModelShape, tokens: int, tp: int,
                   allreduce: AllReduceCost = TP_ALLREDUCE) -> float:
    """The all-reduces of one forward pass of `tokens` tokens on a TP-`tp` worker."""
    return m.layers * TP_ALLREDUCES_PER_LAYER * allreduce.seconds(
        tokens * m.hidden * m.dtype_bytes, tp)


def tp_allreduce_terms(m: ModelShape, tp: int) -> tuple[float, float]:
    """tp_allreduce_s as (seconds a step, seconds a token): the calls' latencies, their bytes."""
    step = tp_allreduce_s(m, 0, tp)
    return step, tp_allreduce_s(m, 1, tp) - step


def worker_kv_tokens(gpu: str, model: str, tp: int) -> int:
    """KV tokens a TP-`tp` worker's pool holds: each rank's HBM after its weights, at
    kv_memory_fraction, over a rank's KV bytes per token (negative: the weights do not fit)."""
    g, m = GPUS[gpu], MODELS[model]
    free = (g.hbm_gb * 1e9 - m.rank_weight_bytes(tp)) * ROOFLINE_EFFICIENCY["kv_memory_fraction"]
    return int(free / m.rank_kv_bytes_per_token(tp))


def tp_refusal(gpu: str, model: str, tp: int) -> str | None:
    """Why a worker of `model` on `gpu` cannot have TP size `tp` (None: it can): the model's
    heads (protocol/tp_layout.py's rule) or its weights per rank leaving under MIN_KV_TOKENS of
    KV room."""
    from protocol.tp_layout import tp_refusal as heads_refusal
    m = MODELS[model]
    reason = heads_refusal(m.heads, m.kv_heads, tp)
    if reason:
        return reason
    if worker_kv_tokens(gpu, model, tp) < MIN_KV_TOKENS:
        return (f"{model}'s weights at tp {tp} ({m.rank_weight_bytes(tp) / 1e9:.0f} GB a rank) "
                f"leave less than {MIN_KV_TOKENS} tokens of KV on a {GPUS[gpu].hbm_gb:.0f} GB "
                f"{gpu}")
    return None


def feasible_tps(gpu: str, model: str, choices: Sequence[int] = TP_CHOICES) -> tuple[int, ...]:
    """The TP sizes of `choices` a worker of `model` on `gpu` can have (tp_refusal)."""
    return tuple(t for t in choices if tp_refusal(gpu, model, t) is None)


def gpu_cost_model(gpu: str = "h100", model: str = "llama3-8b", link: str = "400g",
                   chunk_tokens: int = 8192, prefill_tp: int = 1,
                   decode_tp: int = 1) -> CostModel:
    """Roofline: prefill is compute-bound at prefill_mfu of the bf16 peak (2 x params FLOPs a
    token for the linear layers, 4 x layers x hidden x context a token for attention); a decode
    step reads the weights and the batch's KV at decode_mbu of the HBM bandwidth, plus its
    linear FLOPs at decode_mfu, plus a fixed step overhead; the KV pool is kv_memory_fraction
    of what the weights leave of HBM; P -> D transfers on `link` at link_efficiency.

    Prefill workers of TP `prefill_tp`, decode workers of `decode_tp` (TP_ASSUMPTIONS): each
    rank computes and reads 1/t (its weights, its KV heads), and every step pays
    TP_ALLREDUCES_PER_LAYER all-reduces a layer (tp_allreduce_s: per step their latencies, per
    token their bytes); the KV pool holds what the ranks' memory holds. The simulator gives
    every worker one pool size: the decode workers' (admission and reservations); the prefill
    workers' own is in the notes. Raises ValueError on a TP size `tp_refusal` refuses."""
    for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        reason = tp_refusal(gpu, model, tp)
        if reason:
            raise ValueError(f"{role} TP {tp} for {model} on {gpu}: {reason}")
    g, m, e = GPUS[gpu], MODELS[model], ROOFLINE_EFFICIENCY
    flops = g.bf16_tflops * 1e12 * e["prefill_mfu"]
    compute_tok_s = flops * prefill_tp / (2 * m.params)
    p_step_ar, p_token_ar = tp_allreduce_terms(m, prefill_tp)
    tok_s = 1.0 / (1.0 / compute_tok_s + p_token_ar) if p_token_ar else compute_tok_s
    # attention FLOPs a token at context c: 4 * layers * hidden * c; equal to the linear part
    # (2 * params) at c = params / (2 * layers * hidden); split over the ranks as the linear
    # part is (the query heads are), never slowed by the all-reduce
    attn_ctx = m.params / (2 * m.layers * m.hidden) * (compute_tok_s / tok_s)
    prefill_overhead = e["step_overhead_s"] + p_step_ar
    d_step_ar, d_token_ar = tp_allreduce_terms(m, decode_tp)
    bw = g.hbm_tbps * 1e12 * e["decode_mbu"]
    per_ctx = m.rank_kv_bytes_per_token(decode_tp) / bw
    base = max(m.rank_weight_bytes(decode_tp) / bw, 0.0) + e["step_overhead_s"] + d_step_ar
    per_seq = 2 * m.params / (decode_tp * g.bf16_tflops * 1e12 * e["decode_mfu"]) + d_token_ar
    lk = LINKS[link]
    lanes = min(prefill_tp, decode_tp)   # rank-to-rank page moves in parallel
    kv_tokens = worker_kv_tokens(gpu, model, decode_tp)
    tp_label = "" if prefill_tp == decode_tp == 1 else f" TP P{prefill_tp}/D{decode_tp}"
    return CostModel(
        label=f"roofline {gpu} {model}{tp_label}",
        prefill=PrefillCost(tok_s, attn_ctx, prefill_overhead, chunk_tokens),
        decode=DecodeCost(base, per_seq, per_ctx),
        link=LinkCost(lk.gbps * e["link_efficiency"] * lanes,
                      lk.latency_s + HANDOFF_LATENCY_S),
        kv_bytes_per_token=m.kv_bytes_per_token, kv_capacity_tokens=kv_tokens,
        notes={"gpu": asdict(g), "model": asdict(m), "link": link,
               "efficiency": dict(e), "source": "roofline",
               "handoff_latency": {"s": HANDOFF_LATENCY_S, "source": HANDOFF_SOURCE},
               "tp": {"prefill": prefill_tp, "decode": decode_tp,
                      "allreduce": asdict(TP_ALLREDUCE),
                      "allreduces_per_layer": TP_ALLREDUCES_PER_LAYER,
                      "prefill_kv_capacity_tokens": worker_kv_tokens(gpu, model, prefill_tp),
                      "assumptions": TP_ASSUMPTIONS}})


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
