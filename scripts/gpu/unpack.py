"""Unpacks the bundle (scripts/gpu/bundle.py) into a private site folder that PYTHONPATH puts
ahead of the machine's own packages: the slim Ray tar.xz and every wheel extracted in place
(a wheel is a zip of its site-packages files; none carried has scripts or data to place), each
file's sha256 checked against manifest.json first. A folder already stamped with the same
manifest is kept as it is (a rerun costs nothing).

    python scripts/gpu/unpack.py BUNDLE SITE OUT.json

Prints one JSON line (and writes it to OUT.json): ok, the folder, whether this Python can use
it (the bundle is for CPython 3.12: a dry run elsewhere unpacks it but leaves it off the path).
Standard library only: it runs before anything else is importable."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tarfile
import time
import zipfile
from pathlib import Path

STAMP = ".raypd-bundle.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def unpack(bundle: Path, site: Path) -> dict:
    manifest_text = (bundle / "manifest.json").read_text()
    manifest = json.loads(manifest_text)
    key = hashlib.sha256(manifest_text.encode()).hexdigest()
    usable = f"cp{sys.version_info.major}{sys.version_info.minor}" == manifest["python"]
    result = {"site": str(site), "python_tag": manifest["python"], "usable_here": usable,
              "packages": {p["name"]: p["version"] for p in manifest["packages"]}}
    stamp = site / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("key") == key:
        return {**result, "ok": True, "reused": True}
    t = time.perf_counter()
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    for p in manifest["packages"]:
        path = bundle / p["file"]
        if sha256(path) != p["sha256"]:
            return {**result, "ok": False, "error": f"{p['file']}: sha256 differs from manifest"}
        if p["form"] == "slim-tar":
            with tarfile.open(path, "r:xz") as tar:
                tar.extractall(site, filter="tar")
        else:
            with zipfile.ZipFile(path) as zf:
                zf.extractall(site)
    stamp.write_text(json.dumps({"key": key}))
    return {**result, "ok": True, "reused": False, "seconds": round(time.perf_counter() - t, 1)}


def main(argv: list[str]) -> int:
    bundle, site, out = Path(argv[0]), Path(argv[1]), Path(argv[2])
    try:
        result = unpack(bundle, site)
    except (OSError, ValueError, KeyError, tarfile.TarError, zipfile.BadZipFile) as e:
        result = {"ok": False, "site": str(site), "error": f"{type(e).__name__}: {e}"}
    out.write_text(json.dumps(result) + "\n")
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
