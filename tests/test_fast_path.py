"""The fast path (scheduler/store/routes.py): a job whose runner is resident with a free slot
goes from its client straight to the device's queue, with placement's checks made in one
script. Against a real Redis (database 1) and a real placement service, then end to end on
the real stack."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import redis

from api_client import Client
from api_client.job import Job
from scheduler.cluster import DeviceInfo
from scheduler.errors import InvalidRequest
from scheduler.local.embedded import EmbeddedRedis
from scheduler.placement.service import PlacementService
from scheduler.protocol import JobRequest, Placement
from scheduler.settings import Settings
from scheduler.store import keys
from scheduler.store.celery_app import run_message
from scheduler.store.routes import FastPath, shape
from scheduler.store.scripts import script
from tests.conftest import placement_on_db1, wait_for

GIB = 1 << 30
DEVICE = "vgpu:fp:0"
pytestmark = pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")


@pytest.fixture()
def service(
    redis_server: EmbeddedRedis, db: redis.Redis, models_dir: Path, tmp_path: Path
) -> Iterator[PlacementService]:
    device = DeviceInfo(DEVICE, "fp", "w@fp", "v", "vgpu", 4 * GIB, 4 * GIB, True)
    with placement_on_db1(redis_server, db, models_dir, tmp_path / "state", device) as service:
        yield service


def fast_send(service: PlacementService, db: redis.Redis, req: JobRequest) -> Placement | None:
    fast = FastPath(db, device_ttl_s=60, claim_ttl_s=60, stream_ttl_s=60)

    message = partial(run_message, service.app, req)

    return fast.send(req, message)


def placed_first(service: PlacementService, db: redis.Redis, ready: bool = True) -> str:
    """Place one job the normal way (its runner is created); returns the runner's id."""
    first = JobRequest(model="tiny", prompt="first", options={"num_parallel": 2})
    assert "device" in service.place(first.model_dump(mode="json"))
    runner_id = next(iter(db.smembers(keys.RUNNERS))).decode()
    if ready:
        db.hset(keys.runner(runner_id), "state", "ready")
    db.delete(keys.device_queue(DEVICE))  # no worker here: drop the first job's message
    return runner_id


def test_a_job_for_a_ready_runner_with_a_free_slot_is_sent_at_once_as_placement_would(
    service: PlacementService, db: redis.Redis
) -> None:
    runner_id = placed_first(service, db)
    demand = float(db.hget(keys.DEMAND, "tiny").split(b":")[0])
    req = JobRequest(model="tiny", prompt="second", options={"num_parallel": 2})
    placement = fast_send(service, db, req)
    assert placement is not None and placement.runner_id == runner_id
    # counted for the eviction order as placement counts a job, in the same step, with
    # the client's hops
    assert float(db.hget(keys.DEMAND, "tiny").split(b":")[0]) > demand + 0.99
    hops = {k.decode(): float(v) for k, v in db.hgetall(keys.job_hops(req.id)).items()}
    assert hops["submitted"] == req.submitted_at and hops["sent"] >= req.submitted_at
    assert 0 < db.ttl(keys.job_hops(req.id)) <= 60
    assert db.hget(keys.runner(runner_id), "in_flight") == b"2"
    record = json.loads(db.hget(keys.inflight(DEVICE), req.id))
    assert record["placement"]["id"] == placement.id and record["worker"] == "w@fp"
    assert db.hget(keys.job_custody(req.id), "holder") == placement.id.encode()
    assert db.get(keys.job_placed(req.id)) == f"fast:{placement.id}".encode()
    assert db.exists(keys.job_submitted(req.id))
    # the queue holds a Celery message of the run task, as send_job would have pushed
    [raw] = db.lrange(keys.device_queue(DEVICE), 0, -1)
    message = json.loads(raw)
    assert message["headers"]["task"] == keys.TASK_RUN and message["headers"]["id"] == req.id
    args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
    assert args[0]["id"] == req.id and args[1]["runner_id"] == runner_id and kwargs == {}
    # its slot was the last one: the next job goes through placement
    third = JobRequest(model="tiny", prompt="third", options={"num_parallel": 2})
    assert fast_send(service, db, third) is None
    assert not db.exists(keys.job_submitted(third.id), keys.job_placed(third.id))


def test_the_same_attempt_run_again_after_a_lost_reply_is_sent_once(
    service: PlacementService, db: redis.Redis
) -> None:
    """redis-py sends a script again when its reply was lost: the second run of the same
    attempt answers "sent" (not "id taken", which would fail a submit whose job runs), and
    changes nothing."""
    runner_id = placed_first(service, db)
    req = JobRequest(model="tiny", prompt="second", options={"num_parallel": 2})
    fast = FastPath(db, device_ttl_s=60, claim_ttl_s=60, stream_ttl_s=60)
    name = shape(req)
    assert name is not None
    raw = fast.route(name)
    assert raw is not None

    message = partial(run_message, service.app, req)

    attempt = fast.attempt(req, name, raw, message, [])
    assert attempt is not None
    run = script(db, "fast_send")
    assert [run(keys=attempt.keys, args=attempt.args) for _ in range(2)] == [1, 1]
    assert db.hget(keys.runner(runner_id), "in_flight") == b"2"  # the first job's and this
    assert db.llen(keys.device_queue(DEVICE)) == 1
    # another attempt for the same id (with a slot free for it) is refused, as before
    db.hincrby(keys.runner(runner_id), "in_flight", -1)
    other = fast.attempt(req, name, raw, message, [])
    assert other is not None
    assert run(keys=other.keys, args=other.args) == -1


@pytest.mark.parametrize("obstacle", ["loading", "parked", "queued", "silent", "gone"])
def test_the_fast_path_steps_aside_and_writes_nothing_when_placement_must_decide(
    service: PlacementService, db: redis.Redis, obstacle: str
) -> None:
    runner_id = placed_first(service, db, ready=obstacle != "loading")
    if obstacle == "parked":  # a job waits: a new one must not overtake it
        service.parked.park(JobRequest(model="other", prompt="waits"), score=1.0)
    elif obstacle == "queued":
        db.lpush(keys.placement_queue("batch"), b"a submission placement has yet to take")
    elif obstacle == "silent":
        db.zadd(keys.HEARTBEATS, {DEVICE: 1.0})
    elif obstacle == "gone":
        db.delete(keys.runner(runner_id))
    before = db.hget(keys.runner(runner_id), "in_flight")
    req = JobRequest(model="tiny", prompt="second", options={"num_parallel": 2})
    assert fast_send(service, db, req) is None
    assert db.hget(keys.runner(runner_id), "in_flight") == before
    assert not db.hexists(keys.inflight(DEVICE), req.id)
    assert db.llen(keys.device_queue(DEVICE)) == 0
    assert not db.exists(keys.job_submitted(req.id), keys.job_placed(req.id), keys.job_hops(req.id))
    shape_key = keys.route(str(shape(req)))
    assert bool(db.exists(shape_key)) == (obstacle != "gone")  # a dead runner's route goes


def test_a_route_that_does_not_parse_sends_jobs_through_placement_until_it_is_rewritten(
    service: PlacementService, db: redis.Redis
) -> None:
    placed_first(service, db)
    req = JobRequest(model="tiny", prompt="second", options={"num_parallel": 2})
    db.set(keys.route(str(shape(req))), b"\xff not a route")
    assert fast_send(service, db, req) is None
    assert not db.exists(keys.job_submitted(req.id), keys.job_placed(req.id))
    assert "device" in service.place(req.model_dump(mode="json"))  # placement's way...
    assert db.get(keys.route(str(shape(req)))).startswith(b"{")  # ...writes it afresh


def test_a_taken_job_id_is_refused_on_the_fast_path_too(
    service: PlacementService, db: redis.Redis
) -> None:
    placed_first(service, db)
    req = JobRequest(model="tiny", prompt="second", options={"num_parallel": 2})
    db.set(keys.job_submitted(req.id), 1.0)
    with pytest.raises(InvalidRequest, match="already taken"):
        fast_send(service, db, req)
    # its claim lapsed while Redis knows its job (a custody record): taken still, and a
    # client's mistake, not a move the custody table refused
    db.delete(keys.job_submitted(req.id))
    db.hset(keys.job_custody(req.id), mapping={"state": "done", "holder": "p0"})
    with pytest.raises(InvalidRequest, match="already taken"):
        fast_send(service, db, req)
    assert not db.exists(keys.CUSTODY_REFUSED, keys.job_submitted(req.id))


def test_only_jobs_placement_alone_may_place_have_no_shape() -> None:
    assert shape(JobRequest(model="m", prompt="hi")) == "m|generate|0|0"
    assert shape(JobRequest(model="m", kind="chat", messages=[{"role": "user", "content": "x"}]))
    for special in (
        {"prompt": ""},  # a load or an unload
        {"prompt": "hi", "device": "cpu:h"},
        {"prompt": "hi", "options": {"num_gpu": 0}},
        {"prompt": "hi", "attempt": 1},
        {"prompt": "hi", "avoid": ["gpu:h:0"]},
    ):
        assert shape(JobRequest(model="m", **special)) is None


def test_a_resident_model_serves_through_the_fast_path_end_to_end(
    client: Client, settings: Settings
) -> None:
    client.generate("tiny", "warm up", options={"num_predict": 2})  # loads, publishes a route
    job = client.submit("tiny", "hello", options={"num_predict": 4, "temperature": 0})
    text = "".join(chunk.response for chunk in job.stream() if not chunk.done)
    assert text == job.result().response and job.result().eval_count == 4
    assert client.r.get(keys.job_placed(job.id)).startswith(b"fast:")
    hops = job.hops()
    # no placement hop: the client sent it; then the worker's hops, in path order
    assert "placement_received" not in hops
    assert list(hops) == [
        "submitted",
        "sent",
        "worker_received",
        "admitted",
        "first_token",
        "first_chunk_written",
        "first_chunk_read",
    ]
    times = list(hops.values())
    assert all(a <= b + 0.05 for a, b in zip(times, times[1:], strict=False))
    off = Client(client.redis_url, settings=settings.model_copy(update={"fast_path": False}))
    with off:
        slow = off.submit("tiny", "hello", options={"num_predict": 2})
        slow.result()
        assert not off.r.get(keys.job_placed(slow.id)).startswith(b"fast:")
        # placement notes its hops after it sends: a quick job can end before they land
        assert wait_for(lambda: "placement_received" in slow.hops())
    with pytest.raises(InvalidRequest, match="already taken"):
        client.submit("tiny", "again", extra={"id": job.id})
    # the normal path's claim of an id, sent again by redis-py after a lost reply, finds
    # the id claimed by this very request: its own, not taken
    again = client.request("tiny", "", options={"num_predict": 2})  # a load: placement's
    client.r.set(keys.job_submitted(again.id), again.submitted_at)
    client.send_to_placement(again)
    assert Job(client, again).result().done_reason == "load"
