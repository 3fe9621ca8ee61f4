"""A worker's threads other than its engine loop run torch on one OpenMP thread
(workers/device.py serial_openmp_here), and the engine lock makes every caller such a thread;
the loop thread and the rest of the process keep theirs."""

from __future__ import annotations

import threading

import pytest
import torch

from workers.device import libgomp, serial_openmp_here
from workers.host import EngineLock

pytestmark = pytest.mark.skipif(libgomp() is None, reason="torch without libgomp")


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def _omp_max_threads() -> int:
    return libgomp().omp_get_max_threads()


def test_serial_here_sets_only_the_calling_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def serial():
            serial_openmp_here()
            torch.ones(4).add_(1)            # torch's own first use does not undo it
            return _omp_max_threads()
        assert _in_thread(serial) == 1
        assert _in_thread(lambda: (torch.get_num_threads(), _omp_max_threads())) == (2, 2)
        assert _omp_max_threads() == 2       # this thread untouched
    finally:
        torch.set_num_threads(before)


def test_engine_lock_serializes_callers_but_not_the_loop():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    lock = EngineLock()
    try:
        def caller():
            with lock:
                return _omp_max_threads()

        def loop():
            lock.loop_thread = threading.current_thread()
            with lock:
                return _omp_max_threads()
        assert _in_thread(caller) == 1
        assert _in_thread(loop) == 2
        off = EngineLock(serial_callers=False)

        def plain():
            with off:
                return _omp_max_threads()
        assert _in_thread(plain) == 2
    finally:
        torch.set_num_threads(before)
