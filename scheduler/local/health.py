"""Health checks for containers: ``python -m scheduler.local.health worker|placement``.

Exit 0 when this host's worker devices (or some placement service) heartbeat within the
device TTL; exit 1 with the reason otherwise. One Redis round trip.
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
        beats = cast(list[bytes], client.zrangebyscore(keys.HEARTBEATS, since, "+inf"))
        mine = [b for b in beats if b.decode().split(":")[1] == settings.host_id]
        return None if mine else f"no device of host {settings.host_id!r} heartbeats"
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
