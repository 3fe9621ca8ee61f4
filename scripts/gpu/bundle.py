"""Builds the folder the GPU machine needs (it has no network): the wheels of
bundle-requirements.txt for CPython 3.12 on manylinux x86-64, Ray unpacked and trimmed to what
raypd runs and packed as one tar.xz, and manifest.json (versions, sizes, sha256, each
package's requirements). Run here, where pip reaches the registries:

    python scripts/gpu/bundle.py DIR        (scripts/gpu-bundle.sh DIR)

Invariants, each checked before it writes the manifest (exit 1 with the reason otherwise):
  * nothing carried is already on the machine (machine-packages.txt), unless its line says
    `override: WHY`;
  * every requirement of every carried package (no extras, markers read for CPython 3.12 on
    Linux x86-64) is carried or on the machine, and satisfied by the carried version or the
    machine's where that was read (the machine versions never read are listed, not guessed);
  * the folder is under 60 MiB.
The same inputs give the same bytes (sorted tar members, fixed times), so the manifest's sha256
identify the bundle; the manifest is also copied to scripts/gpu/bundle-manifest.json, which the
offline coverage test reads.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_path import MACHINE, MANIFEST, machine_packages  # noqa: E402
from unpack import sha256  # noqa: E402  (the unpacker checks with the same function)

REQUIREMENTS = HERE / "bundle-requirements.txt"
LIMIT_BYTES = 60 * 2**20
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "os_name": "posix",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
              "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "extra": ""}
# Ray as raypd runs it: core, actors, object store, collectives, metrics; not its libraries
# (RLlib, Tune, Train, Data, Serve, LLM), its Java jars or the dashboard's web build
RAY_DROP_DIRS = ("ray/jars", "ray/rllib", "ray/tune", "ray/train", "ray/data", "ray/serve",
                 "ray/llm", "ray/dashboard/client/build")
RAY_DROP_SUFFIXES = (".map",)
FIXED_MTIME = 1_700_000_000
CACHE = Path.home() / ".cache" / "raypd" / "gpu-bundle-wheels"


@dataclass(frozen=True)
class Wanted:
    """One line of bundle-requirements.txt."""

    name: str
    version: str
    slim: bool = False
    override: str | None = None


def read_requirements(path: Path = REQUIREMENTS) -> list[Wanted]:
    out = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        spec, _, rest = line.partition(" ")
        name, sep, version = spec.partition("==")
        if not sep:
            raise SystemExit(f"{path}: {raw!r}: expected NAME==VERSION")
        rest = rest.strip()
        out.append(Wanted(canonicalize_name(name), version, slim=rest == "slim",
                          override=rest.removeprefix("override:").strip()
                          if rest.startswith("override:") else None))
    return out


def download(w: Wanted, python: str) -> Path:
    """The wheel of `w` for cp312 manylinux x86-64 (or pure Python), from the cache or pip."""
    CACHE.mkdir(parents=True, exist_ok=True)
    stem = w.name.replace("-", "_")
    found = [p for p in CACHE.glob("*.whl")
             if canonicalize_name(p.name.split("-")[0]) == canonicalize_name(stem)
             and p.name.split("-")[1] == w.version]
    if not found:
        cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(CACHE),
               *[a for p in PLATFORMS for a in ("--platform", p)], f"{w.name}=={w.version}"]
        subprocess.run(cmd, check=True)
        return download(w, python)
    wheel = found[0]
    tags = wheel.name.removesuffix(".whl").split("-")[-3:]
    if not (tags[0] in ("py3", "cp312") or tags[0].startswith("py3")) or \
            tags[1] not in ("none", "abi3", "cp312"):
        raise SystemExit(f"{wheel.name}: not a CPython 3.12 wheel")
    return wheel


def requires(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines that apply on the machine without extras."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        headers = Parser().parsestr(zf.read(meta).decode())
    out = []
    for line in headers.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(MARKER_ENV):
            out.append(str(Requirement(f"{req.name}{req.specifier}")))
    return out


def _dropped(name: str) -> bool:
    return name.endswith(RAY_DROP_SUFFIXES) or any(
        name == d or name.startswith(d + "/") for d in RAY_DROP_DIRS)


def slim_tar(wheel: Path, out: Path) -> dict:
    """Unpack `wheel`, leave out RAY_DROP_*, pack the rest as a reproducible tar.xz for
    `tar -xJf out -C SITE`. Returns what was kept and dropped (bytes)."""
    kept = dropped = 0
    with zipfile.ZipFile(wheel) as zf, tarfile.open(out, "w:xz", preset=9) as tar:
        for info in sorted(zf.infolist(), key=lambda i: i.filename):
            if info.is_dir():
                continue
            if _dropped(info.filename):
                dropped += info.file_size
                continue
            member = tarfile.TarInfo(info.filename)
            member.size, member.mtime = info.file_size, FIXED_MTIME
            member.mode = (info.external_attr >> 16) & 0o777 or 0o644
            member.uname = member.gname = ""
            tar.addfile(member, io.BytesIO(zf.read(info)))
            kept += info.file_size
    return {"unpacked_bytes": kept, "dropped_bytes": dropped,
            "dropped": [*RAY_DROP_DIRS, *(f"*{s}" for s in RAY_DROP_SUFFIXES)]}


def check_closure(packages: list[dict], machine: dict[str, str | None]) -> list[str]:
    """Requirements met only by a machine package whose version was never read (the rest
    hold, else SystemExit names what is missing or too old)."""
    carried = {p["name"]: p["version"] for p in packages}
    unverified, problems = [], []
    for p in packages:
        for line in p["requires"]:
            req = Requirement(line)
            name = canonicalize_name(req.name)
            version = carried.get(name, machine.get(name))
            if name not in carried and name not in machine:
                problems.append(f"{p['name']} needs {line}: neither carried nor on the machine")
            elif version is None:
                if req.specifier:
                    unverified.append(f"{line} (for {p['name']}): machine version not read")
            elif not req.specifier.contains(version, prereleases=True):
                where = "carried" if name in carried else "on the machine"
                problems.append(f"{p['name']} needs {line}; {version} is {where}")
    if problems:
        raise SystemExit("bundle incomplete:\n  " + "\n  ".join(problems))
    return sorted(unverified)


def build(out_dir: Path, python: str = sys.executable) -> dict:
    machine = machine_packages(MACHINE)
    wanted = read_requirements()
    already = [w.name for w in wanted if w.name in machine and not w.override]
    if already:
        raise SystemExit(f"already on the GPU machine, not carried: {', '.join(already)} "
                         "(add `override: WHY` to carry another version)")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    (out_dir / "wheels").mkdir(parents=True)
    packages = []
    for w in wanted:
        wheel = download(w, python)
        entry: dict = {"name": w.name, "version": w.version, "requires": requires(wheel)}
        if w.slim:
            target = out_dir / f"{w.name}-{w.version}-cp312-slim.tar.xz"
            entry.update(form="slim-tar", source_wheel=wheel.name,
                         source_bytes=wheel.stat().st_size, **slim_tar(wheel, target))
        else:
            target = out_dir / "wheels" / wheel.name
            shutil.copyfile(wheel, target)
            entry["form"] = "wheel"
        if w.override:
            entry["override"] = w.override
        entry.update(file=str(target.relative_to(out_dir)), bytes=target.stat().st_size,
                     sha256=sha256(target))
        packages.append(entry)
    unverified = check_closure(packages, machine)
    total = sum(p["bytes"] for p in packages)
    manifest = {"python": "cp312", "platforms": list(PLATFORMS), "limit_bytes": LIMIT_BYTES,
                "total_bytes": total, "packages": packages,
                "machine_versions_not_read": unverified}
    text = json.dumps(manifest, indent=2) + "\n"
    (out_dir / "manifest.json").write_text(text)
    total_on_disk = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    if total_on_disk >= LIMIT_BYTES:
        raise SystemExit(f"bundle is {total_on_disk / 2**20:.1f} MiB, over the "
                         f"{LIMIT_BYTES // 2**20} MiB limit")
    MANIFEST.write_text(text)
    return manifest


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    manifest = build(Path(argv[0]).resolve())
    print(f"bundle: {manifest['total_bytes'] / 2**20:.1f} MiB in {argv[0]} "
          f"({len(manifest['packages'])} packages; manifest.json; "
          f"{len(manifest['machine_versions_not_read'])} requirements on machine versions "
          "never read)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
