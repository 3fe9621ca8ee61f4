"""Token ids to text one token at a time, at a cost that does not grow with the output: the
prefix/read-offset method (vLLM's `detokenize_incrementally`). Each token decodes a short
window twice: the tokens since the last emitted text (`prefix_offset`..`read_offset`) and
the same window with the new tokens; the difference is the new text. Text ending in an
undecodable byte (U+FFFD: a multi-byte character split across tokens) waits for the next
token. The window starts a few prompt tokens back, so a tokenizer that strips a leading
space off a lone token still gets the output's first word right."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

PROMPT_CONTEXT = 6      # prompt tokens the first window starts from


class TextStream:
    """Invariant: `text` is the concatenation of every string `add` and `flush` returned;
    `chars_decoded` counts the characters the tokenizer produced for it (the cost)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 prompt: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ()) \
            if skip_special_tokens else frozenset()
        self.ids: list[int] = list(prompt[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.chars_decoded = 0

    def _decode(self, ids: list[int]) -> str:
        s = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        self.chars_decoded += len(s)
        return s

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; the new text they complete ("" while a character is incomplete)."""
        out = []
        for t in token_ids:
            if t in self._special:
                continue
            self.ids.append(t)
            before = self._decode(self.ids[self.prefix_offset:self.read_offset])
            after = self._decode(self.ids[self.prefix_offset:])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                out.append(after[len(before):])
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        new = "".join(out)
        self.text += new
        return new

    def flush(self) -> str:
        """At the output's end: whatever text is still held (an incomplete last character
        decodes as U+FFFD, as a whole-output decode gives it)."""
        if self.read_offset == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        new = after[len(before):]
        self.text += new
        return new
