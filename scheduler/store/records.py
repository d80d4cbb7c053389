"""Redis hashes to typed records: the one place that knows how devices, runners and demand
are stored field by field; and once-only claims (a job's placement, a placement's start,
a parked job or orphan taken out to handle)."""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import Any, Literal, cast

import redis

from scheduler.cluster import DeviceState, DeviceView, RunnerState, RunnerView, decayed
from scheduler.store import keys
from scheduler.store.connection import REDIS_AWAY, again_if_lost

# how long a taken record waits for its taker to ask again: through an outage, too
TAKEN_KEPT_S = 3600
Taken = Literal["orphan", "parked"]


class TakeUnsure(redis.ConnectionError):
    """Redis did not answer a take: the record may be taken under ``token``, and only the
    taker asking again with it once Redis answers gets it back (``HeldJobs.hold_take``)."""

    def __init__(self, what: Taken, job_id: str, token: str, cause: Exception) -> None:
        super().__init__(f"taking {what} job {job_id}: {cause}")
        self.what, self.job_id, self.token = what, job_id, token


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def decoded(h: dict[Any, Any]) -> dict[str, str]:
    """A hash as Redis returns it (bytes) with text keys and values."""
    return {text(k): text(v) for k, v in h.items()}


def device_from_hash(device_id: str, h: dict[str, str], reserved: int) -> DeviceState:
    return DeviceState(
        id=device_id,
        worker=h["worker"],
        queue=h["queue"],
        kind=h["kind"],  # type: ignore[arg-type]
        total=int(h["total"]),
        reported_free=int(h["free"]),
        reserved=reserved,
    )


def runner_from_hash(runner_id: str, h: dict[str, str]) -> RunnerState | None:
    if not h or "model" not in h:
        return None
    return RunnerState(
        id=runner_id,
        model=h["model"],
        config_key=h.get("config_key", ""),
        devices=_devices(h),
        state=h.get("state", "loading"),  # type: ignore[arg-type]
        in_flight=int(h.get("in_flight", 0)),
        expires_at=float(h.get("expires_at", -1)),
        last_used=float(h.get("last_used", 0)),
        num_parallel=int(h.get("num_parallel", 1)),
        n_gpu_layers=int(h.get("n_gpu_layers", -1)),
    )


def device_view(device_id: str, h: dict[str, str], reserved: int) -> DeviceView:
    return DeviceView(
        id=device_id,
        host=h.get("host", ""),
        worker=h.get("worker", ""),
        name=h.get("name", ""),
        kind=h.get("kind", "cpu"),
        total=int(h.get("total", 0)),
        reported_free=int(h.get("free", 0)),
        reserved=reserved,
        virtual=h.get("virtual") == "1",
        uuid=h.get("uuid", ""),
        queue=h.get("queue", ""),
        heartbeat=float(h.get("heartbeat", 0)),
    )


def runner_view(runner_id: str, h: dict[str, str]) -> RunnerView | None:
    if "model" not in h:
        return None
    loaded_at = h.get("loaded_at")
    return RunnerView(
        id=runner_id,
        model=h["model"],
        state=h.get("state", "loading"),
        devices=_devices(h),
        bytes=int(h.get("bytes", 0)),
        size=int(h.get("total_bytes", h.get("bytes", 0))),
        context_length=int(h.get("num_ctx", 0)),
        num_parallel=int(h.get("num_parallel", 1)),
        n_gpu_layers=int(h.get("n_gpu_layers", -1)),
        block_count=int(h.get("block_count", 0)),
        embedding=h.get("embedding") == "1",
        in_flight=int(h.get("in_flight", 0)),
        keep_alive_s=float(h.get("keep_alive_s", 0)),
        expires_at=float(h.get("expires_at", -1)),
        last_used=float(h.get("last_used", 0)),
        loaded_at=None if loaded_at is None else float(loaded_at),
        worker=h.get("worker", ""),
        config_key=h.get("config_key", ""),
    )


def decayed_demand(raw: dict[str, str], now: float) -> dict[str, float]:
    """The demand hash (model → "count:time") as counts decayed to ``now``."""
    demand = {}
    for model, value in raw.items():
        score, last = value.split(":")
        demand[model] = decayed(float(score), float(last), now)
    return demand


def _devices(h: dict[str, str]) -> dict[str, int]:
    return {k: int(v) for k, v in json.loads(h.get("devices", "{}")).items()}


def claim_once(client: redis.Redis, key: str, owner: str, ttl_s: int) -> bool:
    """Claim ``key`` for ``owner`` (an id of one delivery of a message): True when it is
    (now) ``owner``'s, so that a claim tried again after a lost reply is still found ours;
    False when another owner has it."""
    pipe = client.pipeline()  # MULTI: set if free, then read who has it
    pipe.set(key, owner, nx=True, ex=ttl_s)
    pipe.get(key)
    return bool(pipe.execute()[1] == owner.encode())


def take(take_script: Any, what: Taken, job_id: str, token: str = "") -> bytes | None:
    """Take a job's record out of the orphans or the parked queue (``take_script``:
    lua/take.lua) to handle it; None when another taker has it. A reply lost on the way is
    asked for again under the same token, so the record is neither lost with it nor handed
    to two takers; TakeUnsure when Redis does not answer that either. ``token``: a take
    asked again after one."""
    queue = keys.ORPHANS if what == "orphan" else keys.PARKED
    token = token or uuid.uuid4().hex
    try:
        raw = again_if_lost(
            lambda: take_script(
                keys=[queue, keys.parked_job(job_id), keys.taken(what, job_id)],
                args=[job_id, token, TAKEN_KEPT_S, what],
            )
        )
    except REDIS_AWAY as exc:
        raise TakeUnsure(what, job_id, token, exc) from exc
    if raw:  # the answer came: nothing will ask again (kept an hour, were this lost)
        with contextlib.suppress(*REDIS_AWAY):
            take_script.registered_client.delete(keys.taken(what, job_id))
    return cast(bytes, raw) if raw else None
