"""Outputs after a step: whether a request stops (end-of-sequence or stop token after
`min_tokens`, a stop string in its text, `max_tokens`, the model's context) and its final text.

Only stop strings need the tokenizer; a request without them is never detokenized here
before it ends.
"""

from __future__ import annotations

from workers.request import Request


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def stop_reason(self, req: Request) -> str | None:
        """"stop", "length" or None (goes on), for a request that just got a token. A stop
        string cuts `req.output_text` before it (`req.stop_cut`)."""
        sp, tok, n_out = req.sampling, req.output_token_ids[-1], len(req.output_token_ids)
        if n_out >= sp.min_tokens and (tok in req.eos_token_ids or tok in sp.stop_token_ids):
            return "stop"
        if sp.stop and n_out >= sp.min_tokens:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            hits = [text.find(s) for s in sp.stop if s in text]
            if hits:
                req.output_text, req.stop_cut = text[:min(hits)], True
                return "stop"
        if n_out >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def final_text(self, req: Request, reason: str) -> None:
        """Set the ending request's `output_text` (a stop string's cut is kept)."""
        if not (reason == "stop" and req.stop_cut):
            req.output_text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
