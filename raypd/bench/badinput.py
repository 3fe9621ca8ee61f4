"""`raypd bench badinput`: run the bad-input catalogue (raypd/bench/badinput_catalogue.yaml) against a
server and report, as JSON, how many cases got their expected answer and whether the server
stayed sound after each one.

    raypd bench badinput --url http://127.0.0.1:8000 [--grpc 127.0.0.1:8001]
                         [--keys-file keys.yaml] --json badinput.json

After every HTTP or gRPC case the server must answer /health with 200, serve a good request,
and hold no referenced KV block (from /api/stats, waited for up to `--settle-s`). A case is
`clean` (expected status, server sound), `wrong_status` (server sound, other status), or
`server_broken`; cases that need what was not given (gRPC address, keys file) are `skipped`.
Trace and config cases run here, through `raypd submit`'s loader and the config loader.
"""

from __future__ import annotations

import http.client
import json
import socket
import tempfile
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

CATALOGUE = Path(__file__).with_name("badinput_catalogue.yaml")
GOOD_BODY = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
BASE_BODY = {"prompt": "hello world", "max_tokens": 4}


@dataclass
class CaseResult:
    name: str
    kind: str
    expected: Any
    got: Any = None
    message: str = ""
    outcome: str = "skipped"     # clean | wrong_status | server_broken | skipped
    why: str = ""


@dataclass
class Target:
    url: str
    grpc: str | None = None
    keys: dict[str, str] = field(default_factory=dict)     # key name -> key
    slow_wait_s: float = 15.0     # how long a stalling client waits for the server to act
    settle_s: float = 10.0        # how long blocks may take to be released after a case
    timeout_s: float = 120.0

    @property
    def host_port(self) -> tuple[str, int]:
        u = urllib.parse.urlsplit(self.url)
        return u.hostname or "127.0.0.1", u.port or 80

    def auth(self, name: str | None) -> dict[str, str]:
        name = name or "admin"
        if name == "none" or not self.keys:
            return {}
        if name == "wrong":
            return {"Authorization": "Bearer not-a-key-of-this-server"}
        return {"Authorization": f"Bearer {self.keys[name]}"}


def load_catalogue(path: str | Path = CATALOGUE) -> list[dict]:
    cases = yaml.safe_load(Path(path).read_text())
    names = [c["name"] for c in cases]
    assert len(set(names)) == len(names), "case names must be unique"
    return cases


def read_keys(path: str | Path) -> dict[str, str]:
    """name -> key from a server keys file (ingress/auth.py format)."""
    raw = yaml.safe_load(Path(path).read_text())
    return {str(k.get("name") or f"key-{i}"): k["key"] for i, k in enumerate(raw["keys"])}


# ---- HTTP ----------------------------------------------------------------------------------------
def http_request(t: Target, method: str, path: str, body: bytes | None,
                 headers: dict[str, str], send_bytes: int | None = None) -> tuple[int, str]:
    """One request; `send_bytes` sends only that much of the body (its Content-Length stays
    the whole body's): for refusals made from the headers, so that no unread byte makes the
    server's close a reset that would lose its answer."""
    host, port = t.host_port
    conn = http.client.HTTPConnection(host, port, timeout=t.timeout_s)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        hdrs = {k.lower(): v for k, v in headers.items()}
        if body is not None and "content-length" not in hdrs:
            hdrs["content-length"] = str(len(body))
        for k, v in hdrs.items():
            conn.putheader(k, v)
        conn.endheaders()
        if body and send_bytes != 0:
            conn.send(body if send_bytes is None else body[:send_bytes])
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    finally:
        conn.close()


def _error_text(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:500]


def _gen_body(gen: dict) -> bytes:
    if "nest" in gen:
        n = gen["nest"]
        return ('{"prompt": "x", "a": ' + "[" * n + "]" * n + "}").encode()
    if "digits" in gen:
        return ('{"prompt": "x", "max_tokens": 1' + "0" * gen["digits"] + "}").encode()
    if "pad_bytes" in gen:
        return json.dumps({"prompt": "x", "pad": "a" * gen["pad_bytes"]}).encode()
    if "prompt_tokens" in gen:
        return json.dumps({"prompt": [5] * gen["prompt_tokens"], "max_tokens": 2}).encode()
    if "prompt_batch" in gen:
        return json.dumps({"prompt": ["a"] * gen["prompt_batch"], "max_tokens": 2}).encode()
    if "messages" in gen:
        return json.dumps({"messages": [{"role": "user", "content": "x"}] * gen["messages"],
                           "max_tokens": 2}).encode()
    raise ValueError(f"unknown gen {gen!r}")


def run_http(t: Target, c: dict) -> tuple[Any, str]:
    if c.get("slow"):
        return _run_slow(t, c["slow"], c.get("path", "/v1/completions"))
    method = c.get("method", "POST")
    path = c.get("path", "/v1/completions")
    if "gen" in c:
        body: bytes | None = _gen_body(c["gen"])
    elif "raw_hex" in c:
        body = bytes.fromhex(c["raw_hex"])
    elif "raw" in c:
        body = c["raw"].encode()
    elif method == "POST":
        payload = c.get("json", {})
        if not path.startswith("/admin"):
            payload = {**BASE_BODY, **payload}
        body = json.dumps(payload).encode()
    else:
        body = None
    headers = {**t.auth(c.get("auth")), **(c.get("headers") or {})}
    if body is not None:
        headers.setdefault("Content-Type", c.get("content_type", "application/json"))
    status, text = 0, ""
    for _ in range(c.get("repeat", 1)):
        status, text = http_request(t, method, path, body, headers, c.get("send_bytes"))
    return status, _error_text(text) if status >= 400 else ""


def _run_slow(t: Target, what: str, path: str) -> tuple[Any, str]:
    """A client that stalls: sends half its headers (or half its body) and waits."""
    host, port = t.host_port
    s = socket.create_connection((host, port), timeout=t.slow_wait_s)
    try:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
        if what == "headers":
            s.sendall(head.encode())
        else:
            auth = "".join(f"{k}: {v}\r\n" for k, v in t.auth(None).items())
            s.sendall((head + auth + "Content-Type: application/json\r\nContent-Length: 100"
                       "\r\n\r\n{\"prompt\": ").encode())
        try:
            data = s.recv(65536)
        except TimeoutError:
            return "open", f"the server kept the stalled connection for {t.slow_wait_s:g} s"
        if not data:
            return "closed", ""
        while b"\r\n\r\n" not in data or len(data) < _answer_length(data):
            more = s.recv(65536)
            if not more:
                break
            data += more
        line, _, rest = data.decode("latin-1").partition("\r\n")
        status = int(line.split()[1])
        return status, _error_text(rest.partition("\r\n\r\n")[2])
    finally:
        s.close()


def _answer_length(data: bytes) -> int:
    """Bytes of a whole HTTP answer (head + Content-Length body), from its head."""
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return len(head) + 4 + int(v.strip())
    return len(head) + 4


# ---- gRPC ------------------------------------------------------------------------------------------
def run_grpc(t: Target, c: dict) -> tuple[Any, str]:
    import grpc
    from google.protobuf import json_format

    from ingress import raypd_pb2 as pb
    from ingress import raypd_pb2_grpc as pb_grpc
    if "gen" in c:
        req = pb.GenerateRequest(prompt_token_ids=[5] * c["gen"]["prompt_tokens"])
    else:
        req = json_format.ParseDict(c.get("request", {}), pb.GenerateRequest())
    if not req.HasField("sampling"):
        req.sampling.max_tokens = 4
    md = [(k.lower(), v) for k, v in t.auth(c.get("auth")).items()]
    outcomes: list[tuple[str, str]] = []
    with grpc.insecure_channel(t.grpc) as channel:
        stub = pb_grpc.RaypdStub(channel)

        def one() -> None:
            try:
                list(stub.Generate(req, metadata=md, timeout=t.timeout_s))
                outcomes.append(("OK", ""))
            except grpc.RpcError as e:
                outcomes.append((e.code().name, e.details() or ""))
        threads = [threading.Thread(target=one) for _ in range(c.get("concurrent", 1))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    bad = [o for o in outcomes if o[0] != "OK"]
    return bad[0] if bad else outcomes[0]


# ---- files -----------------------------------------------------------------------------------------
def run_file(c: dict) -> tuple[Any, str]:
    with tempfile.TemporaryDirectory() as d:
        text = c["file"]
        if "keys_file" in c:
            keys = Path(d) / "keys.yaml"
            keys.write_text(c["keys_file"])
            text = text.replace("KEYS_FILE", str(keys))
        path = Path(d) / ("trace.jsonl" if c["kind"] == "trace" else "config.yaml")
        path.write_text(text)
        try:
            if c["kind"] == "trace":
                from raypd.replay.workload import load_workload
                load_workload(path)
            else:
                from cluster.config import load_config
                load_config(path)
        except ValueError as e:       # TraceError, ConfigError, RequestError
            return "error", str(e)
        return "ok", ""


# ---- soundness after each case --------------------------------------------------------------------
def server_sound(t: Target) -> str:
    """'' when healthy, serving and holding no referenced block; else what is wrong."""
    try:
        status, text = http_request(t, "GET", "/health", None, {})
        if status != 200:
            return f"/health answered {status}: {text[:200]}"
        status, text = http_request(t, "POST", "/v1/completions",
                                    json.dumps(GOOD_BODY).encode(),
                                    {**t.auth("admin"), "Content-Type": "application/json"})
        if status != 200:
            return f"a good request got {status}: {_error_text(text)[:200]}"
        deadline = time.monotonic() + t.settle_s
        while True:
            status, text = http_request(t, "GET", "/api/stats?requests=0", None,
                                        t.auth("admin"))
            if status != 200:
                return ""                  # no stats to look at (no admin key): not judged
            used = {a["worker_id"]: a.get("blocks_used") for a in json.loads(text)["actors"]}
            if all(not u for u in used.values()):
                return ""
            if time.monotonic() > deadline:
                return f"blocks still referenced {t.settle_s:g} s after the case: {used}"
            time.sleep(0.1)
    except (OSError, http.client.HTTPException) as e:
        return f"the server did not answer: {type(e).__name__}: {e}"


def run_case(t: Target, c: dict) -> CaseResult:
    r = CaseResult(c["name"], c["kind"], c["expect"])
    if c.get("needs_keys") and not t.keys:
        r.why = "needs the server's keys file (--keys-file)"
        return r
    if c["kind"] == "grpc" and not t.grpc:
        r.why = "needs the gRPC address (--grpc)"
        return r
    try:
        if c["kind"] == "http":
            r.got, r.message = run_http(t, c)
        elif c["kind"] == "grpc":
            r.got, r.message = run_grpc(t, c)
        else:
            r.got, r.message = run_file(c)
    except (OSError, http.client.HTTPException) as e:
        r.got, r.message = "no answer", f"{type(e).__name__}: {e}"
    matched = r.got == c["expect"] and (not c.get("contains") or c["contains"] in r.message)
    broken = server_sound(t) if c["kind"] in ("http", "grpc") else ""
    if broken:
        r.outcome, r.why = "server_broken", broken
    else:
        r.outcome = "clean" if matched else "wrong_status"
        if not matched:
            r.why = f"expected {c['expect']!r}" + (f" with {c['contains']!r}"
                                                   if c.get("contains") else "")
    return r


def run_catalogue(t: Target, cases: list[dict] | None = None) -> dict:
    cases = load_catalogue() if cases is None else cases
    t0 = time.monotonic()
    results = [run_case(t, c) for c in cases]
    ran = [r for r in results if r.outcome != "skipped"]
    by_kind: dict[str, dict[str, int]] = {}
    for r in results:
        k = by_kind.setdefault(r.kind, {"cases": 0, "clean": 0, "wrong_status": 0,
                                        "server_broken": 0, "skipped": 0})
        k[r.outcome] += 1
        k["cases"] += r.outcome != "skipped"
    return {"cases": len(ran), "clean": sum(r.outcome == "clean" for r in ran),
            "wrong_status": sum(r.outcome == "wrong_status" for r in ran),
            "server_broken": sum(r.outcome == "server_broken" for r in ran),
            "skipped": len(results) - len(ran), "by_kind": by_kind,
            "seconds": round(time.monotonic() - t0, 1),
            "failures": [asdict(r) for r in ran if r.outcome != "clean"],
            "results": [asdict(r) for r in results]}


# ---- command line ---------------------------------------------------------------------------------


