"""Turns logits into next tokens: greedy, or temperature / top-k / top-p with a per-request seed."""

from __future__ import annotations

import torch

from workers.request import Request


def _generator(req: Request) -> torch.Generator | None:
    if req.sampling.seed is None:
        return None
    if req.generator is None:
        g = torch.Generator()
        g.manual_seed(req.sampling.seed)
        req.generator = g
    return req.generator  # type: ignore[return-value]


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """One token per row of `logits` [n, vocab], following each request's SamplingParams."""
    out: list[int] = []
    if not requests:
        return out
    greedy = logits.argmax(dim=-1).tolist()
    for row, req in enumerate(requests):
        sp = req.sampling
        blocked = _blocked_tokens(req)
        if sp.temperature == 0:
            if blocked:
                masked = logits[row].clone()
                masked[blocked] = float("-inf")
                out.append(int(masked.argmax()))
            else:
                out.append(greedy[row])
            continue
        x = logits[row] / sp.temperature
        if blocked:
            x[blocked] = float("-inf")
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
        out.append(int(torch.multinomial(probs, 1, generator=_generator(req))))
    return out


def _blocked_tokens(req: Request) -> list[int]:
    """Stop tokens are not sampled before min_tokens outputs."""
    sp = req.sampling
    if len(req.output_token_ids) >= sp.min_tokens:
        return []
    return list(sp.stop_token_ids) + list(req.eos_token_ids)
