"""Health checks for containers: ``python -m scheduler.local.health worker|placement``.

Exit 0 when one of this host's devices is registered as placement reads it (in the device set,
its record heartbeating within the device TTL), or when some placement service heartbeats;
exit 1 with the reason otherwise.
"""

from __future__ import annotations

import sys
import time
from typing import cast

import redis

from scheduler.settings import get_settings
from scheduler.store import keys
from scheduler.store.connection import resolve_redis_url


def check(role: str) -> str | None:
    """None when healthy, else what is wrong."""
    settings = get_settings()
    client = redis.Redis.from_url(resolve_redis_url(settings), socket_timeout=5)
    since = time.time() - settings.device_ttl_s
    try:
        if role == "placement":
            alive = client.zcount(keys.PLACEMENT_ALIVE, since, "+inf")
            return None if alive else "no placement service heartbeats"
        ids = [d.decode() for d in cast(set[bytes], client.smembers(keys.DEVICES))]
        mine = [d for d in ids if d.split(":")[1] == settings.host_id]
        beats = [client.hget(keys.device(d), "heartbeat") for d in mine]
        if any(b is not None and float(b) >= since for b in beats):
            return None
        return f"no device of host {settings.host_id!r} is registered and heartbeating"
    except redis.RedisError as exc:
        return f"Redis: {exc}"
    finally:
        client.close()


def main() -> None:
    role = sys.argv[1] if len(sys.argv) > 1 else "worker"
    problem = check(role)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
