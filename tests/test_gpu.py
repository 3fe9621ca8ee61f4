"""The engine on a GPU computes what stock transformers computes on the same GPU: greedy tokens
equal to `generate()` for the tiny model and SmolLM2 (float32), with CUDA graphs on and off;
one metadata copy per step; cuda_ipc moves pages bit-exactly between two actors sharing one GPU,
and a 1 prefill + 1 decode cluster on that GPU matches `generate()`.
Skipped without a GPU (scripts/gpu-first-contact.sh runs the same checks on one, without the
SmolLM2 checkpoint, which cannot travel to a machine with no network)."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import make_engine, random_prompt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

CUDA = torch.device("cuda", 0)


def hf_greedy_on(model, prompt_ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def tiny_cuda():
    from workers.model_loader import load_model
    engine_copy, reference = load_model("tiny"), load_model("tiny")[0].to(CUDA)
    return engine_copy, reference


@pytest.mark.parametrize("impl, graphs", [("compact", True), ("compact", False),
                                          ("stock", False)])
def test_tiny_greedy_on_cuda_matches_generate_on_cuda(tiny_cuda, impl, graphs):
    from workers.model_runner import ModelRunner
    from workers.request import SamplingParams
    loaded, reference = tiny_cuda
    if impl == "stock":   # the stock model is moved to the device in place: use its own copy
        from workers.model_loader import load_model
        loaded = load_model("tiny")
    engine = make_engine(loaded, device="cuda", cuda_graphs=graphs, model_impl=impl)
    stats = engine.get_stats()
    assert stats["device"] == "cuda" and stats["cuda_graphs"] == graphs
    assert stats["model_impl"] == impl
    assert engine.runner.kv_cache.device.type == "cuda"
    prompts = [random_prompt(n, seed=n) for n in (3, 17, 33, 64, 90, 5, 40, 128)]
    before, steps = ModelRunner.h2d_copies, 0
    reqs = [engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True))
            for p in prompts]
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert ModelRunner.h2d_copies - before == steps
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == hf_greedy_on(reference, p, 24), f"{len(p)}-token prompt"
    if graphs:
        assert engine.get_stats()["cuda_graph_replays"] > 0
    engine.check_invariants()


def test_smollm2_greedy_on_cuda_matches_generate_and_says_paris():
    from workers.engine import EngineConfig, LLMEngine
    from workers.model_loader import load_model
    from workers.request import SamplingParams
    loaded = load_model("smollm2", "float32")
    reference = load_model("smollm2", "float32")[0].to(CUDA)
    engine = LLMEngine(EngineConfig(model="smollm2", dtype="float32", device="cuda",
                                    num_blocks=512), loaded=loaded)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = engine.inputs.tokenize(chat)
    plain = [engine.inputs.tokenize("The quick brown fox"), random_prompt(200, seed=1, vocab=4000)]
    reqs = engine.generate([ids, *plain], SamplingParams(max_tokens=24, ignore_eos=True))
    for r in reqs:
        assert r.output_token_ids == hf_greedy_on(reference, r.prompt_token_ids, 24)
    assert "Paris" in reqs[0].output_text


@pytest.fixture(scope="module")
def ray_gpu(ray_session):
    import ray
    if ray.cluster_resources().get("GPU", 0) < 1:
        ray.shutdown()
        ray.init(address="local", num_cpus=4, num_gpus=torch.cuda.device_count(),
                 include_dashboard=False, log_to_driver=False)
    yield


def test_cuda_ipc_between_two_actors_sharing_one_gpu(ray_gpu):
    import ray
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    @ray.remote(num_gpus=0.5, num_cpus=0)
    class End:
        def __init__(self):
            from kvtransfer.endpoint import KVConsumer, KVProducer
            self.producer = KVProducer("cuda_ipc", lease_s=60, device="cuda")
            self.consumer = KVConsumer("cuda_ipc")

        def offer(self):
            g = torch.Generator(device="cuda").manual_seed(3)
            kv = torch.randn(4, 2, 10, 16, 2, 64, device="cuda", generator=g).to(torch.bfloat16)
            self.kv = kv
            # one staging a pull (a CUDA IPC export is received once)
            return [self.producer.offer_blocks("r", kv, [7, 2, 5], [1, 2, 3])
                    for _ in range(2)], kv[:, :, [7, 2, 5]].cpu()

        def pull(self, handles):
            pages, _ = self.consumer.pull(handles[0])
            assert pages.device.type == "cuda"
            dest = torch.zeros(4, 2, 10, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
            self.consumer.pull_into(handles[1], dest, [0, 1, 9])
            return pages.cpu(), dest[:, :, [0, 1, 9]].cpu()

        def ack(self, tid):
            return self.producer.ack(tid)

    p, d = End.remote(), End.remote()
    handles, expected = ray.get(p.offer.remote())
    assert all(h.export.kind == "cuda" for h in handles)
    pulled, scattered = ray.get(d.pull.remote(handles))
    assert torch.equal(pulled.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(scattered.view(torch.uint8), expected.view(torch.uint8))
    assert all(ray.get([p.ack.remote(h.transfer_id) for h in handles]))
    for a in (p, d):
        ray.kill(a)


def test_disagg_on_one_gpu_over_cuda_ipc_matches_generate(ray_gpu, tiny_cuda):
    from cluster.pd import PDCluster, PDConfig
    from router.orchestrator import FlowConfig
    from workers.request import SamplingParams
    _, reference = tiny_cuda
    cluster = PDCluster(PDConfig(engine={"model": "tiny", "num_blocks": 256, "device": "cuda"}, num_gpus_per_worker=0.5, flow=FlowConfig(transport="cuda_ipc")))
    try:
        assert {i["device"] for i in cluster.info} == {"cuda"}
        for n in (5, 40, 70):
            p = random_prompt(n, seed=50 + n)
            out = cluster.run_request(p, SamplingParams(max_tokens=16, ignore_eos=True))
            assert out.token_ids == hf_greedy_on(reference, p, 16)
            assert out.lifecycle.transfer_bytes > 0
        cluster.check_invariants()
    finally:
        cluster.shutdown()


def test_device_page_checksums_equal_the_host_computation():
    """wsum64 is made on P's GPU and may be checked on a CPU: both must give the same values."""
    from workers.kv_handoff import checksum_algo, page_checksums
    pages = torch.randn(4, 2, 40, 16, 2, 64, generator=torch.Generator().manual_seed(5)) \
        .to(torch.bfloat16)
    on_gpu = page_checksums(pages.to(CUDA))
    assert checksum_algo(on_gpu) == "wsum64"
    assert on_gpu == page_checksums(pages, "wsum64")
