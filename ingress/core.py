"""The ingress core that HTTP and gRPC share: one validated request type, its sub-requests with
server-assigned ids, capacity (sub-requests in flight, then 429), keys and tenants.

A request is refused (400/401/403/404/429) before anything reaches the backend: a refusal costs
no engine work, and `n` is bounded before any sub-request is built.
"""

from __future__ import annotations

import ipaddress
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ingress.auth import ANONYMOUS, KeyRing, Principal, authenticate, tenant_of
from ingress.backend import Backend
from ingress.errors import IngressError
from ingress.limits import IngressLimits
from ingress.request_checks import ModelLimits, RequestLimits
from protocol.messages import RequestResult, TokenDelta
from protocol.sampling import SamplingParams


@dataclass
class IngressSettings:
    """Everything an ingress is configured with (cluster/serve.py builds it from the config)."""

    model_name: str = "raypd"
    max_inflight: int = 256
    limits: IngressLimits = field(default_factory=IngressLimits)
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    model: ModelLimits = field(default_factory=ModelLimits)
    keys: KeyRing | None = None            # None: no key checks (admin from loopback only)
    protect_metrics: bool = True           # /metrics needs an admin key when keys are set
    lora_names: tuple[str, ...] = ()       # LoRA adapters served as their own model ids


@dataclass
class GenerationRequest:
    """One client request, validated: what both ingresses hand to the backend."""

    prompts: list                          # each: str | list[int] | list[dict] (chat messages)
    sampling: SamplingParams
    chat: bool
    n: int = 1
    tenant: str = ""
    lora: str = ""
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    client_request_id: str = ""            # kept as a label, never used as the id
    model: str = ""                        # the model id asked for (base or an adapter)


@dataclass
class SubRequest:
    """One backend request: one prompt, one of the `n` choices."""

    index: int                             # the choice index in the answer
    prompt: Any
    sampling: SamplingParams
    request_id: str                        # server-assigned
    first_of_prompt: bool                  # counts the prompt's tokens in `usage`


class IngressCore:
    def __init__(self, backend: Backend, settings: IngressSettings) -> None:
        self.backend = backend
        self.settings = settings
        self.model_name = settings.model_name
        self.max_inflight = settings.max_inflight
        self._inflight = 0
        self.peak_inflight = 0
        self._lock = threading.Lock()
        self.on_inflight = lambda n: None   # set by the metrics owner

    # ---- capacity (HTTP and gRPC together) ----
    def acquire(self, n: int) -> None:
        if n > self.max_inflight:
            raise IngressError(400, f"this request needs {n} concurrent sequences (prompts x "
                               f"n); the server runs at most {self.max_inflight}", param="n")
        with self._lock:
            if self._inflight + n > self.max_inflight:
                raise IngressError(429, f"server over capacity: {self._inflight} requests in "
                                   f"flight (max {self.max_inflight}); retry later",
                                   code="over_capacity", retry_after_s=1)
            self._inflight += n
            self.peak_inflight = max(self.peak_inflight, self._inflight)
            self.on_inflight(self._inflight)

    def release(self, n: int) -> None:
        with self._lock:
            self._inflight -= n
            assert self._inflight >= 0, self._inflight
            self.on_inflight(self._inflight)

    @property
    def inflight(self) -> int:
        return self._inflight

    # ---- who asks ----
    def authorize(self, authorization: str | None, scope: str, client_host: str | None = None
                  ) -> Principal:
        """The caller's principal for `scope`. Without keys, admin routes answer loopback
        clients only."""
        keys = self.settings.keys
        if keys is None:
            if scope == "admin" and not _is_loopback(client_host):
                raise IngressError(403, "admin routes without API keys answer local clients "
                                   "only; configure server.api_keys_file or server.api_key",
                                   code="admin_local_only")
            return ANONYMOUS
        return authenticate(keys, authorization, scope)

    def check_model(self, name: str | None) -> None:
        """A 404 naming the served models unless `name` is one of them; None (not asked) is the
        base model. An empty name is a name that no model has (as an unknown one is)."""
        loras = self.settings.lora_names
        if name is not None and name != self.model_name and name not in loras:
            served = ", ".join(repr(m) for m in (self.model_name, *loras))
            raise IngressError(404, f"the model {name!r} does not exist; this server serves "
                               f"{served}", param="model", code="model_not_found")

    def lora_of(self, model: str | None, lora: str) -> str:
        """The LoRA adapter a request runs under: `model` when it names one, else the `lora`
        field (an alias); "" for the base model. An unknown adapter is a 404."""
        loras = self.settings.lora_names
        if model and model in loras:
            return model
        if lora and lora not in loras:
            raise IngressError(404, f"the LoRA adapter {lora!r} does not exist; this server "
                               f"serves: {', '.join(loras) or 'none'}", param="lora",
                               code="model_not_found")
        return lora

    @staticmethod
    def tenant(principal: Principal, asked: str) -> str:
        return tenant_of(principal, asked)

    # ---- sub-requests ----
    def sub_requests(self, req: GenerationRequest, prefix: str) -> tuple[str, list[SubRequest]]:
        """(the answer's id, one SubRequest per prompt x choice); ids are the server's."""
        base = f"{prefix}-{uuid.uuid4().hex[:24]}"
        total = len(req.prompts) * req.n
        self.acquire_check(total)
        subs = []
        for i, prompt in enumerate(req.prompts):
            for j in range(req.n):
                sp = req.sampling
                if sp.seed is not None and j:
                    sp = SamplingParams(**{**sp.__dict__, "seed": _wrap64(sp.seed + j)})
                k = i * req.n + j
                subs.append(SubRequest(k, prompt, sp, base if total == 1 else f"{base}-{k}",
                                       first_of_prompt=(j == 0)))
        return base, subs

    # ---- the backend ----
    async def run(self, sub: SubRequest, tenant: str, lora: str,
                  on_delta: Callable[[TokenDelta], None] | None = None) -> RequestResult:
        """Run one sub-request. A chat prompt travels as its message list: the router applies
        the chat template to it."""
        return await self.backend.run_request_async(
            sub.prompt, sub.sampling, chat=False, tenant=tenant, lora_id=lora,
            request_id=sub.request_id, on_delta=on_delta)

    def abort(self, request_id: str) -> bool:
        """Release a sub-request everywhere; False when it already ended or is unknown."""
        try:
            return bool(self.backend.abort(request_id))
        except Exception:   # noqa: BLE001 - it ended meanwhile, or the backend is going away
            return False

    def acquire_check(self, n: int) -> None:
        if n > self.max_inflight:
            raise IngressError(400, f"this request needs {n} concurrent sequences (prompts x "
                               f"n); the server runs at most {self.max_inflight}", param="n")


def _wrap64(x: int) -> int:
    """Seed + choice index, kept inside int64."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
