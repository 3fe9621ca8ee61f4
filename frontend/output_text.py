"""A request's output text as it streams: incremental detokenization (detokenize.py) and stop
strings. A stop string ends the output where it starts (or where it ends, with
`include_stop_str_in_output`), counted only from `min_tokens` on; text that a stop string
might still begin in (its longest length minus one character) is held back from the stream,
so a stop string is never streamed and the streamed text always equals the final text."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from frontend.detokenize import TextStream
from protocol.sampling import SamplingParams


@dataclass(frozen=True)
class TextDelta:
    """What `OutputText.add` gives back: the tokens it kept and the text safe to send now."""

    token_ids: tuple[int, ...]
    text: str
    stopped: bool = False      # a stop string ended the output at this delta


class OutputText:
    """Invariants: `token_ids` are the output tokens kept (none after a stop string's token);
    `sent` <= len(`text`); once `stopped`, `add` keeps nothing more."""

    def __init__(self, tokenizer: Any, sampling: SamplingParams,
                 prompt: Sequence[int] = ()) -> None:
        self.sampling = sampling
        self.stream = TextStream(tokenizer, sampling.skip_special_tokens, prompt)
        self.stop = tuple(sampling.stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""          # the output's text so far (cut at a stop string)
        self.sent = 0           # characters of `text` handed out
        self.stopped = False

    @property
    def chars_decoded(self) -> int:
        return self.stream.chars_decoded

    def add(self, token_ids: Iterable[int]) -> TextDelta:
        """Take the next output tokens; the tokens kept and the text now safe to stream."""
        kept: list[int] = []
        for t in token_ids:
            if self.stopped:
                break
            kept.append(t)
            self.token_ids.append(t)
            new = self.stream.add((t,))
            if new:
                self.text += new
                if self.stop and len(self.token_ids) >= self.sampling.min_tokens:
                    self._check_stop(len(new))
        return TextDelta(tuple(kept), self._take(final=self.stopped), self.stopped)

    def finish(self) -> str:
        """The output ended (on the worker): the rest of its text, nothing held back."""
        if not self.stopped:
            self.text += self.stream.flush()
            if self.stop and len(self.token_ids) >= self.sampling.min_tokens:
                self._check_stop(len(self.text))
        return self._take(final=True)

    def _check_stop(self, new_chars: int) -> None:
        """Cut `text` at the first stop string that the last `new_chars` characters touch."""
        start = max(0, len(self.text) - new_chars - self.hold)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return
        i, s = min(hits)
        self.text = self.text[:i + (len(s) if self.sampling.include_stop_str_in_output else 0)]
        self.stopped = True

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent:end], max(self.sent, end)
        return delta
