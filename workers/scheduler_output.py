"""What one engine step runs: the scheduler's decision (`SchedulerOutput`) that the model runner
consumes, and what the step gave back (`ModelRunnerOutput`) that the scheduler then applies.

Torch-free (like vLLM v1's `SchedulerOutput`): the scheduler builds and reads these without
loading the model's libraries, and a test can build a step by hand.

Invariants of a `SchedulerOutput`: each request appears in at most one chunk; a chunk's
`block_table` covers its request's first `num_computed_tokens + num_new_tokens` tokens; a decode
chunk computes exactly one token (the last sampled one) of a request that has computed tokens
before; `out_of_blocks` requests have no chunk (the engine ends them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.request import Request


@dataclass
class ScheduledChunk:
    """One request's share of a step: `num_new_tokens` from its `num_computed_tokens` on,
    written through `block_table` (the request's blocks, in order)."""

    request: Request
    num_new_tokens: int
    block_table: list[int]

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.request.num_computed_tokens > 0

    @property
    def ends_known_tokens(self) -> bool:
        """The chunk reaches its request's last known token: the step samples a token for it."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    """The step the scheduler chose: its chunks (running requests first, then admissions) and
    the requests that can never grow in this pool (`out_of_blocks`: the engine ends them)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    out_of_blocks: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(ch.num_new_tokens for ch in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing for the model to run (out_of_blocks requests may still need ending)."""
        return not self.chunks

    def step_order(self) -> tuple[list[int], list[int]]:
        """Chunk indices in the flat batch's order: decodes (shortest context first, so similar
        lengths share an attention group), then prefill chunks in scheduling order."""
        chunks = self.chunks
        decodes = sorted((i for i, ch in enumerate(chunks) if ch.is_decode),
                         key=lambda i: chunks[i].request.num_computed_tokens)
        dset = set(decodes)
        return decodes, [i for i in range(len(chunks)) if i not in dset]


@dataclass
class ModelRunnerOutput:
    """What a step produced: one sampled token for each chunk that `ends_known_tokens`, by
    chunk index (`sampled_chunks[i]` got `token_ids[i]`), and the model's time."""

    sampled_chunks: list[int]
    token_ids: list[int]
    forward_s: float = 0.0

    def __post_init__(self) -> None:
        assert len(self.sampled_chunks) == len(self.token_ids), self
