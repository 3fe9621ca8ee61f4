"""What a client asks of one request: its sampling parameters.

Plain data shared by the ingress, the router and the workers (which sample). Validated once,
where it is made: a SamplingParams that exists is a valid one (frozen; an invalid one raises
RequestError naming the field when it is built), so nobody downstream checks it again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.errors import RequestError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
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
    # max_tokens was asked for: a prompt that leaves less room than that in the model's context
    # is refused (400, as vLLM and OpenAI answer), instead of stopping at the context's end
    strict_max_tokens: bool = False
    include_stop_str_in_output: bool = False   # a stop string that ends the output stays in it
    skip_special_tokens: bool = True           # special tokens leave no text
    # the worker's own text work: False where the router detokenizes and checks the stop
    # strings itself (router/frontend), so the engine sees token ids only
    detokenize: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise RequestError (a ValueError) naming the bad field."""
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
