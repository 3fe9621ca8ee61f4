"""The Python half of scripts/gpu-check.sh (standard library only, so it runs before anything is
installed): the no-GPU answer, the chat check against a running server, and the ONE JSON that
assembles every step's output with the issue's targets:

  transfer   cuda_ipc GB/s >= 0.5 x a device-to-device copy_ of the same bytes
  decode     engine decode tok/s at batch 64 >= 0.5 x the weights-read bound (within 2x)
  ttft       transfer <= 3% of TTFT at 4,096 tokens

    python scripts/gpu_check.py no-gpu REASON
    python scripts/gpu_check.py env OUT.json        (exit 1 when something is missing)
    python scripts/gpu_check.py chat URL OUT.json [--timeout S]
    python scripts/gpu_check.py assemble DIR        (prints the JSON; exit 0 only if all pass)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

TARGETS = {
    "transfer_vs_device_copy": (">=", 0.5),
    "decode_vs_bound_b64": (">=", 0.5),
    "transfer_share_of_ttft_4096": ("<=", 0.03),
}
CHAT_PROMPT = "What is the capital of France? Answer in one word."
# import name -> pip name of what the checks need (pyproject's dependencies + pytest)
MODULES = {"torch": "torch", "ray": "ray[default]", "transformers": "transformers",
           "gguf": "gguf", "accelerate": "accelerate", "safetensors": "safetensors",
           "grpc": "grpcio", "google.protobuf": "protobuf", "msgpack": "msgpack",
           "numpy": "numpy", "yaml": "pyyaml", "tqdm": "tqdm", "fastapi": "fastapi",
           "uvicorn": "uvicorn", "aiohttp": "aiohttp", "matplotlib": "matplotlib",
           "prometheus_client": "prometheus-client", "pytest": "pytest"}


def no_gpu(reason: str) -> dict:
    return {"ok": False, "error": f"no GPU: {reason}", "evidence": "none",
            "checks": {}, "targets": {}}


def environment() -> dict:
    """What this Python has: each needed module's version or why it is missing; torch's CUDA."""
    import importlib
    found, missing = {}, {}
    for mod, pip_name in MODULES.items():
        try:
            m = importlib.import_module(mod)
            found[mod] = getattr(m, "__version__", "?")
        except Exception as e:   # noqa: BLE001 - anything that stops the import
            missing[pip_name] = f"{type(e).__name__}: {e}"
    env = {"python": sys.executable, "version": sys.version.split()[0], "found": found,
           "missing": missing}
    if "torch" in found:
        import torch
        env.update(torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                   gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
    return env


def _load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def pytest_results(path: Path) -> dict:
    """{test name: passed | failed | skipped | error} from a junit XML file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return {"_error": f"no pytest results ({e})"}
    out = {}
    for case in root.iter("testcase"):
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = {"failure": "failed"}.get(child.tag, child.tag)
        out[case.get("name", "?")] = status
    return out


def target(value, op: str, bound: float) -> dict:
    if not isinstance(value, int | float):
        return {"value": None, "target": f"{op} {bound}", "pass": False,
                "why": "not measured"}
    ok = value >= bound if op == ">=" else value <= bound
    return {"value": value, "target": f"{op} {bound}", "pass": ok}


def assemble(directory: Path) -> dict:
    """Every step's output in `directory` (install.json, pytest.xml, chat.json,
    bench_engine.json, bench_transfer.json, steps.json) as one report."""
    steps = _load_json(directory / "steps.json") or {}
    install = _load_json(directory / "install.json") or {"_error": "no install record"}
    tests = pytest_results(directory / "pytest.xml")
    chat = _load_json(directory / "chat.json") or {"ok": False, "error": "no chat result"}
    engine = _load_json(directory / "bench_engine.json") or {}
    transfer = _load_json(directory / "bench_transfer.json") or {}
    values = {"transfer_vs_device_copy": transfer.get("transfer_vs_device_copy"),
              "decode_vs_bound_b64": engine.get("decode_vs_bound_b64"),
              "transfer_share_of_ttft_4096": transfer.get("transfer_share_of_ttft_4096")}
    targets = {k: target(values[k], *TARGETS[k]) for k in TARGETS}
    greedy = {k: v for k, v in tests.items() if "greedy" in k}
    checks = {
        "greedy_equality_cuda": {"pass": bool(greedy) and all(v == "passed"
                                                              for v in greedy.values()),
                                 "tests": greedy},
        "gpu_tests": {"pass": bool(tests) and "_error" not in tests
                      and all(v == "passed" for v in tests.values()), "tests": tests},
        "serve_1p1d_one_gpu_cuda_ipc_chat": {"pass": bool(chat.get("ok")), **chat},
    }
    evidence = {engine.get("evidence"), transfer.get("evidence")} - {None}
    logs = {}
    for name, check in (("pytest", checks["gpu_tests"]),
                        ("serve", checks["serve_1p1d_one_gpu_cuda_ipc_chat"]),
                        ("bench_engine", targets["decode_vs_bound_b64"]),
                        ("bench_transfer", targets["transfer_vs_device_copy"])):
        log = directory / f"{name}.log"
        if not check["pass"] and log.is_file():
            logs[name] = log.read_text(errors="replace").splitlines()[-25:]
    report = {
        "ok": all(c["pass"] for c in checks.values()) and all(t["pass"] for t in
                                                              targets.values()),
        "checks": checks, "targets": targets,
        "device_name": engine.get("device_name") or transfer.get("device_name"),
        "evidence": evidence.pop() if len(evidence) == 1 else sorted(evidence) or "none",
        "bench_engine": engine, "bench_transfer": transfer, "install": install, "steps": steps,
        "failed_logs": logs,
    }
    return report


def chat(url: str, out: Path, timeout_s: float) -> dict:
    """Wait for `url`/health, ask the chat question greedily, record whether it says Paris."""
    deadline = time.monotonic() + timeout_s
    result: dict = {"ok": False, "prompt": CHAT_PROMPT}
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            time.sleep(2)
    else:
        result["error"] = f"server at {url} not healthy within {timeout_s:.0f} s"
        out.write_text(json.dumps(result))
        return result
    body = json.dumps({"model": "smollm2", "max_tokens": 16, "temperature": 0,
                       "messages": [{"role": "user", "content": CHAT_PROMPT}]}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
        result.update(answer=answer, ok="paris" in answer.lower())
    except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
        result["error"] = f"{type(e).__name__}: {e}"
    out.write_text(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    ng = sub.add_parser("no-gpu")
    ng.add_argument("reason")
    en = sub.add_parser("env")
    en.add_argument("out", type=Path)
    ch = sub.add_parser("chat")
    ch.add_argument("url")
    ch.add_argument("out", type=Path)
    ch.add_argument("--timeout", type=float, default=300.0)
    asm = sub.add_parser("assemble")
    asm.add_argument("dir", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "no-gpu":
        print(json.dumps(no_gpu(args.reason), indent=2))
        return 2
    if args.cmd == "env":
        env = environment()
        args.out.write_text(json.dumps(env, indent=2))
        return 1 if env["missing"] else 0
    if args.cmd == "chat":
        return 0 if chat(args.url, args.out, args.timeout)["ok"] else 1
    report = assemble(args.dir)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
