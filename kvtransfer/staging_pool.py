"""Staging memory that outlives a transfer, so a reader maps each piece of it once.

cuda_ipc stages each transfer's pages in a private buffer and exports it; a decode worker that
maps a fresh CUDA IPC handle for every pull pays the map and the unmap each time (~0.4 ms on an
H200, more than the copy of a few MiB). A `StagingPool` hands out byte ranges of a few long-lived
segments instead: every transfer staged in one segment shares that segment's CUDA allocation,
so a reader that keeps its mapping of the segment (cuda_ipc `_MAPPED`) maps it once, and torch's
own receive cache turns later opens of it into a reference-count release.

Invariants (asserted by `check`):
- the ranges handed out and the free ranges of a segment tile it exactly, never overlap;
- every range starts on an ALIGN boundary;
- the segments' bytes never exceed `cap_bytes`; a request that does not fit is refused (None)
  and the caller stages it privately, as without a pool.
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass, field

import torch

from kvcache.manager import cdiv

ALIGN = 512                      # bytes: every range starts here (any dtype's alignment)
DEFAULT_SEGMENT_BYTES = 64 << 20
_IDS = itertools.count()


def _round_up(n: int, to: int) -> int:
    return cdiv(n, to) * to


@dataclass
class _Segment:
    id: str
    buffer: torch.Tensor                                  # uint8, the segment's bytes
    free: list[tuple[int, int]] = field(default_factory=list)    # sorted (start, length)
    taken: dict[int, int] = field(default_factory=dict)           # start -> length


@dataclass(frozen=True)
class Range:
    """A range handed out by `take`: give it back with `give(range)`."""

    segment: str
    start: int
    nbytes: int
    view: torch.Tensor     # uint8 bytes [start, start + nbytes) of the segment


class StagingPool:
    """First-fit byte ranges over segments on one device, grown on demand up to `cap_bytes`.
    Thread-safe (a producer stages and releases from different threads)."""

    def __init__(self, device: torch.device | str, cap_bytes: int,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        assert cap_bytes >= 0 and segment_bytes > 0
        self.device = torch.device(device)
        self.cap_bytes = cap_bytes
        self.segment_bytes = _round_up(segment_bytes, ALIGN)
        self._segments: dict[str, _Segment] = {}
        self._lock = threading.Lock()

    @property
    def reserved_bytes(self) -> int:
        return sum(s.buffer.numel() for s in self._segments.values())

    def take(self, nbytes: int) -> Range | None:
        """A free range of `nbytes` (first fit; a new segment when none has room and the cap
        allows one), or None: the caller stages without the pool."""
        need = _round_up(max(nbytes, 1), ALIGN)
        with self._lock:
            for seg in self._segments.values():
                got = self._carve(seg, need)
                if got is not None:
                    return self._range(seg, got, nbytes)
            size = max(min(self.segment_bytes, self.cap_bytes), need)
            if self.reserved_bytes + size > self.cap_bytes:
                return None
            try:
                buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            except RuntimeError:     # out of device memory: stage privately (or fail) instead
                return None
            seg = _Segment(f"{os.getpid()}-{next(_IDS)}", buffer, [(0, size)])
            self._segments[seg.id] = seg
            return self._range(seg, self._carve(seg, need), nbytes)

    def give(self, r: Range) -> None:
        """Return a range taken from this pool (merged with its free neighbours)."""
        with self._lock:
            seg = self._segments[r.segment]
            length = seg.taken.pop(r.start)
            free = sorted([*seg.free, (r.start, length)])
            merged: list[tuple[int, int]] = []
            for start, n in free:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((start, n))
            seg.free = merged

    def close(self) -> None:
        """Drop every segment (its memory goes back once no reader maps it any more)."""
        with self._lock:
            self._segments.clear()

    def check(self) -> None:
        """Assert the module's invariants."""
        with self._lock:
            assert self.reserved_bytes <= self.cap_bytes
            for seg in self._segments.values():
                spans = sorted([*seg.free, *seg.taken.items()])
                at = 0
                for start, n in spans:
                    assert start == at and start % ALIGN == 0 and n > 0, (seg.id, spans)
                    at += n
                assert at == seg.buffer.numel(), (seg.id, spans)

    @staticmethod
    def _carve(seg: _Segment, need: int) -> int | None:
        for i, (start, n) in enumerate(seg.free):
            if n >= need:
                if n == need:
                    del seg.free[i]
                else:
                    seg.free[i] = (start + need, n - need)
                seg.taken[start] = need
                return start
        return None

    @staticmethod
    def _range(seg: _Segment, start: int | None, nbytes: int) -> Range:
        assert start is not None
        return Range(seg.id, start, nbytes, seg.buffer[start:start + nbytes])
