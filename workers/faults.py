"""Fault injection for the chaos bench and the fault-tolerance tests: subclasses of the worker
hosts that add the faults through the hosts' hooks (`_before_step`, `_run_step`, `_stage`,
`ack`, `_before_pull`, `_land`). Production actors are the plain hosts; a cluster gets these
only when its PDConfig asks for them (`fault_injection=True`).

Faults, and where they apply:
    stall_next_step(s)         the next engine step hangs s seconds (hung-worker detection)
    fail_next_steps(n)         the next n engine steps raise (only their requests fail)
    crash_loop()               the engine loop breaks: the process exits, Ray restarts it
    pause_at(rid, stage, n)    the loop holds (engine lock free) once request `rid` is in its
                               `stage` with n output tokens, until resume() (tests catch a
                               request in a stage deterministically; paused_at() says where)
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
from dataclasses import dataclass
from typing import Any

from kvtransfer.base import TransferError
from protocol.errors import REJECT_CORRUPT, TransferRejected
from protocol.messages import PrefillResult, TransferPlan
from workers.decode_host import DecodeHost
from workers.engine import StepOutput
from workers.host import prefilling
from workers.kv_handoff import Reservation
from workers.prefill_host import PrefillHost

PAUSE_LIMIT_S = 60.0     # a paused loop resumes on its own after this (a test that failed)


@dataclass(frozen=True)
class PausedAt:
    """Where a paused engine loop holds a request: before the step that would advance it."""

    request_id: str         # the worker request id
    stage: str              # "prefill" (computing prompt tokens) or "decode"
    output_tokens: int      # output tokens it had then (it gets no more while paused)


def _stage(req: Any) -> str:
    return "prefill" if prefilling(req) else "decode"


class EngineFaults:
    """Loop and step faults, for either role (mixed in before the host class)."""

    def _init_engine_faults(self) -> None:
        self._stall_s = 0.0          # stall the next step this long
        self._step_errors = 0        # fail the next steps
        self._crash_loop = False     # break the loop
        self._pause_for: tuple[str, str, int] | None = None   # (request id, stage, tokens)
        self._paused_at: PausedAt | None = None
        self._resume = threading.Event()

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

    def pause_at(self, request_id: str, stage: str, min_output_tokens: int = 0) -> None:
        """Pause the engine loop before the first step that finds request `request_id` in the
        engine in `stage` ("prefill" or "decode") with at least `min_output_tokens` output
        tokens, until `resume()` (or PAUSE_LIMIT_S). The loop waits with the engine lock free,
        so actor calls (an abort, a stats query) are served meanwhile, and no step runs."""
        assert stage in ("prefill", "decode"), stage
        self._resume.clear()
        self._paused_at = None
        self._pause_for = (request_id, stage, min_output_tokens)

    def paused_at(self) -> PausedAt | None:
        """Where the armed pause caught its request, or None while it has not (yet)."""
        return self._paused_at

    def resume(self) -> None:
        """End the pause (or disarm it, if it caught nothing yet)."""
        self._pause_for = None
        self._resume.set()

    def stage_of(self, request_id: str) -> str | None:
        """Request `request_id`'s stage in this engine ("prefill" or "decode"), or None when
        the engine does not hold it (never came, finished, aborted). Answers while paused."""
        with self._lock:
            req = self._engine_request(request_id)
            return None if req is None else _stage(req)

    def _engine_request(self, request_id: str) -> Any:
        view = self.engine.view
        return next((r for r in (*view.running_requests(), *view.waiting_requests())
                     if r.request_id == request_id), None)

    def _maybe_pause(self) -> None:
        """Under the lock, in the loop, before a step: hold here if the armed request is in
        its stage; the lock is released while held and taken back before the step."""
        if self._pause_for is None:
            return
        rid, stage, min_tokens = self._pause_for
        req = self._engine_request(rid)
        if req is None or len(req.output_token_ids) < min_tokens or _stage(req) != stage:
            return
        self._pause_for = None
        self._paused_at = PausedAt(rid, stage, len(req.output_token_ids))
        self._lock.__exit__(None, None, None)      # held once, by the loop's `with`
        try:
            self._resume.wait(PAUSE_LIMIT_S)
        finally:
            self._lock.__enter__()

    def _before_step(self) -> None:
        if self._crash_loop:
            raise RuntimeError("injected engine loop failure")
        self._maybe_pause()
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

