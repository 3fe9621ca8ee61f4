"""A tensor-parallel worker's ranks: rank 0 (the engine: scheduler, KV manager, sampling) starts
ranks 1..t-1, each holding its shard of the model and of the KV pool, and drives them over one
shared-memory channel (workers/kernels/tp_comm.py).

Rank 0 sends one message a step (`StepInputs`: token ids, positions, slot mapping, block tables)
and every rank runs the same step; the per-layer all-reduces go over the same channel. Page
reads and writes (KV transfer, migration) reach every rank's pool with one message each. No
per-request message ever crosses between ranks.

The ranks are processes (`launcher="process"`: spawned here) or Ray actors (`"ray"`: in the
worker's placement group, workers/tp_actors.py); either way a rank that dies fails the group's
next call (`CommError`) and takes its worker down with it: the channel checks its peers' pids
while it waits, so nothing hangs on a dead rank.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from protocol.tp_layout import RankHeads, all_rank_heads, rank_heads
from workers.engine_config import EngineConfig
from workers.kernels.tp_comm import CommError, GlooComm, ShmComm, free_port
from workers.tp_shard import DEFAULT_LM_HEAD, TPShard

STEP, READ, WRITE, CALL, STOP = b"S", b"R", b"W", b"C", b"Q"
SLOT_BYTES = 4 << 20          # the channel's per-rank slot (bigger messages go in chunks)
READY_TIMEOUT_S = 300.0       # a rank that has not loaded its shard by then fails the start
GLOO_TIMEOUT_S = 7 * 24 * 3600.0   # gloo's group timeout bounds an idle rank's wait too


@dataclass(frozen=True)
class RankSpec:
    """What a rank other than 0 needs to build its shard (plain data: it crosses processes)."""

    cfg: EngineConfig
    rank: int
    tp: int
    comm_name: str
    num_blocks: int
    max_model_len: int
    kv_dtype: str
    lm_head: str = DEFAULT_LM_HEAD
    slot_bytes: int = SLOT_BYTES


def build_rank_runner(spec: RankSpec, comm: ShmComm):
    """A rank's ModelRunner over its shard (the model loaded as the engine loads it)."""
    from workers.device import DTYPES, resolve_device
    from workers.engine import load_engine_model
    from workers.model_runner import ModelRunner
    device = resolve_device(spec.cfg.device)
    model = load_engine_model(spec.cfg, device)[0]
    config = model.config
    shard = TPShard(rank_heads(config.num_attention_heads, config.num_key_value_heads,
                               spec.tp, spec.rank), comm, spec.lm_head)
    return ModelRunner(model, spec.num_blocks, spec.cfg.block_size, DTYPES[spec.kv_dtype],
                       spec.cfg.model_impl, spec.max_model_len, device=device,
                       cuda_graphs=False, release_stock=True,
                       max_num_seqs=spec.cfg.max_num_seqs, tp=shard)


def rank_main(spec: RankSpec) -> None:
    """A rank other than 0: build the shard, report ready, then run what rank 0 sends until it
    says stop (or the channel fails: rank 0 is gone)."""
    comm = join_comm(spec)
    try:
        if spec.cfg.num_threads:
            torch.set_num_threads(spec.cfg.num_threads)
        runner = build_rank_runner(spec, comm)
        comm.barrier(READY_TIMEOUT_S)
        serve_rank(runner, comm)
    except CommError:
        pass     # rank 0 is gone or aborted the group: nothing left to serve
    finally:
        comm.close()


def join_comm(spec: RankSpec):
    """A rank's channel: the shared-memory segment rank 0 made, or the gloo group at the
    address rank 0 named (`tp_allreduce: gloo`)."""
    if spec.comm_name.startswith("tcp://"):
        return GlooComm.init(spec.rank, spec.tp, spec.comm_name, GLOO_TIMEOUT_S)
    return ShmComm.attach(spec.comm_name, spec.rank, spec.tp, spec.slot_bytes)


def serve_rank(runner, comm: ShmComm) -> None:
    """A rank's loop: one message from rank 0 at a time."""
    with torch.inference_mode():
        while True:
            msg = comm.broadcast(None)
            kind, body = msg[:1], msg[1:]
            if kind == STEP:
                from workers.model_runner import StepInputs
                runner.execute_inputs(StepInputs.from_bytes(body))
            elif kind == READ:
                comm.gather(runner.read_local_pages(pickle.loads(body)))
            elif kind == WRITE:
                ids, pages = _load_pages(body)
                runner.write_local_pages(ids, runner.tp.heads_of(pages))
            elif kind == CALL:      # a named rank-local job (workers/tp_handoff.py)
                fn, args = pickle.loads(body)
                fn(runner, comm, *args)
            elif kind == STOP:
                return
            else:
                raise CommError(f"unknown TP message kind {kind!r}")


def _dump_pages(ids: list[int], pages: torch.Tensor) -> bytes:
    raw = pages.contiguous().reshape(-1).view(torch.uint8).numpy()
    return pickle.dumps((ids, str(pages.dtype).removeprefix("torch."), tuple(pages.shape), raw),
                        protocol=pickle.HIGHEST_PROTOCOL)


def _load_pages(body: bytes) -> tuple[list[int], torch.Tensor]:
    ids, dtype, shape, raw = pickle.loads(body)
    return ids, torch.from_numpy(raw).view(getattr(torch, dtype)).view(shape)


@dataclass
class TPGroup:
    """Rank 0's handle on ranks 1..t-1: their launch, one message a step, page access, stop."""

    comm: ShmComm
    tp: int
    lm_head: str = DEFAULT_LM_HEAD
    ranks: list[Any] = field(default_factory=list)   # processes or tp_actors.RankActor
    heads: list[RankHeads] = field(default_factory=list)   # every rank's heads, by rank
    steps_sent: int = 0
    stopped: bool = False

    @classmethod
    def launch(cls, cfg: EngineConfig, *, num_blocks: int, max_model_len: int, kv_dtype: str,
               lm_head: str = DEFAULT_LM_HEAD, launcher: str = "process",
               placement=None, rank_threads: int | None = None) -> TPGroup:
        """Create the channel and start ranks 1..t-1 (they load their shards while rank 0
        builds its own; `wait_ready` joins them)."""
        assert cfg.tp > 1
        gloo = cfg.tp_allreduce == "gloo"
        comm = None if gloo else ShmComm.create(cfg.tp, SLOT_BYTES)
        where = f"tcp://127.0.0.1:{free_port()}" if gloo else comm.name
        group = cls(comm, cfg.tp, lm_head)
        rank_cfg = replace(cfg, num_threads=rank_threads or cfg.num_threads)
        specs = [RankSpec(rank_cfg, r, cfg.tp, where, num_blocks, max_model_len, kv_dtype,
                          lm_head) for r in range(1, cfg.tp)]
        try:
            if launcher == "ray":
                from workers.tp_actors import start_rank_actors
                group.ranks = start_rank_actors(specs, placement)
            else:
                ctx = multiprocessing.get_context("spawn")
                for spec in specs:
                    p = ctx.Process(target=rank_main, args=(spec,), daemon=True,
                                    name=f"raypd-tp-rank{spec.rank}")
                    p.start()
                    group.ranks.append(p)
            if gloo:    # joins once every rank has (they start above)
                group.comm = GlooComm.init(0, cfg.tp, where, GLOO_TIMEOUT_S)
        except BaseException:
            group.close()
            raise
        return group

    def wait_ready(self) -> None:
        """Every rank has built its shard (raises CommError when one failed or died)."""
        self.comm.barrier(READY_TIMEOUT_S)

    def send_step(self, inputs) -> None:
        self.comm.broadcast(STEP + inputs.to_bytes())
        self.steps_sent += 1

    def read_pages(self, block_ids: list[int], own: torch.Tensor) -> torch.Tensor:
        """Whole pages (every KV head) of `block_ids`: each rank's heads gathered, one copy of
        each head (replicas skipped), in head order."""
        self.comm.broadcast(READ + pickle.dumps(list(block_ids)))
        parts = self.comm.gather(own)
        assert len(self.heads) == self.tp, "rank0_shard sets the ranks' heads"
        seen, keep = set(), []
        for heads, part in zip(self.heads, parts, strict=True):
            if heads.kv_lo not in seen:    # a replicated head: its first rank's copy
                seen.add(heads.kv_lo)
                keep.append(part)
        return torch.cat(keep, dim=4) if len(keep) > 1 else keep[0].clone()

    def write_pages(self, block_ids: list[int], pages: torch.Tensor) -> None:
        """Every rank writes its heads of whole `pages` (rank 0 writes its own after this)."""
        self.comm.broadcast(WRITE + _dump_pages(list(block_ids), pages))

    def call(self, fn, *args) -> None:
        """Run `fn(runner, comm, *args)` on every rank but 0 (rank 0 runs its part itself):
        a rank-local job such as staging a KV shard (`fn` must be importable by name)."""
        self.comm.broadcast(CALL + pickle.dumps((fn, args)))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the ranks (a clean stop, else abort the channel and kill what is left)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            if self.comm is not None:
                self.comm.broadcast(STOP, timeout_s=timeout_s)
        except CommError:
            self.comm.abort()
        deadline = time.monotonic() + timeout_s
        for r in self.ranks:
            if isinstance(r, multiprocessing.process.BaseProcess):
                r.join(max(0.0, deadline - time.monotonic()))
                if r.is_alive():
                    r.kill()
            else:
                from workers.tp_actors import stop_rank_actor
                stop_rank_actor(r)
        if self.comm is not None:
            self.comm.close()

    def pids(self) -> list[int]:
        """Rank 0's pid and its ranks' (processes, or workers/tp_actors.RankActor)."""
        return [os.getpid(), *(r.pid for r in self.ranks)]


def rank0_shard(config, group: TPGroup) -> TPShard:
    """Rank 0's shard of a model of this config in `group`."""
    group.heads = all_rank_heads(config.num_attention_heads, config.num_key_value_heads,
                                 group.tp)
    return TPShard(group.heads[0], group.comm, group.lm_head)
