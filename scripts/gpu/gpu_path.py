"""What the first-contact run imports, read from the code: the repo modules its steps reach
(every `import`, module level or inside a function, followed through the repo) and the
third-party distributions those need. The bundle's test checks that each such distribution is
on the GPU machine (machine-packages.txt) or in the bundle (bundle-manifest.json); the probe step
imports every reached module there.

Standard library only: it runs before anything is unpacked."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
REPO_PACKAGES = ("cluster", "ingress", "router", "frontend", "workers", "kvtransfer", "protocol",
                 "kvcache", "raypd")
# what the steps run: their own scripts, `python -m raypd.cli bench engine|transfer`, and the
# 1P+1D cluster of step (c)
ENTRIES = ("scripts/gpu/first_contact.py", "scripts/gpu/probe.py", "scripts/gpu/greedy.py",
           "scripts/gpu/disagg_ipc.py", "scripts/gpu/decode_kernel.py", "raypd.cli",
           "raypd.cli.__main__", "raypd.bench.engine",
           "raypd.bench.transfer", "cluster.pd", "workers.engine", "kvtransfer.endpoint",
           # loaded by name (kvtransfer/base.py make_transport), which a scan cannot follow
           "kvtransfer.cuda_ipc", "kvtransfer.shm", "kvtransfer.object_store", "kvtransfer.rdt",
           "kvtransfer.grpc_pages")
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"yaml": "pyyaml", "grpc": "grpcio", "google": "protobuf", "cupy": "cupy-cuda13x",
                 "PIL": "pillow", "prometheus_client": "prometheus-client",
                 "typing_extensions": "typing-extensions", "pydantic_core": "pydantic-core",
                 "dateutil": "python-dateutil", "jsonschema_specifications":
                 "jsonschema-specifications", "rpds": "rpds-py", "opentelemetry":
                 "opentelemetry-api", "attr": "attrs"}
# names a scan finds that are no distribution of their own (torch's submodules are torch's)
NOT_DISTRIBUTIONS = frozenset({"__future__", "__main__"})
MANIFEST = HERE / "bundle-manifest.json"
MACHINE = HERE / "machine-packages.txt"


def normalize(name: str) -> str:
    """A distribution name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_repo_top(top: str) -> bool:
    """A top-level import name of this repo: one of its packages or a module beside this one."""
    return top in REPO_PACKAGES or (HERE / f"{top}.py").is_file()


def module_file(name: str) -> Path | None:
    """The file of repo module `name` (a dotted name, or a path to a script), None if it is not
    one of the repo's modules (a third-party module, or a name inside a repo module)."""
    if name.endswith(".py"):
        return ROOT / name
    parts = name.split(".")
    if not is_repo_top(parts[0]):
        return None
    base = ROOT.joinpath(*parts) if parts[0] in REPO_PACKAGES else HERE.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_names(tree: ast.AST, package: str) -> set[str]:
    """Every absolute dotted name an import in `tree` may load (for `from a import b`: a.b and a,
    since b may be a module or a name in a)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: against the importing module's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{alias.name}" for alias in node.names)
    return names


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def scan(entries: tuple[str, ...] = ENTRIES) -> tuple[set[str], set[str]]:
    """(repo modules reached, top-level third-party import names) from `entries`."""
    seen: set[str] = set()
    third_party: set[str] = set()
    todo = list(entries)
    stdlib = set(sys.stdlib_module_names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = module_file(name)
        if path is None:
            top = name.split(".")[0]
            if top and not is_repo_top(top) and top not in stdlib | NOT_DISTRIBUTIONS:
                third_party.add(top)
            continue
        seen.add(name)
        parent = name.rpartition(".")[0]
        if parent and not name.endswith(".py"):
            todo.append(parent)   # importing a.b runs a/__init__.py first
        tree = ast.parse(path.read_text(), str(path))
        todo.extend(_imported_names(tree, _package_of(name, path)))
    return {n for n in seen if not n.endswith(".py")}, third_party


def needed_distributions(entries: tuple[str, ...] = ENTRIES) -> dict[str, list[str]]:
    """{distribution: [import names]} the GPU path needs."""
    out: dict[str, list[str]] = {}
    for top in sorted(scan(entries)[1]):
        out.setdefault(normalize(DISTRIBUTIONS.get(top, top)), []).append(top)
    return out


def machine_packages(path: Path = MACHINE) -> dict[str, str | None]:
    """{distribution: version or None (there, version not read)} of the GPU machine."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[normalize(name)] = version.strip() or None
    return out


def bundled(manifest: Path = MANIFEST) -> dict[str, str]:
    """{distribution: version} the bundle carries."""
    return {normalize(p["name"]): p["version"] for p in json.loads(manifest.read_text())["packages"]}


if __name__ == "__main__":   # print what the GPU path needs and where each comes from
    machine, carried = machine_packages(), bundled()
    for dist, names in needed_distributions().items():
        where = "bundle" if dist in carried else "machine" if dist in machine else "MISSING"
        print(f"{dist:28} {where:8} {' '.join(names)}")
