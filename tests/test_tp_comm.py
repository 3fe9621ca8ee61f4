"""The tensor-parallel channel between the ranks of one host (workers/kernels/tp_comm.ShmComm)
with 2, 3 and 4 spawned processes: all-reduce equals the sum in rank order (float32 exactly;
bf16: the float32 sum rounded once) with the same bits on every rank, for odd sizes and sizes
over a slot and every algorithm; broadcast and gather deliver every rank's bytes; a dead peer,
a timeout and abort() raise CommError in the waiting ranks instead of hanging."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import secrets
import time

import pytest
import torch

from workers.kernels import tp_comm
from workers.kernels.tp_comm import CommError, ShmComm

SLOT = 64 << 10          # small slots, so that a few hundred KB take several calls
BCAST = 4096             # a small broadcast area, so that chunking is cheap to test
SIZES = [1, 7, 33, 576, 16 * 576, 100_003]       # elements; 100,003 float32 > 6 slots
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PAYLOADS = [b"", b"x", random.Random(0).randbytes(5000), random.Random(1).randbytes(3 * BCAST + 17)]


@pytest.fixture(scope="module", autouse=True)
def native_library():
    try:
        tp_comm._library()     # built here once, not by every spawned rank at once
    except RuntimeError as e:
        pytest.skip(str(e))


def rank_input(rank: int, n: int, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    return (torch.randn(n, generator=g) * 100).to(DTYPES[dtype])


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def expected_sum(world: int, n: int, dtype: str) -> bytes:
    """Rank 0's + rank 1's + ... in that order, in float32 (bf16: widened, rounded once)."""
    acc = rank_input(0, n, dtype).float()
    for r in range(1, world):
        acc = acc + rank_input(r, n, dtype).float()
    return raw(acc.to(DTYPES[dtype]))


def new_name() -> str:
    return f"{tp_comm.PREFIX}{os.getpid()}_{secrets.token_hex(6)}"


def join(name: str, rank: int, world: int) -> ShmComm:
    if rank == 0:
        return ShmComm.create(world, SLOT, name=name, bcast_bytes=BCAST)
    return ShmComm.attach(name, rank, world, SLOT)


def healthy_session(rank: int, world: int, names: list[str]) -> dict:
    """All-reduces of every dtype, size and algorithm, broadcasts and gathers, in one group."""
    comm = join(names[0], rank, world)
    got: dict = {"allreduce": {}}
    for dtype in DTYPES:
        for n in SIZES:
            for algo in tp_comm.ALGOS:
                t = rank_input(rank, n, dtype)
                assert comm.all_reduce_(t, algo=algo) is t
                got["allreduce"][dtype, n, algo] = raw(t)
    got["broadcast"] = [comm.broadcast(p if rank == 0 else None, timeout_s=30) for p in PAYLOADS]
    got["many_broadcasts"] = [comm.broadcast(bytes([i]) * i if rank == 0 else None)
                              for i in range(100)]
    small = torch.arange(15, dtype=torch.int64).reshape(3, 5) + 100 * rank
    big = torch.full((SLOT // 4 * 2 + 3,), float(rank))           # over two slots
    # as lists: a tensor put on a multiprocessing queue travels as a handle to shared memory
    # that is gone once its process has exited
    got["gather"] = [None if g is None else [t.tolist() for t in g]
                     for g in (comm.gather(small), comm.gather(big))]
    comm.barrier()
    comm.close()
    return got


def failure_session(rank: int, world: int, names: list[str]) -> dict:
    """Three groups one after another: a timeout, an abort, then rank 2 dies."""
    got = {}
    if rank < 2:                           # a timeout: rank 1 waits for a rank 0 that is late
        comm = join(names[0], rank, 2)
        if rank == 1:
            got["timeout"] = timed(lambda: comm.barrier(timeout_s=0.3))
        else:
            time.sleep(1.0)
            got["after_timeout"] = timed(lambda: comm.barrier(timeout_s=5))
        comm.close()
        comm = join(names[1], rank, 2)     # abort(): rank 0 wakes rank 1 out of a broadcast
        if rank == 1:
            got["abort"] = timed(lambda: comm.broadcast(None))
        else:
            time.sleep(0.3)
            comm.abort()
        comm.close()
    comm = join(names[2], rank, 3)         # rank 2 dies while the others all-reduce
    comm.barrier()
    if rank == 2:
        os._exit(0)
    got["death"] = timed(lambda: comm.all_reduce_(torch.ones(1000), timeout_s=30))
    comm.close()
    return got


def creator_dies_session(rank: int, world: int, names: list[str]) -> dict:
    """Rank 0 dies while rank 1 waits (no timeout) for its broadcast."""
    comm = join(names[0], rank, 2)
    comm.barrier()
    if rank == 0:
        time.sleep(0.2)
        os._exit(0)
    got = {"death": timed(lambda: comm.broadcast(None, timeout_s=None))}
    comm.close()
    os.unlink(os.path.join(tp_comm.DEFAULT_DIR, names[0]))   # its creator could not
    return got


def timed(call) -> tuple[str, str, float]:
    """(the exception's class name, its message, seconds) of a call expected to raise."""
    t0 = time.monotonic()
    try:
        call()
    except Exception as e:  # noqa: BLE001 (the test reads the class)
        return type(e).__name__, str(e), time.monotonic() - t0
    return "returned", "", time.monotonic() - t0


def _rank_main(session, rank: int, world: int, names: list[str], out) -> None:
    torch.set_num_threads(1)
    out.put((rank, session(rank, world, names)))


def run_ranks(session, world: int, groups: int = 1, timeout: float = 90) -> dict[int, dict]:
    """{rank: what `session` returned} from `world` spawned processes (a dead rank returns
    nothing)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    names = [new_name() for _ in range(groups)]
    procs = [ctx.Process(target=_rank_main, args=(session, r, world, names, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) or not out.empty():
            try:
                rank, got = out.get(timeout=0.5)
                results[rank] = got
            except queue.Empty:
                assert time.monotonic() < deadline, "the ranks hung"
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    for name in names:
        assert not os.path.exists(os.path.join(tp_comm.DEFAULT_DIR, name)), "segment leaked"
    return results


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"{w}ranks")
def healthy(request) -> tuple[int, dict[int, dict]]:
    world = request.param
    results = run_ranks(healthy_session, world)
    assert sorted(results) == list(range(world))
    return world, results


def test_all_reduce_is_the_rank_order_sum_with_the_same_bits_on_every_rank(healthy):
    world, results = healthy
    for (dtype, n, algo), _ in results[0]["allreduce"].items():
        want = expected_sum(world, n, dtype)
        for rank in range(world):
            assert results[rank]["allreduce"][dtype, n, algo] == want, (rank, dtype, n, algo)


def test_broadcast_delivers_rank_0s_payload_of_any_size_to_every_rank(healthy):
    world, results = healthy
    for rank in range(world):
        assert results[rank]["broadcast"] == PAYLOADS
        assert results[rank]["many_broadcasts"] == [bytes([i]) * i for i in range(100)]


def test_gather_gives_rank_0_every_ranks_tensor_in_rank_order(healthy):
    world, results = healthy
    small, big = results[0]["gather"]
    assert small == [(torch.arange(15).reshape(3, 5) + 100 * r).tolist() for r in range(world)]
    assert big == [[float(r)] * (SLOT // 4 * 2 + 3) for r in range(world)]
    assert all(results[r]["gather"] == [None, None] for r in range(1, world))


@pytest.fixture(scope="module")
def failures() -> dict[int, dict]:
    results = run_ranks(failure_session, 3, groups=3)
    assert sorted(results) == [0, 1]            # rank 2 died
    return results


def test_a_wait_past_its_timeout_raises_and_breaks_the_group(failures):
    kind, msg, seconds = failures[1]["timeout"]
    assert (kind, "timed out" in msg) == ("CommError", True) and 0.3 <= seconds < 0.9
    kind, msg, _ = failures[0]["after_timeout"]   # the late rank finds the group aborted
    assert (kind, "aborted" in msg) == ("CommError", True)


def test_abort_wakes_a_rank_waiting_for_a_broadcast(failures):
    kind, msg, seconds = failures[1]["abort"]
    assert (kind, "aborted" in msg) == ("CommError", True) and seconds < 1.5


def test_a_peer_that_dies_makes_the_others_all_reduce_raise_instead_of_hanging(failures):
    for rank in (0, 1):
        kind, msg, seconds = failures[rank]["death"]
        assert kind == "CommError" and ("rank 2 died" in msg or "aborted" in msg), msg
        assert seconds < 2.0


def test_a_broadcast_without_timeout_raises_when_rank_0_dies():
    results = run_ranks(creator_dies_session, 2)
    kind, msg, seconds = results[1]["death"]
    assert (kind, "rank 0 died" in msg) == ("CommError", True) and seconds < 2.0


def test_wrong_dtype_or_layout_is_refused_before_any_wait():
    comm = ShmComm.create(1, SLOT, name=new_name())
    try:
        with pytest.raises(ValueError):
            comm.all_reduce_(torch.ones(4, dtype=torch.float64))
        with pytest.raises(ValueError):
            comm.all_reduce_(torch.ones(4, 4).t())
        t = torch.arange(5, dtype=torch.float32)     # one rank: the sum is itself
        assert comm.all_reduce_(t).tolist() == [0, 1, 2, 3, 4]
        assert comm.broadcast(b"abc") == b"abc"
        with pytest.raises(CommError):
            comm.abort()
            comm.barrier()
    finally:
        comm.close()
