"""The engine loop: admit requests, schedule a step, run the model, sample, post-process.

One engine = one model + one KV pool + one scheduler. Prefill and decode workers (Ray actors)
each host one; `raypd generate` runs one in-process.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from kvcache.hashing import CacheNamespace
from kvcache.kv_sizing import bytes_per_layer_block, kv_layout
from kvcache.manager import KVCacheManager, cdiv
from protocol.errors import RequestError, UnknownLoRAError
from protocol.lifecycle import EngineStats
from protocol.messages import AdmittedRequest, MigratedRequest
from protocol.step_rates import default_batched_tokens
from workers.device import (
    DEVICES,
    DTYPES,
    device_name,
    keep_freed_host_memory,
    load_dtype,
    resolve_device,
)
from workers.kv_quant import QUANT_FORMATS, is_quantized
from workers.kv_tier2 import attach_tier2, observe_prefill_cost, tier2_counters
from workers.lora import LoRAStats, read_adapter
from workers.model_runner import MODEL_IMPLS, ModelRunner
from workers.random_model import build_random, is_random
from workers.request import Request, RequestStatus, SamplingParams
from workers.sampler import sample
from workers.scheduler import Scheduler, SchedulerConfig
from workers.step_budget import StepBudget

KV_DTYPES = ("auto", *DTYPES, *QUANT_FORMATS)


@dataclass
class EngineConfig:
    model: str = "smollm2"
    dtype: str = "auto"                 # model weights: auto | float32 | bfloat16
    kv_dtype: str = "auto"              # KV pool: auto (= model dtype) | float32 | bfloat16 |
                                        # int8 | fp8 (quantized, workers/kv_quant.py)
    block_size: int = 16
    num_blocks: int | None = None       # overrides kv_cache_gb
    kv_cache_gb: float = 1.0
    kv_tier2_gb: float = 0.0            # host tier for evicted blocks (0: off; workers/kv_tier2.py)
    kv_tier2_dir: str | None = None     # its memory-mapped file's folder (CPU pools; temp dir)
    max_num_batched_tokens: int | None = None   # tokens per step; None: by device
                                                # (protocol/step_rates.DEFAULT_BATCHED_TOKENS)
    max_step_ms: float | None = None    # TPOT target: mixed steps' prefill sized under it (off)
    max_num_seqs: int = 64
    max_model_len: int | None = None    # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    num_threads: int | None = None      # torch threads for this engine (per actor)
    seed: int = 0                       # for --model tiny weights
    model_impl: str = "auto"            # auto (compact where it applies) | compact | stock
    lora_adapters: dict[str, str] = field(default_factory=dict)   # name -> PEFT folder
    max_loras: int = 4                  # adapters resident at once (LRU beyond that)
    device: str = "auto"                # auto (cuda when this actor holds a GPU) | cpu | cuda
    cuda_graphs: bool = True            # cuda: replay decode steps of bucketed batch sizes

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, "
                             f"got {self.kv_dtype!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.num_blocks is None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.kv_tier2_gb < 0:
            raise ValueError(f"kv_tier2_gb must be >= 0, got {self.kv_tier2_gb}")
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            raise ValueError(f"max_step_ms must be > 0 (or None: off), got {self.max_step_ms}")
        if (self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1
                or self.max_num_seqs < 1):
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, "
                             f"got {self.model_impl!r}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")


@dataclass
class StepOutput:
    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False


class LLMEngine:
    def __init__(self, cfg: EngineConfig, loaded=None) -> None:
        """`loaded` = (model, tokenizer, ModelInfo) to share an already loaded model."""
        cfg.validate()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = resolve_device(cfg.device)   # the one device decision (workers/device.py)
        if self.device.type == "cpu":
            keep_freed_host_memory()   # a step's temporaries reuse memory, no page faults
        owns_model = loaded is None   # its own load: nobody else runs the stock model
        if loaded is None and is_random(cfg.model):   # benchmarks: built on the device
            loaded = build_random(cfg.model, cfg.dtype, self.device, seed=cfg.seed)
        if loaded is None:   # the stock model only where it runs (workers/light_model.py)
            from workers.model_loader import load_for_engine
            loaded = load_for_engine(cfg.model, load_dtype(cfg.dtype, cfg.model, self.device),
                                     seed=cfg.seed, stock_needed=cfg.model_impl == "stock"
                                     or bool(cfg.lora_adapters))
        self.model, self.tokenizer, self.info = loaded
        self.cfg = cfg
        self.loras = {name: read_adapter(name, path, self.model.config)
                      for name, path in cfg.lora_adapters.items()}
        kv_dtype = self.info.dtype if cfg.kv_dtype == "auto" else cfg.kv_dtype
        self.kv_dtype = kv_dtype
        layout = kv_layout(self.model.config)   # the planner's figures are what the pool holds
        self.kv_bytes_per_block = layout.num_layers * bytes_per_layer_block(layout, kv_dtype,
                                                                            cfg.block_size)
        per_token = self.kv_bytes_per_block / cfg.block_size
        self.kv_bytes_per_token = int(per_token) if per_token.is_integer() else per_token
        num_blocks = cfg.num_blocks or int(cfg.kv_cache_gb * 2**30 // self.kv_bytes_per_block)
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
        self.runner = ModelRunner(self.model, num_blocks, cfg.block_size,
                                  kv_dtype if is_quantized(kv_dtype) else DTYPES[kv_dtype],
                                  cfg.model_impl, self.max_model_len, self.loras, cfg.max_loras,
                                  device=self.device, cuda_graphs=cfg.cuda_graphs,
                                  release_stock=owns_model, max_num_seqs=cfg.max_num_seqs)
        self.tier2 = attach_tier2(self.kv.pool, self.runner, cfg.kv_tier2_dir)
        self.namespace = CacheNamespace(self.info.model_id, self.info.revision,
                                        self.info.tokenizer_fingerprint, kv_dtype)
        self.requests: dict[str, Request] = {}
        self.frozen: set[str] = set()    # running decodes stopped to move away (migration)
        self._ids = itertools.count()

    # ---- requests in -------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            chat = True
        elif isinstance(prompt, list):
            chat = False   # token ids: already tokenized (chat template applied, if any)
        if chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
        return list(prompt)

    def make_request(self, prompt: str | list[int] | list[dict],
                     sampling: SamplingParams | None = None, request_id: str | None = None,
                     chat: bool = False, tenant: str = "", lora_id: str = "") -> Request:
        """Validate and build a request (not yet queued). Raises RequestError (counted in
        stats.requests_rejected)."""
        try:
            return self._build_request(prompt, sampling or SamplingParams(), request_id, chat,
                                       tenant, lora_id)
        except RequestError:
            self.stats.requests_rejected += 1
            raise

    def _build_request(self, prompt, sampling: SamplingParams, request_id: str | None,
                       chat: bool, tenant: str, lora_id: str) -> Request:
        if isinstance(prompt, str) and not prompt.strip() and not chat:
            raise RequestError("prompt is empty")
        token_ids = self.tokenize(prompt, chat)
        if not token_ids:
            raise RequestError("prompt is empty")
        vocab = self.info.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise RequestError(f"prompt has {n} tokens; the model's context is "
                               f"{self.max_model_len} tokens (prompt must leave room for output)",
                               param="messages" if chat else "prompt")
        if sampling.strict_max_tokens and n + sampling.max_tokens > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n + sampling.max_tokens} tokens ({n} in the "
                f"{'messages' if chat else 'prompt'}, {sampling.max_tokens} in the completion). "
                "Please reduce the length of the prompt or of the completion (max_tokens).",
                param="max_tokens")
        need = cdiv(n + 1, self.cfg.block_size)
        if need > self.kv.pool.num_blocks:
            raise RequestError(f"prompt needs {need} KV blocks; the whole pool has "
                               f"{self.kv.pool.num_blocks}")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        # the adapter's content hash keys the cache: two names for the same files share blocks
        ns = self.namespace.with_request(tenant=tenant, lora_id=self.lora_hash(lora_id))
        req = Request(rid, token_ids, sampling, ns.root_hash(), self.cfg.block_size,
                      lora_name=lora_id,
                      eos_token_ids=() if sampling.ignore_eos else tuple(self.info.eos_token_ids))
        req.update_block_hashes()
        return req

    def _busy_loras(self) -> set[str]:
        """Adapters of requests running or reserved (not those still queued): at most
        max_loras of them, so every step's adapters fit the resident slots."""
        queued = {id(r) for r in self.scheduler.waiting}
        return {r.lora_name for r in self.requests.values()
                if r.lora_name and id(r) not in queued}

    def lora_hash(self, name: str) -> str:
        """Content hash of adapter `name` ("" for the base model); raises UnknownLoRAError."""
        if not name:
            return ""
        spec = self.loras.get(name)
        if spec is None:
            known = ", ".join(sorted(self.loras)) or "none"
            raise UnknownLoRAError(f"the LoRA adapter {name!r} does not exist; "
                                   f"this server serves: {known}")
        return spec.content_hash

    def add_request(self, prompt, sampling: SamplingParams | None = None, **kw) -> Request:
        req = kw.pop("request", None) or self.make_request(prompt, sampling, **kw)
        self.requests[req.request_id] = req
        if req.lora_name:
            counts = self.runner.lora.stats.requests
            counts[req.lora_name] = counts.get(req.lora_name, 0) + 1
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.status is RequestStatus.FINISHED:
            return False
        self._finish(req, "abort", time.perf_counter())
        return True

    # ---- the loop ----------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        chunks = self.scheduler.schedule()
        outputs: list[StepOutput] = []
        now = time.perf_counter()
        for req in self.scheduler.out_of_blocks:
            self._finish(req, "length", now)
            outputs.append(StepOutput(req, [], True))
        self.scheduler.out_of_blocks.clear()
        if not chunks:
            return outputs
        t0 = time.perf_counter()
        logits, sampled = self.runner.execute(chunks)
        now = time.perf_counter()
        self.stats.busy_s += now - t0
        self.stats.steps += 1
        observe_prefill_cost(self.kv.costs, chunks, now - t0)
        if self.step_budget.on:   # off (the default): nothing to derive on the hot path
            decodes = [ch.request for ch in chunks if not ch.request.is_prefill]
            self.step_budget.observe(len(decodes), sum(r.num_tokens for r in decodes),
                                     sum(ch.num_new_tokens for ch in chunks) - len(decodes),
                                     now - t0)
        self.stats.observe_utilization(*self.scheduler.stored_tokens())
        for ch in chunks:
            ch.request.num_computed_tokens += ch.num_new_tokens
            ch.request.lifecycle.computed_tokens += ch.num_new_tokens
            self.stats.computed_tokens += ch.num_new_tokens
            if ch.request.lora_name:
                tokens = self.runner.lora.stats.tokens
                tokens[ch.request.lora_name] = tokens.get(ch.request.lora_name, 0) \
                    + ch.num_new_tokens
        reqs = [chunks[i].request for i in sampled]
        for req, tok in zip(reqs, sample(logits, reqs), strict=True):
            req.append_token(tok, now)
        for ch in chunks:
            req = ch.request
            self.kv.cache_computed(req.request_id, req.namespace_root, req.block_hashes,
                                   req.all_token_ids, req.num_computed_tokens)
        for req in reqs:
            reason = self._stop_reason(req)
            if reason:
                self._finish(req, reason, now)
            outputs.append(StepOutput(req, [req.output_token_ids[-1]], reason is not None))
        return outputs

    def _stop_reason(self, req: Request) -> str | None:
        sp, tok, n_out = req.sampling, req.output_token_ids[-1], len(req.output_token_ids)
        if n_out >= sp.min_tokens and (tok in req.eos_token_ids or tok in sp.stop_token_ids):
            return "stop"
        if sp.stop and n_out >= sp.min_tokens:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            hits = [text.find(s) for s in sp.stop if s in text]
            if hits:
                req.output_text, req.stop_cut = text[:min(hits)], True
                return "stop"
        if n_out >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str, now: float) -> None:
        if not (reason == "stop" and req.stop_cut):
            req.output_text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        req.finish(reason, now)
        if req.lora_name:
            self.runner.lora.stats.observe_finished(req.lora_name, len(req.prompt_token_ids),
                                                    req.lifecycle.cached_tokens)
        self.scheduler.finish(req, free_blocks=not (req.hold_kv and reason != "abort"))
        self.requests.pop(req.request_id, None)
        self.frozen.discard(req.request_id)
        self.stats.requests_finished += 1

    # ---- disaggregation hooks (the narrow API the P/D handoff uses) -------------------------
    def admitted_request(self, admitted: AdmittedRequest, max_tokens: int | None = None) -> Request:
        """Build the engine request for an AdmittedRequest, trusting its tokens and hashes
        (validated and hashed once, at admission) but not its namespace: a worker of another
        model revision, tokenizer, dtype, tenant or adapter refuses it (RequestError).
        `max_tokens` overrides the sampling's (P samples only the first token)."""
        ns = self.namespace.with_request(tenant=admitted.tenant,
                                         lora_id=self.lora_hash(admitted.lora_id))
        if ns.root_hash() != admitted.namespace_root or admitted.block_size != self.cfg.block_size:
            raise RequestError(f"request {admitted.request_id} was admitted under another "
                               "cache namespace or block size than this worker's")
        need = cdiv(admitted.num_tokens + 1, self.cfg.block_size)
        if need > self.kv.pool.num_blocks:
            raise RequestError(f"prompt needs {need} KV blocks; the whole pool has "
                               f"{self.kv.pool.num_blocks}")
        rid = admitted.worker_request_id
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        sp = admitted.sampling
        if max_tokens is not None:
            sp = replace(sp, max_tokens=max_tokens, min_tokens=min(sp.min_tokens, max_tokens))
        req = Request(rid, list(admitted.prompt_token_ids), sp, admitted.namespace_root,
                      self.cfg.block_size, lora_name=admitted.lora_id,
                      eos_token_ids=() if sp.ignore_eos else tuple(self.info.eos_token_ids))
        req.block_hashes = list(admitted.block_hashes)
        return req

    def resumed_request(self, m: MigratedRequest) -> Request:
        """Decode side of a live migration: the engine request that goes on with a decode
        another worker froze (its prompt, its output so far but the last token, which `fill`
        appends; its lifecycle and clocks carried over). Same namespace checks as
        `admitted_request`."""
        req = self.admitted_request(m.admitted)
        out, f = list(m.frozen.output_token_ids), m.frozen
        if cdiv(len(req.prompt_token_ids) + len(out) + 1, self.cfg.block_size) \
                > self.kv.pool.num_blocks:
            raise RequestError(f"request {m.admitted.request_id} holds more tokens than this "
                               "worker's whole pool")
        req.output_token_ids = out[:-1]
        req.lifecycle = replace(f.lifecycle)
        now, gap = time.perf_counter(), max(0.0, time.time() - f.frozen_at)
        req.arrival_time = now - f.since_arrival_s - gap
        req.first_token_time = req.first_scheduled_time = now - f.since_first_token_s - gap
        req.update_block_hashes()
        return req

    def freeze(self, request_id: str) -> Request | None:
        """Decode side, between two steps: stop decoding a running request so that it can move
        to another worker (live migration). Its blocks stay held (KV of every token but the
        last sampled one) until `release` or `abort`; `unfreeze` puts it back. None (nothing
        changed) unless it is a running decode: not queued, prefilling, frozen or finished."""
        req = self.requests.get(request_id)
        if req is None or req.status is not RequestStatus.RUNNING or req.is_prefill \
                or not req.output_token_ids or req not in self.scheduler.running:
            return None
        assert req.num_computed_tokens == req.num_tokens - 1, req
        self.scheduler.running.remove(req)
        req.status = RequestStatus.WAITING
        self.frozen.add(request_id)
        return req

    def unfreeze(self, request_id: str) -> bool:
        """A frozen request decodes here again (its move did not happen)."""
        req = self.requests.get(request_id)
        if request_id not in self.frozen or req is None:
            return False
        self.frozen.discard(request_id)
        req.status = RequestStatus.RUNNING
        self.scheduler.running.append(req)
        return True

    def match_prefix(self, req: Request) -> list:
        """The cached blocks of the request's longest cached prefix (at least its last prompt
        token is left to compute)."""
        return self.kv.match_prefix(req.namespace_root, req.block_hashes, req.all_token_ids,
                                    req.num_tokens - 1)

    def reserve(self, req: Request, hits: list | None = None,
                migrated: bool = False) -> int | None:
        """Decode side: take the request's prefix hit (`hits`: `match_prefix(req)` when the
        caller has it already) and reserve blocks for its whole prompt before anyone computes
        it (decode-first admission). Returns the hit in blocks, or None (nothing reserved) when
        the pool (or the adapter slots) cannot take it now. The request is the engine's but not
        the scheduler's until `fill` or `fallback`."""
        if req.lora_name and not self.scheduler.lora_fits(req.lora_name):
            return None
        if hits is None:
            hits = self.match_prefix(req)
        new = self.kv.allocate_slots(req.request_id, req.num_tokens, hits)
        if new is None:
            return None
        self.requests[req.request_id] = req
        req.lifecycle.blocks_allocated += len(new)
        if not migrated:     # a moved decode's prompt was counted where it was admitted
            req.lifecycle.cached_tokens = len(hits) * self.cfg.block_size
            self.stats.prompt_tokens += len(req.prompt_token_ids)
            self.stats.reused_tokens += req.lifecycle.cached_tokens
        return len(hits)

    def fill(self, req: Request, dest_block_ids: Sequence[int], pages: torch.Tensor | None,
             first_token: int, sampler_state: bytes | None = None) -> StepOutput:
        """Decode side: write the transferred pages into the reserved request's blocks (the
        caller has checked it still owns them), add the first token (sampled by the prefill
        worker, whose generator state goes on here) and let it decode."""
        assert req.status is RequestStatus.WAITING and req.request_id in self.requests
        if pages is not None:
            self.runner.write_pages(list(dest_block_ids), pages)
        if sampler_state is not None:
            g = torch.Generator()
            g.set_state(torch.frombuffer(bytearray(sampler_state), dtype=torch.uint8))
            req.generator = g
        now = time.perf_counter()
        req.num_computed_tokens = req.num_tokens
        req.append_token(first_token, now)
        self.kv.cache_computed(req.request_id, req.namespace_root, req.block_hashes,
                               req.all_token_ids, req.num_computed_tokens)
        req.status = RequestStatus.RUNNING
        self.scheduler.running.append(req)
        reason = self._stop_reason(req)
        if reason:
            self._finish(req, reason, now)
        return StepOutput(req, [first_token], reason is not None)

    def fallback(self, req: Request) -> None:
        """Decode side: give up on the transfer and prefill the reserved request here."""
        assert req.status is RequestStatus.WAITING and req not in self.scheduler.waiting
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        self.scheduler.add(req)

    def release(self, request_id: str) -> None:
        """Free the blocks a handoff holds outside the scheduler: a prefill request finished
        with `hold_kv`, or a reservation given up (its cached blocks stay cached)."""
        req = self.requests.get(request_id)
        if req is not None and req.status is RequestStatus.WAITING:
            self._finish(req, "abort", time.perf_counter())
        self.frozen.discard(request_id)
        self.kv.free(request_id)

    def read_pages(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A private copy of these blocks' pages (for staging)."""
        return self.runner.read_pages(list(block_ids))

    @staticmethod
    def sampler_state(req: Request) -> bytes | None:
        """The request's seeded generator state (None: greedy or unseeded)."""
        g = req.generator
        return None if g is None else bytes(g.get_state().numpy().tobytes())

    def generate(self, prompts: Iterable, sampling: SamplingParams | None = None,
                 **kw) -> list[Request]:
        reqs = [self.add_request(p, sampling, **kw) for p in prompts]
        while self.has_unfinished():
            self.step()
        return reqs

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks, in order (empty when it holds none)."""
        return self.kv.block_table(request_id)

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

    # ---- introspection -----------------------------------------------------------------------
    @property
    def stalled(self) -> bool:
        """The last step could schedule nothing: blocks are held by reservations or leases."""
        return self.scheduler.stalled

    def waiting_requests(self) -> tuple[Request, ...]:
        return tuple(self.scheduler.waiting)

    def running_requests(self) -> tuple[Request, ...]:
        return tuple(self.scheduler.running)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now (free + evictable cached)."""
        return self.kv.pool.num_free_blocks

    def pool_counts(self) -> dict[str, int]:
        """The block ledger: free, cached (unreferenced), referenced, total."""
        return self.kv.pool.counts()

    def pool_usage(self) -> tuple[int, int, int, int]:
        """(used, cached, free, total) blocks of the pool, as a load report gives them."""
        pool = self.kv.pool
        return pool.num_used_blocks, pool.num_cached_blocks, pool.num_free_blocks, \
            pool.num_blocks

    def block_holders(self) -> dict[str, str]:
        """Requests that reference blocks now: request id -> "<blocks> blocks, <state>"."""
        state = {r.request_id: "waiting" for r in self.scheduler.waiting}
        state.update({r.request_id: "running" for r in self.scheduler.running})
        return {rid: f"{len(blocks)} blocks, {state.get(rid, 'not scheduled')}"
                for rid, blocks in self.kv.req_blocks.items() if blocks}

    def take_kv_events(self) -> list:
        return self.kv.pool.take_events()

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

    def lora_load_s_total(self) -> float:
        """Seconds spent loading adapters into slots so far (they load inside a step)."""
        lora = self.runner.lora
        return lora.stats.load_s_total if lora is not None else 0.0

    def lora_load_report(self) -> dict:
        """What the router's adapter affinity looks at: adapters resident, mean load time."""
        lora = self.runner.lora
        if lora is None:
            return {"loras_resident": (), "lora_load_s": 0.0}
        st = lora.stats
        return {"loras_resident": tuple(lora.resident),
                "lora_load_s": st.load_s_total / st.loads if st.loads else 0.0}

    def check_invariants(self) -> None:
        self.kv.pool.check_invariants()
