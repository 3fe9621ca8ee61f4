"""`raypd bench engine`: the paged engine and stock transformers `generate()`, side by side.

Same weights, dtype and threads, one process, one after the other, on the same inputs; both
warmed up; every figure is the median of `repeats` runs. Fairness rules:
- decode: `generate()` time for `new` tokens minus its time for 1 token (its prefill), against
  the engine's window from the step where every request has its first token to the end,
  counting only the tokens decoded inside that window;
- mixed: the same batches on both sides (requests sorted by prompt length and cut in two, as a
  careful user forms `generate()`'s static batches, so it pays little padding; the engine runs
  each batch to its end before the next), every request stopping at its own length
  (`generate()` gets a per-request stopping criterion);
- prefix: TTFT of a request whose 1,024-token prefix is cached against the same request cold;
- lora (`--lora N`): N random rank-8 adapters on every projection, made by the bench; one batch
  with requests spread round-robin over the base model and the adapters against the same batch
  on an engine without adapters (`lora_throughput_ratio` = base-only time / mixed time);
- step overhead: step time minus the model's forward at batch 8, the median of `repeats` runs;
- prefill attention: the native kernel against SDPA on one layer's heads at the prefill lengths
  (raypd/bench/prefill_attention.py: same dtype, shapes and threads, each in its best layout,
  interleaved, outputs checked against each other).
Physical scale: `decode_bound_ms` is what reading the weights and the batch's KV once at the
memory read ceiling takes; `decode_compute_bound_ms` the step's arithmetic at
`matmul_peak_gflops` and `decode_roofline_ms` the larger of the two (the step's floor). Both
ceilings are the best sample the machine gave (`memory_read_gbps`, the mean of its samples
beside it; on a GPU its maker's figure too), so neither flatters what is set against it.
`prefill_gflops` (the arithmetic the engine computes: lm_head on the sampled row alone) is set
against `matmul_peak_gflops`, the engine's own linear at a large shape.

`--device` runs both sides on that device (generate() gets the stock model moved there). A
random-weight model of a real shape (`--model random:llama3-8b`) has no answers to compare:
it gets the engine's own figures only (`run_shape_bench`): prefill tok/s at 2,048 tokens,
decode tok/s at batch 1/16/64 against the weights-read bound at the device's read ceiling.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from kvcache.manager import cdiv
from raypd.bench.spec_bandwidth import spec_read_gbps
from workers.device import resolve_device, synchronize
from workers.engine import EngineConfig, LLMEngine
from workers.kernels.bindings import SIGNATURES
from workers.layers import Linear
from workers.model_loader import ModelInfo
from workers.random_model import is_random
from workers.request import SamplingParams
from workers.sampler import sample


class _StopAtOwnLength(StoppingCriteria):
    """generate(): row i is done once it has `lengths[i]` new tokens."""

    def __init__(self, prompt_width: int, lengths: list[int]) -> None:
        self.width = prompt_width
        self.lengths = torch.tensor(lengths)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.width) >= self.lengths.to(input_ids.device)


def _hf_generate(model, batch: list[list[int]], lengths: list[int], pad_id: int) -> float:
    """Seconds for `generate()` on a left-padded static batch, row i stopping at lengths[i]."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                        device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lengths),
                       do_sample=False, pad_token_id=pad_id,
                       stopping_criteria=StoppingCriteriaList([_StopAtOwnLength(width, lengths)]))
    synchronize(model.device)
    return time.perf_counter() - t0


def _engine_run(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]
                ) -> tuple[float, float, int, list[float]]:
    """(wall s, decode-window s, tokens decoded inside the window, step seconds of the window's
    steps) for one batch. The window opens at the first step after which every request has its
    first token."""
    t0 = time.perf_counter()
    reqs = [engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
            for p, m in zip(prompts, max_tokens, strict=True)]
    t_open, tokens_at_open, steps = None, 0, []
    while engine.has_unfinished():
        s0 = time.perf_counter()
        engine.step()
        s1 = time.perf_counter()
        if t_open is not None:
            steps.append(s1 - s0)
        elif all(r.first_token_time for r in reqs):
            t_open, tokens_at_open = s1, sum(len(r.output_token_ids) for r in reqs)
    t1 = time.perf_counter()
    decoded = sum(len(r.output_token_ids) for r in reqs) - tokens_at_open
    return t1 - t0, t1 - (t_open or t1), decoded, steps


def _median(f, repeats: int) -> float:
    return statistics.median(f() for _ in range(repeats))


class _TimedKernels:
    """The native kernels' library (workers/kernels/bindings.py) with every call timed (the bench
    swaps it in for `bindings.library` while it counts; attributes that are not calls pass
    through)."""

    # every entry point (decode_layers_*: every layer's kernels in one call,
    # workers/kernels/csrc/decode_layers.cpp; what runs between them there is a copy of the
    # query rows)
    CALLS = frozenset(SIGNATURES)

    def __init__(self, lib) -> None:
        self._lib, self.seconds = lib, 0.0

    def _timed(self, f):
        def call(*args):
            t0 = time.perf_counter()
            try:
                return f(*args)
            finally:
                self.seconds += time.perf_counter() - t0
        return call

    def __getattr__(self, name: str):
        f = getattr(self._lib, name)
        return self._timed(f) if name in self.CALLS else f


def _python_overhead_ms(engine: LLMEngine, prompts: list[list[int]], steps: int = 12) -> dict:
    """Decode steps of `prompts` (all prefilled first): the median step time (plain steps),
    then over steps run with both instruments on, their time, the time inside kernels per step
    (torch's operators by the profiler's self time, which excludes Python; the native kernels
    timed around each ctypes call), and the rest of those same steps: `python_overhead_ms`
    (scheduling, block tables, metadata, sampling bookkeeping, the interpreter between ops)."""
    from torch.profiler import ProfilerActivity, profile

    from workers.kernels import bindings
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=2 * steps + 2, ignore_eos=True))
    while engine.scheduler.waiting or any(r.is_prefill for r in engine.scheduler.running):
        engine.step()
    plain = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - t0)
    library = bindings.library
    lib = library()
    timed = _TimedKernels(lib) if lib is not None else None
    if timed is not None:
        bindings.library = lambda: timed
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            timed_step_ms = (time.perf_counter() - t0) * 1e3 / steps
    finally:
        bindings.library = library
    while engine.has_unfinished():
        engine.step()
    torch_ms = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3 / steps
    native_ms = (timed.seconds if timed else 0.0) * 1e3 / steps
    # the rest of the same (instrumented) steps: the plain steps' median is not the time the
    # kernels were counted in (on a noisy machine the difference even came out negative)
    return {"step_ms": 1e3 * statistics.median(plain), "timed_step_ms": timed_step_ms,
            "torch_ops_ms": torch_ms, "native_kernels_ms": native_ms,
            "python_overhead_ms": timed_step_ms - torch_ms - native_ms}


def _decode_weight_bytes(engine: LLMEngine) -> int:
    """The weight bytes a decode step streams: every linear's weight (lm_head included) and
    bias as the step reads them, a linear that a float32 model holds as bf16
    (workers/kernels/csrc/linear_w16.cpp) at 2 bytes a value, not the 4 of float32 bytes it
    never reads.
    Not the input embedding, of which a step gathers one row a token (unless lm_head is that
    matrix: tied, counted once as lm_head), nor the norms' few kB a layer. Counted on the model
    the step runs: the stock model's parameters are no count of it, since the runner frees the
    stock copies of what the compact model fuses (8B of Llama-3-8B's 16 GB went uncounted)."""
    compact = engine.runner.compact
    if compact is None:
        model = engine.model
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                    if "norm" in n)
        untied = 0 if emb.data_ptr() == head.data_ptr() else emb.numel() * emb.element_size()
        return sum(p.numel() * p.element_size() for p in model.parameters()) - untied - norms
    total = 0
    for m in compact.modules():
        if isinstance(m, Linear):
            held = m.weight if m.weight is not None else m.packed   # one of them is kept
            per_value = 2 if m.w16 is not None else held.element_size()
            total += m.out_features * m.in_features * per_value
            total += 0 if m.bias is None else m.bias.numel() * m.bias.element_size()
    return total


def _sample_ms(engine: LLMEngine, batch: int, repeats: int) -> float:
    """The sampler's time for one decode step of `batch` requests at temperature 1.0 (what an
    OpenAI client that sets no temperature gets), each seeded, on logits of the model's vocab."""
    logits = torch.randn(batch, engine.info.vocab_size, generator=torch.Generator().manual_seed(0)
                         ).to(engine.device, engine.runner.model.dtype) * 4
    reqs = [engine.inputs.make_request([1, 2, 3], SamplingParams(temperature=1.0, seed=i))
            for i in range(batch)]
    sample(logits, reqs)            # warm-up

    def once() -> float:
        t = time.perf_counter()
        sample(logits, reqs)
        return time.perf_counter() - t
    return 1e3 * statistics.median(once() for _ in range(max(repeats, 5)))


CPU = torch.device("cpu")


def _memory_read_samples(device: torch.device = CPU, n: int = 5) -> list[float]:
    """GB/s read by a large sum (well beyond any cache; 2 GiB on a GPU), `n` samples after one
    warm-up."""
    x = torch.ones((2048 if device.type == "cuda" else 256) * 2**20 // 4, device=device)
    x.sum()
    synchronize(device)

    def once() -> float:
        t0 = time.perf_counter()
        x.sum()
        synchronize(device)
        return x.numel() * 4 / (time.perf_counter() - t0) / 1e9
    return [once() for _ in range(n)]


def _read_ceiling(samples: list[float], device: torch.device, name: str) -> dict:
    """The read-bandwidth ceiling as the matmul ceiling is taken: the best sample
    (`memory_read_gbps`), the mean beside it; on a GPU its maker's figure beside both (None for
    a name not in raypd/bench/spec_bandwidth.py). A ceiling is what the machine did at its
    best: a mean or median of a drifting VM's samples is a lower ceiling, and a lower bound
    flatters `decode_step / decode_bound`."""
    best = max(samples)
    spec = spec_read_gbps(name, device.type)
    out = {"memory_read_gbps": best, "memory_read_gbps_mean": statistics.fmean(samples),
           "memory_read_gbps_samples": samples}
    if device.type == "cuda":
        out.update(memory_read_spec_gbps=spec,
                   memory_read_vs_spec=None if spec is None else best / spec)
    return out


def _attn_decode_gbps(engine: LLMEngine, batch: int, context: int, repeats: int = 5) -> dict:
    """The decode attention kernel alone on the engine's own pool, as a decode step runs it:
    every layer in turn (each layer's KV cold when its turn comes, as in a step: measured on
    layer 0 alone, its 7 MB stayed in cache and read twice as fast), `batch` sequences of
    `context` tokens in scattered blocks; KV bytes read (K and V of every context token once,
    every layer) per second, median of `repeats` passes after one warm-up. None where the
    attention is not the native kernel (a GPU, a quantized pool)."""
    from workers import kernels
    pool = engine.runner.kv_cache
    k_cache, v_cache = pool[0]
    if k_cache.device.type != "cpu" or k_cache.dtype not in kernels.DTYPE_CODES:
        return {"attn_decode_gbps": None}
    num_blocks, bs, n_kv, head_dim = k_cache.shape
    width = cdiv(context, bs)
    if batch * width > num_blocks:
        return {"attn_decode_gbps": None}
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks, generator=g)[:batch * width].view(batch, width)
    lens = torch.full((batch,), context, dtype=torch.int64)
    heads = engine.info.num_heads
    q = torch.randn(batch, heads, head_dim, generator=g).to(k_cache.dtype)
    if kernels.paged_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, None) is None:
        return {"attn_decode_gbps": None}

    def every_layer() -> float:
        t0 = time.perf_counter()
        for k, v in pool:
            kernels.paged_decode(q, k, v, tables, lens, head_dim ** -0.5, None)
        return time.perf_counter() - t0
    every_layer()
    per_layer = statistics.median(every_layer() for _ in range(repeats)) / len(pool)
    read = 2 * batch * context * n_kv * head_dim * k_cache.element_size()
    return {"attn_decode_gbps": read / per_layer / 1e9,
            "attn_decode_ms_per_layer": 1e3 * per_layer,
            "attn_decode_shape": {"batch": batch, "context": context, "layers": len(pool),
                                  "threads": torch.get_num_threads()},
            "attention_kernel": engine.runner.attention_kernel}


def _matmul_peak_gflops(dtype: torch.dtype, device: torch.device = CPU) -> float:
    """The engine's Linear on a 2048 x 2048 x 2048 product in `dtype` (8192 on a GPU), the best
    of 9: a ceiling is what the machine did at its best (on a shared 2-core VM the median of 5
    read 1,094 in one run and 1,651 in the next: a low ceiling flattered `prefill_gflops`)."""
    n = 8192 if device.type == "cuda" else 2048
    w = torch.randn(n, n, device=device).to(dtype)
    x = torch.randn(n, n, device=device).to(dtype)
    lin = Linear(w)
    with torch.inference_mode():
        lin(x)
        synchronize(device)

        def once() -> float:
            t0 = time.perf_counter()
            lin(x)
            synchronize(device)
            return 2 * n**3 / (time.perf_counter() - t0) / 1e9
        return max(once() for _ in range(9))


@dataclass(frozen=True)
class PrefillFlops:
    """The arithmetic of one cold prefill, as the engine computes it: every layer's linears on
    every token, lm_head on the sampled rows only (a prompt's last row: ModelRunner._forward
    runs the head on `sample_rows` alone), causal attention (QK^T and PV over the n(n+1)/2
    visible pairs of every head of every layer)."""

    linear: int
    attention: int

    @property
    def total(self) -> int:
        return self.linear + self.attention


def prefill_flops(model, info: ModelInfo, tokens: int, sampled_rows: int = 1) -> PrefillFlops:
    """`PrefillFlops` of `tokens` prompt tokens of which `sampled_rows` reach lm_head. Not the
    input embedding (a gather), nor the norms, rotary and activations (elementwise)."""
    assert 0 <= sampled_rows <= tokens
    layer_matrices = sum(p.numel() for name, p in model.named_parameters()
                         if ".layers." in name and p.dim() == 2)
    head = model.get_output_embeddings().weight.numel()
    pairs = tokens * (tokens + 1) // 2
    return PrefillFlops(linear=2 * layer_matrices * tokens + 2 * head * sampled_rows,
                        attention=4 * info.num_layers * info.num_heads * info.head_dim * pairs)


def _step_overhead(engine: LLMEngine, batch: list[list[int]], new: int, repeats: int) -> dict:
    """Decode steps of `batch` (prefilled first), `repeats` runs: each run's median of step
    time minus the model's forward (`runner.last_forward_s`); `step_overhead_ms` their median,
    the runs' figures beside it."""
    assert repeats >= 1
    runs = []
    for _ in range(repeats):
        for p in batch:
            engine.add_request(p, SamplingParams(max_tokens=new, ignore_eos=True))
        while engine.scheduler.waiting or any(r.is_prefill for r in engine.scheduler.running):
            engine.step()
        overheads = []
        while engine.has_unfinished():
            s0 = time.perf_counter()
            engine.step()
            overheads.append(time.perf_counter() - s0 - engine.runner.last_forward_s)
        runs.append(1e3 * statistics.median(overheads))
    return {"step_overhead_ms": statistics.median(runs), "step_overhead_ms_runs": runs,
            "step_overhead_batch": len(batch)}


def _mixed_comparison(hf_model, engine: LLMEngine, mixed: list[tuple[list[int], int]],
                      batch_size: int, pad: int, repeats: int) -> dict:
    """`generate()` and the engine on the same batches: `mixed` (prompt, output length) sorted
    by prompt length and cut into batches of `batch_size` (a careful user's static batches,
    little padding), run one after another on each side, every request stopping at its own
    length. The engine gets each batch as a whole and runs it to its end before the next, so
    both sides hold the same requests at once; it still skips a finished row's work, which
    `generate()` pads. `throughput_ratio_mixed` = generate()'s seconds / the engine's."""
    by_len = sorted(mixed, key=lambda m: len(m[0]))
    batches = [by_len[i:i + batch_size] for i in range(0, len(by_len), batch_size)]

    def hf_all() -> float:
        return sum(_hf_generate(hf_model, [p for p, _ in b], [o for _, o in b], pad)
                   for b in batches)

    def engine_all() -> float:
        return sum(_engine_run(engine, [p for p, _ in b], [o for _, o in b])[0] for b in batches)
    t_hf, t_eng = _median(hf_all, repeats), _median(engine_all, repeats)
    return {"hf_mixed_s": t_hf, "engine_mixed_s": t_eng, "throughput_ratio_mixed": t_hf / t_eng,
            "mixed_batches": [len(b) for b in batches],
            "mixed_output_tokens": sum(o for _, o in mixed)}


def _prefill_attention(info: ModelInfo, dtype: torch.dtype, device: torch.device,
                       lengths: tuple[int, ...], repeats: int) -> dict:
    """raypd's native prefill attention against torch's SDPA on one layer of this model's heads
    (raypd/bench/prefill_attention.py), in the model's dtype and, beside it, float32 (the other
    kernel); `prefill_attention_speedup` = SDPA's median / the kernel's, by prompt length, in
    the model's dtype (None where the kernel does not apply or disagrees with SDPA). The
    native kernels are CPU kernels: on a GPU both are None."""
    from raypd.bench.prefill_attention import AttentionShape, run_prefill_attention_bench
    if device.type != "cpu":
        return {"prefill_attention": None, "prefill_attention_speedup": None}
    shape = AttentionShape(info.num_heads, info.num_kv_heads, info.head_dim)
    dtypes = tuple(dict.fromkeys((dtype, torch.float32)))
    result = run_prefill_attention_bench(shape, dtypes, lengths, repeats)
    own = result[str(dtype).removeprefix("torch.")]
    return {"prefill_attention": result,
            "prefill_attention_speedup": {n: r["speedup_median"] for n, r in own.items()}}


def _lora_bench(model: str, dtype: str, loaded, prompts: list[list[int]], outputs: list[int],
                num_loras: int, repeats: int) -> dict:
    """The same batch on an engine without adapters and, spread over the base model and
    `num_loras` adapters, on an engine serving them (all resident: max_loras = num_loras)."""
    import tempfile

    from workers.lora import write_random_adapter
    rank = 8
    num_blocks = sum(cdiv(len(p) + o, 16) for p, o in zip(prompts, outputs, strict=True)) + 64
    with tempfile.TemporaryDirectory(prefix="raypd-bench-lora-") as tmp:
        adapters = {f"lora{i}": str(write_random_adapter(f"{tmp}/lora{i}", loaded[0].config,
                                                         rank=rank, seed=i))
                    for i in range(num_loras)}
        engines = {
            "base": LLMEngine(EngineConfig(model=model, dtype=dtype, num_blocks=num_blocks,
                                           enable_prefix_caching=False), loaded=loaded),
            "lora": LLMEngine(EngineConfig(model=model, dtype=dtype, num_blocks=num_blocks,
                                           enable_prefix_caching=False, lora_adapters=adapters,
                                           max_loras=num_loras), loaded=loaded)}
        names = ["", *adapters]
        spread = [names[i % len(names)] for i in range(len(prompts))]

        def run(kind: str) -> float:
            engine = engines[kind]
            t0 = time.perf_counter()
            for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
                engine.add_request(p, SamplingParams(max_tokens=o, ignore_eos=True),
                                   lora_id=spread[i] if kind == "lora" else "")
            while engine.has_unfinished():
                engine.step()
            return time.perf_counter() - t0
        run("base")
        run("lora")   # warm-up; loads every adapter once
        t_lora, t_base = [], []
        for _ in range(repeats):   # interleaved, so drifts of the machine hit both
            t_base.append(run("base"))
            t_lora.append(run("lora"))
        stats = engines["lora"].get_stats()
        for e in engines.values():
            e.check_invariants()
    base_s, lora_s = statistics.median(t_base), statistics.median(t_lora)
    return {"lora_adapters": num_loras, "lora_rank": rank, "lora_batch": len(prompts),
            "lora_base_only_s": base_s, "lora_mixed_s": lora_s,
            "lora_throughput_ratio": base_s / lora_s,
            "lora_output_tokens": sum(outputs), "lora_loads": stats["lora_loads"],
            "lora_load_s_mean": stats["lora_load_s_mean"]}


def run_shape_bench(model: str, dtype: str = "auto", device: str = "auto",
                    cuda_graphs: bool = True, repeats: int = 3, quick: bool = False,
                    prefill_tokens: int = 2048, decode_batches: tuple[int, ...] = (1, 16, 64),
                    decode_prompt: int = 512, decode_new: int = 64) -> dict:
    """The engine's own figures on a random-weight model of a real shape (see the module doc):
    `prefill_tok_s`, `engine_decode_tok_s_b{B}`, `decode_bound_tok_s_b{B}` (B tokens per
    weights + KV read at `memory_read_gbps`) and their ratio `decode_vs_bound_b{B}`."""
    if quick:
        prefill_tokens, decode_batches, decode_prompt, decode_new = 256, (1, 4), 64, 8
    bs = 16
    need = max(decode_batches) * cdiv(decode_prompt + decode_new + 1, bs) \
        + cdiv(prefill_tokens + 2, bs) + 16
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, device=device,
                                    cuda_graphs=cuda_graphs, num_blocks=need, block_size=bs,
                                    max_num_batched_tokens=max(2048, prefill_tokens),
                                    max_num_seqs=max(decode_batches),
                                    enable_prefix_caching=False))
    dev = engine.device
    rng = random.Random(0)
    vocab = engine.info.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]
    stats = engine.get_stats()
    out: dict = {"model": model, "quick": quick, "dtype": engine.info.dtype,
                 "kv_dtype": engine.kv_dtype, "repeats": repeats, "device": stats["device"],
                 "device_name": stats["device_name"], "cuda_graphs": stats["cuda_graphs"],
                 "model_impl": stats["model_impl"], "linear_kernel": stats["linear_kernel"],
                 "attention_kernel": stats["attention_kernel"], "fused_ops": stats["fused_ops"],
                 "evidence": "gpu-measured" if dev.type == "cuda" else "cpu-measured"}
    _engine_run(engine, [prompt(64) for _ in range(2)], [4, 4])   # warm-up
    weight_bytes = _decode_weight_bytes(engine)
    out.update(weight_bytes=weight_bytes,
               **_read_ceiling(_memory_read_samples(dev), dev, stats["device_name"]))
    read_gbps = out["memory_read_gbps"]
    p = prompt(prefill_tokens)

    def prefill_once() -> float:
        t0 = time.perf_counter()
        _engine_run(engine, [p], [1])
        return time.perf_counter() - t0
    prefill_once()
    out["prefill_tokens"] = prefill_tokens
    out["prefill_tok_s"] = {str(prefill_tokens): prefill_tokens / _median(prefill_once, repeats)}
    for b in decode_batches:
        batch = [prompt(decode_prompt) for _ in range(b)]
        _engine_run(engine, batch, [4] * b)   # captures this batch's graphs, if any
        runs = [_engine_run(engine, batch, [decode_new] * b) for _ in range(repeats)]
        tok_s = statistics.median(n / max(t, 1e-9) for _, t, n, _ in runs)
        kv_bytes = b * (decode_prompt + decode_new / 2) * engine.kv_bytes_per_token
        bound_s = (weight_bytes + kv_bytes) / (read_gbps * 1e9)
        out[f"engine_decode_tok_s_b{b}"] = tok_s
        out[f"decode_step_ms_b{b}"] = 1e3 * statistics.median(
            s for *_, steps in runs for s in steps)
        out[f"decode_bound_ms_b{b}"] = 1e3 * bound_s
        out[f"decode_bound_tok_s_b{b}"] = b / bound_s
        out[f"decode_vs_bound_b{b}"] = tok_s / (b / bound_s)
    out.update(_attn_decode_gbps(engine, min(16, max(decode_batches)),
                                 decode_prompt + decode_new // 2))
    out["cuda_graph_replays"] = engine.get_stats()["cuda_graph_replays"]
    engine.check_invariants()
    return out


def run_engine_bench(model: str = "smollm2", quick: bool = False,
                     threads: int | None = None, dtype: str = "auto",
                     repeats: int = 3, lora: int = 0, lora_only: bool = False,
                     device: str = "auto", cuda_graphs: bool = True,
                     attention_only: bool = False) -> dict:
    """Every figure; `lora` > 0 adds the multi-LoRA comparison (`lora_only`: just that);
    `attention_only`: just the kernel-vs-SDPA prefill attention (`_prefill_attention`).
    A `random:<shape>` model gets `run_shape_bench` (no reference to compare with)."""
    from workers.device import cpu_model_name, load_dtype
    from workers.model_loader import load_model
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if threads:
        torch.set_num_threads(threads)
    if is_random(model):
        return run_shape_bench(model, dtype, device, cuda_graphs, repeats, quick)
    dev = resolve_device(device)
    hf_model, tok, info = load_model(model, load_dtype(dtype, model, dev))
    prefill_lens = (512,) if quick else (512, 2048)
    if attention_only:
        return {"model": model, "quick": quick, "threads": torch.get_num_threads(),
                "dtype": info.dtype, "repeats": repeats, "device": dev.type,
                "cpu_model": cpu_model_name(),
                **_prefill_attention(info, hf_model.dtype, dev, prefill_lens, repeats)}
    loaded = (copy.deepcopy(hf_model), tok, info)   # the engine builds its own copy anyway
    hf_model.to(dev)                                # generate() on the engine's device
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    rng = random.Random(0)
    vocab = min(info.vocab_size, 30000)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    if lora:
        n, (lo_p, hi_p), (lo_o, hi_o) = (16, (32, 256), (8, 32)) if quick \
            else (32, (64, 512), (16, 64))
        lora_out = _lora_bench(model, dtype, loaded,
                               [prompt(rng.randint(lo_p, hi_p)) for _ in range(n)],
                               [rng.randint(lo_o, hi_o) for _ in range(n)], lora, repeats)
        if lora_only:
            return {"model": model, "quick": quick, "threads": torch.get_num_threads(),
                    "dtype": info.dtype, "repeats": repeats, **lora_out}

    plen, new = (256, 32) if quick else (512, 64)
    mixed_batch, (lo_p, hi_p), (lo_o, hi_o) = (8, (64, 512), (8, 64)) if quick \
        else (16, (64, 1024), (16, 128))
    n_mixed = 2 * mixed_batch
    prefix_len = 512 if quick else 1024
    total_tokens = 16 * (plen + new) + hi_p * n_mixed + max(prefill_lens) + 4096
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, num_blocks=cdiv(total_tokens, 16),
                                    max_num_batched_tokens=2048, max_num_seqs=64,
                                    enable_prefix_caching=False, device=device,
                                    cuda_graphs=cuda_graphs), loaded=loaded)
    stats = engine.get_stats()
    out: dict = {"model": model, "quick": quick, "threads": torch.get_num_threads(),
                 "dtype": info.dtype, "kv_dtype": engine.kv_dtype, "repeats": repeats,
                 "model_impl": stats["model_impl"], "linear_kernel": stats["linear_kernel"],
                 "attention_kernel": stats["attention_kernel"], "fused_ops": stats["fused_ops"],
                 "device": stats["device"], "device_name": stats["device_name"],
                 "cpu_model": cpu_model_name(),
                 "evidence": "gpu-measured" if stats["device"] == "cuda" else "cpu-measured",
                 "prompt_tokens": plen, "new_tokens": new}
    # warm-up: both sides, a short batch
    warm = [prompt(64) for _ in range(4)]
    _hf_generate(hf_model, warm, [4] * 4, pad)
    _engine_run(engine, warm, [4] * 4)

    # ---- decode at batch 1 and 16 ----------------------------------------------------------
    weight_bytes = _decode_weight_bytes(engine)
    out["decode_weight_bytes"] = weight_bytes
    # the read bandwidth is sampled right before and after each figure set against it (on a
    # shared VM it moved 2x within minutes: a sum of 256 MiB read 27 GB/s, then 59 GB/s); the
    # bounds take the best of every sample of the run, as the matmul ceiling is a best-of
    reads: list[float] = []

    def read_now() -> list[float]:
        samples = _memory_read_samples(dev)
        reads.extend(samples)
        return samples
    kv_bytes: dict[int, float] = {}
    for b in (1, 16):
        batch = [prompt(plen) for _ in range(b)]
        t_full = _median(lambda batch=batch: _hf_generate(hf_model, batch, [new] * len(batch),
                                                          pad), repeats)
        t_pre = _median(lambda batch=batch: _hf_generate(hf_model, batch, [1] * len(batch), pad),
                        repeats)
        out[f"hf_decode_tok_s_b{b}"] = b * (new - 1) / max(t_full - t_pre, 1e-9)
        before = read_now()
        runs = [_engine_run(engine, batch, [new] * b) for _ in range(repeats)]
        out[f"memory_read_gbps_b{b}"] = max(before + read_now())
        out[f"engine_decode_tok_s_b{b}"] = statistics.median(
            n / max(t, 1e-9) for _, t, n, _ in runs)
        out[f"decode_step_ms_b{b}"] = 1e3 * statistics.median(
            s for *_, steps in runs for s in steps)
        kv_bytes[b] = b * (plen + new / 2) * engine.kv_bytes_per_token
    before = read_now()
    out.update(_attn_decode_gbps(engine, 16, plen + new // 2))
    out["memory_read_gbps_attn"] = max(before + read_now())
    out.update(_read_ceiling(reads, dev, stats["device_name"]))
    for b in (1, 16):
        out[f"decode_bound_ms_b{b}"] = 1e3 * (weight_bytes + kv_bytes[b]) \
            / (out["memory_read_gbps"] * 1e9)
    for b in (1, 16):   # step time minus the time inside kernels
        split = _python_overhead_ms(engine, [prompt(plen) for _ in range(b)])
        out[f"python_overhead_ms_b{b}"] = split["python_overhead_ms"]
        out[f"step_split_b{b}"] = split
    out["decode_ratio_b16"] = out["engine_decode_tok_s_b16"] / out["hf_decode_tok_s_b16"]
    out["decode_step_ms"] = out["decode_step_ms_b16"]
    out["decode_bound_ms"] = out["decode_bound_ms_b16"]

    # ---- step overhead at batch 8: step time minus the model's forward ----------------------
    out.update(_step_overhead(engine, [prompt(plen) for _ in range(8)], new, repeats))
    out["sample_ms_b16"] = _sample_ms(engine, 16, repeats)

    # ---- prefill throughput (one request of n tokens, cold) -------------------------------
    out["prefill_tok_s"], out["hf_prefill_tok_s"], out["prefill_gflops"] = {}, {}, {}
    for n in prefill_lens:
        p = prompt(n)

        def eng_once(p=p) -> float:
            t0 = time.perf_counter()
            _engine_run(engine, [p], [1])
            return time.perf_counter() - t0

        def hf_once(p=p) -> float:
            with torch.inference_mode():
                t0 = time.perf_counter()
                hf_model(torch.tensor([p], device=dev), logits_to_keep=1)
                synchronize(dev)
                return time.perf_counter() - t0
        t_eng, t_hf = _median(eng_once, repeats), _median(hf_once, repeats)
        out["prefill_tok_s"][str(n)] = n / t_eng
        out["hf_prefill_tok_s"][str(n)] = n / t_hf
        # one prompt: its last row alone goes through lm_head (ModelRunner._forward)
        out["prefill_gflops"][str(n)] = prefill_flops(hf_model, info, n, sampled_rows=1).total \
            / t_eng / 1e9
    out.update(_prefill_attention(info, hf_model.dtype, dev, prefill_lens, repeats))
    out["matmul_peak_gflops"] = _matmul_peak_gflops(hf_model.dtype, dev)
    # the arithmetic floor of the decode steps above: every row's matmuls (the head too: each
    # decode row samples) and its attention, at the matmul peak. With few cores this, not the
    # read, is the larger at batch 16; the roofline is the larger of the two
    layer_params = sum(p.numel() for name, p in hf_model.named_parameters() if ".layers." in name)
    for b in (1, 16):
        row = 2 * (layer_params + info.vocab_size * info.hidden_size) \
            + 4 * info.num_layers * info.num_heads * info.head_dim * (plen + new / 2)
        compute_ms = 1e3 * b * row / (out["matmul_peak_gflops"] * 1e9)
        out[f"decode_compute_bound_ms_b{b}"] = compute_ms
        out[f"decode_roofline_ms_b{b}"] = max(compute_ms, out[f"decode_bound_ms_b{b}"])

    # ---- mixed lengths: the same batches on both sides, each request stopping at its own -----
    mixed = [(prompt(rng.randint(lo_p, hi_p)), rng.randint(lo_o, hi_o)) for _ in range(n_mixed)]
    out.update(_mixed_comparison(hf_model, engine, mixed, mixed_batch, pad, repeats))
    engine.check_invariants()

    # ---- prefix reuse: a fresh engine with prefix caching on, same weights -------------------
    cached = LLMEngine(EngineConfig(model=model, dtype=dtype,
                                    num_blocks=(prefix_len + 256) // 16 * 4 * repeats,
                                    enable_prefix_caching=True, device=device,
                                    cuda_graphs=cuda_graphs), loaded=loaded)
    cold, hit = [], []
    for _ in range(repeats):
        shared = prompt(prefix_len)   # a new prefix each repeat: the first request is cold
        for ttft in (cold, hit):
            r = cached.add_request(shared + prompt(64), SamplingParams(max_tokens=1))
            while cached.has_unfinished():
                cached.step()
            ttft.append(r.lifecycle.ttft_s)
    cached.check_invariants()
    ttft_cold, ttft_hit = statistics.median(cold), statistics.median(hit)
    out.update(ttft_cold_s=ttft_cold, ttft_hit_s=ttft_hit, prefix_ttft_ratio=ttft_hit / ttft_cold,
               prefix_hit_tokens=r.lifecycle.cached_tokens)
    if lora:
        out.update(lora_out)
    return out


# ---- `--calibration`: the engine figures the simulator's cpu-here cost model is fitted to ----
CALIBRATION_PREFILL = (128, 512, 1024, 2048)
CALIBRATION_DECODE = ((1, 128), (1, 1024), (4, 512), (16, 128), (16, 512))
CALIBRATION_PREFILL_BATCH = ((4, 128), (2, 512), (8, 128))   # (sequences, tokens each)


def calibration_batches(step_budget: int) -> tuple[tuple[int, int], ...]:
    """The calibration's batched prefill points (sequences, tokens each) that fit one step of
    `step_budget` tokens (CALIBRATION_PREFILL_BATCH's), topped up to two with a step of 2 and
    of 4 sequences filling it (the fit needs batched steps to tell a step's size from
    attention)."""
    fit = [(b, n) for b, n in CALIBRATION_PREFILL_BATCH if b * n <= step_budget]
    for b in (2, 4):
        if len(fit) < 2 and step_budget // b >= 1 and (b, step_budget // b) not in fit:
            fit.append((b, step_budget // b))
    return tuple(fit)


def run_calibration(model: str = "smollm2", threads: int | None = None, dtype: str = "auto",
                    repeats: int = 3, device: str = "auto",
                    prefill_lens: tuple[int, ...] = CALIBRATION_PREFILL,
                    decode_points: tuple[tuple[int, int], ...] = CALIBRATION_DECODE,
                    prefill_batches: tuple[tuple[int, int], ...] | None = None,
                    decode_steps: int = 8, max_num_batched_tokens: int | None = None) -> dict:
    """The engine alone (no transformers baseline), prefix caching off, warmed up:
    `prefill_tok_s` of one cold request at each length in `prefill_lens` (chunked at
    `max_num_batched_tokens`, None: the engine's default for its device, the step budget a
    worker runs at; median of `repeats` runs),
    `prefill_batch_s`, the seconds of one step prefilling `batch` cold sequences of `tokens`
    each (median of `repeats`; None: calibration_batches of the budget), and
    `decode_step_ms_grid`, the median step time of a decode-only batch of `batch` sequences
    of `context` prompt tokens each over
    repeats x decode_steps steps (the first one left out). `raypd simulate --gpu cpu-here`
    fits its prefill and decode costs to these (raypd/sim/cost_model.py cpu_cost_model)."""
    if threads:
        torch.set_num_threads(threads)
    max_batch = max(b for b, _ in decode_points)
    need = max(max(prefill_lens) + 2, max(b * (c + decode_steps + 8) for b, c in decode_points))
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, device=device,
                                    num_blocks=cdiv(need, 16) + max_batch + 16, block_size=16,
                                    max_num_batched_tokens=max_num_batched_tokens,
                                    max_num_seqs=max(64, max_batch),
                                    enable_prefix_caching=False))
    max_num_batched_tokens = engine.max_num_batched_tokens      # as resolved for the device
    if prefill_batches is None:
        prefill_batches = calibration_batches(max_num_batched_tokens)
    rng = random.Random(0)
    vocab = min(engine.info.vocab_size, 30000)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]
    stats = engine.get_stats()
    out: dict = {"model": model, "calibration": True, "threads": torch.get_num_threads(),
                 "dtype": engine.info.dtype, "kv_dtype": engine.kv_dtype, "repeats": repeats,
                 "device": stats["device"], "device_name": stats["device_name"],
                 "max_num_batched_tokens": max_num_batched_tokens,
                 "evidence": "gpu-measured" if stats["device"] == "cuda" else "cpu-measured"}
    _engine_run(engine, [prompt(64) for _ in range(4)], [4] * 4)   # warm-up
    out["prefill_tok_s"] = {}
    for n in prefill_lens:
        p = prompt(n)
        _engine_run(engine, [p], [1])
        out["prefill_tok_s"][str(n)] = n / _median(lambda p=p: _engine_run(engine, [p], [1])[0],
                                                   repeats)
    out["prefill_batch_s"] = []
    for b, n in prefill_batches:
        assert b * n <= max_num_batched_tokens, "one step per point"
        ps = [prompt(n) for _ in range(b)]
        _engine_run(engine, ps, [1] * b)
        out["prefill_batch_s"].append({"batch": b, "tokens": n, "step_s": _median(
            lambda ps=ps: _engine_run(engine, ps, [1] * len(ps))[0], repeats)})
    grid = []
    for b, c in decode_points:   # one prefill per point, then repeats x decode_steps steps
        steps = _engine_run(engine, [prompt(c) for _ in range(b)],
                            [repeats * decode_steps + 2] * b)[3]
        grid.append({"batch": b, "context": c, "step_ms": 1e3 * statistics.median(steps[1:])})
    out["decode_step_ms_grid"] = grid
    for b in (1, 16):   # the two points every cost model reads (at the shortest context)
        pts = [g for g in grid if g["batch"] == b]
        if pts:
            out[f"decode_step_ms_b{b}"] = min(pts, key=lambda g: g["context"])["step_ms"]
    engine.check_invariants()
    return out
