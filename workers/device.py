"""The one place that decides where an engine runs and in which dtype its weights compute.

`--device auto` is cuda when this process (the worker actor) holds a GPU: Ray gave it one
(`ray.get_gpu_ids()` non-empty) or, outside Ray, torch sees one; else cpu. `--device cuda`
without a GPU is an error that says so, never a silent CPU run.

`--dtype auto` computes in bfloat16 where the hardware multiplies bfloat16 natively (CPUs with
AVX512-BF16 or AMX, GPUs from Ampere on): there bf16 matmuls run 3-5x faster than float32 and
read half the bytes, as vLLM does by default. On a CPU without it, auto is float32, a bf16
checkpoint's too (torch's bf16 matmuls convert every element there: 5-10x slower); on a GPU
without it, the checkpoint's own. The built-in `tiny` test model stays float32 (its reference
comparisons are exact).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.engine_config import WEIGHT_DTYPES

# names accepted for weights/KV (the one list: workers/engine_config.WEIGHT_DTYPES) -> torch
DTYPES = {name: getattr(torch, name) for name in WEIGHT_DTYPES}
DEVICES = ("auto", "cpu", "cuda")


class DeviceError(ValueError):
    """The requested device is not available in this process."""


@dataclass(frozen=True)
class DeviceProbe:
    """What the device decision looks at (a test passes a fake one)."""

    cuda_available: bool = False     # torch.cuda.is_available()
    in_ray_actor: bool = False       # this process is a Ray actor
    ray_gpu_ids: tuple = ()          # ray.get_gpu_ids() there (the GPUs Ray gave the actor)

    @staticmethod
    def here() -> DeviceProbe:
        in_actor, gpu_ids = False, ()
        try:
            import ray
            if ray.is_initialized():
                in_actor = ray.get_runtime_context().get_actor_id() is not None
                gpu_ids = tuple(ray.get_gpu_ids()) if in_actor else ()
        except Exception:   # noqa: BLE001 - Ray missing or half started: not an actor
            in_actor, gpu_ids = False, ()
        return DeviceProbe(torch.cuda.is_available(), in_actor, gpu_ids)


def resolve_device(requested: str = "auto", probe: DeviceProbe | None = None) -> torch.device:
    """The engine's device for `requested` (auto | cpu | cuda); DeviceError when cuda is asked
    for and this process has no GPU. auto: cuda when Ray gave this actor a GPU and torch sees
    it, or outside Ray when torch sees one; cpu otherwise (an actor without GPUs stays on the
    CPU even on a GPU node, so fractional placement decides)."""
    if requested not in DEVICES:
        raise DeviceError(f"device must be one of {', '.join(DEVICES)}, got {requested!r}")
    probe = probe or DeviceProbe.here()
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda":
        if not probe.cuda_available:
            raise DeviceError("device 'cuda' was asked for but this process sees no GPU "
                              "(torch.cuda.is_available() is False; give the workers GPUs with "
                              "workers.num_gpus, or use device 'auto' / 'cpu')")
        return torch.device("cuda", 0)
    holds_gpu = bool(probe.ray_gpu_ids) if probe.in_ray_actor else True
    return torch.device("cuda", 0) if probe.cuda_available and holds_gpu else torch.device("cpu")


def device_name(device: torch.device) -> str:
    """Human name of the device: the GPU's product name, or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model_name()


@functools.cache
def cpu_model_name() -> str:
    """The CPU's model name with its family and model numbers, as lscpu gives them ("AMD EPYC
    (family 26, model 2)"): a VM's name alone may not tell Zen 3 from Zen 5."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break       # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name")
    if name is None:
        import platform
        return platform.processor() or "cpu"
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def has_native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return cpu_has_native_bf16()


def auto_dtype(checkpoint_dtype: str, device: torch.device) -> str:
    """The compute dtype for `--dtype auto` of a checkpoint saved in `checkpoint_dtype`: bf16
    where the device multiplies it natively; on a CPU without (AVX2 only, say), float32 for a
    bf16 checkpoint too: there torch's bf16 matmuls convert every element (measured on a 2-core
    Zen 3: a 512 x 576 x 1536 linear 144 ms in bf16 against 15 in float32, 5x at 16 rows)."""
    if checkpoint_dtype in ("float32", "float16", "bfloat16") and has_native_bf16(device):
        return "bfloat16"
    if device.type == "cpu":
        return "float32"
    return checkpoint_dtype if checkpoint_dtype in DTYPES else "float32"


def load_dtype(requested: str, model: str, device: torch.device) -> str:
    """The dtype to ask the loader for: `requested`, except that `auto` of a checkpoint on a GPU
    is decided by that GPU (the loader alone would ask the host CPU). tiny stays auto
    (float32)."""
    if requested != "auto" or model == "tiny" or device.type != "cuda":
        return requested
    return "bfloat16" if has_native_bf16(device) else "float32"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (on a GPU, kernel launches return before the work is
    done: a figure timed across them needs this); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` in page-locked host memory when it is headed for a GPU (async copies need it)."""
    return t.pin_memory() if device.type == "cuda" else t


class PinnedStaging:
    """One reused page-locked host buffer for a worker's per-step host -> device copies (a
    fresh pinned allocation each step costs a driver call and pins memory anew).

    Invariant: the buffer is rewritten only after the previous copy out of it finished (a CUDA
    event recorded after each copy is waited on first); it grows by doubling, never shrinks.
    Off a GPU it passes tensors through (nothing to pin)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buf: torch.Tensor | None = None
        self._done = torch.cuda.Event() if device.type == "cuda" else None
        self.allocations = 0          # pinned buffers made (a seam for tests)

    def stage(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` (1-D, on the host) in the pinned buffer, ready for a non-blocking copy; call
        `copied()` right after issuing that copy."""
        if self._done is None:
            return flat
        self._done.synchronize()      # the last copy out of the buffer has finished
        n = flat.numel()
        if self._buf is None or self._buf.numel() < n or self._buf.dtype != flat.dtype:
            size = max(n, 2 * (self._buf.numel() if self._buf is not None else 0), 1024)
            self._buf = torch.empty(size, dtype=flat.dtype).pin_memory()
            self.allocations += 1
        view = self._buf[:n]
        view.copy_(flat)
        return view

    def copied(self) -> None:
        """The copy out of the staged view was issued on the current stream."""
        if self._done is not None:
            self._done.record()


# ---- one OpenMP team per worker process ------------------------------------------------------
# libgomp keeps a thread pool per thread that ever ran a parallel region, and once it manages
# more threads than the process has CPUs it stops spinning between regions (a futex sleep and
# wake for each one): measured here, a bf16 linear at batch 1 took 2x as long on a second
# thread (250 us against 130) and a worker's engine step 35-43 ms against 21 ms. So in a
# worker only the engine loop thread runs parallel regions: every other thread (the actor's
# constructor, Ray's method threads) calls `serial_openmp_here` before its torch work.
_serial = threading.local()


@functools.cache
def libgomp() -> ctypes.CDLL | None:
    """libgomp as torch loaded it (its bundled copy first), or None (another OpenMP, or none)."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for path in [*sorted(lib_dir.glob("libgomp*.so*")), "libgomp.so.1"]:
        try:
            lib = ctypes.CDLL(str(path))
            lib.omp_set_num_threads.argtypes, lib.omp_set_num_threads.restype = [ctypes.c_int], None
            return lib
        except (OSError, AttributeError):
            continue
    return None


def serial_openmp_here() -> None:
    """torch's operators on this thread run on one OpenMP thread (other threads keep theirs):
    torch's own per-thread setting is made first (its first use on a thread would reset it)."""
    if getattr(_serial, "done", False):
        return
    torch.get_num_threads()
    if (lib := libgomp()) is not None:
        lib.omp_set_num_threads(1)
    _serial.done = True


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_BELOW = 1 << 30


@functools.cache
def keep_freed_host_memory() -> bool:
    """glibc's malloc, for this process: allocations under 1 GiB come from its heap, and freed
    memory stays there (M_MMAP_THRESHOLD and M_TRIM_THRESHOLD at 1 GiB). By default each large
    temporary of a CPU step (a 2,048-token chunk's activations: MBs a layer) is a fresh mmap
    whose pages fault in on first touch, and is unmapped when freed; kept, the next step reuses
    them (what tcmalloc or jemalloc give, which vLLM's CPU guide preloads). SmolLM2, 2 threads:
    a 2,048-token prefill 0.72 -> 0.57 s. The resident size stays at the largest step's
    working set. False where the C library has no mallopt (not glibc)."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BELOW) and mallopt(M_TRIM_THRESHOLD, KEEP_BELOW))
