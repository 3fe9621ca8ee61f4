"""API keys: who a request comes from, what it may do (scopes), and which tenant it runs as.

Keys file (config `server.api_keys_file`, YAML):

    keys:
      - key: sk-acme-1          # the bearer token
        tenant: acme            # its requests run in this cache namespace; no other
        scopes: [inference]     # inference: /v1/* and gRPC; admin: /admin/*, /api/stats, /metrics
        rate_limit_rps: 20      # optional: requests per second (burst: the same number)

A single `server.api_key` (or $RAYPD_API_KEY) is one key with both scopes and no tenant of its
own (a request may name its tenant). Tokens are compared in constant time against every key.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ingress.errors import IngressError

SCOPES = ("inference", "admin")
BEARER = {"WWW-Authenticate": "Bearer"}


@dataclass
class RateLimit:
    """A token bucket: `rps` per second, bursts of up to `rps` (at least 1)."""

    rps: float
    _tokens: float = field(default=0.0, init=False)
    _at: float = field(default_factory=time.monotonic, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self._tokens = max(1.0, self.rps)

    def take(self) -> float:
        """0 when allowed, else the seconds until a request would be."""
        with self._lock:
            now = time.monotonic()
            burst = max(1.0, self.rps)
            self._tokens = min(burst, self._tokens + (now - self._at) * self.rps)
            self._at = now
            if self._tokens >= 1:
                self._tokens -= 1
                return 0.0
            return (1 - self._tokens) / self.rps


@dataclass
class Principal:
    """The holder of one key."""

    key_id: str                       # names the key in logs and labels (never the key)
    tenant: str | None                # None: the request names its tenant
    scopes: frozenset[str]
    rate_limit: RateLimit | None = None


ANONYMOUS = Principal("anonymous", None, frozenset(SCOPES))


class KeyRing:
    def __init__(self, keys: dict[str, Principal]) -> None:
        self._digests = [(hashlib.sha256(k.encode()).digest(), p) for k, p in keys.items()]

    def __len__(self) -> int:
        return len(self._digests)

    @classmethod
    def single(cls, key: str) -> KeyRing:
        return cls({key: Principal("api_key", None, frozenset(SCOPES))})

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        """Read a keys file; ValueError naming the file and the entry."""
        where = str(path)
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ValueError(f"{where}: cannot read the API keys file: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{where}: not valid YAML: {e}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("keys"), list):
            raise ValueError(f"{where}: must be a mapping with a list `keys`")
        keys: dict[str, Principal] = {}
        for i, k in enumerate(raw["keys"]):
            at = f"{where}: keys[{i}]"
            if not isinstance(k, dict):
                raise ValueError(f"{at}: must be a mapping with key, tenant, scopes")
            unknown = sorted(set(k) - {"key", "tenant", "scopes", "rate_limit_rps", "name"})
            if unknown:
                raise ValueError(f"{at}.{unknown[0]}: unknown field (valid: key, name, tenant, "
                                 f"scopes, rate_limit_rps)")
            key = k.get("key")
            if not isinstance(key, str) or len(key) < 8:
                raise ValueError(f"{at}.key: must be a string of at least 8 characters")
            if key in keys:
                raise ValueError(f"{at}.key: the same key is listed twice")
            tenant = k.get("tenant")
            if tenant is not None and (not isinstance(tenant, str) or not tenant.isprintable()):
                raise ValueError(f"{at}.tenant: must be a string")
            scopes = k.get("scopes", ["inference"])
            if not isinstance(scopes, list) or not scopes or \
                    any(s not in SCOPES for s in scopes):
                raise ValueError(f"{at}.scopes: must be a non-empty list of "
                                 f"{' and/or '.join(SCOPES)}, got {scopes!r}")
            rps = k.get("rate_limit_rps")
            if rps is not None and (isinstance(rps, bool) or not isinstance(rps, int | float)
                                    or not rps > 0):
                raise ValueError(f"{at}.rate_limit_rps: must be a number > 0, got {rps!r}")
            name = k.get("name") or f"key-{i}"
            keys[key] = Principal(str(name), tenant, frozenset(scopes),
                                  RateLimit(float(rps)) if rps else None)
        if not keys:
            raise ValueError(f"{where}: keys: lists no key")
        return cls(keys)

    def find(self, token: str) -> Principal | None:
        """The key's holder; every key is compared (constant time in which one matches)."""
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for d, p in self._digests:
            if hmac.compare_digest(d, digest):
                found = p
        return found


def authenticate(ring: KeyRing | None, authorization: str | None, scope: str) -> Principal:
    """The principal of an `Authorization: Bearer KEY` value, allowed `scope`; IngressError
    401 / 403 / 429 (rate limit) otherwise. No ring: everyone is ANONYMOUS."""
    if ring is None:
        return ANONYMOUS
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise IngressError(401, "missing bearer token: send 'Authorization: Bearer <api key>'",
                           code="invalid_api_key", headers=BEARER)
    p = ring.find(token.strip())
    if p is None:
        raise IngressError(401, "incorrect API key", code="invalid_api_key", headers=BEARER)
    if scope not in p.scopes:
        raise IngressError(403, f"this API key lacks the {scope!r} scope",
                           code="insufficient_scope")
    if p.rate_limit is not None:
        wait = p.rate_limit.take()
        if wait:
            raise IngressError(429, f"rate limit of API key {p.key_id!r} exceeded "
                               f"({p.rate_limit.rps:g} requests/s)", code="rate_limited",
                               retry_after_s=wait)
    return p


def tenant_of(p: Principal, asked: str) -> str:
    """The cache namespace a request runs in: its key's tenant (a request may repeat it, never
    name another), or what it asks when the key has none."""
    if p.tenant is None:
        return asked
    if asked and asked != p.tenant:
        raise IngressError(403, f"tenant: this API key belongs to tenant {p.tenant!r}; it "
                           f"cannot use tenant {asked!r}", param="tenant",
                           code="tenant_mismatch")
    return p.tenant
