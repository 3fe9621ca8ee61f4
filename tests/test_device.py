"""The engine's device, decided in one place: auto picks cuda only when the worker holds a GPU;
cuda without a GPU is a clear error; a step's metadata is built on the host and reaches the
device in one copy; the CPU never enters the CUDA-graph path; reports say gpu-measured only
when the pools were on a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, make_engine, random_prompt

from workers.cuda_graphs import batch_buckets, bucket_for, width_bucket
from workers.device import DeviceError, DeviceProbe, resolve_device
from workers.model_runner import ModelRunner
from workers.request import SamplingParams
from workers.scheduler_output import ScheduledChunk, SchedulerOutput


@pytest.mark.parametrize("probe, expected", [
    (DeviceProbe(cuda_available=True, in_ray_actor=True, ray_gpu_ids=(0,)), "cuda"),
    # an actor on a GPU node that Ray gave no GPU stays on the CPU
    (DeviceProbe(cuda_available=True, in_ray_actor=True, ray_gpu_ids=()), "cpu"),
    (DeviceProbe(cuda_available=True, in_ray_actor=False), "cuda"),    # raypd generate
    (DeviceProbe(cuda_available=False, in_ray_actor=True, ray_gpu_ids=(0,)), "cpu"),
    (DeviceProbe(cuda_available=False), "cpu"),
])
def test_auto_device_is_cuda_only_where_the_worker_holds_a_gpu(probe, expected):
    assert resolve_device("auto", probe).type == expected


@pytest.mark.parametrize("native, saved, want", [
    (True, "float32", "bfloat16"), (True, "bfloat16", "bfloat16"), (True, "float16", "bfloat16"),
    # a CPU without native bf16 (AVX2 only): torch's bf16 matmuls are 5-10x slower there
    (False, "bfloat16", "float32"), (False, "float16", "float32"), (False, "float32", "float32"),
])
def test_auto_dtype_on_the_cpu_is_bf16_only_where_the_cpu_multiplies_it_natively(
        monkeypatch, native, saved, want):
    from workers import device
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: native)
    assert device.auto_dtype(saved, torch.device("cpu")) == want


def test_explicit_devices_and_cuda_without_gpu_is_a_clear_error():
    gpu = DeviceProbe(cuda_available=True, in_ray_actor=True, ray_gpu_ids=(0,))
    assert resolve_device("cpu", gpu).type == "cpu"
    assert resolve_device("cuda", gpu) == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match="sees no GPU"):
        resolve_device("cuda", DeviceProbe(cuda_available=False))
    with pytest.raises(DeviceError, match="one of auto, cpu, cuda"):
        resolve_device("tpu", gpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_engine_refuses_cuda_on_a_machine_without_gpu(tiny_loaded):
    with pytest.raises(ValueError, match="sees no GPU"):
        make_engine(tiny_loaded, device="cuda")


def test_step_metadata_is_one_host_to_device_copy(tiny_loaded, tiny_reference):
    """Decodes of different context lengths (two decode groups) and prefill chunks with and
    without a cached prefix in one step: every metadata tensor is a view of one uploaded
    buffer, and each engine step makes exactly one host -> device copy."""
    engine = make_engine(tiny_loaded, max_num_batched_tokens=64)
    prompts = [random_prompt(n, seed=n) for n in (5, 40, 70)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    reqs = [engine.add_request(p, sp) for p in prompts]
    steps = 0
    before = ModelRunner.h2d_copies
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert ModelRunner.h2d_copies - before == steps
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == hf_greedy(tiny_reference, p, 6)

    # one mixed step, looked at directly: short and long decodes, a prefill with a prefix
    runner = engine.runner
    shared = random_prompt(32, seed=7)
    a = engine.add_request(random_prompt(3, seed=8), SamplingParams(max_tokens=4))
    b = engine.add_request(shared + random_prompt(8, seed=9), SamplingParams(max_tokens=4))
    engine.step()                  # both prefilled; the next step decodes them
    c = engine.add_request(shared + random_prompt(20, seed=10), SamplingParams(max_tokens=4))
    chunks = [ScheduledChunk(r, 1, engine.kv.block_table(r.request_id)) for r in (a, b)]
    engine.kv.allocate_slots(c.request_id, c.num_tokens,
                             engine.kv.match_prefix(c.namespace_root, c.block_hashes,
                                                    c.all_token_ids, c.num_tokens - 1))
    c.num_computed_tokens = 32
    chunks.append(ScheduledChunk(c, c.num_tokens - 32, engine.kv.block_table(c.request_id)))
    runner.one_decode_group = False    # the torch path's length groups: two here
    before = ModelRunner.h2d_copies
    ids, pos, meta, rows, _ = runner.prepare(SchedulerOutput(chunks))
    assert ModelRunner.h2d_copies - before == 1
    assert len(meta.decode_groups) == 2 and meta.prefills[0].block_table is not None
    tensors = [ids, pos, rows, meta.slot_mapping, meta.prefills[0].block_table,
               *(t for g in meta.decode_groups for t in (g.block_tables, g.context_lens))]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    runner.one_decode_group = True     # the native kernel reads each row's own context
    assert len(runner.prepare(SchedulerOutput(chunks))[2].decode_groups) == 1
    assert all(t.device == runner.device for t in tensors)
    assert [g.needs_mask for g in meta.decode_groups] == [False, False]   # one row each


def test_cpu_never_builds_cuda_graphs(tiny_loaded):
    engine = make_engine(tiny_loaded, cuda_graphs=True)
    stats = engine.get_stats()
    assert engine.runner.graphs is None and not stats["cuda_graphs"]
    assert stats["device"] == "cpu" and stats["device_name"]
    assert engine.runner.kv_cache.shape[2] == engine.kv.pool.num_blocks   # no scratch block
    from workers.cuda_graphs import DecodeGraphs
    with pytest.raises(AssertionError, match="cuda only"):
        DecodeGraphs(engine.runner, 8, engine.kv.pool.num_blocks, 2048)


def test_graph_buckets():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert bucket_for(17, batch_buckets(64)) == 32 and bucket_for(65, batch_buckets(64)) is None
    assert [width_bucket(w, 100) for w in (1, 3, 64, 65, 100)] == [1, 4, 64, 100, 100]
    assert width_bucket(101, 100) is None


def test_device_reaches_the_engine_through_the_config_chain(tmp_path):
    from cluster.config import ConfigError, load_config
    from raypd.cli import build_parser
    from raypd.cli.common import engine_config_from_args
    cfg = load_config(None, {"model.name": "tiny", "engine.device": "cpu",
                             "engine.cuda_graphs": False})
    assert cfg.engine_config()["device"] == "cpu" and cfg.engine_config()["cuda_graphs"] is False
    with pytest.raises(ConfigError, match="engine.device: cuda needs GPUs"):
        load_config(None, {"model.name": "tiny", "engine.device": "cuda"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  device: tpu\n")
    with pytest.raises(ConfigError, match="engine.device: must be one of auto, cpu, cuda"):
        load_config(bad)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--device", "cpu",
                                      "--no-cuda-graphs"])
    ec = engine_config_from_args(args)
    assert (ec.device, ec.cuda_graphs) == ("cpu", False)
    assert engine_config_from_args(build_parser().parse_args(["generate", "--prompt", "x"])
                                   ).device == "auto"


def test_evidence_label_follows_the_pools_device_not_the_gpus_reserved():
    from raypd.replay.report import build_report, evidence_from_devices
    assert evidence_from_devices(["cuda"]) == "gpu-measured"
    assert evidence_from_devices(["cpu", "cuda"]) == "cpu-measured"
    assert evidence_from_devices([]) == "cpu-measured"
    on_cpu = [{"worker_id": "p0", "role": "prefill", "device": "cpu", "device_name": "EPYC"}]
    rep = build_report([], params={"num_gpus_per_worker": 1}, wall_s=1.0, stats_after=on_cpu)
    assert rep["evidence_level"] == "cpu-measured" and rep["device_names"] == ["EPYC"]
    on_gpu = [{"worker_id": "d0", "role": "decode", "device": "cuda", "device_name": "H200"}]
    rep = build_report([], params={"num_gpus_per_worker": 0}, wall_s=1.0, stats_after=on_gpu)
    assert rep["evidence_level"] == "gpu-measured" and rep["devices"] == ["cuda"]


def test_padded_static_decode_step_computes_what_the_eager_step_computes(
        tiny_loaded, tiny_reference, monkeypatch):
    """What a CUDA graph replays (batch padded to its bucket, one block-table width, padding
    rows in a scratch block, attention over the whole padded width with per-row masks), run
    eagerly on the CPU through the attention's torch path (the one cuda takes): the same greedy
    tokens as generate()."""
    from workers import kernels
    from workers.cuda_graphs import StaticDecode
    monkeypatch.setattr(kernels, "paged_decode", lambda *a, **k: None)
    engine = make_engine(tiny_loaded, num_blocks=256, max_num_seqs=8)
    scratch = 255   # the pool is far larger than these prompts need
    engine.runner.graphs = StaticDecode(engine.runner, 8, scratch, engine.max_model_len)
    prompts = [random_prompt(n, seed=200 + n) for n in (3, 21, 47, 90, 130)]   # batch 5 -> 8
    reqs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert engine.runner.graphs.replays >= 10
    assert engine.runner.kv_cache[:, :, scratch].abs().sum() > 0   # padding rows wrote there
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == hf_greedy(tiny_reference, p, 12), f"{len(p)} tokens"


def test_freed_host_memory_is_reused_without_page_faults():
    """After keep_freed_host_memory (what a CPU engine calls), a large temporary freed and
    taken again reuses the same pages: once the heap holds it, a fill faults in almost nothing
    (by default glibc maps 64 MB afresh each time and every 4 KB page faults: ~16,000)."""
    import resource

    from workers.device import keep_freed_host_memory
    if not keep_freed_host_memory():
        pytest.skip("the C library has no mallopt (not glibc)")

    def fill_faults() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.empty(64 << 20, dtype=torch.uint8)
        t.fill_(1)
        del t
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    # the heap grows to hold it first (an aligned request may not fit the chunk just freed,
    # and what else the process holds moves it): some fill after the first reuses the pages
    faults = [fill_faults() for _ in range(5)]
    assert min(faults[1:]) < 1000, faults
