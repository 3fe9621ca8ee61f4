"""Fault injection for the chaos bench and the fault-tolerance tests: subclasses of the worker
hosts that add the faults through the hosts' hooks (`_before_step`, `_run_step`, `_stage`,
`ack`, `_before_pull`, `_land`). Production actors are the plain hosts; a cluster gets these
only when its PDConfig asks for them (`fault_injection=True`).

Faults, and where they apply:
    stall_next_step(s)         the next engine step hangs s seconds (hung-worker detection)
    fail_next_steps(n)         the next n engine steps raise (only their requests fail)
    crash_loop()               the engine loop breaks: the process exits, Ray restarts it
    lose_block()               a free block leaves the free list (refcount 0, no hash): the
                               pool's invariant check fails (a leak count must not read 0)
    inject_fault("corrupt", n) P flips bytes of its next n staged copies, after checksumming
    arm_corruption()           the same for the next staging, with an id to follow it by
    inject_fault("drop_ack", n) P ignores its next n acks (the lease has to end them)
    inject_transfer_faults(n)  D's next n pulls fail
    inject_pull_delay(s, n, tag) D's next n pulls start s seconds late (slower than a lease)
    disarm_fault(kind), cancel_pull_delays(tag)   cancel what was armed and not applied yet
Each fault counts when it is applied, not when it is armed (`fault_counts()`).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, deque
from typing import Any

from kvtransfer.base import TransferError
from protocol.errors import REJECT_CORRUPT, TransferRejected
from protocol.messages import PrefillResult, TransferPlan
from workers.decode_host import DecodeHost
from workers.engine import StepOutput
from workers.kv_handoff import Reservation
from workers.prefill_host import PrefillHost


class EngineFaults:
    """Loop and step faults, for either role (mixed in before the host class)."""

    def _init_engine_faults(self) -> None:
        self._stall_s = 0.0          # stall the next step this long
        self._step_errors = 0        # fail the next steps
        self._crash_loop = False     # break the loop

    def stall_next_step(self, seconds: float) -> None:
        """Make the next engine step hang for `seconds` (to test hung-worker detection)."""
        self._stall_s = seconds

    def fail_next_steps(self, n: int = 1) -> None:
        """Make the next `n` engine steps raise (to test that only their requests fail)."""
        self._step_errors = n

    def crash_loop(self) -> None:
        """Break the engine loop (to test that the actor restarts)."""
        self._crash_loop = True
        self._work.set()

    def lose_block(self) -> int:
        """Lose one free block: off the free list with refcount 0 and no hash, so the pool's
        invariant check raises from now on. Returns its id."""
        with self._lock:
            pool = self.engine.kv.pool
            return pool._free.pop()

    def _before_step(self) -> None:
        if self._crash_loop:
            raise RuntimeError("injected engine loop failure")
        super()._before_step()

    def _run_step(self) -> list[StepOutput]:
        if self._stall_s:
            time.sleep(self._stall_s)
            self._stall_s = 0.0
        if self._step_errors:
            self._step_errors -= 1
            raise RuntimeError("injected engine step failure")
        return super()._run_step()


class FaultyPrefillHost(EngineFaults, PrefillHost):
    """A prefill worker that corrupts staged copies and drops acks when told to."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self._init_engine_faults()
        self._faults = {"corrupt": 0, "drop_ack": 0}   # next n stagings / acks
        self.corrupt_injected = 0                      # staged copies corrupted
        self.acks_dropped = 0                          # acks ignored
        self._corrupt_armed: list[int] = []            # ids of armed corruptions, in order
        self._corrupt_applied: dict[int, tuple[str, str]] = {}   # id -> (P, transfer)
        self._ack_lock = threading.Lock()              # guards _faults["drop_ack"]
        super().__init__(*args, **kw)

    def inject_fault(self, kind: str, n: int = 1) -> None:
        """`corrupt` flips bytes of the next n staged copies (after their checksums were
        taken); `drop_ack` ignores the next n acks (the lease has to expire)."""
        assert kind in self._faults, kind
        self._faults[kind] = max(0, self._faults[kind] + n)

    def disarm_fault(self, kind: str) -> None:
        """Cancel what `inject_fault(kind, n)` armed and was not applied yet."""
        assert kind in self._faults, kind
        with self._ack_lock:
            self._faults[kind] = 0

    def arm_corruption(self) -> int:
        """The next staged copy gets corrupted; returns an id for `corruption_applied`."""
        with self._lock:
            fid = len(self._corrupt_applied) + len(self._corrupt_armed) + self.corrupt_injected
            fid = max([fid, *self._corrupt_armed, *self._corrupt_applied]) + 1
            self._corrupt_armed.append(fid)
            return fid

    def corruption_applied(self, fid: int, disarm: bool = False) -> tuple[str, str] | None:
        """The transfer (this worker's id, the worker request id) that armed corruption hit,
        or None if it hit no staged copy yet; `disarm`: cancel it if not."""
        with self._lock:
            if disarm and fid in self._corrupt_armed:
                self._corrupt_armed.remove(fid)
            return self._corrupt_applied.get(fid)

    def _stage(self, req: Any, plan: TransferPlan, corrupt: bool = False) -> PrefillResult:
        corrupt = corrupt or self._faults["corrupt"] > 0 or bool(self._corrupt_armed)
        fid = None
        if self._faults["corrupt"] > 0:
            self._faults["corrupt"] -= 1
        elif corrupt:
            fid = self._corrupt_armed.pop(0)
        try:
            result = super()._stage(req, plan, corrupt=corrupt)
        except BaseException:
            if fid is not None:
                self._corrupt_armed.insert(0, fid)     # the next staging takes it
            raise
        corrupt = corrupt and result.handle is not None   # nothing staged: nothing corrupted
        self.corrupt_injected += corrupt
        if fid is not None:
            if corrupt:
                self._corrupt_applied[fid] = (self.worker_id, result.worker_request_id)
            else:
                self._corrupt_armed.insert(0, fid)     # the next staging takes it
        return result

    def ack(self, transfer_id: str) -> str:
        """As PrefillHost.ack, or "dropped" when a drop_ack fault swallowed it."""
        with self._ack_lock:
            if self._faults["drop_ack"] > 0:
                self._faults["drop_ack"] -= 1
                self.acks_dropped += 1
                return "dropped"
        return super().ack(transfer_id)

    def fault_counts(self) -> dict[str, int]:
        """Faults applied so far by this incarnation (no engine lock: answers mid-step)."""
        return {"corrupt_injected": self.corrupt_injected, "acks_dropped": self.acks_dropped}

    def stats(self) -> dict:
        d = super().stats()
        d.update(self.fault_counts())
        return d


class FaultyDecodeHost(EngineFaults, DecodeHost):
    """A decode worker that delays or fails pulls when told to, and keeps the chaos audit:
    which transfers reached verification here and which of those it refused as corrupt."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self._init_engine_faults()
        self._faults_left = 0                  # pulls to fail
        self._pull_delays: deque[tuple[float, str]] = deque()   # (seconds, tag): next pulls
        self.pull_delays_applied: Counter[str] = Counter()       # tag -> pulls delayed
        self._count_lock = threading.Lock()    # the counts (read without the engine lock)
        self.transfer_faults_applied = 0
        self._exit_on_pull = False
        # (prefill worker, worker request id): transfers whose pages reached verification
        # here, and of those the ones refused as corrupt
        self.pages_received: set[tuple[str, str]] = set()
        self.corrupt_rejected: set[tuple[str, str]] = set()
        super().__init__(*args, **kw)

    def inject_transfer_faults(self, n: int) -> None:
        """Make the next `n` transfers into this worker fail (for failure-policy tests)."""
        self._faults_left = n

    def inject_exit_on_pull(self) -> None:
        """The next pull into this worker kills its process (a worker dying mid-transfer)."""
        self._exit_on_pull = True

    def inject_pull_delay(self, seconds: float, n: int = 1, tag: str = "delay") -> None:
        """The next `n` pulls not yet delayed start `seconds` late (a pull slower than the
        lease); each counts under `tag` in `fault_counts()` once it is applied."""
        with self._lock:
            self._pull_delays.extend([(seconds, tag)] * n)

    def cancel_pull_delays(self, tag: str) -> int:
        """Cancel the pull delays armed under `tag` that no pull took yet; returns how many."""
        with self._lock:
            kept = deque(d for d in self._pull_delays if d[1] != tag)
            n = len(self._pull_delays) - len(kept)
            self._pull_delays = kept
        return n

    def fault_counts(self) -> dict[str, int]:
        """Faults applied so far by this incarnation (no engine lock: answers mid-pull)."""
        with self._count_lock:
            return {**{f"pull_delays_{t}": n for t, n in self.pull_delays_applied.items()},
                    "transfer_faults_applied": self.transfer_faults_applied}

    def transfers_seen(self, transfers: list[tuple[str, str]]
                       ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """Which of these transfers (prefill worker, worker request id) delivered pages here,
        and which of those this worker refused as corrupt."""
        with self._lock:
            got = [t for t in map(tuple, transfers) if t in self.pages_received]
            return got, [t for t in got if t in self.corrupt_rejected]

    def _before_pull(self) -> None:
        if self._exit_on_pull:
            os._exit(75)
        with self._lock:
            delay, tag = self._pull_delays.popleft() if self._pull_delays else (0.0, "")
        if tag:
            with self._count_lock:
                self.pull_delays_applied[tag] += 1
        if delay > 0:
            time.sleep(delay)
        if self._faults_left > 0:
            self._faults_left -= 1
            self.transfer_faults_applied += 1
            raise TransferError(f"injected transfer fault on {self.worker_id}")

    def _land(self, res: Reservation, result: PrefillResult, pages) -> StepOutput:
        key = (result.prefill_worker, result.worker_request_id)
        if pages is not None:
            self.pages_received.add(key)
        try:
            return super()._land(res, result, pages)
        except TransferRejected as e:
            if e.reason == REJECT_CORRUPT:
                self.corrupt_rejected.add(key)
            raise

    def stats(self) -> dict:
        d = super().stats()
        d.update(self.fault_counts(),
                 pull_delays_applied=sum(self.pull_delays_applied.values()))
        return d

