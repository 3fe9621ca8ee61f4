"""The checks of the cluster smoke run (scripts/cluster-smoke.sh): the submit report holds, and
Prometheus (scraping through Ray's service-discovery file) has a raypd series from every worker.

    python scripts/cluster_smoke_checks.py report report.json --requests 20        # prints requests ok
    python scripts/cluster_smoke_checks.py prometheus --url http://127.0.0.1:9090 --status status.json

Exit 0 when the check holds, 1 when it does not (the output says what is missing).
Only the standard library and HTTP: no Ray, no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# One query per actor role: a raypd series every actor of that role exports once requests have
# gone through it (label that names the actor); the router runs in `raypd serve` on the head.
ROLE_QUERIES = {
    "prefill": ('ray_raypd_lease_releases_total{role="prefill",reason="acked"}', "worker_id"),
    "decode": ('ray_raypd_transfers_total{role="decode"}', "worker_id"),
    "router": ('ray_raypd_router_stage_seconds_count{stage="transfer"}', "router"),
}
ROUTER_ID = "router"


def check_report(report: dict, requests: int) -> list[str]:
    """What is wrong with a `raypd submit` report of `requests` requests (empty: all held)."""
    problems = []
    if report.get("requests_sent") != requests:
        problems.append(f"requests_sent={report.get('requests_sent')} != {requests}")
    if report.get("requests_ok") != requests:
        problems.append(f"requests_ok={report.get('requests_ok')} != {requests} "
                        f"(errors: {report.get('errors')})")
    if not (report.get("output_tokens") or 0) > 0:
        problems.append("no output tokens")
    if (report.get("ttft_s") or {}).get("p50") is None:
        problems.append("no TTFT")
    roles = {a.get("role") for a in report.get("per_actor") or []}
    if not {"prefill", "decode"} <= roles:
        problems.append(f"per_actor rows lack a role: {sorted(map(str, roles))}")
    return problems


@dataclass
class RoleSeries:
    role: str
    query: str
    label: str
    workers_expected: list[str]
    workers_seen: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return set(self.workers_expected) <= set(self.workers_seen)


def prom_query(url: str, query: str, timeout: float = 5.0) -> list[dict]:
    """Prometheus instant query -> its result vector (raises on HTTP or API error)."""
    q = urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query?{q}", timeout=timeout) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"prometheus: {body}")
    return body["data"]["result"]


def check_prometheus(url: str, workers: dict[str, list[str]], timeout_s: float) -> list[RoleSeries]:
    """Poll one query per role until every worker of it has a series (or the time is up)."""
    rows = [RoleSeries(role, *ROLE_QUERIES[role], sorted(ids)) for role, ids in workers.items()]
    deadline = time.monotonic() + timeout_s
    while True:
        for row in rows:
            try:
                result = prom_query(url, row.query)
            except OSError:
                continue                          # Prometheus still starting
            row.workers_seen = sorted({s["metric"].get(row.label, "") for s in result})
        if all(r.ok for r in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(1.0)


def workers_by_role(status: dict) -> dict[str, list[str]]:
    """`raypd status --json` (= /api/stats) -> {role: [actor id, ...]}: the prefill and decode
    workers it lists, and the router."""
    out: dict[str, list[str]] = {role: [] for role in ROLE_QUERIES}
    out["router"] = [ROUTER_ID]
    for w in status.get("actors") or []:
        if w.get("role") in out:
            out[w["role"]].append(str(w["worker_id"]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/cluster_smoke_checks.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="check", required=True)
    r = sub.add_parser("report")
    r.add_argument("path", type=Path)
    r.add_argument("--requests", type=int, required=True)
    pr = sub.add_parser("prometheus")
    pr.add_argument("--url", required=True)
    pr.add_argument("--status", type=Path, required=True, help="raypd status --json output")
    pr.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    if args.check == "report":
        report = json.loads(args.path.read_text())
        problems = check_report(report, args.requests)
        print("; ".join(problems) if problems else report["requests_ok"])
        return 1 if problems else 0
    workers = workers_by_role(json.loads(args.status.read_text()))
    if not all(workers.values()):
        print(json.dumps({"error": f"status lists no worker of some role: {workers}"}))
        return 1
    rows = check_prometheus(args.url, workers, args.timeout)
    print(json.dumps([{"role": x.role, "query": x.query, "expected": x.workers_expected,
                       "seen": x.workers_seen, "ok": x.ok} for x in rows], indent=2))
    return 0 if all(x.ok for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
