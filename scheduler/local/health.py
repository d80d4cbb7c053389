"""Health checks for containers: ``python -m scheduler.local.health worker|placement``.

Exit 0 when one of this host's devices is registered as placement reads it (in the device set,
its record heartbeating within the device TTL), or when some placement service heartbeats;
exit 1 with the reason otherwise.
"""

from __future__ import annotations

import sys
from typing import cast

import redis

from scheduler.settings import get_settings
from scheduler.store import keys
from scheduler.store.clock import redis_now
from scheduler.store.connection import connect_typed, resolve_redis_url


def check(role: str) -> str | None:
    """None when healthy, else what is wrong."""
    settings = get_settings()
    client = connect_typed(resolve_redis_url(settings), socket_timeout=5)
    try:
        since = redis_now(client) - settings.device_ttl_s
        if role == "placement":
            return _placement_problem(client, since)
        return _worker_problem(client, since, settings.host_id)
    except redis.RedisError as exc:
        return f"Redis: {exc}"
    finally:
        client.close()


def _placement_problem(client: redis.Redis, since: float) -> str | None:
    beats = cast(list[bytes], client.zrangebyscore(keys.PLACEMENT_ALIVE, since, "+inf"))
    alive = [n.decode() for n in beats]
    if not alive:
        return "no placement service heartbeats"
    raw = cast(dict[bytes, bytes], client.hgetall(keys.PLACEMENT_FAILING))
    failing = {k.decode(): v.decode() for k, v in raw.items()}
    if all(name in failing for name in alive):
        return "every placement service has a failing loop: " + "; ".join(failing.values())
    return None


def _worker_problem(client: redis.Redis, since: float, host_id: str) -> str | None:
    ids = [d.decode() for d in cast(set[bytes], client.smembers(keys.DEVICES))]
    mine = [d for d in ids if d.split(":")[1] == host_id]
    records = [
        cast(list[bytes | None], client.hmget(keys.device(d), ["heartbeat", "failing"]))
        for d in mine
    ]
    fresh = [failing or b"" for beat, failing in records if beat and float(beat) >= since]
    if not fresh:
        return f"no device of host {host_id!r} is registered and heartbeating"
    if all(fresh):
        return f"the worker of host {host_id!r} has a failing loop: {fresh[0].decode()}"
    return None


def main() -> None:
    role = sys.argv[1] if len(sys.argv) > 1 else "worker"
    problem = check(role)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
