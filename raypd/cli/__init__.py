"""The `raypd` command line: one module of this package per command group, each with a
`register(subparsers)`; a command's heavy imports (torch, Ray, the benchmarks) happen only when
it runs, so `raypd generate` and `raypd bench engine` need neither Ray nor the HTTP stack."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from raypd.cli import bench, generate, kv_plan, ops, replay, run, serve, simulate
    parser = argparse.ArgumentParser(prog="raypd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (run, generate, serve, replay, ops, simulate, kv_plan, bench):
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:   # RequestError, ModelLoadError and config errors are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
