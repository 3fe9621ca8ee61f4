"""The layers of docs/architecture.md, as the code's own imports have them: each package imports
only the packages below it (function-level imports included), the tooling (raypd/) is never
imported by the serving packages, and the torch-free and Ray-free layers really load without
torch and Ray."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# top to bottom: a package may import itself and those after it, never those before it
LAYERS = ("raypd", "cluster", "ingress", "router", "workers", "frontend", "kvtransfer", "protocol",
          "kvcache")
SERVING = LAYERS[1:]
# what must not be imported at all, anywhere in a package (third-party top-level names)
FORBIDDEN = {
    "protocol": {"torch", "ray", "numpy", "fastapi", "argparse"},
    "kvcache": {"torch", "ray", "numpy", "fastapi", "argparse"},
    "router": {"torch", "fastapi", "argparse"},
    "frontend": {"torch", "ray", "numpy", "fastapi", "argparse"},
    "ingress": {"torch", "argparse"},
    "kvtransfer": {"fastapi", "argparse"},
    "workers": {"fastapi", "argparse"},
    "cluster": {"argparse"},
}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module name) of every import in a file, function-level ones too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def package_files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if not p.name.endswith("_pb2.py")
                  and not p.name.endswith("_pb2_grpc.py"))


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_imports_only_the_layers_below_it(package):
    above = set(LAYERS[:LAYERS.index(package)])
    wrong = [f"{p.relative_to(ROOT)}:{line} imports {name}"
             for p in package_files(package) for line, name in imports_of(p) if name in above]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_keeps_out_what_its_layer_must_not_need(package):
    wrong = [f"{p.relative_to(ROOT)}:{line} imports {name}"
             for p in package_files(package) for line, name in imports_of(p)
             if name in FORBIDDEN[package]]
    assert not wrong, "\n".join(wrong)


def test_serving_folders_hold_no_benchmark_simulator_or_cli():
    """Benchmarks, simulators, replay and the CLI live in raypd/ (their rooms), not beside the
    serving code."""
    tooling = ("bench", "sim", "simulate", "cli", "replay", "validate", "plan", "workload",
               "report", "submit")
    wrong = [str(p.relative_to(ROOT)) for pkg in SERVING for p in package_files(pkg)
             if any(p.stem == t or p.stem.startswith(t + "_") or p.stem.endswith("_" + t)
                    for t in tooling)]
    assert not wrong, wrong


@pytest.mark.parametrize("package, absent", [
    ("protocol", ("torch", "ray")), ("kvcache", ("torch", "ray")), ("router", ("torch",)),
    ("frontend", ("torch", "ray")),
    ("ingress", ("torch",)), ("raypd.cli", ("torch", "ray", "fastapi", "uvicorn"))])
def test_a_layer_loads_without_what_it_must_not_need(package, absent):
    """Every module of the package imported in a fresh interpreter: none of `absent` loaded."""
    code = (f"import importlib, pkgutil\n"
            f"import {package} as pkg\n"
            f"for m in pkgutil.iter_modules(pkg.__path__):\n"
            f"    if m.name != '__main__':\n"
            f"        importlib.import_module('{package}.' + m.name)\n")
    got = loaded_by(code, absent)
    assert got == "", f"{package} loaded {got}"


def loaded_by(code: str, watched: tuple[str, ...]) -> str:
    """Which of `watched` (comma-separated) `code` loads, run in a fresh interpreter here."""
    code += f"import sys\nprint(','.join(sorted(n for n in {watched!r} if n in sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_production_hosts_carry_no_fault_injection():
    """Fault injection wraps the hosts (workers/faults.py); the actors a cluster runs by
    default have none of its hooks."""
    from workers.decode_host import DecodeHost
    from workers.faults import FaultyDecodeHost, FaultyPrefillHost
    from workers.prefill_host import PrefillHost
    faults = ("inject_fault", "arm_corruption", "inject_transfer_faults", "inject_pull_delay",
              "stall_next_step", "fail_next_steps", "crash_loop", "transfers_seen",
              "fault_counts")
    for host in (PrefillHost, DecodeHost):
        assert not [f for f in faults if hasattr(host, f)], host
    assert all(hasattr(FaultyPrefillHost, f) or hasattr(FaultyDecodeHost, f) for f in faults)


def test_native_sources_live_in_the_kernels_room():
    """C++ sources and headers sit in workers/kernels/ (csrc/), nowhere else in workers/."""
    room = ROOT / "workers" / "kernels"
    wrong = [str(p.relative_to(ROOT)) for p in (ROOT / "workers").rglob("*")
             if p.suffix in (".cpp", ".cc", ".h", ".hpp") and room not in p.parents]
    assert not wrong, wrong


@pytest.mark.parametrize("module", ["workers.scheduler", "workers.scheduler_output",
                                    "workers.engine_config", "cluster.config"])
def test_the_engine_cores_torch_free_modules_load_without_torch(module):
    """The scheduler and the step it hands the runner (vLLM v1's SchedulerOutput) are plain
    Python: they load, in a fresh interpreter, without torch or Ray; so do the config chain and
    the engine's settings."""
    got = loaded_by(f"import importlib\nimportlib.import_module({module!r})\n", ("torch", "ray"))
    assert got == "", f"{module} loaded {got}"


def test_no_engine_class_holds_more_than_about_twenty_methods():
    """The engine core is split along its jobs (inputs, scheduling, the runner, outputs, the
    P/D API, views): no class of those modules grows past 22 methods."""
    files = ["engine", "engine_handoff", "engine_views", "input_processor", "output_processor",
             "scheduler", "scheduler_output", "model_runner"]
    wrong = []
    for name in files:
        tree = ast.parse((ROOT / "workers" / f"{name}.py").read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            n = sum(isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) for m in cls.body)
            if n > 22:
                wrong.append(f"workers/{name}.py {cls.name}: {n} methods")
    assert not wrong, wrong
