"""KV transfer bandwidth per (prefill, decode) worker pair, measured from real transfers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PairRate:
    gbps: float          # exponentially weighted mean of bytes / seconds, in GB/s (1e9 B)
    transfers: int
    bytes: int
    seconds: float


class TransferRates:
    """GB/s per (P, D) pair from observed (bytes, seconds) of completed transfers; a pair never
    measured has no rate (None), never a default. `alpha`: weight of the newest transfer."""

    def __init__(self, alpha: float = 0.3, min_bytes: int = 1) -> None:
        self.alpha = alpha
        self.min_bytes = min_bytes
        self.pairs: dict[tuple[str, str], PairRate] = {}

    def observe(self, prefill: str, decode: str, nbytes: int, seconds: float) -> None:
        if nbytes < self.min_bytes or seconds <= 0:
            return
        g = nbytes / seconds / 1e9
        p = self.pairs.get((prefill, decode))
        if p is None:
            self.pairs[(prefill, decode)] = PairRate(g, 1, nbytes, seconds)
        else:
            p.gbps += self.alpha * (g - p.gbps)
            p.transfers += 1
            p.bytes += nbytes
            p.seconds += seconds

    def gbps(self, prefill: str, decode: str) -> float | None:
        p = self.pairs.get((prefill, decode))
        return p.gbps if p is not None else None

    def from_worker(self, prefill: str) -> dict[str, float]:
        """{decode worker: GB/s} of the pairs measured from `prefill`."""
        return {d: r.gbps for (p, d), r in self.pairs.items() if p == prefill}

    def to_dict(self) -> dict[str, dict]:
        return {f"{p}->{d}": {"gbps": r.gbps, "transfers": r.transfers, "bytes": r.bytes,
                              "seconds": r.seconds} for (p, d), r in self.pairs.items()}
