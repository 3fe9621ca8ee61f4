"""KV events a worker's block pool publishes so routers can keep a precise prefix index."""

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


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    reason: RemovalReason


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
                "parent_hash": ev.parent_hash, "num_tokens": ev.num_tokens}
    if isinstance(ev, BlockRemoved):
        return {"type": "removed", "block_hashes": list(ev.block_hashes),
                "reason": ev.reason.value}
    return {"type": "cleared"}


def event_from_dict(d: dict) -> KVEvent:
    kind = d.get("type")
    if kind == "stored":
        return BlockStored(tuple(d["block_hashes"]), d.get("parent_hash"), int(d["num_tokens"]))
    if kind == "removed":
        return BlockRemoved(tuple(d["block_hashes"]), RemovalReason(d["reason"]))
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {kind!r}")
