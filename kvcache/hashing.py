"""Chained, deterministic block hashes under a cache namespace (no torch, no Python `hash()`).

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal
prefixes. The chain starts at the namespace root, so two namespaces (other tenant, LoRA
adapter, model revision, tokenizer or KV dtype) never produce the same chain.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass

BlockHash = int  # unsigned 64-bit


def _digest64(data: bytes) -> BlockHash:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(frozen=True)
class CacheNamespace:
    """Everything that must match for a cached KV block to be reusable."""

    model_id: str
    revision: str = ""
    tokenizer_fingerprint: str = ""
    kv_dtype: str = "float32"
    lora_id: str = ""
    tenant: str = ""

    def root_hash(self) -> BlockHash:
        """Hash every chain of this namespace starts from."""
        payload = json.dumps(asdict(self), sort_keys=True).encode()
        return _digest64(b"raypd-ns-v1" + payload)

    def with_request(self, tenant: str = "", lora_id: str = "") -> CacheNamespace:
        """The namespace of one request: the worker's model fields plus its tenant and adapter."""
        return CacheNamespace(self.model_id, self.revision, self.tokenizer_fingerprint,
                              self.kv_dtype, lora_id, tenant)


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash (the namespace root for block 0)."""
    return _digest64(parent.to_bytes(8, "little") + array("q", token_ids).tobytes())


def block_hashes(token_ids: Sequence[int], block_size: int,
                 namespace: CacheNamespace | BlockHash) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block has none)."""
    parent = namespace.root_hash() if isinstance(namespace, CacheNamespace) else namespace
    out: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        out.append(parent)
    return out
