"""First-contact step (a), the cheapest and most telling: versions and where each package was
imported from (the bundle's private site folder or the machine's own); every repo module the
GPU path reaches imports; transformers' GgufConfig (needed only to convert SmolLM2, now lazy);
SDPA with GQA in bfloat16 and float32 against an explicit softmax; one CUDA-graph capture and
replay; a two-process CUDA-IPC round trip without Ray; whether CuPy's NCCL loads; and
PYTORCH_CUDA_ALLOC_CONF.

    python scripts/gpu/probe.py OUT.json     (RAYPD_GPU_DEVICE=cpu: the dry run's stand-ins)

ok is False when torch sees no GPU (on cuda), a module of the GPU path does not import, SDPA
is off its tolerance, the graph replays wrong or the IPC round trip fails. GgufConfig and NCCL
are reported only: nothing on the first-contact path needs them."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from step_io import device, dry_run, run_step  # noqa: E402

PACKAGES = ("torch", "transformers", "ray", "fastapi", "starlette", "uvicorn", "pydantic",
            "pydantic-core", "jsonschema", "opentelemetry-api", "gguf", "numpy", "triton",
            "cupy-cuda13x", "typing-extensions", "safetensors", "tokenizers", "grpcio",
            "protobuf", "msgpack")
SDPA_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
# repo modules that import a package only the GPU machine has (the dry run skips them where it
# is missing; on the GPU machine they must import)
GPU_MACHINE_ONLY = {"workers.kernels.triton_decode_kernels": "triton",
                    "workers.kernels.triton_ops_kernels": "triton"}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def origins() -> dict[str, str]:
    """Where the packages that may come from either place were imported from."""
    out = {}
    for mod in ("ray", "fastapi", "pydantic", "typing_extensions", "torch", "transformers"):
        try:
            out[mod] = str(Path(importlib.import_module(mod).__file__).parent)
        except Exception as e:  # noqa: BLE001 - reported
            out[mod] = f"{type(e).__name__}: {e}"
    return out


def import_gpu_path() -> dict[str, str]:
    """{module: error} for each repo module of the GPU path that does not import."""
    from gpu_path import scan
    failed = {}
    for name in sorted(scan()[0]):
        if name.endswith("__main__"):   # runs a command when imported
            continue
        if dry_run() and name in GPU_MACHINE_ONLY \
                and importlib.util.find_spec(GPU_MACHINE_ONLY[name]) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - each failure is reported
            failed[name] = f"{type(e).__name__}: {e}"
    return failed


def gguf_config() -> str:
    try:
        from transformers import GgufConfig  # noqa: F401
        return "present"
    except ImportError as e:
        return f"absent: {e}"


def sdpa_gqa(dev) -> dict:
    """Causal SDPA with 8 query heads over 2 KV heads (enable_gqa) vs softmax(QK^T)V in fp64."""
    import torch
    import torch.nn.functional as F
    out = {}
    g = torch.Generator().manual_seed(0)
    q64 = torch.randn(2, 8, 33, 64, generator=g, dtype=torch.float64)
    k64 = torch.randn(2, 2, 33, 64, generator=g, dtype=torch.float64)
    v64 = torch.randn(2, 2, 33, 64, generator=g, dtype=torch.float64)
    kr, vr = k64.repeat_interleave(4, dim=1), v64.repeat_interleave(4, dim=1)
    scores = q64 @ kr.transpose(-1, -2) / 8.0
    scores = scores.masked_fill(torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(scores, -1) @ vr
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        q, k, v = (t.to(dev, dtype) for t in (q64, k64, v64))
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        err = (got.double().cpu() - ref).abs().max().item()
        out[name] = {"max_abs_err": err, "ok": err <= SDPA_TOLERANCE[name]}
    return out


def cuda_graph() -> dict:
    """Capture y = x @ w + 1 once, replay on new input, compare with eager."""
    import torch
    if dry_run():
        return {"ok": True, "skipped": "stand-in: no GPU in the dry run"}
    x = torch.randn(64, 64, device="cuda")
    w = torch.randn(64, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x @ w + 1   # warm-up on a side stream, as capture requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x @ w + 1
    x.copy_(torch.randn(64, 64, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    err = (y - (x @ w + 1)).abs().max().item()
    return {"ok": err < 1e-3, "max_abs_err": err}


def _ipc_child(queue, done) -> None:
    tensor = queue.get()
    tensor.add_(1)            # in place: the parent's memory, if the handle really is shared
    done.put(float(tensor.sum()))


def ipc_round_trip(dev) -> dict:
    """Send a tensor to a spawned process (CUDA IPC on cuda, shared memory on cpu), which adds
    1 in place; the parent must see it without any copy back."""
    import torch
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    tensor = torch.zeros(1024, 1024, device=dev)
    if dev.type == "cpu":
        tensor.share_memory_()
    child = ctx.Process(target=_ipc_child, args=(queue, done))
    t = time.perf_counter()
    child.start()
    queue.put(tensor)
    child_sum = done.get(timeout=60)
    child.join(timeout=30)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seen = float(tensor.sum())
    return {"ok": child_sum == seen == 1024 * 1024, "child_sum": child_sum, "parent_sum": seen,
            "mechanism": "cuda_ipc" if dev.type == "cuda" else "shared memory (stand-in)",
            "seconds": round(time.perf_counter() - t, 2)}


def cupy_nccl() -> str:
    try:
        from cupy.cuda import nccl
        return f"loads (NCCL {nccl.get_version()})"
    except Exception as e:  # noqa: BLE001 - reported only
        return f"does not load: {type(e).__name__}: {e}"


def main() -> dict:
    import torch
    dev = torch.device(device())
    result: dict = {"python": sys.version.split()[0], "versions": versions(),
                    "torch_cuda": torch.version.cuda,
                    "cuda_available": torch.cuda.is_available(),
                    "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                    "pythonpath": os.environ.get("PYTHONPATH", "")}
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return {**result, "ok": False, "error": "torch sees no GPU"}
        props = torch.cuda.get_device_properties(0)
        result.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                      capability=f"{props.major}.{props.minor}")
    result["origins"] = origins()
    result["import_failures"] = import_gpu_path()
    if result["import_failures"]:   # fail fast: every later step needs these
        return {**result, "ok": False, "error": "modules of the GPU path do not import"}
    result["gguf_config"] = gguf_config()
    result["sdpa_gqa"] = sdpa_gqa(dev)
    result["cuda_graph"] = cuda_graph()
    result["ipc_round_trip"] = ipc_round_trip(dev)
    result["cupy_nccl"] = cupy_nccl()
    result["ok"] = (all(r["ok"] for r in result["sdpa_gqa"].values())
                    and result["cuda_graph"]["ok"] and result["ipc_round_trip"]["ok"])
    return result


if __name__ == "__main__":
    sys.exit(run_step(main))
