"""API keys of the gateway: bearer tokens stored hashed in Redis, with per-key limits.

A key is ``ggufq-<id>-<secret>``; Redis keeps only the SHA-256 of the whole token, so a
leaked Redis dump leaks no usable key. Per key: the models it may use (empty = all), the
most jobs it may have in flight, and requests per minute (fixed one-minute windows); past a
limit the gateway answers 429 with Retry-After. The key's id is the tenant of its jobs, and
its weight their share while jobs of several tenants wait (scheduler/fairness.py).

Every gateway process reads the same Redis, so limits hold across any number of gateways.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import redis
import redis.asyncio

from api_client.gateway.errors import Forbidden, RateLimited, Unauthorized
from scheduler.errors import InvalidRequest
from scheduler.store import keys as names

STALE_IN_FLIGHT_S = 3600.0  # a request that never ended stops counting after this, at worst
GATEWAY_BEAT_S = 5.0  # a gateway process says it is alive this often
GATEWAY_TTL_S = 15  # ... and is taken for dead (its requests in flight too) this long after
PREFIX = "ggufq-"


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str = ""
    models: list[str] = field(default_factory=list)  # empty: every model
    max_in_flight: int = 0  # 0: no limit
    rpm: int = 0  # requests per minute; 0: no limit
    created_at: float = 0.0
    weight: float = 1.0  # its share of the cluster against other keys' while jobs wait
    admin: bool = False  # may unload and pin models, and ask for large contexts
    max_context: int = 0  # num_ctx x num_parallel at most (0: GGUFQ_HTTP_MAX_CONTEXT)
    max_keep_alive_s: float = 0.0  # keep_alive at most (0: GGUFQ_HTTP_MAX_KEEP_ALIVE_S)

    def check_model(self, model: str) -> None:
        if self.models and model not in self.models:
            raise Forbidden(
                f"API key {self.id!r} may not use model {model!r}; it may use: "
                f"{', '.join(self.models)}; ask for a key that includes it"
            )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _signature(secret: str, digest: str, record: str) -> str:
    return hmac.new(secret.encode(), f"{digest}|{record}".encode(), hashlib.sha256).hexdigest()


class KeyStore:
    """Create, list, revoke and check keys in Redis.

    With ``secret`` (GGUFQ_HTTP_KEY_SECRET, held by the gateways and whoever creates keys,
    not by the workers), each record is signed (HMAC-SHA256 over its token's digest and
    its fields) and a record without a valid signature is no key: whoever can write to
    Redis cannot mint one. Without it, records are not signed."""

    def __init__(self, r: redis.Redis, secret: str = "") -> None:
        self.r = r
        self.secret = secret

    def create(
        self,
        name: str = "",
        models: list[str] | None = None,
        max_in_flight: int = 0,
        rpm: int = 0,
        weight: float = 1.0,
        admin: bool = False,
        max_context: int = 0,
        max_keep_alive_s: float = 0.0,
    ) -> tuple[ApiKey, str]:
        """A new key and its token (shown once: only its hash is stored)."""
        if max_in_flight < 0 or rpm < 0 or max_context < 0 or max_keep_alive_s < 0:
            raise InvalidRequest(
                f"limits must be 0 (none) or positive; got max_in_flight={max_in_flight}, "
                f"rpm={rpm}, max_context={max_context}"
            )
        if not 0 < weight <= 1000:
            raise InvalidRequest(f"weight must be above 0 and at most 1000; got {weight}")
        key = ApiKey(
            uuid.uuid4().hex[:12],
            name,
            list(models or []),
            max_in_flight,
            rpm,
            time.time(),
            weight,
            admin,
            max_context,
            max_keep_alive_s,
        )
        token = f"{PREFIX}{key.id}-{secrets.token_urlsafe(32)}"
        digest = _digest(token)
        record = json.dumps(asdict(key), sort_keys=True)
        signed = {"key": record, "mac": _signature(self.secret, digest, record)}
        pipe = self.r.pipeline()
        pipe.set(names.api_key(digest), json.dumps(signed) if self.secret else record)
        pipe.hset(names.API_KEYS, key.id, digest)
        pipe.execute()
        return key, token

    def migrate(self, remove_old: bool = False) -> int:
        """Copy the records of keys made before they had a keyspace of their own (under
        ``ggufq:apikey``, which every role's Redis user may write) into it; the number
        copied. The administrator runs it (``ggufq keys migrate``), once, after upgrading:
        a record a worker could have written is never taken up by itself. With a secret,
        only records it signed are copied; an id or token already in the new keyspace is
        kept. The old records stay for gateways not yet upgraded, unless ``remove_old``."""
        copied = 0
        for key_id, digest in self.r.hgetall(names.OLD_API_KEYS).items():
            key_id, digest = _text(key_id), _text(digest)
            raw = self.r.get(names.old_api_key(digest))
            new = names.api_key(digest)
            taken = self.r.hexists(names.API_KEYS, key_id) or self.r.exists(new)
            if raw is not None and not taken and self._verified(digest, raw) is not None:
                pipe = self.r.pipeline()  # the record and its id together: never one alone
                pipe.set(new, raw)
                pipe.hset(names.API_KEYS, key_id, digest)
                pipe.execute()
                copied += 1
            if remove_old:
                self.r.delete(names.old_api_key(digest))
                self.r.hdel(names.OLD_API_KEYS, key_id)
        return copied

    def list(self) -> list[ApiKey]:
        keys = []
        for digest in self.r.hvals(names.API_KEYS):
            raw = self.r.get(names.api_key(_text(digest)))
            key = self._verified(_text(digest), raw) if raw is not None else None
            if key is not None:
                keys.append(key)
        return sorted(keys, key=lambda k: k.created_at)

    def revoke(self, key_id: str) -> bool:
        """False when there is no such key."""
        digest = self.r.hget(names.API_KEYS, key_id)
        if digest is None:
            return False
        pipe = self.r.pipeline()
        pipe.delete(names.api_key(_text(digest)))
        pipe.hdel(names.API_KEYS, key_id)
        pipe.execute()
        return True

    def lookup(self, token: str) -> ApiKey:
        digest = _digest(token)
        raw = self.r.get(names.api_key(digest)) if token else None
        key = self._verified(digest, raw) if raw is not None else None
        if key is None:
            hint = "send one" if not token else "it is unknown or was revoked"
            raise Unauthorized(
                f"this gateway needs an API key ({hint}): send 'Authorization: Bearer <key>' "
                "(or 'x-api-key: <key>'); `ggufq keys create` makes one"
            )
        return key

    def _verified(self, digest: str, raw: bytes | str) -> ApiKey | None:
        """The key a stored record holds; None when it is not signed with this store's
        secret (when it has one), or does not parse."""
        try:
            stored = json.loads(raw)
            if not self.secret:
                fields = json.loads(stored["key"]) if "mac" in stored else stored
                return ApiKey(**fields)
            expected = _signature(self.secret, digest, stored["key"])
            if not hmac.compare_digest(expected, str(stored["mac"])):
                return None
            return ApiKey(**json.loads(stored["key"]))
        except (ValueError, KeyError, TypeError):
            return None


class Limiter:
    """Per-key requests per minute and jobs in flight, shared by every gateway via Redis.

    A request in flight is a ticket named by its gateway process (``<gateway>:<uuid>``), and
    each gateway process beats (:meth:`beat`): when a key is at its limit, the tickets of
    gateways that stopped beating (killed, or gone in a deploy) are dropped before the
    request is refused, so a dead gateway's requests stop counting within GATEWAY_TTL_S."""

    def __init__(self, r: redis.Redis, gateway_id: str = "") -> None:
        self.r = r
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]

    def beat(self, r: redis.Redis | redis.asyncio.Redis | None = None) -> Any:
        """This gateway process is alive (call every GATEWAY_BEAT_S), through ``r`` (an
        asyncio client's call returns what to await), else this limiter's client."""
        return (r or self.r).set(names.gateway_beat(self.gateway_id), 1, ex=GATEWAY_TTL_S)

    def admit(self, key: ApiKey, now: float) -> str | None:
        """Count one request against the key's limits; the ticket to :meth:`done`, or None
        when in flight is not limited. Raises RateLimited past a limit."""
        if key.rpm:
            self._per_minute(key, now)
        if not key.max_in_flight:
            return None
        ticket = f"{self.gateway_id}:{uuid.uuid4().hex}"
        name = names.api_key_in_flight(key.id)
        pipe = self.r.pipeline()
        pipe.zremrangebyscore(name, "-inf", now - STALE_IN_FLIGHT_S)
        pipe.zadd(name, {ticket: now})
        pipe.zcard(name)
        pipe.expire(name, int(STALE_IN_FLIGHT_S))
        count = pipe.execute()[2]
        try:
            if count > key.max_in_flight:
                count -= self._drop_the_dead(name)
        except Exception:
            with contextlib.suppress(redis.RedisError):  # never a ticket left behind
                self.r.zrem(name, ticket)
            raise
        if count > key.max_in_flight:
            self.r.zrem(name, ticket)
            raise RateLimited(
                f"API key {key.id!r} has {key.max_in_flight} requests in flight, its most; "
                "wait for one to end and try again",
                retry_after_s=1,
            )
        return ticket

    def _drop_the_dead(self, name: str) -> int:
        """Drop the tickets of gateway processes that stopped beating; how many went."""
        tickets = [_text(t) for t in cast(list[bytes], self.r.zrange(name, 0, -1))]
        gateways = sorted({t.split(":", 1)[0] for t in tickets if ":" in t})
        if not gateways:
            return 0
        alive = self.r.mget([names.gateway_beat(g) for g in gateways])
        dead = {g for g, beat in zip(gateways, alive, strict=True) if beat is None}
        gone = [t for t in tickets if t.split(":", 1)[0] in dead]
        return int(self.r.zrem(name, *gone)) if gone else 0

    def done(self, key: ApiKey, ticket: str | None) -> None:
        if ticket is not None:
            self.r.zrem(names.api_key_in_flight(key.id), ticket)

    def _per_minute(self, key: ApiKey, now: float) -> None:
        minute = int(now // 60)
        name = names.api_key_minute(key.id, minute)
        pipe = self.r.pipeline()
        pipe.incr(name)
        pipe.expire(name, 120)
        count = pipe.execute()[0]
        if count > key.rpm:
            retry = max(1, int((minute + 1) * 60 - now + 0.999))
            raise RateLimited(
                f"API key {key.id!r} made more than {key.rpm} requests this minute, its most; "
                f"try again in {retry} s",
                retry_after_s=retry,
            )


def bearer_token(header: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header ("" when absent)."""
    if not header:
        return ""
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
