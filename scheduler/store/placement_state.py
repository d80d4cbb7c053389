"""What placement reads and writes in Redis: the snapshot, reservations, the jobs it sends to
devices, dead devices and their orphaned jobs, demand, its own liveness."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from scheduler.cluster import DEMAND_TAU_S, Snapshot
from scheduler.protocol import SentJob
from scheduler.store import keys
from scheduler.store.cancel import cancelled_by, watch_keys
from scheduler.store.connection import again_if_lost
from scheduler.store.due import DueSend
from scheduler.store.hands import Hands
from scheduler.store.records import (
    decayed_demand,
    decoded,
    device_from_hash,
    runner_from_hash,
    text,
)
from scheduler.store.scripts import flatten, queue, script
from scheduler.store.streams import fence_stream, progress


@dataclass(frozen=True)
class Pruned:
    """What :meth:`PlacementState.prune` found and did to a runner's job set."""

    unaccounted: set[str]  # placements no in-flight record names now
    forgotten: set[str]  # of them, those the last look saw too: no longer counted
    released: bool = False  # a runner still loading left with no job: gone


@dataclass(frozen=True)
class Claim:
    """A submission's claim: whether this delivery is the first, and whether the job was
    already asked to cancel (read with it)."""

    first: bool
    cancelled: bool


class PlacementState:
    def __init__(self, client: redis.Redis, hands: Hands | None = None) -> None:
        self.r = client
        self.hands = hands or Hands(client)  # the jobs this placement process handles
        self.streams = self.hands.streams  # where the jobs' streams live
        self._reserve = script(client, "reserve")
        self._assign = script(client, "assign")
        self._reap = script(client, "reap")
        self._demand = script(client, "demand")
        self._unsend = script(client, "unsend")
        self._resend = script(client, "resend")
        self._prune = script(client, "prune")
        self._beat = script(client, "placement_beat")
        self._held_epoch = script(client, "held_epoch")

    def snapshot(self, now: float, device_ttl_s: float) -> Snapshot:
        """Every live device and runner, read afresh (the snapshot cache is the fast path)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.smembers(keys.DEVICES)
        pipe.smembers(keys.RUNNERS)
        pipe.zcard(keys.PARKED)
        pipe.hgetall(keys.DEMAND)
        device_ids, runner_ids, parked, demand_raw = pipe.execute()
        device_ids = sorted(text(d) for d in device_ids)
        runner_ids = sorted(text(r) for r in runner_ids)
        pipe = self.r.pipeline(transaction=False)
        for device_id in device_ids:
            pipe.hgetall(keys.device(device_id))
            pipe.hvals(keys.reservations(device_id))
        for runner_id in runner_ids:
            pipe.hgetall(keys.runner(runner_id))
        replies = pipe.execute()
        devices = []
        for i, device_id in enumerate(device_ids):
            h = decoded(replies[2 * i])
            if h and now - float(h.get("heartbeat", 0)) <= device_ttl_s:
                reserved = sum(int(v) for v in replies[2 * i + 1])
                devices.append(device_from_hash(device_id, h, reserved))
        alive = {d.id for d in devices}
        runners = []
        for runner_id, raw in zip(runner_ids, replies[2 * len(device_ids) :], strict=True):
            record = runner_from_hash(runner_id, decoded(raw))
            if record is not None and set(record.devices) <= alive:
                runners.append(record)
        demand = decayed_demand(decoded(demand_raw), now)
        return Snapshot(devices=devices, runners=runners, parked=int(parked), demand=demand)

    # -- runners ---------------------------------------------------------------------------
    def reserve(
        self,
        runner_id: str,
        placement_id: str,
        reservations: dict[str, int],
        fields: dict[str, Any],
        now: float,
        device_ttl_s: float,
    ) -> bool:
        """Create the runner (one job assigned: ``placement_id``) and reserve its memory on
        every device it spans, all or nothing.

        False when a device can no longer hold its part (another placer won the race).
        """
        device_ids = list(reservations)
        record = dict(fields, device_ids=",".join(device_ids), devices=json.dumps(reservations))
        # in_flight: reserve.lua counts the job it is made for
        record.update(state="loading", last_used=now, expires_at=-1)
        device_keys = []
        for device_id in device_ids:
            device_keys += [keys.device(device_id), keys.reservations(device_id)]
        ok, _free = again_if_lost(  # the runner id is new: a second call finds its first
            lambda: self._reserve(
                keys=[keys.RUNNERS, keys.runner(runner_id), *device_keys],
                args=[
                    runner_id,
                    placement_id,
                    device_ttl_s,
                    len(device_ids),
                    *reservations.values(),
                    *flatten(record),
                ],
            )
        )
        return bool(ok)

    def assign(self, runner_id: str, placement_id: str, now: float) -> bool:
        """One more job (``placement_id`` into its job set) for a loading or ready runner;
        False if it is unloading or gone."""
        return bool(self._assign(keys=[keys.runner(runner_id)], args=[now, placement_id]))

    def place_once(self, job_id: str, delivery: str, ttl_s: int, record: str) -> Claim:
        """Claim a submitted job's placement for ``delivery`` (an id of this delivery of its
        message, so that a claim tried again after a lost reply is still found ours) and
        hold it in hand, its parked ``record`` ready (:class:`Hands`); not ``first`` when
        another delivery has it (the broker hands an unacknowledged message out again after
        its visibility timeout, and a reader sends a lost one again). Whether the job was
        asked to cancel is read in the same round trip."""
        first, watched = self.hands.claim(job_id, delivery, ttl_s, record, watch_keys(job_id))
        return Claim(first, cancelled_by(*watched))

    def count_request(self, model: str, now: float, pipe: Any = None) -> None:
        """One more request for ``model`` (queued on ``pipe`` when given)."""
        if pipe is None:
            self._demand(keys=[keys.DEMAND], args=[model, now, DEMAND_TAU_S])
        else:  # by its hash: run the pipeline with scripts.execute
            queue(pipe, self._demand, [keys.DEMAND], [model, now, DEMAND_TAU_S])

    # -- devices ---------------------------------------------------------------------------
    def reap(self, device_ttl_s: float) -> list[str]:
        """Drop devices silent for ``device_ttl_s`` on Redis's clock, with their runners and
        reservations; their jobs become orphans. Returns the dropped devices."""
        return reap(self._reap, device_ttl_s)

    # -- jobs sent to devices ----------------------------------------------------------------
    def sent(self, record: SentJob, queue: str, message: str) -> bool:
        """Send a job to its device: its record and its Celery ``message`` on ``queue`` in
        one step, which lets go of it (:meth:`Hands.sent`). If the device is dropped,
        placement finds the job among the orphans. The job's custody record names this
        placement as its holder, so that a worker that stalled and came back knows it was
        re-placed. False when the job was swept from this process (it had stalled)."""
        return self.hands.sent(record, queue, message)

    def unsend(self, record: SentJob) -> bool:
        """Undo the commit before :meth:`sent` for a job that was not sent (swept from this
        process, or its send step failed): its runner forgets it, and a runner created for
        it goes. False, and nothing undone, when the job was sent after all (the step ran
        and its reply was lost: its custody record's holder is this placement)."""
        placement, created = record.placement, bool(record.placement.device_ids)
        held = [keys.reservations(d) for d in placement.device_ids] if created else []
        undone = again_if_lost(  # the runner's job set forgets the placement once
            lambda: self._unsend(
                keys=[
                    keys.inflight(placement.device_id),
                    keys.RUNNERS,
                    keys.runner(placement.runner_id),
                    *held,
                ],
                args=[record.job.id, placement.runner_id, int(created), placement.id],
            )
        )
        return bool(undone)

    def undone(self, record: SentJob) -> bool:
        """:meth:`unsend` after a send step that raised: False when the job was sent after
        all; True when the commit was undone, or Redis did not answer (then the recount
        takes the commit back if the job was not sent)."""
        try:
            return self.unsend(record)
        except redis.RedisError:
            return True

    def resend(self, record: SentJob, moved: SentJob, queue: str, message: str) -> bool:
        """Put ``moved`` (the same job under a new placement id: its epoch raised) in place
        of ``record``, a send whose message was lost, and its ``message`` on ``queue``, in
        one step (lua/resend.lua): the job's holder, its send deadline and its runner's count
        move to the new id, so that the first message, if it turns up, or a run of it a
        Redis crash forgot, is fenced off. False when the job no longer waits under
        ``record``'s id."""
        job_id, old = record.job.id, record.placement
        if self.streams.sharded and not self._unwritten(job_id):
            return False  # its stream lives apart: a run of it wrote there (or it is away)
        return bool(
            self._resend(
                keys=[
                    keys.inflight(old.device_id),
                    keys.RUNNING,
                    keys.job_chunks(job_id),
                    keys.runner(old.runner_id),
                    queue,
                ],
                args=[
                    job_id,
                    old.id,
                    moved.model_dump_json(),
                    moved.placement.id,
                    old.device_id,
                    message,
                ],
            )
        )

    def prune(self, runner_id: str, seen: set[str], now: float, min_age_s: float) -> Pruned:
        """The placements a runner counts that no in-flight record accounts for, read with
        the records in one step (lua/prune.lua); of them, those also in ``seen`` (the last
        look's) and counted over ``min_age_s`` ago (Redis's clock) are forgotten, and a
        runner still loading left with none is released."""
        unaccounted, forgotten, released = self._prune(
            keys=[keys.runner(runner_id), keys.RUNNERS],
            args=[now, runner_id, min_age_s, *seen],
        )
        return Pruned({text(p) for p in unaccounted}, {text(p) for p in forgotten}, bool(released))

    def announce_recount(self, runner_id: str) -> None:
        """Wake parked jobs: a corrected runner has room."""
        self.r.publish(keys.EVENTS, json.dumps({"event": "runner_recounted", "runner": runner_id}))

    def unstarted(self, records: list[SentJob], sent_before: float) -> list[SentJob]:
        """Of a device's ``records``, the jobs sent before ``sent_before`` whose placement
        no worker thread has claimed to start, nor is running, nor has written a chunk
        (a Redis that crashed loses the last second of writes, start claims with them: a
        job its worker goes on streaming is started all the same, and sent again it
        would run twice into one stream)."""
        records = [r for r in records if r.sent_at < sent_before]
        if not records:
            return []
        pipe = self.r.pipeline(transaction=False)
        for record in records:
            pipe.hget(keys.job_custody(record.job.id), "run")  # its start claim
            pipe.hexists(keys.RUNNING, record.job.id)
            pipe.exists(keys.job_chunks(record.job.id))
        seen = pipe.execute()
        left = [
            r
            for n, r in enumerate(records)
            if not (text(seen[3 * n] or b"") == r.placement.id or any(seen[3 * n + 1 : 3 * n + 3]))
        ]
        if self.streams.sharded:  # its chunks, where streams live apart
            left = [r for r in left if self._unwritten(r.job.id)]
        return left

    def _unwritten(self, job_id: str) -> bool:
        """Whether the job's stream, where it lives apart, holds no chunk (False when its
        Redis does not answer: nothing is sent again on a guess)."""
        try:
            return not self.streams.of(job_id).exists(keys.job_chunks(job_id))
        except redis.RedisError:
            return False

    def fenced_progress(self, job_id: str) -> tuple[int, bool] | None:
        """(chunks the job's stream holds, whether the last is a final one), read as
        placement takes the job (held, lua/take.lua) from its run: where the stream lives
        apart, in the same step as its own record names no holder any more, under the
        epoch of this process's hold (lua/stream_fence.lua), so that the run, should it
        come back, adds nothing after what was read. None when the hold was swept from
        this process (it stalled): the job is another's now."""
        stream = self.streams.of(job_id)
        if not self.streams.sharded:
            return progress(stream, job_id)
        epoch = self._held_epoch(keys=[keys.job_custody(job_id)], args=[self.hands.token(job_id)])
        if epoch is None:
            return None
        return fence_stream(stream, job_id, int(epoch))

    def in_broker(self, sends: list[DueSend]) -> set[DueSend]:
        """Which of ``sends`` have a message waiting in their device's queues (a Celery
        message names its task id in plain JSON); one round trip for all of them. A
        message a worker took is in no record: workers keep none of unacknowledged ones
        (``make_app``'s ``stash_unacked``), and kombu's unacked hash holds placement's own
        messages, which name the job too and must not count as its run's."""
        if not sends:
            return set()
        devices = sorted({d.device_id for d in sends})
        pipe = self.r.pipeline(transaction=False)
        for device_id in devices:
            for priority in ("interactive", "batch"):
                pipe.lrange(keys.device_queue(device_id, priority), 0, -1)
        queues = pipe.execute()
        blobs = {
            device_id: b"\n".join([*queues[2 * n], *queues[2 * n + 1]])
            for n, device_id in enumerate(devices)
        }
        return {due for due in sends if due.job_id.encode() in blobs[due.device_id]}

    def orphans(self) -> list[str]:
        return [text(j) for j in self.r.hkeys(keys.ORPHANS)]

    def claim_orphan(self, job_id: str) -> bytes | None:
        """Take an orphan's record (JSON of a SentJob) to handle it; None when another
        placement process took it."""
        return self.hands.take("orphan", job_id)

    # -- liveness --------------------------------------------------------------------------
    def placement_beat(self, name: str, ttl_s: float, failing: str = "") -> float:
        """This placement service is alive (on Redis's clock, whose time it returns);
        ``failing`` names its loops that keep failing."""
        beat = self._beat(
            keys=[keys.PLACEMENT_ALIVE, keys.PLACEMENT_FAILING], args=[name, ttl_s, failing]
        )
        return float(beat)

    def placement_gone(self, name: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.zrem(keys.PLACEMENT_ALIVE, name)
        pipe.hdel(keys.PLACEMENT_FAILING, name)
        pipe.execute()


# the beat of a device its worker let go of: older than any TTL on Redis's clock
GONE_BEAT = -1e18


def reap(reap_script: Any, device_ttl_s: float) -> list[str]:
    """Drop the devices that have not beaten for ``device_ttl_s`` on Redis's clock."""
    dropped = reap_script(
        keys=[keys.DEVICES, keys.RUNNERS, keys.HEARTBEATS, keys.ORPHANS],
        args=[device_ttl_s],
    )
    return [text(d) for d in dropped]
