"""The GPU machine's bundle (scripts/gpu-bundle.sh): every import the first-contact run reaches
is on the machine (scripts/gpu/machine-packages.txt) or carried (scripts/gpu/bundle-manifest.json),
and so is every requirement of what is carried; nothing carried is already there unless it says
why; under 60 MiB. Offline against the committed manifest; the built folder (.gpu-bundle) is
checked against it where one exists."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
import bundle  # noqa: E402
import gpu_path  # noqa: E402

LIMIT = 60 * 2**20
MANIFEST = json.loads(gpu_path.MANIFEST.read_text())
BUILT = ROOT / ".gpu-bundle"


def test_every_import_of_the_gpu_path_is_on_the_machine_or_carried():
    machine, carried = gpu_path.machine_packages(), gpu_path.bundled()
    needed = gpu_path.needed_distributions()
    assert {"torch", "ray", "fastapi", "transformers"} <= set(needed)
    missing = {d: names for d, names in needed.items() if d not in machine and d not in carried}
    assert not missing, f"the GPU machine would lack: {missing}"


def test_every_requirement_of_a_carried_package_is_met_there():
    machine, carried = gpu_path.machine_packages(), gpu_path.bundled()
    for p in MANIFEST["packages"]:
        for line in p["requires"]:
            name = gpu_path.normalize(Requirement(line).name)
            assert name in carried or name in machine, f"{p['name']} needs {line}"
            if name in carried:
                assert Requirement(line).specifier.contains(carried[name], prereleases=True)


def test_the_manifest_is_the_requirement_list_and_carries_nothing_already_there():
    machine = gpu_path.machine_packages()
    wanted = bundle.read_requirements()
    assert {(w.name, w.version) for w in wanted} == \
        {(gpu_path.normalize(p["name"]), p["version"]) for p in MANIFEST["packages"]}
    for w in wanted:
        assert w.name not in machine or w.override, f"{w.name} is already on the machine"
    assert MANIFEST["python"] == "cp312"


def test_the_recorded_bundle_is_under_60_mib():
    assert MANIFEST["total_bytes"] == sum(p["bytes"] for p in MANIFEST["packages"])
    assert MANIFEST["total_bytes"] < LIMIT


@pytest.mark.skipif(not (BUILT / "manifest.json").is_file(),
                    reason="no bundle built here (scripts/gpu-bundle.sh)")
def test_the_built_bundle_is_the_manifest_and_under_60_mib():
    files = [f for f in BUILT.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) < LIMIT
    built = json.loads((BUILT / "manifest.json").read_text())
    for p in built["packages"]:
        digest = hashlib.sha256((BUILT / p["file"]).read_bytes()).hexdigest()
        assert digest == p["sha256"], p["file"]
    assert {p["name"]: p["version"] for p in built["packages"]} == \
        {p["name"]: p["version"] for p in MANIFEST["packages"]}
