"""Conditional disaggregation: how many uncached prompt tokens a decode worker prefills itself
instead of handing the request to the prefill pool.

Either of two rules admits a local prefill (Dynamo's conditional disaggregation, with the
prefill queue measured in seconds rather than in requests):
- static: at most `local_prefill_max_tokens` (a prompt that short costs D less than a handoff);
- backlog (`local_prefill_when_backlogged`): D prefills a prompt when the time that saves the
  request covers what it costs D's running decodes. Saved: the least-waiting prefill worker's
  wait, less D's own prefill work ahead of it and the prompt's prefill on D (the prefill on P
  and the transfer it also saves are left out: the rule leans to P). Cost: each of D's running
  decodes waits for the prompt's prefill (`engine.max_step_ms` bounds one step's share of
  it). So with an idle D a prompt goes local once the pool's queue is longer than D needs
  for it; with b sequences decoding, once it is (1 + b) times that. The pool's backlog shrinks
  for the requests behind it too.

The backlog rule uses only what the router has: the prefill workers' waits by their own
measured fits (router/policies.WorkerState.wait_s, aged, plus what the router routed since their
reports), and D's prompt tokens still to compute at D's own fit (the pooled prefill fit until
D has measured one). Until something is measured it admits nothing beyond the static rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.policies import Locality, WorkerState

NO_LIMIT = 1 << 62   # no prefill worker live: D prefills everything itself


def local_prefill_limit(prefill: Sequence[WorkerState], decode: WorkerState,
                        static_tokens: int, when_backlogged: bool, now: float) -> int:
    """The most uncached prompt tokens `decode` prefills itself now. `prefill`: the prefill
    workers' states (draining ones are skipped); `now`: router clock."""
    live = [st for st in prefill if not st.draining]
    if not live:
        return NO_LIMIT
    if not when_backlogged:
        return static_tokens
    fit = Locality.pooled_fit(live)
    waits = [w for w in (st.wait_s(fit, now) for st in live) if w is not None]
    own_fit = decode.prefill_fit or fit
    if not waits or own_fit is None:
        return static_tokens
    own_tokens = decode.prefill_tokens + sum(r[1] for r in decode.routed)
    spare_s = min(waits) - own_tokens / own_fit.tok_s
    # saved - prefill >= batch * prefill  <=>  prefill <= spare / (1 + batch)
    return max(static_tokens, own_fit.tokens_within(spare_s / (1 + decode.decode_batch)))
