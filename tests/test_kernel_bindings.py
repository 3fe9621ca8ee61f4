"""The ctypes signatures of workers/kernels/bindings.py against the C++ they call: every
`raypd_*` function declared or defined in workers/kernels/csrc/*.cpp has an entry in SIGNATURES
with the same argument count, argument types and return type, and every entry has a function.
A mismatch would pass the wrong bits to a kernel that reads raw memory; here it is a test
failure. (Needs no compiler: it reads the sources.)"""

from __future__ import annotations

import ctypes
import re

from workers.kernels import bindings, build

# a C++ type -> its ctypes type (pointers of any kind: c_void_p, the tensors' data_ptr())
C_TYPES = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64,
           "double": ctypes.c_double}
DECL = re.compile(r"\b(void|int|int64_t|double)\s+raypd_(\w+)\s*\(([^)]*)\)")


def param_type(param: str):
    param = param.strip()
    if "*" in param:
        return ctypes.c_void_p
    words = param.replace("const ", "").split()
    assert len(words) == 2 and words[0] in C_TYPES, param
    return C_TYPES[words[0]]


def c_signatures() -> dict[str, list[tuple[list, type | None, str]]]:
    """{name less raypd_: [(argtypes, restype, where)]} of every raypd_ declaration and
    definition in csrc/ (decode_layers.cpp redeclares the ones it calls: checked too)."""
    found: dict[str, list] = {}
    for src in build.SOURCES:
        text = re.sub(r"//[^\n]*", "", src.read_text())       # no comments
        for m in DECL.finditer(text):
            ret, name, params = m.groups()
            args = [param_type(p) for p in params.split(",")] if params.strip() else []
            found.setdefault(name, []).append((args, C_TYPES[ret], src.name))
    return found


def test_every_entry_point_has_one_signature_that_matches_the_cpp():
    found = c_signatures()
    assert set(found) == set(bindings.SIGNATURES), \
        (set(found) ^ set(bindings.SIGNATURES))
    wrong = []
    for name, (argtypes, restype) in bindings.SIGNATURES.items():
        for args, ret, where in found[name]:
            if args != list(argtypes) or ret is not restype:
                wrong.append(f"raypd_{name} ({where}): C++ {[a and a.__name__ for a in args]} -> "
                             f"{ret and ret.__name__}, table {[a.__name__ for a in argtypes]} "
                             f"-> {restype and restype.__name__}")
    assert not wrong, "\n".join(wrong)


def test_the_library_is_built_from_every_source_and_header():
    """build.py's key covers every file in csrc/ (a header edit rebuilds)."""
    files = {p.name for p in build.CSRC.iterdir() if p.is_file()}
    assert {p.name for p in (*build.SOURCES, *build.HEADERS)} == files
    assert "paged_decode.cpp" in files and "bf16.h" in files
