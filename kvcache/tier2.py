"""The second KV tier's bookkeeping: which evicted blocks a host store holds (slot, hash, parent,
tokens), LRU up to a slot budget, and the measured costs that decide reload versus recompute.

Torch-free: the bytes live in a host store owned by the worker (workers/kv_tier2.py), which
the pool drives through the `KVBlockMover` protocol. Tiers are exclusive: a hash is held by the
pool (tier 1) or by this index (tier 2), never both (block_pool.py keeps it so).

Slots: every slot is exactly one of free (`_free`), held by an entry (`_entries`, LRU order, front
dropped first) or taken (`_taken`: an entry popped for a reload whose copy has not run yet, so no
demotion may reuse its bytes); free + entries + taken == num_slots (`check_invariants`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvcache.hashing import BlockHash


class KVBlockMover(Protocol):
    """Copies block contents between the pool (tier 1) and the host store (tier 2), in their
    stored form (bit-exact: a quantized block's elements and scales alike)."""

    def demote(self, block_ids: Sequence[int], slots: Sequence[int]) -> None: ...

    def reload(self, slots: Sequence[int], block_ids: Sequence[int]) -> None: ...


@dataclass(frozen=True)
class Tier2Entry:
    slot: int
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]


class Tier2Index:
    """Hash -> slot of the host store, LRU over `num_slots` slots."""

    def __init__(self, num_slots: int) -> None:
        assert num_slots > 0, "a second tier needs at least one slot"
        self.num_slots = num_slots
        self._entries: OrderedDict[BlockHash, Tier2Entry] = OrderedDict()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))   # pop() gives slot 0 first
        self._taken: set[int] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def get(self, block_hash: BlockHash, parent_hash: BlockHash | None,
            token_ids: Sequence[int]) -> Tier2Entry | None:
        """The entry for this hash, confirmed by parent and tokens (no hash collisions)."""
        e = self._entries.get(block_hash)
        if e is None or e.parent_hash != parent_hash or e.token_ids != tuple(token_ids):
            return None
        return e

    def slot_of(self, block_hash: BlockHash) -> int | None:
        e = self._entries.get(block_hash)
        return None if e is None else e.slot

    def put(self, block_hash: BlockHash, parent_hash: BlockHash | None,
            token_ids: Sequence[int]) -> tuple[int | None, BlockHash | None]:
        """Take a slot for a demoted block: (slot, hash dropped to make room). Slot None when
        every slot is taken by a pending reload (the block is then simply evicted)."""
        assert block_hash not in self._entries, "tiers are exclusive: demoted twice"
        dropped = None
        if not self._free:
            if not self._entries:
                return None, None
            dropped, old = self._entries.popitem(last=False)
            self._free.append(old.slot)
        slot = self._free.pop()
        self._entries[block_hash] = Tier2Entry(slot, parent_hash, tuple(token_ids))
        return slot, dropped

    def take(self, block_hash: BlockHash) -> Tier2Entry:
        """Remove an entry for a reload; its slot stays taken until `release`."""
        e = self._entries.pop(block_hash)
        self._taken.add(e.slot)
        return e

    def release(self, slot: int) -> None:
        self._taken.remove(slot)
        self._free.append(slot)

    def discard(self, block_hash: BlockHash) -> bool:
        """Drop an entry (the hash is cached in tier 1 again); True if there was one."""
        e = self._entries.pop(block_hash, None)
        if e is None:
            return False
        self._free.append(e.slot)
        return True

    def clear(self) -> list[BlockHash]:
        hashes = list(self._entries)
        for e in self._entries.values():
            self._free.append(e.slot)
        self._entries.clear()
        return hashes

    def hashes(self) -> list[BlockHash]:
        return list(self._entries)

    def check_invariants(self) -> None:
        held = {e.slot for e in self._entries.values()}
        free = set(self._free)
        assert len(held) == len(self._entries), "two entries share a slot"
        assert len(free) == len(self._free), "a slot is twice in the free list"
        assert not (held & free) and not (held & self._taken) and not (free & self._taken)
        assert len(held) + len(free) + len(self._taken) == self.num_slots, "a slot leaked"


@dataclass
class ReloadCostModel:
    """Seconds per token of reloading a block from tier 2 and of prefilling it, from the
    engine's own measurements. Reload: an exponential moving average of seconds / tokens of
    each reload. Prefill: the marginal cost of a token, the slope of step seconds against step
    tokens over recent prefill steps (exponentially weighted least squares), since a step's
    fixed cost is paid whether a prefix is reloaded or not; the mean seconds per token until
    the steps seen differ enough in size to fit a slope. Before both are measured a reload is
    tried (that is how its cost becomes known)."""

    reload_s_per_token: float | None = None
    alpha: float = 0.2
    _w: float = 0.0        # decayed sums over prefill steps: weight, x, y, xx, xy
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe_reload(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            r = seconds / num_tokens
            old = self.reload_s_per_token
            self.reload_s_per_token = r if old is None else (1 - self.alpha) * old + self.alpha * r

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0:
            return
        keep = 1 - self.alpha / 4        # ~20 steps of memory
        x, y = float(num_tokens), seconds
        self._w = keep * self._w + 1
        self._x = keep * self._x + x
        self._y = keep * self._y + y
        self._xx = keep * self._xx + x * x
        self._xy = keep * self._xy + x * y

    @property
    def prefill_s_per_token(self) -> float | None:
        if self._w == 0:
            return None
        var = self._xx / self._w - (self._x / self._w) ** 2
        if var > 0.05 * (self._x / self._w) ** 2:      # sizes spread by > ~22 %: fit a slope
            slope = (self._xy / self._w - self._x * self._y / self._w ** 2) / var
            if slope > 0:
                return slope
        return self._y / self._x

    def prefer_reload(self) -> bool:
        prefill = self.prefill_s_per_token
        if self.reload_s_per_token is None or prefill is None:
            return True
        return self.reload_s_per_token < prefill


@dataclass
class Tier2Stats:
    """Counters of the second tier over a pool's life (plain data)."""

    tier2_demotions: int = 0      # blocks copied into tier 2 on eviction
    tier2_dropped: int = 0        # tier-2 blocks dropped by its LRU (gone from both tiers)
    tier2_hits: int = 0           # tier-2 blocks reloaded for a prefix hit
    tier2_recomputed: int = 0     # tier-2 hits recomputed instead (reload measured costlier)
    reloaded_tokens: int = 0
    reload_s: float = 0.0
    recompute_avoided_s: float = 0.0   # reloaded tokens x measured prefill s/token at the time
