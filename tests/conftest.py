"""Shared fixtures: the seeded tiny Llama (engine copy + independent reference copy), helpers."""

from __future__ import annotations

import os
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
torch.set_num_threads(int(os.environ.get("RAYPD_TEST_THREADS", "2")))
# a bare ray.init() in a test starts a fresh local instance, never joins a stale or foreign one
os.environ.setdefault("RAY_ADDRESS", "local")
# no implicit ray.init(): a Ray call from a thread that outlived its test (after the module's
# ray.shutdown()) must fail there, not start a second local Ray beside the next module's one
# (seen once: two heads started 3 s apart, the driver lost its GCS and the run was killed)
assert "ray" not in sys.modules, "set Ray's environment before ray is imported"
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"


RAY_DEFAULT_PORTS = {6379, 8076, 8265, 10001, 52365, 52366}   # Ray's own, if left random


def _free_port() -> int:
    import socket
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in RAY_DEFAULT_PORTS:
            return port


RAY_METRICS_PORT = _free_port()   # the shared Ray's metrics agent (exports every second)


def start_shared_ray() -> None:
    """The local Ray instance modules share: its metrics agent serves on RAY_METRICS_PORT."""
    import ray
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 _metrics_export_port=RAY_METRICS_PORT,
                 _system_config={"metrics_report_interval_ms": 1000})


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray instance shared by every module that needs it (shut down at session end;
    a module that needs its own cluster shuts this one down first)."""
    start_shared_ray()
    yield


@pytest.fixture(scope="module")
def metrics_port(ray_session):
    """The shared Ray's metrics port (started by this fixture when no Ray runs, else the Ray
    running must be the shared one)."""
    import ray
    assert ray.is_initialized()
    yield RAY_METRICS_PORT


def pytest_collection_modifyitems(config, items):
    """A test on the shared Ray (or its metrics port) is an integration test: `scripts/test.sh
    --fast` leaves those out, with the e2e runs and the SmolLM2 and `ray up` checks."""
    for item in items:
        if {"ray_session", "metrics_port"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


def pytest_sessionfinish(session, exitstatus):
    import ray
    if ray.is_initialized():
        ray.shutdown()


def shared_dir() -> Path:
    """../shared beside the checkout (override with RAYPD_SHARED_DIR)."""
    return Path(os.environ.get("RAYPD_SHARED_DIR", ROOT.parent / "shared"))


@pytest.fixture(scope="session")
def tiny_loaded():
    """(model, tokenizer, info) of the tiny model, for engines (they swap its attention)."""
    from workers.model_loader import load_model
    return load_model("tiny")


@pytest.fixture(scope="session")
def tiny_reference():
    """A second, independently loaded copy of the tiny model, left on stock SDPA attention."""
    from workers.model_loader import load_model
    return load_model("tiny")[0]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos=None) -> list[int]:
    """Reference: stock transformers generate(), greedy, batch of one."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def save_random_checkpoint(path, config_cls, tokenizer, seed: int, dtype, shape: dict,
                           **extra):
    """A random-weight checkpoint of `config_cls` (`shape` keys, `extra` over them) with the
    tiny tokenizer, saved in `dtype` where raypd loads it through `--model PATH`."""
    from transformers import AutoModelForCausalLM
    config = config_cls(vocab_size=len(tokenizer), **{**shape, **extra})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        window: int | None = None) -> torch.Tensor:
    """float64 softmax(q k^T) v for the native prefill attention kernels' tests: q [Tq, H, D] at
    positions S - Tq.., k, v [S, Hkv, D]; query i sees keys 0..S - Tq + i (the `window` newest
    of them)."""
    tq, h, _ = q.shape
    s, h_kv, _ = k.shape
    kk = k.double().repeat_interleave(h // h_kv, 1)
    vv = v.double().repeat_interleave(h // h_kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    rows = torch.arange(tq).view(-1, 1) + (s - tq)
    cols = torch.arange(s).view(1, -1)
    visible = cols <= rows
    if window is not None:
        visible &= cols > rows - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


def fused_qkv_slices(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [40, 6, 64], k, v [40, 2, 64] as slices of one fused QKV row per token (what the model
    hands the attention kernels): not contiguous, each token's heads x D contiguous."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(40, (6 + 2 + 2) * 64, generator=g).to(dtype)
    q, k, v = qkv[:, :384].view(40, 6, 64), qkv[:, 384:512].view(40, 2, 64), \
        qkv[:, 512:].view(40, 2, 64)
    assert not q.is_contiguous()
    return q, k, v


def wait_until(cond, timeout=60.0) -> None:
    """Poll `cond` every 50 ms until it holds; fail the test after `timeout` seconds."""
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def random_prompt(n: int, seed: int, vocab: int = 250, low: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (n,), generator=g).tolist()


def start_streaming(cluster, prompts: list, sampling, timeout_s: float = 60.0):
    """Run each prompt through `cluster` in a thread of its own (`sampling`: one
    SamplingParams, or one per prompt); return (threads, results) once every request has
    streamed a token. `results[i]` is set when request i ends."""
    import threading
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    streaming = [threading.Event() for _ in prompts]
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = cluster.run_request(prompts[i], samplings[i],
                                         on_delta=lambda d: streaming[i].set())
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    assert all(e.wait(timeout_s) for e in streaming), "a request never streamed"
    return threads, results


def make_engine(loaded, **overrides):
    from workers.engine import EngineConfig, LLMEngine
    cfg = dict(model="tiny", num_blocks=256, block_size=16)
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg), loaded=loaded)


class FakeIpc:
    """Stands in for torch's CUDA IPC: counts each export's receives (open or forgo)."""

    def __init__(self) -> None:
        self.receives: dict[int, int] = {}                 # export token -> receives
        self._buffers: dict[int, weakref.ref] = {}
        self.fail_open = False

    def export(self, buffer: torch.Tensor) -> tuple:
        token = len(self.receives)
        self.receives[token] = 0
        self._buffers[token] = weakref.ref(buffer)
        return ("fake-ipc", token)

    def open(self, rebuild_args: tuple, index: int) -> torch.Tensor:
        if self.fail_open:
            raise RuntimeError("cudaIpcOpenMemHandle failed")
        token = rebuild_args[1]
        self.receives[token] += 1
        buffer = self._buffers[token]()
        assert buffer is not None, "mapped a buffer the producer freed"
        return buffer

    def forgo(self, rebuild_args: tuple) -> None:
        self.receives[rebuild_args[1]] += 1

    def collect(self) -> None:
        pass


@pytest.fixture()
def ipc(monkeypatch) -> FakeIpc:
    """cuda_ipc's GPU path on CPU tensors: the 'cuda' export kind, a fake IPC, one fake GPU."""
    from kvtransfer import cuda_ipc
    from kvtransfer.cuda_ipc import CudaIpcTransport
    fake = FakeIpc()
    monkeypatch.setattr(cuda_ipc, "IPC", fake)
    monkeypatch.setattr(CudaIpcTransport, "_kind_for", lambda self, device: "cuda")
    monkeypatch.setattr(cuda_ipc, "gpu_uuid", lambda index: "GPU-fake")
    monkeypatch.setattr(cuda_ipc, "local_gpu_index",
                        lambda uuid: 0 if uuid == "GPU-fake" else None)
    monkeypatch.setattr(cuda_ipc, "_MAPPED", type(cuda_ipc._MAPPED)())   # a reader's mappings
    return fake
