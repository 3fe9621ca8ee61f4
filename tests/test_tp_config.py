"""Tensor-parallel sizes in the config chain: workers.prefill.tp / workers.decode.tp default to
PDConfig's, reach the PDConfig and each role's engine, a size the model's heads refuse is an
error naming the key and the rule, and `raypd generate`'s TP flags go through the same chain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cluster.config import SERVING, ConfigError, RaypdConfig, load_config, model_heads
from cluster.pd_config import MAX_TP, PDConfig


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "x.yaml"
    path.write_text(text)
    return path


def test_tp_keys_default_to_pd_configs_one():
    from cluster.config import DecodeSection, PrefillSection
    cfg = RaypdConfig()
    assert cfg.workers.prefill.tp == PDConfig().prefill_tp == 1
    assert cfg.workers.decode.tp == PDConfig().decode_tp == 1
    assert PrefillSection.__dataclass_fields__["tp"].metadata[SERVING] == (PDConfig, "prefill_tp")
    assert DecodeSection.__dataclass_fields__["tp"].metadata[SERVING] == (PDConfig, "decode_tp")
    local = yaml.safe_load((Path(__file__).parents[1] / "configs" / "local.yaml").read_text())
    assert local["workers"]["prefill"]["tp"] == local["workers"]["decode"]["tp"] == 1


def test_tp_keys_reach_the_pd_config(tmp_path):
    cfg = load_config(write(tmp_path, "model: {name: tiny}\n"
                            "workers: {prefill: {tp: 2}, decode: {tp: 4}}\n"))
    pd = cfg.to_pd_config()
    pd.validate()
    assert (pd.prefill_tp, pd.decode_tp) == (2, 4)
    assert "tp" not in pd.engine          # one shared engine dict; the role's TP is added at launch


@pytest.mark.parametrize("value", [0, MAX_TP + 1, 2.0])
def test_a_tp_out_of_range_is_an_error_naming_the_key(tmp_path, value):
    with pytest.raises(ConfigError, match=rf"workers.decode.tp: must be an integer >= 1 and "
                                          rf"<= {MAX_TP}, got {value}"):
        load_config(write(tmp_path, f"model: {{name: tiny}}\nworkers: {{decode: {{tp: {value}}}}}"))


def test_a_tp_the_query_heads_refuse_names_the_key_and_the_rule(tmp_path):
    # smollm2: 9 query heads, 3 KV heads
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "workers: {decode: {tp: 2}}\n"))
    assert str(e.value).startswith(f"{tmp_path / 'x.yaml'}: workers.decode.tp: tp 2 does not "
                                   "divide the model's 9 query heads")
    assert "'smollm2' has 9 query and 3 KV heads" in str(e.value)
    # on the command line, blamed on it; the other role is checked too
    with pytest.raises(ConfigError, match="command line: workers.prefill.tp: tp 2 does not"):
        load_config(None, {"workers.prefill.tp": 2})
    assert load_config(None, {"workers.decode.tp": 3}).workers.decode.tp == 3   # 9 / 3, 3 / 3


def test_a_tp_the_kv_heads_refuse_names_the_kv_rule(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 12,
         "num_key_value_heads": 6, "hidden_size": 96}))
    assert model_heads(str(folder)) == (12, 6)
    with pytest.raises(ConfigError, match="workers.prefill.tp: tp 8 does not divide the model's "
                                          "12 query heads"):
        load_config(None, {"model.name": str(folder), "workers.prefill.tp": 8})
    with pytest.raises(ConfigError, match="workers.prefill.tp: tp 4 neither divides the model's "
                                          "6 KV heads nor is a multiple of them"):
        load_config(None, {"model.name": str(folder), "workers.prefill.tp": 4})
    assert load_config(None, {"model.name": str(folder), "workers.decode.tp": 6})


def test_model_heads_are_read_without_weights():
    assert model_heads("tiny") == (4, 2)
    assert model_heads("smollm2") == (9, 3)
    assert model_heads("random:llama3-8b") == (32, 8)
    assert model_heads("random:no-such-shape") is None
    assert model_heads("/no/such/folder") is None        # a path only remote workers see


def test_a_remote_clusters_model_path_is_left_to_the_workers():
    cfg = load_config(None, {"model.name": "/models/on/the/cluster", "ray.address": "auto",
                             "workers.decode.tp": 2})
    assert cfg.to_pd_config().decode_tp == 2


def test_each_roles_worker_is_launched_with_its_roles_tp():
    """cluster/pd.py: the engine config a worker actor gets carries its role's TP (at TP 1
    here: a TP > 1 worker is launched in a placement group, which needs Ray)."""
    from cluster.pd import PDCluster
    launched = []

    class FakeActor:
        def __init__(self, role):
            self.role = role

        def remote(self, name, **kwargs):
            launched.append((self.role, name, kwargs))
            return object()

    cluster = PDCluster.__new__(PDCluster)          # no Ray: only _launch's inputs
    cluster.cfg = PDConfig()
    cluster._args = dict(engine_cfg={"model": "tiny"}, transport="shm", transport_cfg={},
                         lease_s=1.0)
    cluster._classes = {"prefill": FakeActor("prefill"), "decode": FakeActor("decode")}
    cluster._next_index = {"prefill": 0, "decode": 0}
    cluster._born = {}
    cluster._launch("prefill")
    cluster._launch("decode")
    assert [(r, n, k["engine_cfg"]) for r, n, k in launched] == [
        ("prefill", "prefill-0", {"model": "tiny", "tp": 1}),
        ("decode", "decode-0", {"model": "tiny", "tp": 1})]
    assert cluster._args["engine_cfg"] == {"model": "tiny"}   # the shared dict is left alone


# ---- raypd generate's flags --------------------------------------------------------------------
def _printed(argv, capsys) -> dict:
    from raypd.cli import main
    assert main(argv + ["--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_generate_tp_flags_set_the_config_keys(capsys):
    d = _printed(["generate", "--model", "tiny", "--disagg", "--prefill-tp", "2",
                  "--decode-tp", "4"], capsys)
    assert (d["workers"]["prefill"]["tp"], d["workers"]["decode"]["tp"]) == (2, 4)
    d = _printed(["generate", "--model", "tiny", "--tp", "2"], capsys)
    assert (d["workers"]["prefill"]["tp"], d["workers"]["decode"]["tp"]) == (1, 2)


@pytest.mark.parametrize("argv, words", [
    (["--disagg", "--tp", "2"], "--tp: use --prefill-tp / --decode-tp with --disagg"),
    (["--prefill-tp", "2"], "--prefill-tp: only with --disagg (without it: --tp)"),
    (["--decode-tp", "2", "--prefill-tp", "2"], "--prefill-tp, --decode-tp: only with --disagg"),
])
def test_generate_refuses_a_tp_flag_of_the_other_mode(argv, words):
    from raypd.cli import main
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--model", "tiny", *argv])
    assert words in str(e.value)


def test_a_refused_generate_tp_is_a_cli_error_naming_the_key_and_the_rule(capsys):
    from raypd.cli import main
    assert main(["generate", "--prompt", "x", "--disagg", "--decode-tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "command line: workers.decode.tp: tp 2 does not divide the model's 9 query heads" \
        in err
    assert main(["generate", "--prompt", "x", "--model", "tiny", "--tp", "16"]) == 2
    assert "workers.decode.tp: must be an integer >= 1 and <= 8, got 16" in capsys.readouterr().err


def test_generate_tp_sets_the_engines_tp(monkeypatch, capsys):
    """Without --disagg the engine in this process gets EngineConfig.tp = --tp."""
    import workers.engine
    built = []

    class FakeEngine:
        def __init__(self, cfg):
            built.append(cfg)

        def add_request(self, *args, **kwargs):
            class Req:
                output_text, output_token_ids = "ok", []

                class lifecycle:   # noqa: N801 - the request's attribute
                    @staticmethod
                    def to_dict():
                        return {}
            return Req()

        def has_unfinished(self):
            return False

        def check_invariants(self):
            pass

        def get_stats(self):
            return {}
    monkeypatch.setattr(workers.engine, "LLMEngine", FakeEngine)
    from raypd.cli import main
    assert main(["generate", "--prompt", "x", "--model", "tiny", "--tp", "2"]) == 0
    assert built[0].tp == 2 and built[0].model == "tiny"
    assert main(["generate", "--prompt", "x", "--model", "tiny"]) == 0
    assert built[1].tp == 1
    capsys.readouterr()
