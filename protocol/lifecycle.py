"""What happened to one request's KV cache, and the engine-wide counters (plain data)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class RequestLifecycle:
    """One request's KV lifecycle: build (prefill) -> append (decode) -> reuse -> release."""

    prompt_tokens: int = 0
    cached_tokens: int = 0        # prefix-hit length at admission (tokens not recomputed)
    computed_tokens: int = 0      # tokens whose KV this request computed (recompute included)
    recomputed_tokens: int = 0    # computed again after a preemption
    blocks_allocated: int = 0     # new blocks taken from the pool over the request's life
    block_appends: int = 0        # of those, blocks added while decoding
    preemptions: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None   # mean time per output token after the first
    e2e_s: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    # disaggregated path (zero on a single engine)
    transfer_bytes: int = 0
    transfer_s: float = 0.0
    transferred_blocks: int = 0
    skipped_blocks: int = 0       # blocks the decode side already held (delta transfer)
    prefill_worker: str | None = None
    decode_worker: str | None = None
    handoff_round_trips: int = 0  # router -> worker calls awaited before the first token
    router_overhead_ms: float | None = None   # router's own time before the first token
    retries: int = 0              # re-runs after its workers died (router)
    migrations: int = 0           # live moves to another decode worker (KV moved, not recomputed)
    migration_fallbacks: int = 0  # moves that failed and re-prefilled elsewhere (router)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineStats:
    """Counters over an engine's life; ratios are derived in `to_dict`."""

    prompt_tokens: int = 0        # prompt tokens of admitted requests (prefix queries)
    reused_tokens: int = 0        # of those, served from the prefix cache
    computed_tokens: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    evictions: int = 0
    peak_blocks_used: int = 0
    num_blocks: int = 0
    block_size: int = 0
    kv_bytes_per_token: int = 0
    requests_finished: int = 0
    requests_rejected: int = 0
    steps: int = 0
    busy_s: float = 0.0           # seconds spent in model steps
    _util_sum: float = 0.0        # sum over steps of per-step block utilization
    _util_steps: int = 0

    def observe_utilization(self, stored_tokens: int, used_blocks: int) -> None:
        if used_blocks:
            self._util_sum += stored_tokens / (used_blocks * self.block_size)
            self._util_steps += 1

    def prefill_tok_s(self, default: float = 5_000.0) -> float:
        """Measured compute rate (tokens computed per busy second); `default` before data."""
        return self.computed_tokens / self.busy_s if self.busy_s > 0.5 else default

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        d["hit_rate"] = self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        d["block_utilization"] = self._util_sum / self._util_steps if self._util_steps else 0.0
        return d
