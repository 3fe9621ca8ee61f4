"""What a client asks of one request (sampling parameters) and how a refusal is reported.

Plain data shared by the router (which validates at the edge) and the workers (which sample).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class RequestError(ValueError):
    """A request the system refuses, with a message fit for the client (HTTP 400)."""


class UnknownLoRAError(RequestError):
    """A request names an adapter the engine does not serve (HTTP 404, never a silent fallback
    to the base model)."""


class StepFailed(RuntimeError):
    """An engine step raised; the requests of that step end with this (HTTP 500), the worker
    goes on serving the others."""


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        def bad(name: str, why: str) -> None:
            raise RequestError(f"invalid sampling parameter {name}: {why}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not INT64_MIN <= self.seed <= INT64_MAX):
            bad("seed", f"must be a 64-bit signed integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0
               for t in self.stop_token_ids):
            bad("stop_token_ids", "must be token ids (integers >= 0)")
