"""KV events a worker's block pool publishes so routers can keep a precise prefix index.

`tier` says where the worker holds a block: 1 = the KV pool itself, 2 = the host tier of
evicted blocks (kvcache/tier2.py). Tiers are exclusive, so `BlockStored(tier=t)` moves a hash to
tier t (a demotion is `BlockStored(tier=2)`, a reload `BlockStored(tier=1)`), and
`BlockRemoved(tier=t)` drops it from tier t.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvcache.hashing import BlockHash


class RemovalReason(str, Enum):
    EVICTED = "evicted"          # LRU eviction of a cached, unreferenced block
    INVALIDATED = "invalidated"  # explicitly dropped (e.g. content no longer trusted)
    ABORTED = "aborted"          # a block whose contents were never completed / were discarded


@dataclass(frozen=True)
class BlockStored:
    """Full blocks whose KV is now cached, in chain order; `parent_hash` precedes the first."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    num_tokens: int
    tier: int = 1


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    reason: RemovalReason
    tier: int = 1


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventBatch:
    """Events of one worker since its last publish, numbered so a router can spot gaps."""

    worker_id: str
    seq: int
    events: list[KVEvent] = field(default_factory=list)


def event_to_dict(ev: KVEvent) -> dict:
    """Plain-data form (msgpack / JSON friendly)."""
    if isinstance(ev, BlockStored):
        return {"type": "stored", "block_hashes": list(ev.block_hashes),
                "parent_hash": ev.parent_hash, "num_tokens": ev.num_tokens, "tier": ev.tier}
    if isinstance(ev, BlockRemoved):
        return {"type": "removed", "block_hashes": list(ev.block_hashes),
                "reason": ev.reason.value, "tier": ev.tier}
    return {"type": "cleared"}


def event_from_dict(d: dict) -> KVEvent:
    kind = d.get("type")
    if kind == "stored":
        return BlockStored(tuple(d["block_hashes"]), d.get("parent_hash"), int(d["num_tokens"]),
                           _tier(d))
    if kind == "removed":
        return BlockRemoved(tuple(d["block_hashes"]), RemovalReason(d["reason"]), _tier(d))
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {kind!r}")


def _tier(d: dict) -> int:
    tier = int(d.get("tier", 1))
    if tier not in (1, 2):
        raise ValueError(f"KV event tier must be 1 or 2, got {tier}")
    return tier
