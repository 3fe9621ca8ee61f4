"""The steps of scripts/gpu-first-contact.sh, cheapest and most telling first, each in its own
process with its own time limit inside one budget for the whole run:

  a probe           versions, imports, SDPA+GQA, a CUDA graph, CUDA IPC, NCCL   (probe.py)
  b greedy          engine == generate() on cuda: tiny, random:smollm2-135m   (greedy.py)
  c disagg_ipc      1P+1D over cuda_ipc with Ray; P's memory across expiries  (disagg_ipc.py)
  d decode_kernel   Triton paged decode vs the gather path, a Llama-3-8B layer (decode_kernel.py)
  d bench_engine    random:llama3-8b bf16, CUDA graphs on, then off           (raypd bench engine)
  e bench_transfer  cuda_ipc vs a device copy_, share of TTFT at 4k            (raypd bench transfer)

    python scripts/gpu/first_contact.py --work DIR --out DIR [--dry-run] [--steps a,c]

Invariants: a step never runs past its limit or the budget (its whole process group is
killed); when (a) fails nothing else runs (everything after needs what it checks); the run
writes exactly two files to --out (first-contact.json and first-contact-logs.tar.gz: every
step's log and JSON) and prints the JSON last on stdout. Exit 0 when every step that ran and
every target passed, 1 otherwise, 2 when there is no GPU (not in a dry run).
--dry-run runs the same steps on the CPU with stand-ins (tiny models, shm for cuda_ipc,
targets not judged)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "scripts" / "gpu"
REPORT = "first-contact.json"
LOGS = "first-contact-logs.tar.gz"
BENCH_MODEL = "random:llama3-8b"
TARGETS = {   # issue 26's targets on the H200: (step, key in its JSON, op, bound)
    "decode_vs_bound_b64": ("bench_engine_graphs", "decode_vs_bound_b64", ">=", 0.5),
    "transfer_vs_device_copy": ("bench_transfer", "transfer_vs_device_copy", ">=", 0.5),
    "transfer_share_of_ttft_4096": ("bench_transfer", "transfer_share_of_ttft_4096", "<=",
                                    0.03),
}


@dataclass(frozen=True)
class Step:
    name: str
    letter: str
    limit_s: int
    argv: tuple[str, ...]   # "{json}" stands for the step's JSON path


def steps(dry: bool) -> list[Step]:
    py = sys.executable
    cli = (py, "-m", "raypd.cli")
    if dry:
        engine = (*cli, "bench", "engine", "--model", "tiny", "--quick", "--device", "cpu",
                  "--repeats", "1", "--json", "{json}")
        transfer = (*cli, "bench", "transfer", "--quick", "--model", "tiny", "--transports", "shm",
                    "--sizes-mib", "1", "--ttft-prompt-tokens", "256", "--json", "{json}")
    else:
        engine = (*cli, "bench", "engine", "--model", BENCH_MODEL, "--device", "cuda",
                  "--dtype", "bfloat16", "--repeats", "2", "--json", "{json}")
        transfer = (*cli, "bench", "transfer", "--device", "cuda", "--model", BENCH_MODEL,
                    "--ttft-prompt-tokens", "4096", "--json", "{json}")
    return [
        Step("probe", "a", 60, (py, str(GPU / "probe.py"), "{json}")),
        Step("greedy", "b", 100, (py, str(GPU / "greedy.py"), "{json}")),
        Step("disagg_ipc", "c", 100, (py, str(GPU / "disagg_ipc.py"), "{json}")),
        Step("decode_kernel", "d", 60, (py, str(GPU / "decode_kernel.py"), "{json}")),
        Step("bench_engine_graphs", "d", 90, engine),
        Step("bench_engine_eager", "d", 80, (*engine, "--no-cuda-graphs")),
        Step("bench_transfer", "e", 110, transfer),
    ]


def step_env(dry: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)   # every Ray here is a fresh local one
    env.update(RAYPD_GPU_DEVICE="cpu" if dry else "cuda", PYTHONUNBUFFERED="1",
               RAY_ENABLE_AUTO_CONNECT="0", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",   # no network: never wait on it
               RAY_USAGE_STATS_ENABLED="0")
    return env


def run_one(step: Step, work: Path, limit_s: float, env: dict[str, str]) -> dict:
    """Run `step` in a new process group, killed whole at `limit_s`; its result record."""
    out_json = work / f"{step.name}.json"
    argv = [a.replace("{json}", str(out_json)) for a in step.argv]
    t = time.monotonic()
    with open(work / f"{step.name}.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    record: dict = {"rc": rc, "seconds": round(time.monotonic() - t, 1),
                    "limit_s": round(limit_s)}
    try:
        record["result"] = json.loads(out_json.read_text())
    except (OSError, ValueError):
        record["result"] = None
    ok = rc == 0
    if isinstance(record["result"], dict) and "ok" in record["result"]:
        ok = ok and bool(record["result"]["ok"])
    record["ok"] = ok
    if not ok:
        lines = (work / f"{step.name}.log").read_text(errors="replace").splitlines()
        record["log_tail"] = lines[-25:]
        if rc == 124:
            record["error"] = f"timed out after {limit_s:.0f} s"
    return record


def judge(records: dict[str, dict], dry: bool) -> dict:
    out = {}
    for name, (step, key, op, bound) in TARGETS.items():
        result = (records.get(step) or {}).get("result") or {}
        value = result.get(key)
        if dry or step not in records:
            out[name] = {"value": value, "target": f"{op} {bound}", "pass": None,
                         "why": "dry run: not judged" if dry else "step not run"}
        elif not isinstance(value, int | float):
            out[name] = {"value": None, "target": f"{op} {bound}", "pass": False,
                         "why": "not measured"}
        else:
            out[name] = {"value": value, "target": f"{op} {bound}",
                         "pass": value >= bound if op == ">=" else value <= bound}
    return out


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    proc = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return proc.returncode == 0 and "GPU" in proc.stdout


def write_outputs(report: dict, work: Path, out: Path) -> None:
    (work / REPORT).write_text(json.dumps(report, indent=2, default=str) + "\n")
    with tarfile.open(out / LOGS, "w:gz") as tar:
        tar.add(work, arcname="first-contact")
    shutil.copyfile(work / REPORT, out / REPORT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="first_contact.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="logs and step JSON (archived)")
    p.add_argument("--out", type=Path, required=True, help="the two files that come back")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--steps", default="a,b,c,d,e", help="letters or names to run (a rerun)")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="the whole run, counted from RAYPD_GPU_START (epoch s) if set")
    p.add_argument("--unpack-json", type=Path, help="scripts/gpu/unpack.py's record")
    args = p.parse_args(argv)
    start = float(os.environ.get("RAYPD_GPU_START") or time.time())
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = set(args.steps.split(","))
    report: dict = {"ok": False, "dry_run": args.dry_run, "python": sys.executable,
                    "budget_s": args.budget_s, "steps": {}}
    if args.unpack_json and args.unpack_json.is_file():
        report["bundle"] = json.loads(args.unpack_json.read_text())
    code = 1
    if not args.dry_run and not has_gpu():
        report["error"] = "no GPU: nvidia-smi lists none (use --dry-run for the CPU stand-ins)"
        code = 2
    else:
        env = step_env(args.dry_run)
        blocked = None
        for step in steps(args.dry_run):
            if step.letter not in wanted and step.name not in wanted:
                continue
            left = args.budget_s - (time.time() - start)
            if blocked or left < 20:
                report["steps"][step.name] = {"ok": False, "skipped": blocked or "budget"}
                continue
            print(f"first-contact [{time.time() - start:.0f}s]: {step.name} "
                  f"(limit {min(step.limit_s, left - 5):.0f}s)", file=sys.stderr, flush=True)
            record = run_one(step, args.work, min(step.limit_s, left - 5), env)
            report["steps"][step.name] = record
            print(f"first-contact: {step.name}: {'ok' if record['ok'] else 'FAILED'} "
                  f"({record['seconds']}s)", file=sys.stderr, flush=True)
            if step.letter == "a" and not record["ok"]:
                blocked = "blocked: the probe (a) failed"
        report["targets"] = judge(report["steps"], args.dry_run)
        ran_ok = all(r.get("ok") for r in report["steps"].values())
        targets_ok = all(t["pass"] is not False for t in report["targets"].values())
        report["ok"] = bool(report["steps"]) and ran_ok and targets_ok
        code = 0 if report["ok"] else 1
    report["total_seconds"] = round(time.time() - start, 1)
    report["files"] = [REPORT, LOGS]
    write_outputs(report, args.work, args.out)
    print(json.dumps(report, indent=2, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
