"""Read-only views of one engine for its host's load reports and status pages: the pool's block
ledger, the queues, who holds blocks, KV events, adapter residency. Nothing here changes the
engine (but `take_kv_events`, which drains the pool's event queue)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.request import Request

if TYPE_CHECKING:
    from workers.engine import LLMEngine


class EngineView:
    """`engine.view`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    @property
    def stalled(self) -> bool:
        """The last step could schedule nothing: blocks are held by reservations or leases."""
        return self.engine.scheduler.stalled

    def waiting_requests(self) -> tuple[Request, ...]:
        return tuple(self.engine.scheduler.waiting)

    def running_requests(self) -> tuple[Request, ...]:
        return tuple(self.engine.scheduler.running)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now (free + evictable cached)."""
        return self.engine.kv.pool.num_free_blocks

    def pool_counts(self) -> dict[str, int]:
        """The block ledger: free, cached (unreferenced), referenced, total."""
        return self.engine.kv.pool.counts()

    def pool_usage(self) -> tuple[int, int, int, int]:
        """(used, cached, free, total) blocks of the pool, as a load report gives them."""
        pool = self.engine.kv.pool
        return pool.num_used_blocks, pool.num_cached_blocks, pool.num_free_blocks, \
            pool.num_blocks

    def block_holders(self) -> dict[str, str]:
        """Requests that reference blocks now: request id -> "<blocks> blocks, <state>"."""
        sched = self.engine.scheduler
        state = {r.request_id: "waiting" for r in sched.waiting}
        state.update({r.request_id: "running" for r in sched.running})
        return {rid: f"{len(blocks)} blocks, {state.get(rid, 'not scheduled')}"
                for rid, blocks in self.engine.kv.req_blocks.items() if blocks}

    def take_kv_events(self) -> list:
        """The pool's KV events since the last call (stored / removed / cleared)."""
        return self.engine.kv.pool.take_events()

    def lora_load_s_total(self) -> float:
        """Seconds spent loading adapters into slots so far (they load inside a step)."""
        lora = self.engine.runner.lora
        return lora.stats.load_s_total if lora is not None else 0.0

    def lora_load_report(self) -> dict:
        """What the router's adapter affinity looks at: adapters resident, mean load time."""
        lora = self.engine.runner.lora
        if lora is None:
            return {"loras_resident": (), "lora_load_s": 0.0}
        st = lora.stats
        return {"loras_resident": tuple(lora.resident),
                "lora_load_s": st.load_s_total / st.loads if st.loads else 0.0}
