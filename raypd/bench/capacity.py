"""`raypd bench capacity`: how the KV cache grows with context and concurrency, plain cache vs
paged pool vs paged pool with prefix sharing, and where a budget's capacity boundary lies.

  plain          what transformers' own cache (DynamicCache) holds for a batch of N sequences of
                 C tokens: N x C x bytes_per_token (equal lengths, so no padding)
  plain_static   a contiguous cache preallocated per request to the model's context
                 (transformers' StaticCache with max_cache_len = max_position_embeddings)
  paged          blocks the real KV manager (kvcache/manager.py) allocates for the same batch
  paged_prefix   the same with prefix caching, the N requests sharing a system prompt of
                 shared_frac x C tokens (its full blocks are stored once)
Bytes of the paged schemes = blocks x the planner's bytes_per_block (equal to what the pool
tensor allocates: tests/test_kv_plan.py). The largest concurrency that fits a budget is found by
admitting requests into a manager of budget // bytes_per_block blocks until one does not fit;
TPOT at that concurrency (capped at 64) is the engine's median decode step over a pool of
placeholder KV (timing only: the step cost does not depend on the values).
"""

from __future__ import annotations

import base64
import html
import io
import json
import statistics
import time

from kvcache.hashing import block_hashes
from kvcache.kv_sizing import size_kv
from kvcache.manager import KVCacheManager, cdiv

SCHEMES = ("plain_static", "plain", "paged", "paged_prefix")
BLOCK_SIZES = (8, 16, 32, 64)


def _tokens(i: int, context: int, shared: int) -> list[int]:
    """Request i's tokens: the shared system prompt, then its own tokens."""
    return list(range(shared)) + [1_000_000 + i * context + t for t in range(context - shared)]


def admit(kv: KVCacheManager, n: int, context: int, shared: int, prefix: bool) -> int:
    """Admit up to n requests of `context` tokens (sharing `shared` leading tokens) into `kv`
    as the engine does (match prefix, allocate, cache computed blocks); returns how many fit."""
    bs = kv.block_size
    for i in range(n):
        toks = _tokens(i, context, shared if prefix else 0)
        hashes = block_hashes(toks, bs, 0)
        hits = kv.match_prefix(0, hashes, toks, context - 1) if prefix else []
        if kv.allocate_slots(f"r{i}", context, hits) is None:
            return i
        kv.cache_computed(f"r{i}", 0, hashes, toks, context)
    return n


def peak_bytes(scheme: str, n: int, context: int, shared: int, bytes_per_token_plain: float,
               bytes_per_block: int, block_size: int, max_len: int = 0) -> int:
    if scheme == "plain_static":
        return int(n * max(max_len, context) * bytes_per_token_plain)
    if scheme == "plain":
        return int(n * context * bytes_per_token_plain)
    kv = KVCacheManager(n * cdiv(context, block_size) + 1, block_size,
                        enable_prefix_caching=scheme == "paged_prefix", enable_events=False)
    assert admit(kv, n, context, shared, scheme == "paged_prefix") == n
    return kv.pool.num_used_blocks * bytes_per_block


def max_concurrency(scheme: str, budget: int, context: int, shared: int,
                    bytes_per_token_plain: float, bytes_per_block: int, block_size: int,
                    max_len: int = 0, limit: int = 100_000) -> int:
    if scheme == "plain_static":
        return int(budget // (max(max_len, context) * bytes_per_token_plain))
    if scheme == "plain":
        return int(budget // (context * bytes_per_token_plain))
    num_blocks = budget // bytes_per_block
    if num_blocks == 0:
        return 0
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=scheme == "paged_prefix",
                        enable_events=False)
    return admit(kv, limit, context, shared, scheme == "paged_prefix")


def block_size_table(lengths: list[int], bytes_per_token: float) -> list[dict]:
    """Utilization (stored tokens / allocated slots) and mean tail waste per block size."""
    rows = []
    for bs in BLOCK_SIZES:
        slots = [cdiv(n, bs) * bs for n in lengths]
        waste = [s - n for s, n in zip(slots, lengths, strict=True)]
        rows.append({"block_size": bs, "utilization": sum(lengths) / sum(slots),
                     "tail_waste_tokens_mean": statistics.mean(waste),
                     "tail_waste_bytes_mean": statistics.mean(waste) * bytes_per_token})
    return rows


def measure_tpot(model: str, loaded, kv_dtype: str, n: int, context: int, block_size: int,
                 steps: int = 4, devices: set[str] | None = None) -> float:
    """Median decode step (s) of n requests at `context` tokens over placeholder KV; the
    engine's device type is added to `devices` (where the pool really was)."""
    from workers.engine import EngineConfig, LLMEngine
    from workers.request import SamplingParams
    engine = LLMEngine(EngineConfig(model=model, kv_dtype=kv_dtype, block_size=block_size,
                                    num_blocks=n * cdiv(context + steps + 2, block_size) + 1,
                                    max_num_seqs=n, enable_prefix_caching=False), loaded=loaded)
    if devices is not None:
        devices.add(engine.device.type)
    sp = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for i in range(n):
        req = engine.inputs.make_request([3 + (i + t) % 200 for t in range(context - 1)], sp)
        assert engine.handoff.reserve(req) is not None
        engine.handoff.fill(req, [], None, 3)   # placeholder KV: the reserved blocks as they are
    engine.step()                                     # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_capacity(model: str = "smollm2", kv_dtype: str = "auto", budget_gb: float = 1.0,
                 block_size: int = 16, shared_frac: float = 0.5, contexts: list[int] | None = None,
                 concurrencies: list[int] | None = None, tpot_contexts: list[int] | None = None,
                 threads: int | None = None,
                 budgets_gb: tuple[float, ...] = (0.25, 0.5, 1, 2, 4, 8)) -> dict:
    """`budgets_gb`: the budgets of the concurrency-vs-budget curve."""
    import torch

    from raypd.replay.report import evidence_from_devices
    from workers.model_loader import load_model
    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(model)
    hf, _, info = loaded
    kv = info.dtype if kv_dtype == "auto" else kv_dtype
    max_len = info.max_position_embeddings
    contexts = contexts or [c for c in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
                                        65536, 131072) if c <= max_len]
    concurrencies = concurrencies or [1, 2, 4, 8, 16, 32, 64]
    p = size_kv(hf.config, kv, block_size)
    # transformers' cache holds K/V in the model's dtype
    plain_bpt = size_kv(hf.config, info.dtype, block_size).bytes_per_token
    budget = int(budget_gb * 2**30)
    args = dict(bytes_per_token_plain=plain_bpt, bytes_per_block=p.bytes_per_block,
                block_size=block_size, max_len=max_len)

    def shared(c: int) -> int:
        return int(c * shared_frac)

    mid = 1024 if 1024 in contexts else contexts[len(contexts) // 2]
    n_fixed = 16
    vs_context = {s: [peak_bytes(s, n_fixed, c, shared(c), **args) for c in contexts]
                  for s in SCHEMES}
    vs_concurrency = {s: [peak_bytes(s, n, mid, shared(mid), **args) for n in concurrencies]
                      for s in SCHEMES}
    max_conc = {s: [max_concurrency(s, budget, c, shared(c), **args) for c in contexts]
                for s in SCHEMES}
    budgets_gb = list(budgets_gb)
    vs_budget = {s: [max_concurrency(s, int(b * 2**30), mid, shared(mid), **args)
                     for b in budgets_gb] for s in SCHEMES}
    tpot = []
    devices: set[str] = set()
    for c in [256, 1024] if tpot_contexts is None else tpot_contexts:
        if c not in contexts:
            continue
        for s in SCHEMES[1:]:   # plain_static decodes like plain (same batch); not re-timed
            n = min(64, max_conc[s][contexts.index(c)])
            if n >= 1:
                tpot.append({"scheme": s, "context": c, "concurrency": n,
                             "tpot_s": measure_tpot(model, loaded, kv, n, c, block_size,
                                                    devices=devices)})
    import random
    rng = random.Random(0)
    lengths = [rng.randint(1, min(max_len, 4096)) for _ in range(1000)]
    i = contexts.index(mid)
    return {
        "model": model, "kv_dtype": kv, "block_size": block_size, "budget_gb": budget_gb,
        "shared_frac": shared_frac, "bytes_per_token": p.bytes_per_token,
        "bytes_per_token_plain": plain_bpt, "bytes_per_block": p.bytes_per_block,
        "contexts": contexts, "concurrencies": concurrencies, "fixed_concurrency": n_fixed,
        "fixed_context": mid,
        "peak_bytes_vs_context": vs_context, "peak_bytes_vs_concurrency": vs_concurrency,
        "max_concurrency_in_budget": max_conc,
        "budgets_gb": budgets_gb, "max_concurrency_vs_budget": vs_budget,
        "headline": {f"max_concurrency_{s}_at_{budget_gb}GiB_ctx{mid}": max_conc[s][i]
                     for s in SCHEMES},
        "block_sizes": block_size_table(lengths, p.bytes_per_token),
        "block_size_lengths": "1000 requests, lengths uniform in [1, min(context limit, 4096)]",
        "tpot_at_max_concurrency": tpot,
        "tpot_timing": "raypd's paged engine decoding that many requests at that context: median "
                       "of 4 steps after a warm-up, placeholder KV",
        "evidence": evidence_from_devices(sorted(devices)),   # the engines' pools
        "devices": sorted(devices),
    }


CURVES_FILE = "capacity_curves.json"   # in raypd's cache: the last run per (model, KV dtype)
CURVE_KEYS = ("model", "kv_dtype", "block_size", "shared_frac", "bytes_per_token",
              "bytes_per_block", "contexts", "concurrencies", "fixed_concurrency",
              "fixed_context", "peak_bytes_vs_context", "peak_bytes_vs_concurrency", "evidence")


def _curves_path():
    from workers.model_loader import cache_dir
    return cache_dir() / CURVES_FILE


def record_curves(r: dict) -> None:
    """Keep the growth curves of a `bench capacity` run for the run reports of the same model
    and KV dtype (the last run wins)."""
    path = _curves_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[f"{r['model']}|{r['kv_dtype']}"] = {k: r[k] for k in CURVE_KEYS}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def recorded_curves(model: str, kv_dtype: str | None) -> dict | None:
    """The growth curves `raypd bench capacity` recorded for this model and KV dtype, if any."""
    try:
        return json.loads(_curves_path().read_text()).get(f"{model}|{kv_dtype}")
    except (OSError, ValueError):
        return None


def render_html(r: dict) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def fig_png(draw) -> str:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        draw(ax)
        ax.grid(alpha=0.3)
        ax.legend()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        return ("<img alt='plot' src='data:image/png;base64,"
                + base64.b64encode(buf.getvalue()).decode() + "'>")

    gib = 2**30

    # equal-length requests make plain and paged coincide (no tail waste at block multiples):
    # distinct line styles and markers keep every curve visible where they overlap
    styles = {"plain_static": dict(ls=":", marker="x"), "plain": dict(ls="--", marker="s", ms=8,
                                                                      mfc="none"),
              "paged": dict(ls="-", marker="o", ms=4), "paged_prefix": dict(ls="-", marker="^")}

    def line(ax, xs, series, xlabel, ylabel, logx=True, budget=None):
        for s, ys in series.items():
            ax.plot(xs, ys, label=s, **styles.get(s, {"marker": "o"}))
        if budget:
            ax.axhline(budget, color="red", ls="--", label=f"budget {budget} GiB")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if logx:
            ax.set_xscale("log", base=2)

    plots = [
        fig_png(lambda ax: line(ax, r["contexts"], {s: [b / gib for b in v] for s, v in
                                                     r["peak_bytes_vs_context"].items()},
                                f"context (tokens), {r['fixed_concurrency']} requests",
                                "peak KV (GiB)", budget=r["budget_gb"])),
        fig_png(lambda ax: line(ax, r["concurrencies"], {s: [b / gib for b in v] for s, v in
                                                          r["peak_bytes_vs_concurrency"].items()},
                                f"concurrency, context {r['fixed_context']}", "peak KV (GiB)",
                                budget=r["budget_gb"])),
        fig_png(lambda ax: line(ax, r["budgets_gb"], r["max_concurrency_vs_budget"],
                                "KV budget (GiB)", f"max concurrency, ctx {r['fixed_context']}")),
    ]
    rows = "".join(f"<tr><td>{b['block_size']}</td><td>{b['utilization']:.4f}</td>"
                   f"<td>{b['tail_waste_tokens_mean']:.1f}</td></tr>" for b in r["block_sizes"])
    tp = "".join(f"<tr><td>{t['scheme']}</td><td>{t['context']}</td><td>{t['concurrency']}</td>"
                 f"<td>{t['tpot_s'] * 1000:.1f}</td></tr>" for t in r["tpot_at_max_concurrency"])
    head = html.escape(json.dumps(r["headline"], indent=1))
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>raypd capacity</title>"
            "</head><body style='font-family:sans-serif'>"
            f"<h1>KV capacity: {html.escape(r['model'])} ({html.escape(r['kv_dtype'])}, "
            f"block {r['block_size']}) <small>{r['evidence']}</small></h1><pre>{head}</pre>"
            + "".join(plots)
            + "<h2>Block size</h2><table border=1><tr><th>block_size</th><th>utilization</th>"
            f"<th>tail waste (tokens)</th></tr>{rows}</table>"
            "<h2>TPOT at the largest concurrency in budget (cap 64)</h2><table border=1><tr>"
            f"<th>scheme</th><th>context</th><th>concurrency</th><th>TPOT ms</th></tr>{tp}"
            "</table></body></html>")


