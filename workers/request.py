"""A request as the engine sees it: its tokens, sampling parameters, progress and KV lifecycle."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvcache.hashing import BlockHash, hash_block
from protocol.errors import RequestError
from protocol.lifecycle import RequestLifecycle
from protocol.sampling import SamplingParams

__all__ = ["Request", "RequestError", "RequestStatus", "SamplingParams", "TokenIds"]


class RequestStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def token_at(prompt: list[int], output: list[int], position: int) -> int:
    """Token `position` (>= 0) of prompt + output."""
    n = len(prompt)
    return prompt[position] if position < n else output[position - n]


class TokenIds(Sequence[int]):
    """A request's prompt + output tokens read in place: an index or a slice reads the two lists
    it spans, never a concatenated copy of both (the step path reads a few tokens of a long
    request each step). A slice is a new list, as a list's slice is; the view sees tokens
    appended after it was made."""

    __slots__ = ("prompt", "output")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, index):
        n = len(self.prompt)
        if isinstance(index, slice):
            start, stop, step = index.indices(n + len(self.output))
            if step != 1:
                return list(self)[index]
            if stop <= n:
                return self.prompt[start:stop]
            if start >= n:
                return self.output[start - n:stop - n]
            return self.prompt[start:] + self.output[:stop - n]
        if index < 0:
            index += n + len(self.output)
            if index < 0:
                raise IndexError("token index out of range")
        return token_at(self.prompt, self.output, index)

    def __iter__(self):
        yield from self.prompt
        yield from self.output


@dataclass(eq=False)
class Request:
    """Tokens [0, num_computed_tokens) have KV in the request's blocks; the rest are to compute."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    namespace_root: BlockHash
    block_size: int
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    lifecycle: RequestLifecycle = field(default_factory=RequestLifecycle)
    first_token_time: float | None = None
    first_scheduled_time: float | None = None   # perf_counter when first scheduled (trace)
    finish_time: float | None = None
    output_text: str = ""
    stop_cut: bool = False   # output_text was cut before a stop string (it may be "")
    eos_token_ids: tuple[int, ...] = ()   # empty when sampling.ignore_eos
    lora_name: str = ""     # LoRA adapter this request runs under ("" = the base model)
    hold_kv: bool = False   # prefill worker: keep the blocks referenced after finishing (lease)
    generator: object | None = None   # torch.Generator for seeded sampling (set by the sampler)

    def __post_init__(self) -> None:
        self.lifecycle.prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output as a new list (O(tokens) a call: the step path reads `token_ids`)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def token_ids(self) -> TokenIds:
        """Prompt + output as a view: index and slice it without concatenating the two."""
        return TokenIds(self.prompt_token_ids, self.output_token_ids)

    def token_at(self, position: int) -> int:
        """all_token_ids[position] without building the list."""
        return token_at(self.prompt_token_ids, self.output_token_ids, position)

    @property
    def is_prefill(self) -> bool:
        """Still computing tokens it already knows (prompt, or everything after a preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def update_block_hashes(self) -> None:
        """Extend the chained hashes to cover every full block of the known tokens."""
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= self.num_tokens:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else self.namespace_root
            self.block_hashes.append(hash_block(parent, self.token_ids[i * bs:(i + 1) * bs]))

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
            self.lifecycle.ttft_s = now - self.arrival_time
        self.lifecycle.output_tokens = len(self.output_token_ids)
        self.update_block_hashes()

    def finish(self, reason: str, now: float) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_time = now
        lc = self.lifecycle
        lc.finish_reason = reason
        lc.e2e_s = now - self.arrival_time
        if self.first_token_time is not None and len(self.output_token_ids) > 1:
            lc.tpot_s = (now - self.first_token_time) / (len(self.output_token_ids) - 1)
