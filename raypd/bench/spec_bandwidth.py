"""The memory bandwidth a GPU's maker states, by device name, set beside the bandwidth measured.

A measured read rate far under the spec says the measurement (or the machine) is off, and a
decode bound taken on it would flatter the engine. Figures are the makers' data-sheet numbers in
GB/s (10^9 bytes); a name not in the table gets None, never a guess. Entries are matched on the
name `torch.cuda.get_device_name` gives, most specific first (an "H100 PCIe" is no "H100 SXM").
"""

from __future__ import annotations

# (substring of the device name, spec GB/s), most specific first
SPEC_READ_GBPS: tuple[tuple[str, float], ...] = (
    ("GH200", 4000.0),              # Grace Hopper, 96 GB HBM3 (before "H200": it contains it)
    ("H200", 4800.0),               # H200 SXM, 141 GB HBM3e
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),               # H100 SXM5 80 GB HBM3 ("NVIDIA H100 80GB HBM3")
    ("A100 80GB PCIe", 1935.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100", 1555.0),               # the 40 GB parts, SXM4 and PCIe
    ("L40S", 864.0),
    ("L40", 864.0),                 # before "L4"
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
)


def spec_read_gbps(device_name: str, device_type: str = "cuda") -> float | None:
    """The stated bandwidth of a GPU of this name, None for a CPU or a name not in the table
    (a CPU's depends on its channels and DIMMs, which its name does not give)."""
    if device_type != "cuda":
        return None
    for part, gbps in SPEC_READ_GBPS:
        if part in device_name:
            return gbps
    return None
