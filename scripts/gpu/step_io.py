"""What every first-contact step shares: where it runs (RAYPD_GPU_DEVICE, set by the runner:
"cuda" on the GPU machine, "cpu" in the dry run), its one JSON result, and its exit code
(0 only when every check in it passed)."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def device() -> str:
    return os.environ.get("RAYPD_GPU_DEVICE", "cuda")


def dry_run() -> bool:
    return device() != "cuda"


def run_step(body: Callable[[], dict[str, Any]]) -> int:
    """Run `body`, write its dict (plus ok and device) as JSON to argv[1], exit 0 iff ok.
    An exception is the step's failure: its type, message and last frames go in the JSON."""
    out = Path(sys.argv[1])
    try:
        result = body()
    except Exception as e:  # noqa: BLE001 - a step reports every failure as JSON
        result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc().splitlines()[-12:]}
    result = {"device": device(), **result}
    result.setdefault("ok", False)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps(result, default=str))
    return 0 if result["ok"] else 1
