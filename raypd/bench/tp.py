"""`raypd bench tp`: tensor-parallel engines on this machine, side by side (issue 61).

- `allreduce_us`: the CPU all-reduce per backend (shm, gloo) at the message sizes a step uses
  (2 ranks, median of many calls, spawned processes);
- decode step at batch 16 on a random Llama of ~0.4B parameters (hidden 1,024, 16 query heads,
  8 KV heads, 24 layers): TP=1 with two threads against TP=2 with one thread a rank
  (`decode_step_ratio_tp2_b16`), the share of TP=2's step spent in all-reduces (rank 0's wait
  for the slowest rank included: `allreduce_share_b16`), and the lm_head held whole on rank 0
  against split by vocabulary;
- step times at TP 1 / 2 / 4 (and TP 3 on SmolLM2's shape, 9 query heads over 3 KV heads);
- `greedy_mismatches`: float32 greedy tokens of every TP size and every (t_p, t_d) handoff
  pair against TP=1 colocated (and TP=1 against transformers' generate());
- `handoffs`: a 2,048-token prompt prefilled at t_p and handed to t_d rank to rank, for every
  pair among 1, 2 and 4: bytes moved, bytes D's ranks lacked, seconds;
- `rank_kill`: a rank killed while its worker decodes: the step fails (CommError), the running
  requests are aborted (their blocks freed) and run again on another engine; leaked blocks and
  token mismatches counted.

Every figure names the CPU (`cpu_model`); step medians over `repeats` runs.
"""

from __future__ import annotations

import os
import signal
import statistics
import time

import torch

from workers.device import cpu_model_name
from workers.engine import LLMEngine
from workers.engine_config import EngineConfig
from workers.request import SamplingParams

BIG = "random:llama-0.4b"
# the handoffs' model: 8 KV heads split at every TP size, small enough that one process holds
# rank 0 of seven engines (the 0.4B shape's seven did not fit 24 GiB beside their ranks)
HANDOFF_MODEL = "random:llama-test-kv8"
GREEDY_CASES = [("random:llama-test-kv8", (2, 4)), ("random:llama-test", (4,)),
                ("random:smollm2-135m", (3,))]
HANDOFF_PAIRS = [(tp, td) for tp in (1, 2, 4) for td in (1, 2, 4)]


def _engine(model: str, tp: int, threads: int, num_blocks: int, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype="float32", tp=tp, num_threads=threads,
                                  num_blocks=num_blocks, max_num_seqs=64), **kw)


def decode_step_ms(engine: LLMEngine, batch: int, prompt_len: int,
                   steps: int) -> tuple[float, float | None]:
    """Median wall time of a pure decode step at `batch` (prompts prefilled first), and for a
    TP engine the share of the timed decode steps' wall time rank 0 spent in all-reduces
    (waiting for the slower rank included; prefill steps left out of both)."""
    sp = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 900 + 3 for j in range(prompt_len)], sp)
    while any(r.is_prefill for r in engine.requests.values()):
        engine.step()
    shard = engine.runner.tp
    times, reduce_s = [], []
    for _ in range(steps):
        before = shard.allreduce_s if shard is not None else 0.0
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        reduce_s.append((shard.allreduce_s if shard is not None else 0.0) - before)
    while engine.has_unfinished():
        engine.step()
    engine.reset_prefix_cache()
    share = sum(reduce_s[2:]) / sum(times[2:]) if shard is not None else None
    return statistics.median(times[2:]) * 1e3, share


def step_figures(quick: bool, repeats: int) -> dict:
    steps = 8 if quick else 20
    out: dict = {"model": BIG, "batch": 16, "prompt_len": 128, "steps": steps}
    ms = {"tp1_2threads": [], "tp2_1thread": [], "tp2_1thread_vocab_lm_head": []}
    shares = []
    for _ in range(repeats):   # interleaved: drift hits both sides alike
        for key, tp, threads, lm in (("tp1_2threads", 1, 2, None),
                                     ("tp2_1thread", 2, 1, "rank0"),
                                     ("tp2_1thread_vocab_lm_head", 2, 1, "vocab")):
            e = _engine(BIG, tp, threads, 256, tp_lm_head=lm)
            try:
                decode_step_ms(e, 16, 128, 3)     # warm-up
                step, share = decode_step_ms(e, 16, 128, steps)
                ms[key].append(step)
                if key == "tp2_1thread":
                    shares.append(share)
            finally:
                e.close()
    med = {k: round(statistics.median(v), 3) for k, v in ms.items()}
    out["decode_step_ms_b16"] = med
    out["decode_step_ms_b16_runs"] = {k: [round(x, 3) for x in v] for k, v in ms.items()}
    out["decode_step_ratio_tp2_b16"] = round(med["tp2_1thread"] / med["tp1_2threads"], 3)
    out["allreduce_share_b16"] = round(statistics.median(shares), 3) if shares else None
    out["lm_head_vocab_over_rank0"] = round(med["tp2_1thread_vocab_lm_head"]
                                            / med["tp2_1thread"], 3)
    return out


def tp_sizes_figures(quick: bool) -> dict:
    """Decode step (batch 16) and a 512-token prefill step at each TP size, 1 thread a rank
    (TP 4 on 2 cores is oversubscribed: measured, not a target)."""
    rows = []
    for model, sizes in ((BIG, (1, 2, 4)), ("random:smollm2-135m", (1, 3))):
        for tp in sizes:
            e = _engine(model, tp, 1, 256)
            try:
                step = decode_step_ms(e, 16, 128, 6 if quick else 12)[0]
                t0 = time.perf_counter()
                e.generate([[5 + i % 800 for i in range(512)]],
                           SamplingParams(max_tokens=1, ignore_eos=True))
                prefill = (time.perf_counter() - t0) * 1e3
                rows.append({"model": model, "tp": tp, "decode_step_ms_b16": round(step, 3),
                             "prefill_512_ms": round(prefill, 1),
                             "oversubscribed": tp > (os.cpu_count() or 1)})
            finally:
                e.close()
    return {"rows": rows}


def _tokens(engine: LLMEngine, prompts, n: int) -> list[list[int]]:
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [r.output_token_ids for r in engine.generate(prompts, sp)]


def _hf_tokens(model: str, prompts, n: int) -> list[list[int]]:
    from workers.random_model import build_random
    stock = build_random(model, "float32", torch.device("cpu"))[0]
    out = []
    with torch.inference_mode():
        for p in prompts:
            g = stock.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                                                           dtype=torch.long),
                               max_new_tokens=n, do_sample=False, pad_token_id=0)
            out.append(g[0, len(p):].tolist())
    return out


def greedy_mismatches() -> dict:
    prompts = [list(range(3, 40)), [9, 8, 7, 6, 5, 4, 3, 200, 201], list(range(100, 190))]
    n = 8
    rows, mismatches = [], 0
    for model, sizes in GREEDY_CASES:
        one = _engine(model, 1, 2, 64)
        try:
            ref = _tokens(one, prompts, n)
        finally:
            one.close()
        bad = sum(a != b for a, b in zip(ref, _hf_tokens(model, prompts, n), strict=True))
        rows.append({"model": model, "tp": 1, "against": "generate", "mismatches": bad})
        mismatches += bad
        for tp in sizes:
            e = _engine(model, tp, 1, 64)
            try:
                bad = sum(a != b for a, b in zip(ref, _tokens(e, prompts, n), strict=True))
            finally:
                e.close()
            rows.append({"model": model, "tp": tp, "against": "tp1", "mismatches": bad})
            mismatches += bad
    return {"greedy_mismatches": mismatches, "rows": rows}


def handoff_figures(quick: bool) -> dict:
    """A 2,048-token prompt (--quick: 512) prefilled at t_p, handed to t_d rank to rank, decoded
    there: tokens against TP=1 colocated, bytes against what D's ranks lack."""
    from workers.tp_handoff import disagg_generate
    n_tokens = 512 if quick else 2048
    prompt = [(13 * i) % 1000 + 3 for i in range(n_tokens)]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    blocks = n_tokens // 16 + 8
    ref_engine = _engine(HANDOFF_MODEL, 1, 2, blocks)
    try:
        ref = _tokens(ref_engine, [prompt], 4)[0]
    finally:
        ref_engine.close()
    rows, mismatches = [], 0
    ps = {tp: _engine(HANDOFF_MODEL, tp, 1, blocks) for tp in (1, 2, 4)}
    try:
        for t_d in (1, 2, 4):
            d = _engine(HANDOFF_MODEL, t_d, 1, blocks)
            try:
                for t_p in (1, 2, 4):
                    d.reset_prefix_cache()
                    out = disagg_generate(ps[t_p], d, prompt, sp, f"bench{t_p}{t_d}")
                    bad = out.output_token_ids != ref
                    mismatches += bad
                    rows.append({"t_p": t_p, "t_d": t_d, "bytes": out.handoff.nbytes,
                                 "bytes_lacked": out.bytes_lacked,
                                 "seconds": round(out.handoff.seconds, 4),
                                 "shards": out.handoff.shards, "tokens_match": not bad})
            finally:
                d.close()
    finally:
        for e in ps.values():
            e.close()
    return {"prompt_tokens": n_tokens, "model": HANDOFF_MODEL, "handoffs": rows,
            "handoff_mismatches": mismatches}


def rank_kill_figures() -> dict:
    """A rank SIGKILLed while its TP=2 worker decodes 4 requests."""
    from workers.kernels.tp_comm import CommError
    model = "random:llama-test-kv8"
    prompts = [list(range(3 + i, 40 + i)) for i in range(4)]
    n = 12
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    other = _engine(model, 1, 1, 64)
    try:
        ref = _tokens(other, prompts, n)
        e = _engine(model, 2, 1, 64)
        failed, aborted = False, []
        try:
            reqs = [e.add_request(p, sp) for p in prompts]
            for _ in range(3):
                e.step()
            os.kill(e.tp_group.ranks[0].pid, signal.SIGKILL)
            try:
                while e.has_unfinished():
                    e.step()
            except CommError:
                failed = True
                aborted = e.abort_running()
                for r in list(e.requests):
                    e.abort(r)
            leaked = e.kv.pool.num_used_blocks
            e.check_invariants()
        finally:
            e.close()
        again = _tokens(other, [r.prompt_token_ids for r in reqs], n)  # retried elsewhere
        bad = sum(a != b for a, b in zip(ref, again, strict=True))
    finally:
        other.close()
    return {"step_failed": failed, "requests_aborted": len(aborted),
            "completed_elsewhere": len(again), "mismatches": bad, "leaked_blocks": leaked}


def allreduce_figures(quick: bool) -> dict:
    from workers.kernels.tp_comm import measure_allreduce_us
    # a decode step's messages: batch 1 and 16 of SmolLM2 (576) and of the 0.4B shape (1,024),
    # fp32; the 36 KiB; a 512-token prefill chunk of the 0.4B shape (2 MiB)
    sizes = [576 * 4, 16 * 576 * 4, 36 * 1024, 16 * 1024 * 4, 512 * 1024 * 4]
    iters = 200 if quick else 1000
    out = {}
    for backend in ("shm", "gloo"):
        us = measure_allreduce_us(2, sizes, torch.float32, backend,
                                  iters if backend == "shm" else iters // 5)
        out[backend] = {str(k): round(v, 2) for k, v in us.items()}
    out["shm_bf16"] = {str(k): round(v, 2) for k, v in measure_allreduce_us(
        2, sizes, torch.bfloat16, "shm", iters).items()}
    return out


def run_bench_tp(quick: bool = False, repeats: int = 3, parts: tuple[str, ...] = ()) -> dict:
    parts = parts or ("allreduce", "steps", "sizes", "greedy", "handoffs", "rank_kill")
    result: dict = {"cpu_model": cpu_model_name(), "cpus": os.cpu_count(), "dtype": "float32",
                    "label": "cpu-measured", "quick": quick}
    t0 = time.perf_counter()
    if "allreduce" in parts:
        result["allreduce_us"] = allreduce_figures(quick)
    if "steps" in parts:
        result.update(step_figures(quick, 1 if quick else repeats))
    if "sizes" in parts:
        result["step_times"] = tp_sizes_figures(quick)
    if "greedy" in parts:
        g = greedy_mismatches()
        result["greedy_rows"] = g["rows"]
        result["greedy_mismatches"] = g["greedy_mismatches"]
    if "handoffs" in parts:
        h = handoff_figures(quick)
        result["handoffs"] = h["handoffs"]
        result["handoff_prompt_tokens"] = h["prompt_tokens"]
        result["handoff_model"] = h["model"]
        result["greedy_mismatches"] = result.get("greedy_mismatches", 0) \
            + h["handoff_mismatches"]
    if "rank_kill" in parts:
        k = rank_kill_figures()
        result["rank_kill"] = k
        result["leaked_blocks"] = k["leaked_blocks"]
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result
