"""Turns logits into next tokens: greedy, or temperature / top-k / top-p with a per-request seed.

Never NaN: logits are shifted by their max before the temperature divides them (a tiny
temperature gives -inf for all but the best tokens, not inf - inf), blocked ids outside the
vocabulary are ignored, and a row with nothing left to sample falls back to greedy.

Logits stay on the engine's device: the greedy argmax runs there and only token ids come back
(one sync per step). A seeded request draws with its own CPU generator (its state travels from
prefill to decode worker as bytes, whatever their devices), so only its probabilities row is
copied to the host for the draw; unseeded draws run on the device."""

from __future__ import annotations

import torch

from workers.request import Request

GREEDY_BELOW = 1e-6          # temperatures under this sample greedily


def _generator(req: Request) -> torch.Generator | None:
    if req.sampling.seed is None:
        return None
    if req.generator is None:
        g = torch.Generator()
        g.manual_seed(req.sampling.seed & 0xFFFF_FFFF_FFFF_FFFF)   # any int64, two's complement
        req.generator = g
    return req.generator  # type: ignore[return-value]


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """One token per row of `logits` [n, vocab], following each request's SamplingParams."""
    out: list[int] = []
    if not requests:
        return out
    greedy = logits.argmax(dim=-1).tolist()
    vocab = logits.shape[-1]
    for row, req in enumerate(requests):
        sp = req.sampling
        blocked = [t for t in _blocked_tokens(req) if 0 <= t < vocab]
        if sp.temperature < GREEDY_BELOW:
            if blocked:
                masked = logits[row].clone()
                masked[blocked] = float("-inf")
                out.append(int(masked.argmax()))
            else:
                out.append(greedy[row])
            continue
        x = logits[row].float().clone()
        if blocked:
            x[blocked] = float("-inf")
        x = (x - x.max()) / sp.temperature
        if sp.top_k:
            kth = torch.topk(x, min(sp.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if sp.top_p < 1.0:
            sorted_x, idx = torch.sort(x, descending=True)
            cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_x, dim=-1) > sp.top_p  # keep the first over top_p
            sorted_x[drop] = float("-inf")
            x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
        probs = torch.softmax(x, dim=-1)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
            out.append(int(x.argmax()))
            continue
        g = _generator(req)
        if g is not None and probs.device != g.device:
            probs = probs.to(g.device)
        out.append(int(torch.multinomial(probs, 1, generator=g)))
    return out


def _blocked_tokens(req: Request) -> list[int]:
    """Stop tokens are not sampled before min_tokens outputs."""
    sp = req.sampling
    if len(req.output_token_ids) >= sp.min_tokens:
        return []
    return list(sp.stop_token_ids) + list(req.eos_token_ids)
