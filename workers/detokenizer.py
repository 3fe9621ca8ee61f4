"""Incremental detokenization for streaming: text deltas that never need to be taken back.

A delta is held back from the first undecodable byte on (a later token may complete it, and
byte-level decoding then changes the text there), and by the length
of the longest stop string minus one, so a stop string is never streamed (the final text is
cut before it).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = 0          # characters of the text already streamed

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the new text that is safe to stream."""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        end = len(text) - self.hold
        bad = text.find("\ufffd", self.sent)   # an undecodable byte may yet change meaning
        if bad >= 0:
            end = min(end, bad)
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the request's final text (already cut at a stop string)."""
        delta = final_text[self.sent:]
        self.sent = len(final_text)
        return delta
