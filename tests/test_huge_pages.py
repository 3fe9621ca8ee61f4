"""Tensors on transparent huge pages: a process that imports `workers` before it allocates
gets PyTorch's THP allocation (2 MiB pages where Linux grants them on request), unless the user
set THP_MEM_ALLOC_ENABLE; worker actors get the setting in their runtime environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers import HUGE_PAGES_ENV
from workers.host import actor_options

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
GRANTED = THP.exists() and "[never]" not in THP.read_text()
PROBE = """
import workers, torch
x = torch.ones(64 * 2**20 // 4)       # 64 MiB, touched
x.sum()
kb = [l for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")][0].split()[1]
print(workers.HUGE_PAGES_ENV["THP_MEM_ALLOC_ENABLE"], int(kb))
"""


def _probe(env: dict[str, str]) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, check=True,
                         capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    flag, kb = out.stdout.split()
    return flag, int(kb)


@pytest.mark.skipif(not GRANTED, reason="Linux grants no transparent huge pages here")
def test_importing_workers_puts_large_tensors_on_huge_pages():
    flag, kb = _probe({})
    assert flag == "1" and kb >= 32 * 1024      # most of the 64 MiB


def test_the_users_own_setting_wins():
    flag, kb = _probe({"THP_MEM_ALLOC_ENABLE": "0"})
    assert flag == "0" and kb == 0


def test_actor_options_add_the_setting_to_the_runtime_environment():
    ours = HUGE_PAGES_ENV["THP_MEM_ALLOC_ENABLE"]     # "1" unless this run's environment set it
    opts = actor_options({"num_cpus": 0, "runtime_env": {"env_vars": {"A": "1"},
                                                         "pip": ["x"]}})
    assert opts["num_cpus"] == 0 and opts["runtime_env"]["pip"] == ["x"]
    assert opts["runtime_env"]["env_vars"] == {"A": "1", "THP_MEM_ALLOC_ENABLE": ours}
    mine = actor_options({"runtime_env": {"env_vars": {"THP_MEM_ALLOC_ENABLE": "0"}}})
    assert mine["runtime_env"]["env_vars"]["THP_MEM_ALLOC_ENABLE"] == "0"
    assert actor_options({})["runtime_env"] == {"env_vars": {"THP_MEM_ALLOC_ENABLE": ours}}
