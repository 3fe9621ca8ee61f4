"""Compiles csrc/ (every .cpp, with its headers) into one shared library in a cache folder the
caller names, once per source, flags, compiler and CPU.

The sources are plain C++ with a C ABI and no torch headers, so a build takes seconds with the
system compiler, one object per core at a time (a torch C++ extension took about a minute:
torch's headers), and it does not
depend on torch's version or the Python environment. The library's name holds a key of the
sources, the headers, the flags, the compiler's version and the CPU's features (-march=native:
a cache on a home shared by different machines must not hand one the other's build). A build
holds a lock file beside the library (workers starting together compile it once; the others
wait for it) and writes a temporary file that it renames into place, so no reader sees a
half-written library.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))     # one library
HEADERS = tuple(sorted(CSRC.glob("*.h")))       # part of its build key
# -ffast-math: reassociated (vectorized) sums and glibc's vector expf; the kernels hold no
# infinities or NaNs (masked keys are outside their loops), so finite-math is safe
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-std=c++20", "-fPIC", "-shared", "-fopenmp"]
NAME = "raypd_cpu_kernels"


def cpu_features() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    want = ("model name", "flags", "Features")
    return "\n".join(dict.fromkeys(ln for ln in lines if ln.split(":")[0].strip() in want))


def compiler() -> tuple[list[str], str] | None:
    """(command, version line) of the C++ compiler ($CXX, which may hold a wrapper such as
    "ccache g++", else c++ or g++), or None."""
    cxx = shlex.split(os.environ.get("CXX", "")) or [
        c for c in (shutil.which("c++") or shutil.which("g++"),) if c]
    if not cxx:
        return None
    try:
        out = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (cxx, out.stdout.splitlines()[0]) if out.returncode == 0 and out.stdout else None


def sources_digest() -> str:
    """A hash of every kernel source and header: the numerics part of the build key, and the
    engine's numerics version that a recorded KV gate carries (workers/kv_gate.py)."""
    src = b"\0".join(s.read_bytes() for s in (*SOURCES, *HEADERS))
    return hashlib.sha256(src).hexdigest()[:16]


def build(cache: Path) -> Path:
    """The kernels' shared library under `cache`/native (built now unless a build for these
    sources, compiler and CPU is there). Raises RuntimeError when it cannot be built."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C++ compiler (c++ or g++, or $CXX)")
    key = hashlib.sha256(b"\0".join([sources_digest().encode(), " ".join(CFLAGS).encode(), cc[1].encode(),
                                     cpu_features().encode()])).hexdigest()[:16]
    lib = Path(cache) / "native" / f"{NAME}_{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # one build at a time per key: workers starting together on a new machine wait for the
    # first one's library instead of each compiling it (four compiles at once on 2 cores)
    with open(lib.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return lib
        fd, tmp = tempfile.mkstemp(prefix=lib.stem + ".", suffix=".tmp", dir=lib.parent)
        os.close(fd)
        try:
            with tempfile.TemporaryDirectory(dir=lib.parent) as objdir:
                objects = _compile_objects(cc[0], Path(objdir))
                _run([*cc[0], *CFLAGS, "-o", tmp, *objects], cc[0])
            os.replace(tmp, lib)  # atomic: a reader never sees a half-written library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return lib


def _compile_objects(cxx: list[str], objdir: Path) -> list[str]:
    """Each source compiled to an object in `objdir`, as many at once as there are cores,
    largest source first (paged_decode.cpp takes most of the build: with 2 cores the build
    takes about as long as it does alone)."""
    order = sorted(SOURCES, key=lambda s: s.stat().st_size, reverse=True)
    objects = [str(objdir / f"{s.stem}.o") for s in SOURCES]
    jobs = {s: str(objdir / f"{s.stem}.o") for s in order}
    with ThreadPoolExecutor(max_workers=max(1, min(len(order), os.cpu_count() or 1))) as pool:
        for f in [pool.submit(_run, [*cxx, *CFLAGS, "-c", str(s), "-o", o], cxx)
                  for s, o in jobs.items()]:
            f.result()
    return objects


def _run(cmd: list[str], cxx: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cxx)} failed: {out.stderr.strip()[-2000:]}")
