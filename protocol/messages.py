"""The P/D handoff protocol: every message that crosses the router/worker boundary for one request.

Torch-free and Ray-free plain data, imported by the router and by both worker roles. One request:

    router -> D   admit(RequestInput)              -> Admission (AdmittedRequest + TransferPlan)
    router -> P   prefill(AdmittedRequest, plan)   -> PrefillResult (first token, sampler state,
                                                      staged handle, per-page checksums)
    router -> D   land(PrefillResult)              -> D pulls, verifies and decodes; the tokens
                                                      come back on D's one delta stream
    D -> router   deltas()  (one per D, all requests) -> StepDeltas: RequestDelta... (tokens,
                                                      text; RequestDone at the end)

A running decode moves D1 -> D2 by the same rules (live migration: drain, KV pressure):

    router -> D1  freeze(worker request id)        -> FrozenDecode (D1 stops decoding it between
                                                      two steps and keeps its blocks)
    router -> D2  admit_migration(MigratedRequest) -> Admission (reserves prompt + output so far,
                                                      plans the blocks D2 lacks; next epoch)
    router -> D1  stage_migration(id, plan)        -> PrefillResult (the last sampled token as
                                                      "first token", sampler state, checksums)
    router -> D2  land(PrefillResult)              -> D2 replays the output so far on its stream
                                                      (the router forwards only what the client
                                                      lacks) and decodes on

The request is tokenized, validated and hashed once (by D at admission); the AdmittedRequest
travels from then on. D computes the TransferPlan (which of the prompt's blocks P sends into
which of D's reserved blocks); P executes exactly that plan. Each PrefillResult names the
request id, the attempt epoch and the plan's digest; D refuses (TransferRejected) anything
whose epoch, digest or checksums do not match the reservation it holds now.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from kvcache.events import KVEvent
from kvcache.manager import cdiv
from protocol.lifecycle import RequestLifecycle
from protocol.request_trace import PrefillTiming
from protocol.sampling import SamplingParams
from protocol.step_rates import DecodeFit, PrefillFit

# What a client asks to complete: text, token ids, or chat messages ({"role", "content"} each).
ChatMessage = dict[str, str]
Prompt = str | tuple[int, ...] | list[int] | list[ChatMessage]


@dataclass(frozen=True)
class TransferHandle:
    """What the consumer needs to pull one staged transfer. Small and picklable.

    ``address`` is transport specific (grpc: "host:port", shm and cuda_ipc: file path);
    ``object_ref`` is set by the object_store transport only, ``export`` (how to map the staged
    memory: kvtransfer.cuda_ipc.SharedPages) by cuda_ipc only. ``checksum`` is None when the
    producer did not compute one.
    """

    transfer_id: str
    request_id: str
    transport: str
    producer_id: str
    node_id: str
    block_hashes: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    nbytes: int
    checksum: int | None = None
    checksum_algo: str | None = None
    lease_s: float = 0.0  # set by KVProducer.offer: how long the producer keeps the pages
    address: str = ""
    object_ref: Any = None
    export: Any = None

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


def worker_request_id(request_id: str, epoch: int) -> str:
    """The id workers know one attempt by: a surviving worker may still be releasing the
    previous attempt's state under the old id."""
    return request_id if epoch == 0 else f"{request_id}~{epoch}"


@dataclass(frozen=True)
class RequestInput:
    """A request as the client sent it, before anyone tokenized it."""

    request_id: str
    prompt: Prompt
    sampling: SamplingParams
    deadline: float                   # wall clock (time.time()) by which it must have ended
    epoch: int = 0
    chat: bool = False
    tenant: str = ""
    lora_id: str = ""

    @property
    def worker_request_id(self) -> str:
        return worker_request_id(self.request_id, self.epoch)


@dataclass(frozen=True)
class AdmittedRequest:
    """The request as admitted: tokenized, validated and hashed once (by the admitting D).

    `block_hashes` are the chained hashes of the prompt's full blocks under the request's
    cache namespace, whose root is `namespace_root`; a worker whose own root differs (another
    model revision, tokenizer, dtype, tenant or adapter) must refuse the request."""

    request_id: str
    epoch: int
    prompt_token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    block_size: int
    namespace_root: int
    sampling: SamplingParams
    deadline: float
    tenant: str = ""
    lora_id: str = ""

    @property
    def worker_request_id(self) -> str:
        return worker_request_id(self.request_id, self.epoch)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prompt_blocks(self) -> int:
        return cdiv(len(self.prompt_token_ids), self.block_size)


@dataclass(frozen=True)
class TransferPlan:
    """Which blocks travel: the prompt's blocks [first_block, first_block + num_blocks) go into
    D's reserved blocks `dest_block_ids`, in order. Computed once, by D; P sends exactly this.

    `block_hashes` name each sent block (0 for a trailing partial block)."""

    request_id: str
    epoch: int
    decode_worker: str
    first_block: int
    dest_block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.dest_block_ids) == len(self.block_hashes) > 0, self
        assert len(set(self.dest_block_ids)) == len(self.dest_block_ids), self

    @property
    def num_blocks(self) -> int:
        return len(self.dest_block_ids)

    @property
    def digest(self) -> str:
        """Ties a transfer to this exact plan: D lands pages only under the digest it made."""
        text = (f"{self.request_id}|{self.epoch}|{self.decode_worker}|{self.first_block}|"
                f"{self.dest_block_ids}|{self.block_hashes}")
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Admission:
    """D's answer to admit: reserved (with the plan P must execute), prefilled locally, or
    refused for now (no room: the router tries another decode worker or waits)."""

    request: AdmittedRequest
    decode_worker: str
    admitted: bool
    local: bool = False               # D prefills it itself (short uncached part / no P)
    decode_cached_blocks: int = 0     # D's own prefix hit, in blocks (not transferred)
    plan: TransferPlan | None = None  # set when admitted and not local
    reserved_blocks: int = 0          # blocks D holds for it (hit + new), ledger RESERVED
    free_blocks: int = 0


@dataclass(frozen=True)
class PrefillResult:
    """P's result: the first token, the sampler state after drawing it (seeded sampling goes on
    on D exactly where P stopped), and the staged pages of the plan under a lease."""

    request_id: str
    epoch: int
    plan_digest: str
    first_token: int
    handle: TransferHandle | None     # the staged pages (None: nothing to send)
    page_checksums: tuple[int, ...]   # one per staged block, as P read it (crc32 of CPU
                                      # pages, wsum64 of GPU ones: workers/kv_handoff.py)
    staged_at: float                  # wall clock when the lease started
    lease_s: float
    prefill_worker: str
    sampler_state: bytes | None = None
    cached_tokens: int = 0            # P's prefix hit
    computed_tokens: int = 0
    ttft_s: float | None = None
    timing: PrefillTiming | None = None   # P's own stage durations, for the request's trace

    @property
    def worker_request_id(self) -> str:
        return worker_request_id(self.request_id, self.epoch)


@dataclass(frozen=True)
class FrozenDecode:
    """A running decode that its worker (D1) stopped between two engine steps so that it can
    move to another decode worker: what D2 needs to go on exactly where D1 stopped.

    Invariant: D1 computed the KV of every token but the last output token (prompt +
    output_token_ids[:-1]); it keeps the blocks until it stages them (stage_migration) or the
    request is aborted. The sampler state travels with the staged pages (PrefillResult). `since_*` are D1's clocks at `frozen_at` (wall clock), so D2 keeps the
    request's TTFT and TPOT measured from the request's own start."""

    worker_request_id: str
    output_token_ids: tuple[int, ...]
    lifecycle: RequestLifecycle
    since_arrival_s: float
    since_first_token_s: float
    frozen_at: float

    def __post_init__(self) -> None:
        assert self.output_token_ids, "only a decode with an output token can move"


@dataclass(frozen=True)
class MigratedRequest:
    """What D2 admits for a live migration: the request as admitted, under the next epoch, and
    the frozen decode it continues (from `source_worker`)."""

    admitted: AdmittedRequest
    source_worker: str
    frozen: FrozenDecode

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV D1 holds (the last output token is still to compute)."""
        return self.admitted.num_tokens + len(self.frozen.output_token_ids) - 1


@dataclass(frozen=True)
class TokenDelta:
    """What the client gets next: output tokens and their text (the router's detokenizer:
    text may come a token later than its token, and a stop string's tokens are cut)."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class RequestDone:
    """The last item of a stream; `lifecycle` is None when the request was aborted. Token ids
    only: the router does the text work."""

    token_ids: tuple[int, ...] = ()
    lifecycle: RequestLifecycle | None = None


@dataclass(frozen=True)
class RequestDelta:
    """What one request got in one engine step of a decode worker: its new token ids (no text:
    the router detokenizes); with `done`, the request ended (its RequestDone; lifecycle None: it was aborted);
    with `error`, the engine step that ran it failed (StepFailed)."""

    worker_request_id: str
    token_ids: tuple[int, ...] = ()
    done: RequestDone | None = None
    error: str | None = None


@dataclass(frozen=True)
class StepDeltas:
    """One message of a decode worker's delta stream (`DecodeHost.deltas`): the deltas of
    every request that got tokens since the last message (one engine step's, or a few when
    the reader was slower than the steps), in order."""

    worker_id: str
    deltas: tuple[RequestDelta, ...]
    report: LoadReport | None = None   # the worker's load report, pushed with the stream
    # (at most one per `report_every_s` the reader asked for: router/streams.py)


@dataclass(frozen=True)
class RequestResult:
    """How a request ended, as the router hands it to the ingress: its text and token ids and
    its lifecycle record; or, from `generate` (many requests at once), the `error` it failed
    with (then `lifecycle` is None)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    lifecycle: RequestLifecycle | None = None
    error: str | None = None


@dataclass(frozen=True)
class HoldRelease:
    """A worker let a handoff hold go (reported so the router's ledger closes it too)."""

    worker_id: str
    kind: str                          # ledger.STAGED | ledger.RESERVED
    request_id: str                    # worker-side id of the attempt
    reason: str


@dataclass(frozen=True)
class KVCounters:
    """A worker's cumulative KV-lifecycle counters since its incarnation started, as of its
    last step (the router's KV timeline turns their increases into rates and markers).

    Invariant: each is monotone within one incarnation; a restarted worker starts from zero."""

    prompt_tokens: int = 0         # prompt tokens of admitted requests (prefix queries)
    reused_tokens: int = 0         # of those, served from the prefix cache
    evictions: int = 0             # cached blocks evicted for room
    preemptions: int = 0           # running requests preempted (their KV freed, recomputed later)
    tier2_demotions: int = 0       # blocks copied into tier 2 on eviction
    tier2_reloads: int = 0         # tier-2 blocks reloaded for a prefix hit
    transfers: int = 0             # KV transfers offered (prefill) or received (decode)
    transfers_rejected: int = 0    # transfers a decode worker refused (checksum, epoch, ...)

    def __post_init__(self) -> None:
        assert all(v >= 0 for v in vars(self).values()), self


@dataclass(frozen=True)
class LoadReport:
    """What a worker reports to the router's policies and prefix index, as of its last step.

    Every speed in it is measured by the worker itself from its own recent steps
    (protocol/step_rates.py): `prefill_fit` from prefill-only steps, `decode_fit` from
    decode-only steps; None until enough steps were seen (never a made-up default)."""

    worker_id: str
    queued_tokens: int = 0
    running_tokens: int = 0
    num_requests: int = 0
    active_blocks: int = 0
    cached_blocks: int = 0
    free_blocks: int = 0               # allocatable now: free + evictable
    evictable_blocks: int = 0          # cached, referenced by no request (in free_blocks too)
    total_blocks: int = 0
    block_size: int = 0                # tokens a block holds
    queued_s: float | None = None      # seconds of prefill work queued + running (by the fit)
    prefill_tokens: int = 0            # prompt tokens still to compute, queued + running (both
                                       # roles: a decode worker's own prefills too)
    prefill_fit: PrefillFit | None = None
    decode_fit: DecodeFit | None = None
    decode_batch: int = 0              # sequences decoding now
    decode_step_s: float = 0.0         # estimated decode step at the current batch (0: none)
    kv_bytes_per_token: int = 0        # of the loaded model (K and V, all layers)
    busy_for_s: float = 0.0            # how long the running engine step has taken so far
    incarnation: str = ""              # changes when the worker actor restarts
    loras_resident: tuple[str, ...] = ()   # LoRA adapters loaded now (routing affinity)
    lora_load_s: float = 0.0           # measured mean adapter load time (0: none loaded yet)
    lora_slots: int = 0                # adapters that fit at once (0: no adapters served)
    kv: KVCounters = field(default_factory=KVCounters)   # cumulative, for the KV timeline
    events: tuple[KVEvent, ...] = ()   # KV events since the last report
    released: tuple[HoldRelease, ...] = field(default=())   # handoff holds let go since then
    reported_at: float = 0.0           # worker clock when the snapshot was taken
    seq: int = 0                       # the worker's count of reports made (polled or pushed):
    # a report with a lower seq than one already applied is older (its load is stale)
    age_s: float = 0.0                 # how old the snapshot was when the report was made
