"""The engine loop: admit requests, schedule a step, run the model, sample, post-process.

One engine = one model + one KV pool + one scheduler. Prefill and decode workers (Ray actors)
each host one; `raypd generate` runs one in-process. A step reads as the algorithm:
`scheduler.schedule()` -> `SchedulerOutput` -> `runner.execute` -> `sample` ->
`scheduler.update_from_output` -> stop rules (`OutputProcessor`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvcache.hashing import CacheNamespace
from kvcache.kv_sizing import bytes_per_layer_block, kv_layout, rank_layout
from kvcache.manager import KVCacheManager
from protocol.lifecycle import EngineStats
from protocol.step_rates import default_batched_tokens
from protocol.tp_layout import tp_refusal
from workers.device import (
    DTYPES,
    device_name,
    keep_freed_host_memory,
    load_dtype,
    resolve_device,
)
from workers.engine_config import KV_DTYPES, EngineConfig  # noqa: F401  (re-exported)
from workers.engine_handoff import EngineHandoff
from workers.engine_views import EngineView
from workers.input_processor import InputProcessor
from workers.kv_quant import is_quantized
from workers.kv_tier2 import attach_tier2, observe_prefill_cost, tier2_counters
from workers.llama import CompactLlama
from workers.lora import LoRAStats, read_adapter
from workers.model_runner import ModelRunner
from workers.output_processor import OutputProcessor
from workers.random_model import build_random, is_random
from workers.request import Request, RequestStatus, SamplingParams
from workers.sampler import sample
from workers.scheduler import Scheduler, SchedulerConfig
from workers.scheduler_output import ModelRunnerOutput, SchedulerOutput
from workers.step_budget import StepBudget


def load_engine_model(cfg: EngineConfig, device: torch.device):
    """(model, tokenizer, ModelInfo) as an engine loads its own: a random shape built on the
    device, else the stock model only where it runs (workers/light_model.py)."""
    if is_random(cfg.model):
        return build_random(cfg.model, cfg.dtype, device, seed=cfg.seed)
    from workers.model_loader import load_for_engine
    return load_for_engine(cfg.model, load_dtype(cfg.dtype, cfg.model, device), seed=cfg.seed,
                           stock_needed=cfg.model_impl == "stock" or bool(cfg.lora_adapters))


def check_tp_engine(cfg: EngineConfig, config, kv_dtype: str, device: torch.device) -> None:
    """Raise ValueError naming the rule when this engine cannot run at TP size cfg.tp."""
    reason = tp_refusal(config.num_attention_heads, config.num_key_value_heads, cfg.tp)
    if reason:
        raise ValueError(reason)
    if device.type != "cpu":
        raise ValueError("tp > 1 runs on the CPU only for now (shared-memory all-reduce); "
                         f"device {device.type!r}")
    if cfg.model_impl == "stock" or CompactLlama.unsupported(config):
        raise ValueError("tp > 1 needs the compact model (model_impl auto or compact)")
    if cfg.lora_adapters:
        raise ValueError("tp > 1 does not serve LoRA adapters yet")
    if is_quantized(kv_dtype) or cfg.kv_tier2_gb:
        raise ValueError("tp > 1 needs a float KV pool without tier 2")


@dataclass
class StepOutput:
    """A request's new tokens of one step (or of a landed handoff), and whether it ended."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False


class LLMEngine:
    """One model + one KV pool + one scheduler, stepped by its host's loop. Its jobs live in
    their own classes: `inputs` (requests in: InputProcessor), `scheduler` (what runs, and the
    state after a step), `runner` (the model), `outputs` (stop rules and text), `handoff` (the
    P/D and migration API: EngineHandoff), `view` (pool and queue views for load reports)."""

    def __init__(self, cfg: EngineConfig, loaded=None, *, tp_launcher: str | None = None,
                 tp_placement=None, tp_lm_head: str | None = None,
                 tp_rank_threads: int | None = None) -> None:
        """`loaded` = (model, tokenizer, ModelInfo) to share an already loaded model.
        With `cfg.tp` > 1 this engine is rank 0 of a tensor-parallel worker and starts the
        other ranks (`tp_launcher`: "process" (default) or "ray", in `tp_placement`, a Ray
        placement group; `tp_lm_head`: workers/tp_shard.LM_HEADS; `tp_rank_threads`: their
        torch threads, default cfg.num_threads); `close()` stops them."""
        cfg.validate()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = resolve_device(cfg.device)   # the one device decision (workers/device.py)
        if self.device.type == "cpu":
            keep_freed_host_memory()   # a step's temporaries reuse memory, no page faults
        owns_model = loaded is None   # its own load: nobody else runs the stock model
        self.model, self.tokenizer, self.info = loaded or load_engine_model(cfg, self.device)
        self.cfg = cfg
        self.loras = {name: read_adapter(name, path, self.model.config)
                      for name, path in cfg.lora_adapters.items()}
        kv_dtype = self.info.dtype if cfg.kv_dtype == "auto" else cfg.kv_dtype
        self.kv_dtype = kv_dtype
        if cfg.tp > 1:
            check_tp_engine(cfg, self.model.config, kv_dtype, self.device)
        layout = kv_layout(self.model.config)   # the planner's figures are what the pool holds
        self.kv_bytes_per_block = layout.num_layers * bytes_per_layer_block(layout, kv_dtype,
                                                                            cfg.block_size)
        per_token = self.kv_bytes_per_block / cfg.block_size
        self.kv_bytes_per_token = int(per_token) if per_token.is_integer() else per_token
        # kv_cache_gb is each rank's: a TP rank holds its share of the KV heads
        rank_block = layout.num_layers * bytes_per_layer_block(rank_layout(layout, cfg.tp),
                                                               kv_dtype, cfg.block_size)
        num_blocks = cfg.num_blocks or int(cfg.kv_cache_gb * 2**30 // rank_block)
        self.max_model_len = cfg.max_model_len or self.info.max_position_embeddings
        tier2_slots = int(cfg.kv_tier2_gb * 2**30 // self.kv_bytes_per_block)
        self.kv = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                 tier2_slots=tier2_slots)
        self.stats = EngineStats(num_blocks=num_blocks, block_size=cfg.block_size,
                                 kv_bytes_per_token=self.kv_bytes_per_token)
        self.max_num_batched_tokens = (cfg.max_num_batched_tokens
                                       or default_batched_tokens(self.device.type))
        self.step_budget = StepBudget(cfg.max_step_ms, self.max_num_batched_tokens,
                                      min_chunk=cfg.block_size)
        self.scheduler = Scheduler(SchedulerConfig(self.max_num_batched_tokens, cfg.max_num_seqs,
                                                   cfg.max_loras), self.kv, self.stats,
                                   self._busy_loras, self.step_budget)
        self.tp_group = None   # TP: ranks 1..t-1 (workers/tp_group.py); this engine is rank 0
        tp_shard = None
        if cfg.tp > 1:
            from workers.tp_group import TPGroup, rank0_shard
            from workers.tp_shard import DEFAULT_LM_HEAD
            self.tp_group = TPGroup.launch(cfg, num_blocks=num_blocks,
                                           max_model_len=self.max_model_len, kv_dtype=kv_dtype,
                                           launcher=tp_launcher or "process",
                                           placement=tp_placement,
                                           lm_head=tp_lm_head or DEFAULT_LM_HEAD,
                                           rank_threads=tp_rank_threads or cfg.num_threads)
            tp_shard = rank0_shard(self.model.config, self.tp_group)
        try:
            self.runner = ModelRunner(self.model, num_blocks, cfg.block_size,
                                      kv_dtype if is_quantized(kv_dtype) else DTYPES[kv_dtype],
                                      cfg.model_impl, self.max_model_len, self.loras,
                                      cfg.max_loras, device=self.device,
                                      cuda_graphs=cfg.cuda_graphs, release_stock=owns_model,
                                      max_num_seqs=cfg.max_num_seqs, tp=tp_shard,
                                      tp_group=self.tp_group)
            if self.tp_group is not None:
                self.tp_group.wait_ready()
        except BaseException:
            self.close()
            raise
        self.tier2 = attach_tier2(self.kv.pool, self.runner, cfg.kv_tier2_dir)
        self.namespace = CacheNamespace(self.info.model_id, self.info.revision,
                                        self.info.tokenizer_fingerprint, kv_dtype)
        self.requests: dict[str, Request] = {}
        self.frozen: set[str] = set()    # running decodes stopped to move away (migration)
        self.inputs = InputProcessor(self.tokenizer, self.info.vocab_size,
                                     tuple(self.info.eos_token_ids), self.namespace, self.loras,
                                     cfg.block_size, num_blocks, self.max_model_len, self.stats,
                                     self.requests)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.handoff = EngineHandoff(self)
        self.view = EngineView(self)

    def close(self) -> None:
        """Stop a TP worker's other ranks (nothing to do for one rank)."""
        group = getattr(self, "tp_group", None)
        if group is not None:
            group.close()

    # ---- requests in -------------------------------------------------------------------------
    def add_request(self, prompt, sampling: SamplingParams | None = None, **kw) -> Request:
        """Queue a prompt (`inputs.make_request`'s arguments), or a built `request=`."""
        req = kw.pop("request", None) or self.inputs.make_request(prompt, sampling, **kw)
        self.requests[req.request_id] = req
        if req.lora_name:
            self.runner.lora.stats.observe_request(req.lora_name)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.status is RequestStatus.FINISHED:
            return False
        self.finish_request(req, "abort", time.perf_counter())
        return True

    # ---- the loop ----------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        """Schedule, run the model, sample, then the scheduler applies the step and the stop
        rules end what is done."""
        sched = self.scheduler.schedule()
        now = time.perf_counter()
        outputs: list[StepOutput] = []
        for req in sched.out_of_blocks:
            self.finish_request(req, "length", now)
            outputs.append(StepOutput(req, [], True))
        if sched.is_empty:
            return outputs
        t0 = time.perf_counter()
        logits, sampled = self.runner.execute(sched)
        now = time.perf_counter()
        tokens = sample(logits, [sched.chunks[i].request for i in sampled])
        result = ModelRunnerOutput(sampled, tokens, now - t0)
        self._observe_step(sched, result)
        reqs = self.scheduler.update_from_output(sched, result, now)
        outputs += [self.after_token(req, now) for req in reqs]
        return outputs

    def _observe_step(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """A step's time and tokens into the stats, the step budget, the tier-2 cost model and
        the adapters' token counts."""
        chunks, took = sched.chunks, result.forward_s
        self.stats.busy_s += took
        self.stats.steps += 1
        observe_prefill_cost(self.kv.costs, chunks, took)
        if self.step_budget.on:   # off (the default): nothing to derive on the hot path
            decodes = [ch.request for ch in chunks if not ch.request.is_prefill]
            self.step_budget.observe(len(decodes), sum(r.num_tokens for r in decodes),
                                     sched.num_scheduled_tokens - len(decodes), took)
        for ch in chunks:
            if ch.request.lora_name:
                self.runner.lora.stats.observe_tokens(ch.request.lora_name, ch.num_new_tokens)

    def after_token(self, req: Request, now: float) -> StepOutput:
        """A request just got a token: end it if a stop rule says so."""
        reason = self.outputs.stop_reason(req)
        if reason:
            self.finish_request(req, reason, now)
        return StepOutput(req, [req.output_token_ids[-1]], reason is not None)

    def finish_request(self, req: Request, reason: str, now: float) -> None:
        """End a request ("stop", "length", "abort"): its text, its blocks freed (a prefill's
        `hold_kv` keeps them for the handoff), counted."""
        self.outputs.final_text(req, reason)
        req.finish(reason, now)
        if req.lora_name:
            self.runner.lora.stats.observe_finished(req.lora_name, len(req.prompt_token_ids),
                                                    req.lifecycle.cached_tokens)
        self.scheduler.finish(req, free_blocks=not (req.hold_kv and reason != "abort"))
        self.requests.pop(req.request_id, None)
        self.frozen.discard(req.request_id)
        self.stats.requests_finished += 1

    def generate(self, prompts: Iterable, sampling: SamplingParams | None = None,
                 **kw) -> list[Request]:
        """Run prompts to the end in this thread (tests, `raypd generate`)."""
        reqs = [self.add_request(p, sampling, **kw) for p in prompts]
        while self.has_unfinished():
            self.step()
        return reqs

    def abort_running(self) -> list[str]:
        """End every request of the running batch (a failed step's): their blocks are freed."""
        ids = [r.request_id for r in self.scheduler.running]
        for rid in ids:
            try:
                self.abort(rid)
            except Exception:   # noqa: BLE001 - free what can be freed
                pass
        return ids

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (blocks in use stay); publishes an AllBlocksCleared event."""
        self.kv.pool.reset_prefix_cache()

    def _busy_loras(self) -> set[str]:
        """Adapters of requests running or reserved (not those still queued): at most
        max_loras of them, so every step's adapters fit the resident slots."""
        queued = {id(r) for r in self.scheduler.waiting}
        return {r.lora_name for r in self.requests.values()
                if r.lora_name and id(r) not in queued}

    # ---- stats -------------------------------------------------------------------------------
    def get_stats(self) -> dict:
        self.stats.evictions = self.kv.pool.evictions
        d = self.stats.to_dict()
        d.update(tier2_counters(self.kv))
        d.update(blocks_used=self.kv.pool.num_used_blocks, blocks_cached=self.kv.pool.num_cached_blocks,
                 running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                 kv_dtype=self.kv_dtype, dtype=self.info.dtype,
                 model_impl=self.runner.model_impl, model_fallback=self.runner.fallback_reason,
                 linear_kernel=self.runner.linear_kernel,
                 attention_kernel=self.runner.attention_kernel,
                 fused_ops=self.runner.fused_ops,
                 device=self.device.type, device_name=device_name(self.device),
                 cuda_graphs=self.runner.graphs is not None,
                 cuda_graph_replays=self.runner.graphs.replays if self.runner.graphs else 0,
                 max_step_ms=self.cfg.max_step_ms,
                 step_budget_capped_steps=self.step_budget.capped_steps)
        lora = self.runner.lora
        d.update((lora.stats if lora is not None else LoRAStats()).to_dict(),
                 lora_resident=list(lora.resident) if lora is not None else [])
        return d

    def check_invariants(self) -> None:
        """The pool's block ledger holds (workers/kvcache: refcounts, free list, hashes)."""
        self.kv.pool.check_invariants()
