"""`raypd status`, `raypd scale` and `raypd migrate`: operate a running `raypd serve` over HTTP.

    raypd status [--url http://127.0.0.1:8000] [--json]
    raypd scale --prefill 2 --decode 2 [--wait]
    raypd migrate REQUEST_ID [--to decode-1]

`status` reads /api/stats and prints one row per worker actor (role, node, state, queue,
KV blocks used/total, prefix hit rate) and a router summary; it exits 1 when a worker is
unhealthy. `scale` posts the wanted worker counts to /admin/scale: new workers are launched
(the call returns once they serve), surplus ones drain (no new requests; removed once their
requests finish; --wait returns only then; a draining decode worker's running requests move
to the others with their KV). `migrate` asks /admin/migrate to move one running request's
decode to another decode worker with its KV (404: not in flight; 409: not decoding now).
All send the API key (--api-key, else
$RAYPD_API_KEY) as a bearer token. A server that cannot be reached, or that refuses, is
an error (exit 2). Only HTTP here: no Ray, no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "RAYPD_URL"
API_KEY_ENV = "RAYPD_API_KEY"          # the same variable `raypd serve` reads


class OpsError(Exception):
    """The server could not be reached or refused; the message says which and why."""


def register(sub) -> None:
    add_ops_parsers(sub)


def add_ops_parsers(subparsers: Any) -> None:
    """Register `status`, `scale` and `migrate` on the `raypd` subparsers."""
    st = subparsers.add_parser("status", help="show every worker actor of a running server",
                               description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(st)
    st.add_argument("--json", action="store_true", help="print /api/stats as JSON")
    st.set_defaults(func=cmd_status)

    sc = subparsers.add_parser("scale", help="add or drain workers of a running server",
                               description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(sc)
    sc.add_argument("--prefill", type=int, metavar="N", help="wanted prefill workers")
    sc.add_argument("--decode", type=int, metavar="M", help="wanted decode workers")
    sc.add_argument("--wait", action="store_true",
                    help="return only once the drained workers are removed")
    sc.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    sc.set_defaults(func=cmd_scale)

    mg = subparsers.add_parser("migrate", help="move a running request's decode to another "
                               "decode worker with its KV (rebalancing)",
                               description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(mg)
    mg.add_argument("request_id", help="the request's id (as `raypd status --json` lists)")
    mg.add_argument("--to", metavar="WORKER", help="the decode worker (default: the policy's "
                    "pick among the others)")
    mg.set_defaults(func=cmd_migrate)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get(URL_ENV, DEFAULT_URL),
                   help=f"the server (default: ${URL_ENV}, else {DEFAULT_URL})")
    p.add_argument("--api-key", default=None,
                   help=f"bearer token for the admin routes (default: ${API_KEY_ENV})")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for the server's answer (default 600)")


# ---- HTTP ----------------------------------------------------------------------------------------
def request(method: str, url: str, path: str, *, api_key: str | None = None,
            body: dict | None = None, timeout: float = 600.0) -> dict:
    """One JSON call to the server; OpsError when it cannot be reached or does not answer 2xx.
    (The standard library's client: two small calls need no dependency.)"""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    headers = {"Accept": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    target = url.rstrip("/") + path
    req = urllib.request.Request(target, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        why = getattr(e, "reason", e)
        if isinstance(e, TimeoutError) or isinstance(why, TimeoutError):
            raise OpsError(f"{target} did not answer within {timeout:.0f} s") from None
        raise OpsError(f"cannot connect to a raypd server at {url} ({why}); is `raypd serve` "
                       f"running there? (--url or ${URL_ENV})") from None
    except ValueError as e:                       # a malformed URL
        raise OpsError(f"bad --url {url!r}: {e}") from None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if status // 100 != 2:
        err = doc.get("error") if isinstance(doc, dict) else None
        msg = err.get("message") if isinstance(err, dict) else None
        raise OpsError(f"{method} {target} answered {status}: "
                       f"{msg or raw[:200].decode(errors='replace')}")
    if not isinstance(doc, dict):
        raise OpsError(f"{target} did not answer a JSON object: is this a raypd server?")
    return doc


# ---- status ------------------------------------------------------------------------------------
COLUMNS = ("WORKER", "ROLE", "NODE", "STATE", "QUEUE W/R", "KV USED/TOTAL", "HIT RATE")


def status_rows(stats: dict) -> list[tuple[str, ...]]:
    """The table rows (strings) of /api/stats's actors, in its order."""
    rows = []
    for a in stats.get("actors", []):
        used, total = a.get("blocks_used"), a.get("num_blocks")
        kv = f"{_n(used)}/{_n(total)}"
        if used is not None and total:
            kv += f" ({100 * used / total:.0f}%)"
        hit = a.get("hit_rate")
        rows.append((str(a.get("worker_id")), str(a.get("role")),
                     (a.get("node_id") or "-")[:12], str(a.get("state")),
                     f"{_n(a.get('waiting'))}/{_n(a.get('running'))}", kv,
                     "-" if hit is None else f"{100 * hit:.1f}%"))
    return rows


def format_status(stats: dict) -> str:
    rows = [COLUMNS, *status_rows(stats)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    r = stats.get("router", {})
    live = r.get("live", {})
    reqs = ", ".join(f"{k}: {v}" for k, v in sorted(r.get("requests", {}).items())) or "none"
    lines.append("")
    lines.append(f"router: policy {r.get('policy')}, in flight {r.get('in_flight')}/"
                 f"{r.get('max_inflight')}, live {live.get('prefill', 0)} prefill + "
                 f"{live.get('decode', 0)} decode, draining: "
                 f"{', '.join(r.get('draining') or []) or 'none'}, unhealthy: "
                 f"{', '.join(r.get('unhealthy') or []) or 'none'}, retries {r.get('retries')}")
    lines.append(f"requests by status: {reqs}")
    moves = r.get("migrations") or {}
    if any(moves.values()):
        lines.append("live migrations: " + ", ".join(f"{k} {v}" for k, v in moves.items()))
    lines.extend(autoscale_lines(r.get("autoscale")))
    if stats.get("stats_error"):
        lines.append(f"warning: {stats['stats_error']}")
    return "\n".join(lines)


def autoscale_lines(a: dict | None) -> list[str]:
    """The autoscaler's part of `raypd status`: off, or its bounds, counts and last decision
    with the reason per role."""
    if not a:
        return ["autoscale: off"]
    c = a.get("config", {})
    ups, downs = a.get("scale_ups", {}), a.get("scale_downs", {})
    out = [f"autoscale: on (prefill {c.get('min_prefill')}..{c.get('max_prefill')}, decode "
           f"{c.get('min_decode')}..{c.get('max_decode')}; SLO TTFT {c.get('ttft_s')} s, TPOT "
           f"{c.get('tpot_s')} s at p{c.get('percentile'):g}); scale-ups prefill "
           f"{ups.get('prefill', 0)} decode {ups.get('decode', 0)}, scale-downs prefill "
           f"{downs.get('prefill', 0)} decode {downs.get('decode', 0)}; starting "
           f"{a.get('starting')}" + (f"; last scale error: {a['last_error']}"
                                      if a.get("last_error") else "")]
    last = a.get("last")
    if last:
        for role, r in (last.get("roles") or {}).items():
            out.append(f"  last decision, {role}: {r.get('current')} -> {r.get('target')} "
                       f"({r.get('reason')})")
    return out


def cmd_status(args: argparse.Namespace) -> int:
    try:
        stats = request("GET", args.url, "/api/stats", api_key=args.api_key,
                        timeout=args.timeout)
    except OpsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(stats, indent=2) if args.json else format_status(stats))
    return 1 if any(a.get("state") == "unhealthy" for a in stats.get("actors", [])) else 0


# ---- scale -------------------------------------------------------------------------------------
def cmd_scale(args: argparse.Namespace) -> int:
    if args.prefill is None and args.decode is None:
        print("error: give --prefill N and/or --decode M", file=sys.stderr)
        return 2
    for name in ("prefill", "decode"):
        v = getattr(args, name)
        if v is not None and v < 0:
            print(f"error: --{name} must be >= 0, got {v}", file=sys.stderr)
            return 2
    body = {k: v for k, v in (("prefill", args.prefill), ("decode", args.decode))
            if v is not None}
    body["wait"] = bool(args.wait)
    try:
        out = request("POST", args.url, "/admin/scale", api_key=args.api_key, body=body,
                      timeout=args.timeout)
    except OpsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    live = out.get("live", {})
    line = f"live: {live.get('prefill', 0)} prefill + {live.get('decode', 0)} decode workers"
    draining = out.get("draining") or []
    if draining:
        line += f"; draining {', '.join(draining)} (removed once their requests finish)"
    elif args.wait:
        line += "; no worker left draining"
    print(f"{line} ({out.get('seconds', 0):.1f} s)")
    return 0


# ---- migrate -----------------------------------------------------------------------------------
def cmd_migrate(args: argparse.Namespace) -> int:
    body = {"request_id": args.request_id}
    if args.to:
        body["to"] = args.to
    try:
        request("POST", args.url, "/admin/migrate", api_key=args.api_key, body=body,
                timeout=args.timeout)
    except OpsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    where = args.to or "the policy's pick"
    print(f"asked {args.request_id} to move to {where}: it moves between two of its tokens "
          "(or stays, if no decode worker has room)")
    return 0


def _n(v: Any) -> str:
    return "-" if v is None else str(v)


def main(argv: list[str] | None = None) -> int:
    """`python -m raypd.cli.ops status|scale ...` (the same as `raypd status|scale ...`)."""
    parser = argparse.ArgumentParser(prog="raypd")
    add_ops_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
