"""LoRA adapters over HTTP on a disaggregated cluster (1 prefill + 1 decode worker, both with
the adapters): GET /v1/models lists each adapter as its own model id; a request selects one by
`model` (or the `lora` field, an alias) and gets the single engine's answer under that adapter,
prefilled on P and decoded on D; the same prompt under another adapter never hits the cache;
an unknown adapter is a 404 and the server keeps serving."""

from __future__ import annotations

import pytest
import requests
from conftest import make_engine

from cluster.config import load_config
from cluster.serve import start_server
from workers.lora import write_random_adapter
from workers.model_loader import base_config, load_model
from workers.request import SamplingParams

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root, config = tmp_path_factory.mktemp("lora"), base_config("tiny")
    return {"a1": str(write_random_adapter(root / "a1", config, rank=4, seed=1, std=0.3)),
            "a2": str(write_random_adapter(root / "a2", config, rank=8, seed=2, std=0.3,
                                           targets=("q_proj", "v_proj", "down_proj")))}


@pytest.fixture(scope="module")
def server(ray_session, adapters):
    cfg = load_config("configs/local.yaml", {
        "model.name": "tiny", "engine.num_blocks": 256, "transfer.transport": "shm",
        "workers.prefill.count": 1, "workers.decode.count": 1,
        "model.lora_adapters": adapters})
    handle = start_server(cfg, "127.0.0.1", 0)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def engine(adapters):
    return make_engine(load_model("tiny"), lora_adapters=adapters)


def _complete(server, prompt, **body):
    r = requests.post(f"{server.url}/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                            "return_token_ids": True, "temperature": 0.0, **body})
    return r


def _reference(engine, prompt, lora):
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return engine.generate([prompt], sp, lora_id=lora)[0].output_token_ids


def test_models_lists_each_adapter_as_a_model_id(server):
    data = requests.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [("tiny", None), ("a1", "tiny"),
                                                      ("a2", "tiny")]


def test_model_selects_the_adapter_on_prefill_and_decode_workers(server, engine):
    prompt = "The adapters change what comes next in this forty byte text"
    outputs = {}
    for name in ["tiny", "a1", "a2"]:
        r = _complete(server, prompt, model=name)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lc = choice["raypd_lifecycle"]
        assert lc["prefill_worker"] and lc["decode_worker"], lc   # went through P then D
        assert lc["cached_tokens"] == 0, (name, lc)   # same tokens, other adapter: no hit
        outputs[name] = choice["token_ids"]
    assert outputs["tiny"] == _reference(engine, prompt, "")
    assert outputs["a1"] == _reference(engine, prompt, "a1")
    assert outputs["a2"] == _reference(engine, prompt, "a2")
    assert len({tuple(v) for v in outputs.values()}) == 3
    again = _complete(server, prompt, model="a1").json()["choices"][0]
    assert again["token_ids"] == outputs["a1"] and again["raypd_lifecycle"]["cached_tokens"] > 0


def test_lora_field_is_an_alias_of_model(server, engine):
    prompt = "a short prompt for the alias"
    r = _complete(server, prompt, lora="a2")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == _reference(engine, prompt, "a2")


@pytest.mark.parametrize("body", [{"model": "nope"}, {"lora": "nope"}])
def test_unknown_adapter_is_404_and_the_server_keeps_serving(server, body):
    r = _complete(server, "hi", **body)
    assert r.status_code == 404, r.text
    assert "'nope'" in r.json()["error"]["message"]
    assert _complete(server, "hi", model="a1").status_code == 200


def test_unknown_adapter_raised_on_a_worker_is_a_404(ray_session):
    """The adapter list at the ingress and on a worker can disagree (a worker started with
    another config): the worker's refusal, wrapped by Ray, still answers 404 with its message."""
    import ray

    from ingress.errors import classify
    from protocol.errors import UnknownLoRAError

    @ray.remote
    def refuse():
        raise UnknownLoRAError("the LoRA adapter 'gone' does not exist; served: a1")

    with pytest.raises(Exception) as info:
        ray.get(refuse.remote())
    err = classify(info.value)
    assert (err.status, err.grpc_code, err.param) == (404, "NOT_FOUND", "model")
    assert "'gone'" in err.message
