"""Outputs after a step: whether a request stops (end-of-sequence or stop token after
`min_tokens`, a stop string in its text, `max_tokens`, the model's context) and its final text.

Text work happens here only for a request whose sampling asks for it (`detokenize`: an engine
used on its own). A served request comes from the router with `detokenize` off: the router
detokenizes and checks its stop strings (frontend/), and this engine sees token ids only.
A stop string is checked incrementally (frontend/output_text.py: a cost per token that does
not grow with the output); a request without stop strings is decoded once, when it ends.
"""

from __future__ import annotations

from frontend.output_text import OutputText
from workers.request import Request


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._texts: dict[str, OutputText] = {}   # request id -> its text, while it has stops

    def stop_reason(self, req: Request) -> str | None:
        """"stop", "length" or None (goes on), for a request that just got a token. A stop
        string cuts `req.output_text` at it (`req.stop_cut`)."""
        sp, tok, n_out = req.sampling, req.output_token_ids[-1], len(req.output_token_ids)
        if n_out >= sp.min_tokens and (tok in req.eos_token_ids or tok in sp.stop_token_ids):
            return "stop"
        if sp.stop and sp.detokenize:
            text = self._texts.get(req.request_id)
            if text is None:
                text = self._texts[req.request_id] = OutputText(
                    self.tokenizer, sp, req.prompt_token_ids)
            if text.add(req.output_token_ids[len(text.token_ids):]).stopped:
                req.output_text, req.stop_cut = text.text, True
                return "stop"
        if n_out >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def final_text(self, req: Request, reason: str) -> None:
        """Set the ending request's `output_text` (a stop string's cut is kept; none without
        `detokenize`)."""
        self._texts.pop(req.request_id, None)
        if req.sampling.detokenize and not (reason == "stop" and req.stop_cut):
            req.output_text = self.tokenizer.decode(
                req.output_token_ids, skip_special_tokens=req.sampling.skip_special_tokens)
