"""The bad-input catalogue (raypd/bench/badinput_catalogue.yaml) against a real `raypd serve --model
tiny` subprocess with API keys and gRPC: every case gets its expected status and message, and
after each one the server is healthy, serves a good request and holds no referenced block."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from raypd.bench.badinput import Target, load_catalogue, read_keys, run_catalogue

ROOT = Path(__file__).resolve().parents[1]
KEYS = """keys:
  - {name: admin, key: adm-0123456789, scopes: [inference, admin]}
  - {name: acme, key: acme-0123456789, tenant: acme, scopes: [inference]}
  - {name: globex, key: globex-0123456789, tenant: globex, scopes: [inference]}
  - {name: slow, key: slow-0123456789, scopes: [inference], rate_limit_rps: 0.2}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("badinput")
    (d / "keys.yaml").write_text(KEYS)
    port, grpc_port = _free_port(), _free_port()
    (d / "serve.yaml").write_text(f"""
model: {{name: tiny, max_model_len: 128}}
engine: {{num_blocks: 256}}
server:
  port: {port}
  grpc_port: {grpc_port}
  api_keys_file: {d / "keys.yaml"}
  limits: {{header_timeout_s: 1, body_timeout_s: 1}}
ray: {{num_cpus: 2}}
""")
    log = open(d / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "raypd.cli", "serve", "--config",
                             str(d / "serve.yaml"), "--log-level", "warning"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, (d / "serve.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "raypd serve did not come up"
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        time.sleep(0.5)
    yield Target(url, f"127.0.0.1:{grpc_port}", read_keys(d / "keys.yaml"), slow_wait_s=5.0)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def test_the_catalogue_has_60_cases_over_http_grpc_traces_and_configs():
    kinds = Counter(c["kind"] for c in load_catalogue())
    assert sum(kinds.values()) >= 60
    assert set(kinds) == {"http", "grpc", "trace", "config"}


@pytest.mark.integration
def test_every_case_gets_its_answer_and_leaves_the_server_sound(served):
    result = run_catalogue(served)
    assert result["skipped"] == 0
    assert result["cases"] == len(load_catalogue())
    assert result["clean"] == result["cases"], json.dumps(result["failures"], indent=1)[:6000]
    assert result["wrong_status"] == 0 and result["server_broken"] == 0


@pytest.mark.integration
def test_bench_badinput_command_writes_the_counts(served, tmp_path):
    from raypd.cli import main
    some = [c for c in load_catalogue() if c["name"] in
            ("seed_above_int64", "grpc_unknown_model", "config_not_yaml", "no_key")]
    (tmp_path / "some.yaml").write_text(json.dumps(some))
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)
    out = tmp_path / "badinput.json"
    rc = main(["bench", "badinput", "--url", served.url, "--grpc", served.grpc,
               "--keys-file", str(keys), "--catalogue", str(tmp_path / "some.yaml"),
               "--json", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0
    assert (doc["cases"], doc["clean"], doc["wrong_status"], doc["server_broken"]) == (4, 4, 0, 0)


@pytest.mark.integration
def test_keys_bind_tenants_cached_prefixes_stay_inside_one(served):
    from raypd.bench.badinput import http_request
    prompt = [7 + i for i in range(40)]          # token ids: 2 full blocks

    def cached(key: str) -> int:
        status, text = http_request(served, "POST", "/v1/completions",
                                    json.dumps({"prompt": prompt, "max_tokens": 2}).encode(),
                                    {**served.auth(key), "Content-Type": "application/json"})
        assert status == 200, text
        return json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"]
    cached("acme")
    assert cached("acme") > 0          # acme's second request hits acme's cache
    assert cached("globex") == 0       # globex's identical prompt sees none of it
