"""A worker's measured speed, fitted from its own recent engine steps: prefill seconds as a
function of new tokens and context, and decode step seconds as a function of the batch.

Torch-free and Ray-free: the live worker actor and the simulator's workers feed it the same
records, so the router's load reports mean the same thing in both.

Prefill model (per step, over the step's prefill chunks):
    t = overhead_s + sum(u_i) / tok_s + sum(u_i * ctx_i) / (tok_s * ctx_tokens)
where u_i are a chunk's new tokens and ctx_i the mean context they attend to
(num_computed_tokens + u_i / 2): the linear layers cost the same per token, attention grows with
context. Fitted by non-negative least squares on the last `window` prefill-only steps; a step
that mixes prefill and decode work is not used for either fit. Adapter loads inside a step are
left out of its seconds (the worker reports them on their own, as lora_load_s).

Decode model: t = d0 + d1 * batch + d2 * context tokens of the batch, on decode-only steps.
A fit exists only after `min_steps` steps; before that the report says so (no made-up rate).
A live worker refits on a clock (`REFIT_INTERVAL_S`), not at every step it reads its fits in:
between refits it reports the last fit, which is at most that old.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIN_STEPS = 4
# A live worker's fits are refitted at most this often (seconds): a fit is a least-squares
# solve over the window in pure Python, and the worker reads its fits once a step.
REFIT_INTERVAL_S = 0.25

# An engine step's token budget (engine.max_num_batched_tokens) when the config leaves it unset,
# by device type; the live engine and the simulator's CPU cost model read it here. On a CPU a
# step of more than 512 tokens (several prompts at once) serves no more tokens a second, and it
# delays the first token of every prompt in it until the whole step ends (SmolLM2 in float32, 2
# cores with AVX512-BF16, colocated, vLLM's client: 512-token prompts at concurrency 8, median
# TTFT 2.1 s against 4.0 s with 2048 and 57 tok/s both; 1024-token prompts at concurrency 16,
# 3.4 s against 8.6 s, 53 tok/s both; 128 lost a sixth of the throughput). On a GPU, 2048.
DEFAULT_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}


def default_batched_tokens(device_type: str) -> int:
    """The step token budget for an engine on `device_type` ("cpu", "cuda") left unset."""
    return DEFAULT_BATCHED_TOKENS.get(device_type, DEFAULT_BATCHED_TOKENS["cuda"])


@dataclass(frozen=True)
class PrefillFit:
    """Measured prefill speed: `seconds(n, cached)` of prompt tokens [cached, n)."""

    tok_s: float            # tokens / s at zero context
    ctx_tokens: float       # context at which a token costs twice as much; 0: no context cost
    overhead_s: float       # fixed cost of one prefill step
    num_steps: int          # steps the fit is made of

    def seconds(self, num_tokens: int, num_cached_tokens: int) -> float:
        u = num_tokens - num_cached_tokens
        if u <= 0:
            return 0.0
        t = u / self.tok_s
        if self.ctx_tokens > 0:
            t *= 1.0 + (num_tokens + num_cached_tokens) / (2.0 * self.ctx_tokens)
        return self.overhead_s + t

    def tokens_within(self, seconds: float) -> int:
        """The most new tokens one step prefills from an empty context within `seconds` (the
        inverse of `seconds(n, 0)`; 0 when the step overhead alone takes longer)."""
        r = seconds - self.overhead_s
        if r <= 0:
            return 0
        if self.ctx_tokens <= 0:
            return int(r * self.tok_s + 1e-9)   # (1e-9: float noise at an exact fit)
        # n / tok_s * (1 + n / (2 ctx)) = r
        return int(self.ctx_tokens * (math.sqrt(1.0 + 2.0 * r * self.tok_s / self.ctx_tokens)
                                      - 1.0) + 1e-9)

    def backlog_s(self, prompts: Sequence[tuple[int, int]], token_budget: int) -> float:
        """Seconds to prefill every (num_tokens, num_computed_tokens) of `prompts` on a worker
        that batches them into steps of at most `token_budget` new tokens: the per-token costs
        of each, and one step overhead per step (not per prompt: batched prompts share it)."""
        assert token_budget > 0, token_budget
        left = t = 0.0
        for n, c in prompts:
            if n > c:
                left += n - c
                t += self.seconds(n, c) - self.overhead_s
        return t + self.overhead_s * math.ceil(left / token_budget)


@dataclass(frozen=True)
class DecodeFit:
    """Measured decode step time: `step_s(batch, context_tokens)`."""

    base_s: float
    per_seq_s: float
    per_ctx_token_s: float
    num_steps: int

    def step_s(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.base_s + self.per_seq_s * batch + self.per_ctx_token_s * context_tokens


def nnls(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares with coefficients >= 0 (a few columns: active-set by dropping the most
    negative coefficient and refitting). Columns that are all zero get 0."""
    k = len(rows[0]) if rows else 0
    active = [j for j in range(k) if any(r[j] for r in rows)]
    while active:
        coef = _lstsq([[r[j] for j in active] for r in rows], ys)
        if coef is None:
            active.pop()            # singular: drop the last column and refit
            continue
        worst = min(range(len(active)), key=lambda i: coef[i])
        if coef[worst] >= 0:
            out = [0.0] * k
            for j, c in zip(active, coef, strict=True):
                out[j] = c
            return out
        active.pop(worst)
    return [0.0] * k


def _lstsq(rows: list[list[float]], ys: Sequence[float]) -> list[float] | None:
    """Normal equations, solved by Gaussian elimination with partial pivoting (a few columns)."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    scale = [a[i][i] or 1.0 for i in range(k)]   # precondition: columns differ by 1e6+
    a = [[a[i][j] / (scale[i] ** 0.5 * scale[j] ** 0.5) for j in range(k)] for i in range(k)]
    b = [b[i] / scale[i] ** 0.5 for i in range(k)]
    for c in range(k):
        p = max(range(c, k), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) < 1e-12:
            return None
        a[c], a[p], b[c], b[p] = a[p], a[c], b[p], b[c]
        for r in range(c + 1, k):
            f = a[r][c] / a[c][c]
            for j in range(c, k):
                a[r][j] -= f * a[c][j]
            b[r] -= f * b[c]
    x = [0.0] * k
    for c in reversed(range(k)):
        x[c] = (b[c] - sum(a[c][j] * x[j] for j in range(c + 1, k))) / a[c][c]
    return [x[i] / scale[i] ** 0.5 for i in range(k)]


class StepRates:
    """The recent steps of one worker and the fits made of them, refitted lazily: when read
    after new steps, and (with `refit_interval_s` > 0) at most once per `refit_interval_s` of
    `clock` once a fit exists; in between a read returns the cached fit. The first fit is made
    as soon as `min_steps` steps exist. `refit_interval_s` 0 (the default, as the simulators
    use it) refits at every read after new steps and never reads the clock."""

    def __init__(self, window: int = 64, min_steps: int = MIN_STEPS,
                 refit_interval_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.min_steps = min_steps
        self.refit_interval_s = refit_interval_s
        self.clock = clock
        self._prefill: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._decode: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._prefill_fit: PrefillFit | None = None
        self._decode_fit: DecodeFit | None = None
        self._dirty_p = self._dirty_d = False
        self._refit_p_at = self._refit_d_at = 0.0   # clock time from which a refit may run
        self.last_decode_step_s = 0.0
        self.last_decode_batch = 0

    def observe_prefill(self, seconds: float, chunks: Sequence[tuple[int, int]]) -> None:
        """One prefill-only step: `chunks` = (new tokens, tokens computed before) per request."""
        u = sum(n for n, _ in chunks)
        if u <= 0 or seconds <= 0:
            return
        work = sum(n * (c + n / 2.0) for n, c in chunks)
        self._prefill.append((float(u), work, seconds))
        self._dirty_p = True

    def observe_decode(self, seconds: float, batch: int, context_tokens: int) -> None:
        """One decode-only step of `batch` sequences holding `context_tokens` tokens in all."""
        if batch <= 0 or seconds <= 0:
            return
        self._decode.append((batch, context_tokens, seconds))
        self.last_decode_step_s, self.last_decode_batch = seconds, batch
        self._dirty_d = True

    def _due(self, has_fit: bool, refit_at: float) -> float | None:
        """The clock time of a refit allowed now (0.0 off the clock), or None: wait."""
        if self.refit_interval_s <= 0:
            return 0.0
        now = self.clock()
        return now if not has_fit or now >= refit_at else None

    def prefill_fit(self) -> PrefillFit | None:
        if self._dirty_p and (now := self._due(self._prefill_fit is not None,
                                               self._refit_p_at)) is not None:
            self._dirty_p = False
            steps = list(self._prefill)
            if len(steps) >= self.min_steps:
                c0, c1, c2 = nnls([(1.0, u, w) for u, w, _ in steps], [t for *_, t in steps])
                if c1 <= 0:     # no per-token cost resolved: the mean rate, honestly
                    c1 = sum(t for *_, t in steps) / sum(u for u, *_ in steps)
                    c0 = c2 = 0.0
                self._prefill_fit = PrefillFit(1.0 / c1, (c1 / c2) if c2 > 0 else 0.0, c0,
                                               len(steps))
                self._refit_p_at = now + self.refit_interval_s
        return self._prefill_fit

    def decode_fit(self) -> DecodeFit | None:
        if self._dirty_d and (now := self._due(self._decode_fit is not None,
                                               self._refit_d_at)) is not None:
            self._dirty_d = False
            steps = list(self._decode)
            if len(steps) >= self.min_steps:
                d = nnls([(1.0, b, c) for b, c, _ in steps], [t for *_, t in steps])
                self._decode_fit = DecodeFit(d[0], d[1], d[2], len(steps))
                self._refit_d_at = now + self.refit_interval_s
        return self._decode_fit
