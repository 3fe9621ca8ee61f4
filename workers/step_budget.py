"""The prefill token budget of a mixed step under a step-time target (`engine.max_step_ms`), so
that decoding requests do not wait behind a whole prefill chunk (vLLM tunes the same trade with
its chunked-prefill token budget; here the engine measures its own speed and picks it per step).

Model of one engine step, fitted on this engine's recent steps (all of them, mixed included):

    t = base_s + per_seq_s * decodes + per_decode_ctx_s * decode context tokens
        + per_prefill_token_s * prefill tokens

(non-negative least squares, protocol/step_rates.nnls). For a step with decodes in it, the
prefill tokens allowed are what is left of the target after the decode part, at the measured
per-token prefill cost; never fewer than `min_chunk` (a prefill always advances: the target is
a goal, not a wall), never more than max_num_batched_tokens. A step without decodes has no
TPOT to protect and keeps the whole budget; so does every step before the fit exists
(`min_steps` steps) and every step with the target off (None: today's behaviour).

Invariant: `prefill_tokens(...)` is within [min(min_chunk, full), full].
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from protocol.step_rates import nnls


@dataclass(frozen=True)
class StepSample:
    decodes: int
    decode_ctx_tokens: int
    prefill_tokens: int
    seconds: float


class StepBudget:
    def __init__(self, max_step_ms: float | None, full_budget: int, min_chunk: int,
                 window: int = 64, min_steps: int = 8, refit_every: int = 8) -> None:
        assert max_step_ms is None or max_step_ms > 0, max_step_ms
        assert full_budget >= 1 and min_chunk >= 1
        self.target_s = None if max_step_ms is None else max_step_ms / 1e3
        self.full, self.min_chunk = full_budget, min_chunk
        self.samples: deque[StepSample] = deque(maxlen=window)
        self.min_steps, self.refit_every = min_steps, refit_every
        self.coef: list[float] | None = None
        self._since_fit = 0
        self.capped_steps = 0     # steps whose prefill the target held below the full budget

    @property
    def on(self) -> bool:
        return self.target_s is not None

    def observe(self, decodes: int, decode_ctx_tokens: int, prefill_tokens: int,
                seconds: float) -> None:
        """One finished step (off: nothing is kept)."""
        if not self.on:
            return
        self.samples.append(StepSample(decodes, decode_ctx_tokens, prefill_tokens, seconds))
        self._since_fit += 1
        if len(self.samples) >= self.min_steps and (self.coef is None
                                                    or self._since_fit >= self.refit_every):
            # context last: where it moves with the batch (singular), nnls drops it, not prefill
            rows = [(1.0, s.decodes, s.prefill_tokens, s.decode_ctx_tokens) for s in self.samples]
            self.coef = nnls(rows, [s.seconds for s in self.samples])
            self._since_fit = 0

    def prefill_tokens(self, decodes: int, decode_ctx_tokens: int) -> int:
        """Prefill tokens a step with these decodes may compute."""
        if not self.on or decodes == 0 or self.coef is None:
            return self.full
        base, per_seq, per_tok, per_ctx = self.coef
        left = self.target_s - (base + per_seq * decodes + per_ctx * decode_ctx_tokens)
        n = self.full if per_tok <= 0 else int(max(0.0, left) / per_tok)
        n = max(min(self.min_chunk, self.full), min(self.full, n))
        if n < self.full:
            self.capped_steps += 1
        return n
