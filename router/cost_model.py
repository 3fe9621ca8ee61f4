"""The simulator's hidden cost model: what a prefill step, a decode step, a KV transfer and an
adapter load cost. Only the simulator charges time with it; policies never see it (they see the
workers' load reports, whose speeds the simulated workers fit from the steps charged here).

Prefill step (chunks of (new tokens u, tokens computed before c)):
    step_s = step_overhead_s + sum(u) / tok_s + sum(u * (c + u/2)) / (tok_s * attn_ctx_tokens)
Decode step of `batch` sequences holding `ctx` tokens in all:
    step_s = base_s + per_seq_s * batch + per_ctx_token_s * ctx
Transfer of n bytes over a link: latency_s + n / (gbps * 1e9).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class PrefillCost:
    tok_s: float = 8_000.0             # linear-layer rate at zero context
    attn_ctx_tokens: float = 32_768.0  # context at which a token costs twice as much; 0: off
    step_overhead_s: float = 0.02      # fixed cost of one prefill step
    chunk_tokens: int = 8192           # chunked prefill: new tokens per step at most

    def prefill_s(self, num_tokens: int, num_cached_tokens: int = 0) -> float:
        """Chunked prefill of tokens [num_cached_tokens, num_tokens) alone on a worker."""
        t, done = 0.0, num_cached_tokens
        while done < num_tokens:
            c = min(self.chunk_tokens, num_tokens - done)
            t += self.step_s([(c, done)])
            done += c
        return t

    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        t = self.step_overhead_s
        for u, c in chunks:
            t += u / self.tok_s
            if self.attn_ctx_tokens > 0:
                t += u * (c + u / 2.0) / (self.tok_s * self.attn_ctx_tokens)
        return t


@dataclass(frozen=True)
class DecodeCost:
    base_s: float = 0.008
    per_seq_s: float = 0.0002
    per_ctx_token_s: float = 2e-8

    def step_s(self, batch: int, ctx_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.base_s + self.per_seq_s * batch + self.per_ctx_token_s * ctx_tokens


@dataclass(frozen=True)
class LinkCost:
    gbps: float = 25.0
    latency_s: float = 0.0005

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / (self.gbps * 1e9) if nbytes > 0 else 0.0


@dataclass(frozen=True)
class CostModel:
    label: str = "synthetic"
    prefill: PrefillCost = PrefillCost()
    decode: DecodeCost = DecodeCost()
    link: LinkCost = LinkCost()
    kv_bytes_per_token: int = 36_864   # SmolLM2-135M, fp16 (2 x 30 layers x 3 kv heads x 64 x 2)
    kv_capacity_tokens: int = 4_194_304   # KV tokens one worker's pool holds
    lora_load_s: float = 0.2
    notes: dict = field(default_factory=dict)   # where the figures come from (stated in output)

    def to_dict(self) -> dict:
        return asdict(self)
