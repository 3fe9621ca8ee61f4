"""Helpers of scripts/bench-vs-vllm.sh: its datasets, vLLM's sweep choice and the JSON it writes.

  python scripts/bench_vs_vllm.py data HF_DIR WORK
      the text datasets (scripts/bench_vs_vllm_data.py)
  python scripts/bench_vs_vllm.py sweep-best WORK --sweep 512,1024,2048 [--unseen NAME] WORKLOAD...
      the --max-num-batched-tokens vLLM serves the scored runs with: the sweep value whose
      tuning pass (WORK/vllm_mbtV.WORKLOAD.tune.json) served the most (`sweep_table`)
  python scripts/bench_vs_vllm.py summarize WORK OUT.json --runs R --sweep 512,... [--unseen NAME] WORKLOAD...
      OUT.json: `cpu_model`; `vllm_sweep` (each value's tuning figures and the best);
      `vllm_blocks` (vLLM's two blocks, the order being vLLM, raypd default, raypd colocated,
      llama.cpp, vLLM again) and `drift` per workload ((block 2 - block 1) / block 1 of vLLM's
      output tok/s; beyond DRIFT_LIMIT a workload says so and misses every target); per
      workload and server medians over the runs with their spread, failed requests (null:
      unknown), each run's problems (run_problems: completed == num_prompts, output tokens);
      ratios raypd / vLLM against the mean of vLLM's two blocks' medians, vLLM's failures beside
      them; `unseen_workloads` (a shape no tuning used: reported apart, no targets);
      `cpu_s_per_output_token` per server and process (and the client); `targets_met`
      (issue 29's targets, every one of a workload false where any check of it fails)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys

from bench_vs_vllm_cpu import CpuTally
from bench_vs_vllm_runs import (
    NO_IGNORE_EOS,
    Workload,
    cpu_tally,
    load_run,
    load_server,
    run_problems,
    server_kind,
)

VLLM_BLOCKS = ("vllm1", "vllm2")      # file labels of vLLM's first and second block
RAYPD = ("default", "colocated")
ORDER = ["vllm1", "default", "colocated", "llamacpp", "vllm2"]
# vLLM's own --max-num-batched-tokens for its API server on a CPU (0.32: 2048 x world size):
# what it serves with when no sweep value ran clean
VLLM_CPU_DEFAULT_MBT = 2048
DRIFT_LIMIT = 0.10
BASELINE_FIGURES = ("output_throughput", "median_ttft_ms", "p99_tpot_ms", "median_tpot_ms")
# The workloads built to reuse a prefix; in every other one a prefix-cache hit is an accident of
# the prompts (it once was: seeds shared across workloads), and a server that gets one does less
# work than the workload names, so its figures are not the workload's: more than this fraction of
# a run's prompt tokens from cache, on any server (or a vLLM or raypd run whose counters were
# not read), and the workload's targets count as missed.
REUSE_WORKLOADS = ("prefix_repetition_c8", "shared_prefix_chat_c8")
MAX_ACCIDENTAL_CACHED = 0.02


def cpu_model(lscpu: str | None = None) -> str:
    """The CPU's model name with its family, model and stepping numbers (a VM's model name
    alone, "AMD EPYC", names no generation), from `lscpu` (or /proc/cpuinfo without it)."""
    if lscpu is None:
        try:
            lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True,
                                   env={**os.environ, "LC_ALL": "C"}).stdout
        except (OSError, subprocess.CalledProcessError):
            lscpu = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    fields: dict[str, str] = {}
    for line in lscpu.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    ids = [f"{label} {fields[key]}" for label, key in
           (("family", "cpu family"), ("model", "model"), ("stepping", "stepping"))
           if fields.get(key)]
    return f"{name} ({', '.join(ids)})" if ids else name


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def sweep_table(work: str, values: list[int], workloads: list[Workload]) -> dict:
    """vLLM's tuning pass at each --max-num-batched-tokens: output tok/s per workload and their
    geometric mean (each workload weighs alike); the best is the highest mean among the values
    whose every tuning run is complete (run_problems), None when none is."""
    figures, best, best_score = {}, None, -1.0
    for v in values:
        per, problems = {}, {}
        for w in workloads:
            run = load_run(work, f"vllm_mbt{v}", w.name, "tune")
            per[w.name] = run.get("output_throughput")
            problems[w.name] = run_problems(run, w.output_len)
            if per[w.name] is None and not problems[w.name]:
                problems[w.name] = ["no output_throughput in the result"]
        clean = bool(workloads) and not any(problems.values())
        score = _geomean(list(per.values())) if clean else None
        figures[str(v)] = {"output_tok_s": per, "score": score, "complete": clean,
                           "problems": {k: p for k, p in problems.items() if p}}
        if score is not None and score > best_score:
            best, best_score = v, score
    return {"knob": "--max-num-batched-tokens", "values": values,
            "tuning_pass": "each scored workload once, max(num_prompts // 2, concurrency) "
                           "prompts of its own (seed 1000 w + 900, the `tune` text files), "
                           "after a warm-up; the unseen workloads not at all",
            "score": "geometric mean over the workloads of output tok/s",
            "figures": figures, "best": best,
            "served_with": best if best is not None else VLLM_CPU_DEFAULT_MBT}


def relative_drift(first: float | None, second: float | None) -> float | None:
    """(second - first) / first: how far vLLM's second block moved from its first."""
    return (second - first) / first if first and second is not None else None


def _mean_known(xs: list[float | None]) -> float | None:
    return sum(xs) / len(xs) if xs and None not in xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def equal_output_tokens(stats: dict[str, dict | None], runs: int) -> bool:
    """Every server that honours ignore_eos produced the same output tokens in run r as the
    others, for every r (a server that did not run, or a count not read, is not equal)."""
    held = {k: s for k, s in stats.items() if server_kind(k) not in NO_IGNORE_EOS}
    if any(s is None for s in held.values()):
        return False
    for r in range(runs):
        got = {s["per_run"][r].get("total_output_tokens") for s in held.values()}
        if None in got or len(got) != 1:
            return False
    return True


def workload_entry(work: str, w: Workload, runs: int) -> dict:
    labels = [x for s in w.servers for x in (VLLM_BLOCKS if s == "vllm" else (s,))]
    stats = {x: load_server(work, x, w, runs) for x in labels}
    blocks = [stats.get(b) or {} for b in VLLM_BLOCKS]
    base = {k: _mean_known([b.get(k) for b in blocks]) for k in BASELINE_FIGURES}
    vllm_failed = [b.get("failed_requests") for b in blocks]
    entry = {"args": w.args, "backend": w.backend, "servers": stats,
             "vllm_baseline": base,
             "drift": relative_drift(blocks[0].get("output_throughput"),
                                     blocks[1].get("output_throughput"))}
    for label in RAYPD:
        r = stats.get(label) or {}
        entry[label] = {
            "vllm_output_tok_s": base["output_throughput"],
            "vllm_output_tok_s_blocks": [b.get("output_throughput") for b in blocks],
            "raypd_output_tok_s": r.get("output_throughput"),
            "output_tok_s_ratio": _ratio(r.get("output_throughput"), base["output_throughput"]),
            "median_ttft_ratio": _ratio(r.get("median_ttft_ms"), base["median_ttft_ms"]),
            "p99_tpot_ratio": _ratio(r.get("p99_tpot_ms"), base["p99_tpot_ms"]),
            "failed_requests": r.get("failed_requests"),
            "vllm_failed_requests": None if None in vllm_failed else sum(vllm_failed),
        }
    cached = [r["prompt_cached_fraction"] for st in stats.values() if st is not None
              for r in st["per_run"] if r.get("prompt_cached_fraction") is not None]
    entry["prompt_cached_fraction_max"] = max(cached) if cached else None
    checks = {
        "no_failed_requests": all(s is not None and s["failed_requests"] == 0
                                  and s["runs_missing"] == 0 for s in stats.values()),
        "runs_complete": all(s is not None and s["runs_with_problems"] == 0
                             for s in stats.values()),
        "equal_output_tokens": equal_output_tokens(stats, runs),
        f"vllm_drift<={DRIFT_LIMIT}": entry["drift"] is not None
        and abs(entry["drift"]) <= DRIFT_LIMIT,
    }
    if w.name not in REUSE_WORKLOADS:
        # vLLM and raypd export the counters: a run of theirs without a fraction is not
        # known to be clean (a renamed counter must not pass for no hits)
        measured = all(r.get("prompt_cached_fraction") is not None
                       for label, s in stats.items() if server_kind(label) != "llamacpp"
                       for r in (s or {}).get("per_run", []))
        checks["no_accidental_prefix_hits"] = measured and \
            max(cached, default=0.0) <= MAX_ACCIDENTAL_CACHED
    entry["checks"] = checks
    if entry["drift"] is not None and abs(entry["drift"]) > DRIFT_LIMIT:
        entry["drift_note"] = (f"vLLM's two blocks differ by {entry['drift']:+.1%} (limit "
                               f"{DRIFT_LIMIT:.0%}): the machine moved during the run; no "
                               "target of this workload counts")
    return entry


def workload_targets(entry: dict, tuned: bool) -> dict[str, bool]:
    """Issue 29's targets and the checks; every one false where any check fails or vLLM's
    sweep chose no baseline."""
    c, d = entry["colocated"], entry["default"]
    t = dict(entry["checks"])
    t.update({"colocated_output_tok_s_ratio>=1.2": (c["output_tok_s_ratio"] or 0) >= 1.2,
              "colocated_median_ttft_ratio<=1.0": (c["median_ttft_ratio"] or 9e9) <= 1.0,
              "colocated_p99_tpot_ratio<=1.0": (c["p99_tpot_ratio"] or 9e9) <= 1.0,
              "default_output_tok_s_ratio>=0.9": (d["output_tok_s_ratio"] or 0) >= 0.9,
              "default_p99_tpot_ratio<=0.9": (d["p99_tpot_ratio"] or 9e9) <= 0.9})
    lc, col = entry["servers"].get("llamacpp"), entry["servers"].get("colocated") or {}
    if "llamacpp" in entry["servers"]:
        t["colocated_median_tpot<llamacpp_bf16"] = (
            lc is not None and col.get("median_tpot_ms") is not None
            and lc.get("median_tpot_ms") is not None
            and col["median_tpot_ms"] < lc["median_tpot_ms"])
    clean = tuned and all(entry["checks"].values())
    return {k: bool(x) and clean for k, x in t.items()}


def _block(stats: dict | None) -> dict | None:
    keep = ("output_throughput", "output_throughput_spread", "median_ttft_ms", "p99_tpot_ms",
            "failed_requests", "runs_with_problems", "cpu_s_per_output_token")
    return None if stats is None else {k: stats.get(k) for k in keep}


def cpu_per_output_token(entries: list[dict]) -> dict:
    """CPU-seconds per output token of each server's processes and its client over the given
    workloads' scored runs; vLLM's two blocks together."""
    tallies: dict[str, CpuTally] = {}
    for e in entries:
        for label, s in e["servers"].items():
            if s is not None:
                key = "vllm" if label in VLLM_BLOCKS else label
                tallies[key] = tallies.get(key, CpuTally.empty()).merged(cpu_tally(s["per_run"]))
    return {k: t.per_output_token() for k, t in tallies.items()}


def summarize(work: str, out: str, runs: int, workloads: list[Workload], sweep: list[int],
              unseen: tuple[str, ...] = ()) -> dict:
    scored = [w for w in workloads if w.name not in unseen]
    table = sweep_table(work, sweep, scored)
    result = {"cpu_model": cpu_model(),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "dtype": os.environ.get("RAYPD_BENCH_DTYPE_USED"),   # both servers' --dtype
              "client": "vllm bench serve (vLLM-CPU 0.32)", "evidence_level": "cpu-measured",
              "runs_per_server_and_workload": runs,
              "order": ORDER,
              "figures": "medians over the runs (each run's own median TTFT / p99 TPOT / "
                         "output tok/s), spread = [min, max] over the runs",
              "vllm_baseline": "mean of vLLM's two blocks' medians (the median of the two), "
                               "each block at the sweep's best --max-num-batched-tokens",
              "drift_limit": DRIFT_LIMIT,
              "vllm_sweep": table, "workloads": {}, "unseen_workloads": {}}
    for w in workloads:
        key = "unseen_workloads" if w.name in unseen else "workloads"
        result[key][w.name] = workload_entry(work, w, runs)
    every = {**result["workloads"], **result["unseen_workloads"]}
    result["vllm_blocks"] = [
        {"block": i + 1, "label": label, "max_num_batched_tokens": table["served_with"],
         "workloads": {n: _block(e["servers"].get(label)) for n, e in every.items()}}
        for i, label in enumerate(VLLM_BLOCKS)]
    result["drift"] = {n: e["drift"] for n, e in every.items()}
    result["drift_exceeded"] = [n for n, d in result["drift"].items()
                                if d is None or abs(d) > DRIFT_LIMIT]
    result["cpu_s_per_output_token"] = cpu_per_output_token(list(result["workloads"].values()))
    result["cpu_s_per_output_token_unseen"] = cpu_per_output_token(
        list(result["unseen_workloads"].values()))
    targets = {n: workload_targets(e, table["best"] is not None)
               for n, e in result["workloads"].items()}
    result["targets_met"] = targets
    result["all_targets_met"] = bool(targets) and all(all(t.values()) for t in targets.values())
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    data = sub.add_parser("data")
    data.add_argument("hf_dir")
    data.add_argument("work")
    for name in ("sweep-best", "summarize"):
        s = sub.add_parser(name)
        s.add_argument("work")
        if name == "summarize":
            s.add_argument("out")
            s.add_argument("--runs", type=int, required=True)
        s.add_argument("--sweep", required=True, type=lambda v: [int(x) for x in v.split(",")],
                       help="the --max-num-batched-tokens values, comma-separated")
        s.add_argument("--unseen", action="append", default=[])
        s.add_argument("workloads", nargs="+", type=Workload.parse)
    return p


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    if a.cmd == "data":
        from bench_vs_vllm_data import make_data
        make_data(a.hf_dir, a.work)
    elif a.cmd == "sweep-best":
        table = sweep_table(a.work, a.sweep, [w for w in a.workloads if w.name not in a.unseen])
        for v, f in table["figures"].items():
            print(f"bench-vs-vllm: vLLM --max-num-batched-tokens {v}: score {f['score']}, "
                  f"{f['output_tok_s']}", file=sys.stderr)
        print(table["served_with"])
    else:
        res = summarize(a.work, a.out, a.runs, a.workloads, a.sweep, tuple(a.unseen))
        for part in ("workloads", "unseen_workloads"):
            print(json.dumps({n: {"drift": e["drift"], **{
                k: {m: e[k][m] for m in ("output_tok_s_ratio", "median_ttft_ratio",
                                         "p99_tpot_ratio", "failed_requests",
                                         "vllm_failed_requests")}
                for k in RAYPD}} for n, e in res[part].items()}, indent=1))
        print("cpu model:", res["cpu_model"], "| vLLM sweep best:", res["vllm_sweep"]["best"],
              "| drift exceeded:", res["drift_exceeded"])
        print("all targets met:", res["all_targets_met"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
