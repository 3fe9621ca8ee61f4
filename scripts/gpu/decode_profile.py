"""Where a decode step's time goes, on the GPU machine (or here, on the CPU, for a smoke run):

    python scripts/gpu/decode_profile.py [--model random:llama3-8b] [--graphs auto|on|off|both]
                                         [--batches 1,64] [--json OUT.json]

For each (CUDA graphs on/off, batch): the engine step's wall time and `execute`'s (forward and
sync), the step's host share (step - GPU time), the graph replay alone timed with CUDA events,
and torch.profiler's kernel time per step in groups (gemm, attention, norm, elementwise); the
kernel table and a cProfile of the host side go to stdout. Prompts of 512 random tokens, steps
5-35 of decoding. On the H200 (2026-12-04, random:llama3-8b bf16, graphs on, its first version)
it gave at batch 64: step 8.6 ms, replay 7.25, gemm 4.4, attention 1.3, norm + elementwise 1.4;
with the Triton fused ops (workers/kernels/triton_ops.py), on another machine: step 7.7 ms against 10.6
with `RAYPD_FUSED_OPS=0`, norm + elementwise 0.36 ms against 1.4.

Invariant: it only reads the engine (no setting is changed); labels say `gpu-measured` only when
the engine ran on cuda."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers.device import synchronize  # noqa: E402
from workers.engine import EngineConfig, LLMEngine  # noqa: E402
from workers.request import SamplingParams  # noqa: E402

GROUPS = (("gemm", ("gemm", "nvjet", "splitkreduce", "cutlass", "linear", "addmm", "mm")),
          ("attention", ("paged_decode", "attention", "attn")),
          ("norm", ("layer_norm", "rms_norm", "norm")),
          ("elementwise", ("elementwise", "index", "cat", "gather", "copy", "reduce", "rope",
                  "silu")))


def group_of(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in GROUPS if any(k in low for k in keys)), "other")


def _start(engine: LLMEngine, batch: int, prompt: int, seed: int) -> None:
    rng = random.Random(seed)
    vocab = engine.info.vocab_size
    reqs = [engine.add_request([rng.randrange(3, vocab) for _ in range(prompt)],
                               SamplingParams(max_tokens=400, ignore_eos=True))
            for _ in range(batch)]
    while not all(r.first_token_time for r in reqs):
        engine.step()


def _timed(engine: LLMEngine, n: int) -> tuple[float, float]:
    walls, forwards = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
        forwards.append(engine.runner.last_forward_s)
    return 1e3 * statistics.median(walls), 1e3 * statistics.median(forwards)


def _replay_ms(engine: LLMEngine, batch: int) -> float | None:
    graphs = engine.runner.graphs
    shapes = [s for s in getattr(graphs, "_graphs", {}) if s[0] == batch]
    if not shapes:
        return None
    graph, _ = graphs._graphs[shapes[0]]
    for _ in range(3):
        graph.replay()
    synchronize(engine.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    synchronize(engine.device)
    return start.elapsed_time(end) / 20


def _kernels(engine: LLMEngine, n: int, label: str) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile
    cuda = engine.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            engine.step()
        synchronize(engine.device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages()
    print(f"--- {label}: kernels of {n} steps, by {key}")
    print(table.table(sort_by=key, row_limit=20, max_name_column_width=70))
    groups: dict[str, float] = {}
    for e in table:
        if cuda and e.key.startswith("aten::"):
            continue          # on cuda the kernels carry the time; aten ops would count twice
        g = group_of(e.key)
        groups[g] = groups.get(g, 0.0) + getattr(e, key) / n / 1e3
    return groups


def _host_profile(engine: LLMEngine, n: int, label: str) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        engine.step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
    print(f"--- {label}: cProfile of {n} steps, by tottime\n{out.getvalue()}")


def profile_decode(model: str, graphs: str, batches: list[int], prompt: int = 512) -> dict:
    """The figures above, per (graphs, batch)."""
    cuda = torch.cuda.is_available()
    out: dict = {"model": model, "device": "cuda" if cuda else "cpu",
                 "evidence": "gpu-measured" if cuda else "cpu-measured", "prompt": prompt}
    modes = {"auto": (cuda,), "on": (True,), "off": (False,), "both": (True, False)}[graphs]
    assert cuda or not any(modes), "CUDA graphs need a GPU (main refuses --graphs on|both)"
    for on in modes:
        engine = LLMEngine(EngineConfig(
            model=model, dtype="bfloat16" if cuda else "float32", device=out["device"],
            cuda_graphs=on, block_size=16, max_num_seqs=max(batches),
            num_blocks=max(batches) * -(-(prompt + 420) // 16) + 16,
            max_num_batched_tokens=max(2048, prompt), enable_prefix_caching=False))
        out["fused_ops"] = engine.get_stats()["fused_ops"]
        for b in batches:
            label = f"graphs={'on' if on else 'off'} batch={b}"
            _start(engine, b, prompt, seed=b)
            _timed(engine, 5)
            step_ms, execute_ms = _timed(engine, 30)
            replay = _replay_ms(engine, b) if on else None
            kernels = _kernels(engine, 5, label)
            gpu_ms = replay if replay is not None else \
                (sum(kernels.values()) if cuda else execute_ms)
            if on:
                _host_profile(engine, 20, label)
            while engine.has_unfinished():
                engine.step()
            out[label] = {"step_ms": step_ms, "execute_ms": execute_ms, "replay_ms": replay,
                          "host_ms": step_ms - gpu_ms, "kernel_ms": kernels}
            print(label, json.dumps(out[label]), flush=True)
        del engine
        if cuda:
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--graphs", choices=("auto", "on", "off", "both"), default="auto",
                   help="auto: on where there is a GPU, off elsewhere")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        batches = [int(x) for x in a.batches.split(",")]
    except ValueError:
        p.error(f"--batches: comma-separated integers, got {a.batches!r}")
    if not batches or min(batches) < 1:
        p.error("--batches: at least one batch size, each >= 1")
    if a.graphs in ("on", "both") and not torch.cuda.is_available():
        p.error(f"--graphs {a.graphs}: CUDA graphs need a GPU and torch sees none")
    out = profile_decode(a.model, a.graphs, batches, a.prompt)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
