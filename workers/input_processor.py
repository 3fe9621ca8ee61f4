"""Requests in: a prompt (text, chat messages or token ids) tokenized, checked against the
model's context and the worker's pool, and keyed by its cache namespace (model revision,
tokenizer, dtype, tenant, LoRA adapter), before the engine queues it.

A request that fails a check raises `RequestError` (counted in `stats.requests_rejected`) and
changes nothing else.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from frontend.prompts import check_fits, check_prompt, is_chat, tokenize_prompt, unknown_lora
from kvcache.hashing import CacheNamespace
from protocol.errors import RequestError
from protocol.lifecycle import EngineStats
from workers.lora import LoRASpec
from workers.request import Request, SamplingParams


class InputProcessor:
    """Builds one engine's requests. `requests` is the engine's live map (ids in use)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 namespace: CacheNamespace, loras: Mapping[str, LoRASpec], block_size: int,
                 num_blocks: int, max_model_len: int, stats: EngineStats,
                 requests: Mapping[str, Request]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.namespace = namespace
        self.loras = loras
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.stats = stats
        self.requests = requests
        self._ids = itertools.count()

    def tokenize(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        """Token ids of a prompt (frontend/prompts.py: the router's own rule)."""
        return tokenize_prompt(self.tokenizer, prompt, chat)

    def make_request(self, prompt: str | list[int] | list[dict],
                     sampling: SamplingParams | None = None, request_id: str | None = None,
                     chat: bool = False, tenant: str = "", lora_id: str = "") -> Request:
        """Validate and build a request (not yet queued). Raises RequestError (counted in
        stats.requests_rejected)."""
        try:
            return self._build(prompt, sampling or SamplingParams(), request_id, chat, tenant,
                               lora_id)
        except RequestError:
            self.stats.requests_rejected += 1
            raise

    def _build(self, prompt, sampling: SamplingParams, request_id: str | None, chat: bool,
               tenant: str, lora_id: str) -> Request:
        token_ids = self.tokenize(prompt, chat)
        check_prompt(prompt, token_ids, sampling, self.vocab_size, self.max_model_len,
                     is_chat(prompt, chat))
        n = len(token_ids)
        self.check_fits(n + 1)
        rid = request_id or f"req-{next(self._ids)}"
        self.check_new_id(rid)
        # the adapter's content hash keys the cache: two names for the same files share blocks
        ns = self.namespace.with_request(tenant=tenant, lora_id=self.lora_hash(lora_id))
        req = Request(rid, token_ids, sampling, ns.root_hash(), self.block_size,
                      lora_name=lora_id, eos_token_ids=self.eos_for(sampling))
        req.update_block_hashes()
        return req

    def check_fits(self, num_tokens: int, what: str = "prompt") -> None:
        """RequestError unless `num_tokens` fit this worker's whole pool."""
        check_fits(num_tokens, self.block_size, self.num_blocks, what)

    def check_new_id(self, request_id: str) -> None:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")

    def eos_for(self, sampling: SamplingParams) -> tuple[int, ...]:
        """The end-of-sequence tokens a request stops at (none under ignore_eos)."""
        return () if sampling.ignore_eos else self.eos_token_ids

    def lora_hash(self, name: str) -> str:
        """Content hash of adapter `name` ("" for the base model); raises UnknownLoRAError."""
        if not name:
            return ""
        spec = self.loras.get(name)
        if spec is None:
            raise unknown_lora(name, self.loras)
        return spec.content_hash
