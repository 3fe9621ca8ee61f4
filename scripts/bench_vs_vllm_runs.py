"""One server's runs of one workload in scripts/bench-vs-vllm.sh: read, checked, summarized.

A run is one `vllm bench serve` result (WORK/LABEL.WORKLOAD.RUN.json) with the server's /metrics
and process snapshots before and after it and the client's CPU time beside it. A run counts
as complete only when every check holds (`run_problems`): it exists, its `failed` key is there
and 0 (a missing key is unknown, never 0), `completed == num_prompts`, and, on a server that
honours ignore_eos, its output tokens are num_prompts x the workload's output length. Figures
are medians over the runs with their spread; a count that could not be read is None.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from dataclasses import dataclass

from bench_vs_vllm_cpu import CpuTally, read_client_seconds, run_cpu_seconds

KEEP = ("num_prompts", "completed", "failed", "duration", "total_input_tokens",
        "total_output_tokens", "request_throughput", "output_throughput", "median_ttft_ms",
        "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
        "median_e2el_ms")
FIGURES = ("output_throughput", "median_ttft_ms", "p99_tpot_ms", "median_tpot_ms",
           "prompt_cached_fraction")
# Prometheus counters of prompt tokens and of those a prefix cache served: vLLM's, raypd's
PROMPT_COUNTERS = ("vllm:prompt_tokens_total", "raypd_prompt_tokens_total")
CACHED_COUNTERS = ("vllm:prompt_tokens_cached_total", "raypd_cached_prompt_tokens_total")
# llama-cpp-python's server has no ignore_eos: its outputs may end early
NO_IGNORE_EOS = ("llamacpp",)


@dataclass(frozen=True)
class Workload:
    """One line of the script's workload table: `name|servers|backend|arguments`."""
    name: str
    servers: tuple[str, ...]      # server kinds: vllm, default, colocated, llamacpp
    backend: str
    args: str

    @classmethod
    def parse(cls, line: str) -> Workload:
        name, servers, backend, args = line.split("|", 3)
        return cls(name, tuple(servers.split(",")), backend, args)

    @property
    def output_len(self) -> int | None:
        """The output tokens each request asks for (--random-output-len and its kin)."""
        m = re.search(r"--[a-z-]*output-len (\d+)", self.args)
        return int(m.group(1)) if m else None


def counter_sum(text: str, names: tuple[str, ...]) -> float | None:
    """Sum of every sample of the named counters in a Prometheus text page (all label sets);
    None when none of them is there, or the page does not parse."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        values = [s.value for fam in text_string_to_metric_families(text)
                  for s in fam.samples if s.name in names]
    except ValueError:
        return None
    return sum(values) if values else None


def cached_fraction(before: str, after: str) -> float | None:
    """Prompt tokens served from the prefix cache / prompt tokens, between two scrapes."""
    p0, p1 = counter_sum(before, PROMPT_COUNTERS), counter_sum(after, PROMPT_COUNTERS)
    c0, c1 = counter_sum(before, CACHED_COUNTERS), counter_sum(after, CACHED_COUNTERS)
    if None in (p0, p1, c0, c1) or p1 - p0 <= 0:
        return None
    return (c1 - c0) / (p1 - p0)


def _read(path: str) -> str:
    return open(path).read() if os.path.exists(path) else ""


def _read_json(path: str) -> dict | None:
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return None


def server_kind(label: str) -> str:
    """vllm1, vllm2 and the sweep's vllm_mbt512 are vLLM; default/colocated raypd."""
    if label.startswith("vllm"):
        return "vllm"
    return "llamacpp" if label == "llamacpp" else "raypd"


def load_run(work: str, label: str, name: str, run: str) -> dict:
    """One run's kept figures, its cached fraction and its CPU-seconds per process; a run whose
    result file is missing is {"missing": True, "failed": None}."""
    stem = os.path.join(work, f"{label}.{name}.{run}")
    d = _read_json(stem + ".json")
    if d is None:
        return {"missing": True, "failed": None}
    out = {k: d.get(k) for k in KEEP}
    out["prompt_cached_fraction"] = cached_fraction(_read(stem + ".metrics.before"),
                                                    _read(stem + ".metrics.after"))
    before, after = _read_json(stem + ".procs.before"), _read_json(stem + ".procs.after")
    out["cpu_s"], out["cpu_exited"] = (run_cpu_seconds(before, after, server_kind(label))
                                       if before and after else (None, []))
    out["client_cpu_s"] = read_client_seconds(_read(stem + ".client_cpu"))
    return out


def run_problems(run: dict, output_len: int | None) -> list[str]:
    """Why a run does not count as complete ([] when it does). output_len: tokens each request
    must produce (None where the server may stop early)."""
    if run.get("missing"):
        return ["no result (the client failed)"]
    out = []
    failed, completed, n = run.get("failed"), run.get("completed"), run.get("num_prompts")
    if failed is None:
        out.append("no 'failed' count in the result (unknown, not 0)")
    elif failed:
        out.append(f"{failed} failed requests")
    if n is None or completed is None:
        out.append("no num_prompts or completed count in the result")
    elif completed != n:
        out.append(f"completed {completed} != num_prompts {n}")
    if output_len is not None and n is not None:
        got = run.get("total_output_tokens")
        if got != n * output_len:
            out.append(f"output tokens {got} != {n} x {output_len}")
    return out


def server_stats(runs: list[dict], output_len: int | None) -> dict:
    """Medians and [min, max] over a server's runs of one workload, counts that fail closed
    (failed_requests None where any run's is unknown), each run's problems, and CPU-seconds
    per output token of each of its processes."""
    ok = [r for r in runs if not r.get("missing")]
    failed = [r.get("failed") for r in runs]
    for r in runs:
        r["problems"] = run_problems(r, output_len)
    s = {"runs": len(runs), "runs_missing": len(runs) - len(ok),
         "runs_with_problems": sum(1 for r in runs if r["problems"]),
         "failed_requests": None if any(f is None for f in failed) else sum(failed),
         "completed_requests": sum(r.get("completed") or 0 for r in ok),
         "num_prompts": sum(r.get("num_prompts") or 0 for r in ok)}
    for k in FIGURES:
        vals = [r[k] for r in ok if r.get(k) is not None]
        s[k] = statistics.median(vals) if vals else None
        s[f"{k}_spread"] = [min(vals), max(vals)] if vals else None
    s["cpu_s_per_output_token"] = cpu_tally(runs).per_output_token()
    s["per_run"] = runs
    return s


def cpu_tally(runs: list[dict]) -> CpuTally:
    t = CpuTally.empty()
    for r in runs:
        t.add(r.get("cpu_s"), r.get("client_cpu_s"), r.get("total_output_tokens"),
              len(r.get("cpu_exited") or []))
    return t


def load_server(work: str, label: str, w: Workload, runs: int) -> dict | None:
    """A server's stats over its runs 0..runs-1 of a workload; None when it ran none."""
    got = [load_run(work, label, w.name, str(r)) for r in range(runs)]
    if all(r.get("missing") for r in got):
        return None
    return server_stats(got, None if server_kind(label) in NO_IGNORE_EOS else w.output_len)
