"""LoRA adapters run for real: greedy output under an adapter is token-identical to PEFT's own
model under generate(), on the compact and the stock model path; one batch mixing two adapters
and the base gives each its own reference; the cache never shares blocks across adapters (the
namespace holds the adapter's content hash, not its name); unknown adapters and bad folders
are refused with errors naming them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, make_engine, random_prompt
from peft import LoraConfig, PeftModel, get_peft_model

from protocol.errors import UnknownLoRAError
from workers.lora import LoRAError, read_adapter
from workers.model_loader import load_model
from workers.request import SamplingParams

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
ADAPTERS = {   # name: (rank, alpha, target modules, use_rslora)
    "all": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                    "down_proj"], False),
    "qv": (4, 4, ["q_proj", "v_proj"], True),
}
PROMPT_LENS = [5, 19, 33, 8]


def _make_peft_adapter(folder, seed: int, rank: int, alpha: int, targets, rslora: bool):
    """Save a PEFT adapter with random non-zero A and B (PEFT initialises B to zero)."""
    base, _, _ = load_model("tiny")
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                            use_rslora=rslora, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {name: str(_make_peft_adapter(root / name, seed, *spec))
            for seed, (name, spec) in enumerate(ADAPTERS.items(), start=1)}


@pytest.fixture(scope="module")
def references(adapters):
    """{adapter name or "": [greedy tokens per prompt]} from PEFT's / transformers' generate()."""
    prompts = [random_prompt(n, seed=i) for i, n in enumerate(PROMPT_LENS)]
    refs = {}
    for name in ["", *adapters]:
        base, _, _ = load_model("tiny")
        model = PeftModel.from_pretrained(base, adapters[name]).eval() if name else base
        refs[name] = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    return prompts, refs


def _engine(adapters, **kw):
    return make_engine(load_model("tiny"), lora_adapters=adapters, **kw)


def _drained(engine) -> None:
    engine.check_invariants()
    assert engine.kv.pool.counts()["referenced"] == 0


@pytest.mark.parametrize("impl", ["compact", "stock"])
@pytest.mark.parametrize("name", list(ADAPTERS))
def test_greedy_under_adapter_equals_peft_generate(adapters, references, impl, name):
    prompts, refs = references
    engine = _engine(adapters, model_impl=impl)
    assert engine.runner.model_impl == impl
    got = [r.output_token_ids for r in engine.generate(prompts, GREEDY, lora_id=name)]
    assert got == refs[name]
    assert refs[name] != refs[""], "the adapter must change the output for this test to mean much"
    _drained(engine)


@pytest.mark.parametrize("impl", ["compact", "stock"])
def test_mixed_batch_of_two_adapters_and_base_each_match_reference(adapters, references, impl):
    prompts, refs = references
    engine = _engine(adapters, model_impl=impl)
    reqs = {}
    for name in ["", *adapters]:
        for i, p in enumerate(prompts):
            reqs[(name, i)] = engine.add_request(p, GREEDY, lora_id=name)
    mixed_steps = 0
    while engine.has_unfinished():
        running = {r.lora_name for r in engine.scheduler.running}
        engine.step()
        mixed_steps += len(running) == 3
    assert mixed_steps > 0, "the three models never shared a step"
    for (name, i), req in reqs.items():
        assert req.output_token_ids == refs[name][i], (name, i)
    _drained(engine)


def test_lru_eviction_beyond_max_loras_keeps_outputs_right(adapters, references):
    prompts, refs = references
    engine = _engine(adapters, max_loras=1)
    reqs = [(name, i, engine.add_request(p, GREEDY, lora_id=name))
            for i, p in enumerate(prompts) for name in adapters]
    while engine.has_unfinished():
        engine.step()
        assert len({r.lora_name for r in engine.scheduler.running} - {""}) <= 1
    for name, i, req in reqs:
        assert req.output_token_ids == refs[name][i]
    stats = engine.get_stats()
    assert stats["lora_evictions"] > 0 and stats["lora_loads"] == stats["lora_evictions"] + 1
    assert stats["lora_requests"] == {name: len(prompts) for name in adapters}


def test_same_tokens_under_another_adapter_or_base_never_hit(adapters):
    engine = _engine(adapters)
    prompt = random_prompt(64, seed=7)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    first = engine.generate([prompt], one, lora_id="all")[0]
    assert first.lifecycle.cached_tokens == 0
    for other in ["qv", ""]:
        assert engine.generate([prompt], one, lora_id=other)[0].lifecycle.cached_tokens == 0
    again = engine.generate([prompt], one, lora_id="all")[0]
    assert again.lifecycle.cached_tokens == 48   # the same adapter does hit (3 full blocks)
    _drained(engine)


def test_namespace_is_the_content_hash_not_the_name(adapters, tmp_path):
    engine = _engine({"all": adapters["all"], "alias": adapters["all"], "qv": adapters["qv"]})
    prompt = random_prompt(40, seed=9)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate([prompt], one, lora_id="all")
    assert engine.generate([prompt], one, lora_id="alias")[0].lifecycle.cached_tokens == 32
    # a changed adapter under the same name gets another hash, so never the old blocks
    base, _, _ = load_model("tiny")
    changed = _make_peft_adapter(tmp_path / "all", 99, *ADAPTERS["all"])
    assert read_adapter("all", changed, base.config).content_hash != \
        engine.loras["all"].content_hash


def test_unknown_adapter_is_refused_not_served_by_the_base(adapters):
    engine = _engine(adapters)
    with pytest.raises(UnknownLoRAError, match="'nope'.*all, qv"):
        engine.inputs.make_request([5, 6, 7], GREEDY, lora_id="nope")
    assert engine.stats.requests_rejected == 1


def test_bad_adapter_folders_fail_at_start_naming_the_file(adapters, tmp_path):
    base, _, _ = load_model("tiny")
    with pytest.raises(LoRAError, match="adapter_config.json does not exist"):
        read_adapter("x", tmp_path, base.config)
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads(Path(adapters["qv"], "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "lm_head"]
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    shutil.copy(Path(adapters["qv"], "adapter_model.safetensors"), bad)
    with pytest.raises(LoRAError, match=r"bad/adapter_config.json.*lm_head"):
        read_adapter("x", bad, base.config)
    cfg["target_modules"] = ["q_proj", "v_proj"]
    cfg["r"] = 6   # the weights have rank 4
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoRAError, match=r"adapter_model.safetensors.*shape"):
        read_adapter("x", bad, base.config)
    with pytest.raises(LoRAError, match="'gone'.*gone is not a directory"):
        make_engine(load_model("tiny"), lora_adapters={"gone": str(tmp_path / "gone")})


def test_bench_engine_lora_reports_the_mixed_batch_throughput_ratio():
    from raypd.bench.engine import run_engine_bench
    out = run_engine_bench(model="tiny", quick=True, repeats=1, lora=2, lora_only=True)
    assert out["lora_adapters"] == 2 and out["lora_loads"] == 2
    assert out["lora_throughput_ratio"] > 0 and out["lora_output_tokens"] > 0


def test_a_worker_refuses_a_request_admitted_under_another_adapter_namespace(adapters):
    """The admitted request that crosses to the prefill worker carries the namespace root it
    was hashed under (the adapter's content hash): a worker whose adapter of that name has
    other weights refuses it before computing or staging anything; the same files pass."""
    from protocol.errors import RequestError
    from protocol.messages import AdmittedRequest
    d = make_engine(load_model("tiny"), lora_adapters=adapters)
    req = d.inputs.make_request(random_prompt(40, seed=5), SamplingParams(max_tokens=4),
                         request_id="r1", lora_id="all")
    admitted = AdmittedRequest("r1", 0, tuple(req.prompt_token_ids), tuple(req.block_hashes),
                               req.block_size, req.namespace_root, req.sampling, 1e18, "",
                               "all")
    same = make_engine(load_model("tiny"), lora_adapters={"all": adapters["all"]})
    assert same.handoff.admitted_request(admitted).lora_name == "all"
    other = make_engine(load_model("tiny"), lora_adapters={"all": adapters["qv"]})
    with pytest.raises(RequestError, match="another cache namespace"):
        other.handoff.admitted_request(admitted)
    assert other.kv.pool.counts()["referenced"] == 0


def test_locality_prefers_the_worker_with_the_adapter_resident_and_counts_the_load():
    from router.policies import Locality, RoutingRequest, WorkerState
    ws = [WorkerState("p0", lora_load_s=0.4), WorkerState("p1", loras_resident=("a",),
                                                          lora_load_s=0.4)]
    req = RoutingRequest("r", [], 64, 16, lora="a")
    policy = Locality()
    d = policy.choose_prefill(req, ws, {})
    assert d.worker_id == "p1"
    t_cold, _ = policy.estimate(req, ws[0], 0)
    t_warm, _ = policy.estimate(req, ws[1], 0)
    assert t_cold - t_warm == pytest.approx(0.4)
    base = RoutingRequest("b", [], 64, 16)
    assert policy.estimate(base, ws[0], 0) == policy.estimate(base, ws[1], 0)


def test_engine_stats_count_requests_tokens_and_hits_per_adapter(adapters):
    from protocol.metric_names import WORKER_ADAPTER_COUNTERS, WORKER_COUNTERS
    engine = _engine(adapters)
    prompt = random_prompt(40, seed=11)
    one = SamplingParams(max_tokens=2, ignore_eos=True)
    for name in ["all", "all", "qv", ""]:
        engine.generate([prompt], one, lora_id=name)
    stats = engine.get_stats()
    assert stats["lora_requests"] == {"all": 2, "qv": 1}
    assert stats["lora_prompt_tokens"] == {"all": 80, "qv": 40}
    assert stats["lora_hit_tokens"] == {"all": 32, "qv": 0}   # the second "all" hit 2 blocks
    assert stats["lora_tokens"]["all"] == 40 + 1 + 8 + 1 and stats["lora_resident"] == ["all",
                                                                                          "qv"]
    for key, _ in WORKER_ADAPTER_COUNTERS.values():
        assert key in stats
    assert "lora_loads" in stats and WORKER_COUNTERS["raypd_lora_loads"][0] == ("lora_loads",)


def test_decode_reservations_count_against_max_loras(adapters):
    """A reservation awaiting its KV will run: another adapter beyond max_loras waits."""
    engine = _engine(adapters, max_loras=1)
    a = engine.inputs.make_request(random_prompt(20, seed=1), GREEDY, lora_id="all")
    b = engine.inputs.make_request(random_prompt(20, seed=2), GREEDY, lora_id="qv")
    same = engine.inputs.make_request(random_prompt(20, seed=3), GREEDY, lora_id="all")
    assert engine.handoff.reserve(a) == 0
    assert engine.handoff.reserve(b) is None          # nothing reserved for it
    assert engine.handoff.reserve(same) == 0
    engine.add_request(request=engine.inputs.make_request([5, 6, 7], GREEDY, lora_id="qv"), prompt=None)
    assert engine.scheduler.schedule().chunks == []  # the queued "qv" request waits for a slot


def test_a_workers_prefill_speed_leaves_out_its_adapter_loads(adapters, monkeypatch):
    """An adapter loads inside the engine step that first needs it. The worker reports that
    time on its own (lora_load_s, which the router charges where the adapter is not resident),
    so the step's seconds that its prefill fit measures leave the load out: a worker that
    just loaded an adapter is not slower at prefill, and the router does not charge the load
    twice."""
    import time

    from protocol.messages import RequestInput
    from protocol.step_rates import StepRates
    from workers import lora as lora_mod
    from workers.decode_host import DecodeHost
    from workers.prefill_host import PrefillHost
    real_load_weights = lora_mod.load_weights

    def slow_load_weights(spec):            # a slow disk: the load takes 0.5 s more
        time.sleep(0.5)
        return real_load_weights(spec)
    monkeypatch.setattr(lora_mod, "load_weights", slow_load_weights)
    cfg = dict(model="tiny", num_blocks=32, block_size=16, lora_adapters=adapters)
    p, d = PrefillHost("prefill-l", cfg, transport="shm"), DecodeHost("decode-l", cfg,
                                                                      transport="shm")
    try:
        steps = []

        class Recorded(StepRates):
            def observe_prefill(self, seconds, chunks):
                steps.append((seconds, list(chunks)))
                super().observe_prefill(seconds, chunks)
        p.rates = Recorded()
        adm = d.admit(RequestInput("r", tuple(random_prompt(40, seed=3)),
                                   SamplingParams(max_tokens=2), time.time() + 60,
                                   lora_id="all"))
        assert adm.admitted
        p.prefill(adm.request, adm.plan)
        assert p.load_report().lora_load_s >= 0.5          # the load, reported on its own
        assert [chunks for _, chunks in steps] == [[(40, 0)]]
        assert steps[0][0] < 0.5                            # the step, without the load
    finally:
        p.shutdown()
        d.shutdown()
