"""The router's admission of a request: tokenized once (chat template included), checked, and
its full blocks hashed under the request's cache namespace (model revision, tokenizer, dtype,
tenant, LoRA adapter), so the router can pick P and D by the prefix each holds before either
sees the request. `FrontendSpec` is what a decode worker tells the router to do that (its
tokenizer and namespace); a worker whose namespace differs refuses what the router hashed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from frontend.output_text import OutputText
from frontend.prompts import check_fits, check_prompt, is_chat, tokenize_prompt, unknown_lora
from kvcache.hashing import CacheNamespace, block_hashes
from protocol.messages import AdmittedRequest, RequestInput


@dataclass(frozen=True)
class FrontendSpec:
    """A decode worker's model as the router's text work needs it (crosses Ray once)."""

    tokenizer: Any
    namespace: CacheNamespace          # the worker's model fields (no tenant, no adapter)
    block_size: int
    vocab_size: int
    max_model_len: int
    num_blocks: int                    # the worker's whole pool: a longer prompt never fits
    lora_hashes: Mapping[str, str] = field(default_factory=dict)   # adapter -> content hash


class Frontend:
    def __init__(self, spec: FrontendSpec) -> None:
        self.spec = spec
        self.tokenizer = spec.tokenizer

    def admit(self, request: RequestInput) -> AdmittedRequest:
        """Tokenize, check and hash `request` (RequestError / UnknownLoRAError: a 4xx, and
        nothing reached a worker). The AdmittedRequest keeps the sampling as asked except
        `detokenize`: off, the router does the text work."""
        s = self.spec
        chat = is_chat(request.prompt, request.chat)
        ids = tokenize_prompt(self.tokenizer, request.prompt, chat)
        check_prompt(request.prompt, ids, request.sampling, s.vocab_size, s.max_model_len, chat)
        check_fits(len(ids) + 1, s.block_size, s.num_blocks)
        ns = s.namespace.with_request(tenant=request.tenant,
                                      lora_id=self.lora_hash(request.lora_id))
        root = ns.root_hash()
        sampling = replace(request.sampling, detokenize=False)
        return AdmittedRequest(request.request_id, request.epoch, tuple(ids),
                               tuple(block_hashes(ids, s.block_size, root)), s.block_size, root,
                               sampling, request.deadline, request.tenant, request.lora_id)

    def output(self, admitted: AdmittedRequest) -> OutputText:
        """The request's output text, its window starting at the prompt's last tokens."""
        return OutputText(self.tokenizer, admitted.sampling, admitted.prompt_token_ids)

    def lora_hash(self, name: str) -> str:
        if not name:
            return ""
        h = self.spec.lora_hashes.get(name)
        if h is None:
            raise unknown_lora(name, self.spec.lora_hashes)
        return h
