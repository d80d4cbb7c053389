"""``ggufq fsck``: the invariants of the cluster's state, checked against a live Redis.

:func:`read` takes one atomic look (lua/census.lua) at every place a job, a runner or a
reservation lives; :func:`problems` is pure and says what is wrong with it:

- always: each job is in one state (scheduler/custody.py) and its in-flight record names
  the holder its custody record names; no device reserves memory for a runner that is
  gone, and each runner's reservations are its sizes; no runner sits on a device that is
  gone; each in-flight record's placement is in its runner's jobs (else the runner would
  be unloaded mid-job), and the runner's in_flight is their number; each device has a beat to be
  judged by, each job sent and not started a deadline for the lost-send look, and each
  placement a runner counts without a record a deadline for the recount (else a lost
  message, or a count with no job, would never be found: scheduler/store/due.py);
- once settled (``settled=True``: nothing was submitted and everything ended): no job is
  left anywhere, and no runner counts a job.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import redis

from scheduler.custody import Evidence, JobState, state_of
from scheduler.protocol import SentJob
from scheduler.store import keys
from scheduler.store.records import text
from scheduler.store.scripts import script


@dataclass(frozen=True)
class Problem:
    subject: str  # "job <id>", "runner <id>", "device <id>"
    what: str

    def __str__(self) -> str:
        return f"{self.subject}: {self.what}"


@dataclass
class Runner:
    id: str
    model: str
    in_flight: int
    devices: dict[str, int]  # bytes per device, as its record says
    jobs: frozenset[str] = frozenset()  # the placements it counts (its job set)


@dataclass
class Census:
    """Everything fsck reads, at one moment."""

    devices: set[str] = field(default_factory=set)
    reservations: dict[str, dict[str, int]] = field(default_factory=dict)  # device → runner
    runners: dict[str, Runner] = field(default_factory=dict)
    sent: dict[str, dict[str, SentJob | None]] = field(default_factory=dict)  # device → job
    holders: dict[str, str | None] = field(default_factory=dict)  # sent job → its holder
    running: set[str] = field(default_factory=set)
    parked: set[str] = field(default_factory=set)
    parked_records: set[str] = field(default_factory=set)
    parked_indexed: set[str] = field(default_factory=set)  # in their model's index
    orphans: set[str] = field(default_factory=set)
    held: dict[str, list[str]] = field(default_factory=dict)  # job → placement processes
    beating: set[str] = field(default_factory=set)  # devices in ggufq:heartbeats
    due_sent: set[str] = field(default_factory=set)  # "<job>|<placement>|<device>"
    due_counted: set[str] = field(default_factory=set)  # "<runner>|<placement>"
    # the custody records of the jobs not ended (job → its recorded state; "" when the
    # record is gone), and the moves the custody table refused ("<from> -> <to>" → n; "...
    # on the stream instance <address>" for a final chunk refused on a stream's own Redis)
    custody: dict[str, str] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    unread: dict[str, str] = field(default_factory=dict)  # stream instance → why not read
    owed: set[str] = field(default_factory=set)  # jobs whose final chunk a stream is owed

    @cached_property
    def sent_to(self) -> dict[str, tuple[str, ...]]:
        """Job → the devices whose in-flight records name it."""
        found: dict[str, list[str]] = {}
        for device_id, records in sorted(self.sent.items()):
            for job_id in records:
                found.setdefault(job_id, []).append(device_id)
        return {job_id: tuple(devices) for job_id, devices in found.items()}

    def job_ids(self) -> set[str]:
        """Every job found anywhere but the parked index."""
        return self.parked | self.orphans | set(self.held) | set(self.sent_to) | self.running

    def evidence(self, job_id: str) -> Evidence:
        """Where ``job_id`` was found, for custody's :func:`state_of`."""
        return Evidence(
            parked=job_id in self.parked,
            orphaned=job_id in self.orphans,
            held_by=tuple(sorted(self.held.get(job_id, []))),
            sent_to=self.sent_to.get(job_id, ()),
            running=job_id in self.running,
        )


def read(client: redis.Redis, streams: Mapping[str, redis.Redis] | None = None) -> Census:
    """One atomic look at the cluster's state (lua/census.lua: one round trip), then the
    moves refused on each stream instance of GGUFQ_STREAM_REDIS_URLS (``streams``, by
    address), whose own records a job's final chunk moves (lua/_ends.lua)."""
    reply = script(client, "census")()
    (devices, running, parked, orphans, held, recorded, runners, per_device, holders, indexed) = (
        reply[:10]
    )
    beating, due_sent, due_counted, custody, refused, owed = reply[10:]
    census = Census(
        devices={text(d) for d in devices},
        running={text(j) for j in running},
        parked={text(j) for j in parked},
        parked_records={text(j) for j in recorded},
        orphans={text(j) for j in orphans},
        parked_indexed={text(j) for j in indexed},
        beating={text(d) for d in beating},
        due_sent={text(m) for m in due_sent},
        due_counted={text(m) for m in due_counted},
        custody={text(j): text(s) for j, s in _pairs(custody)},
        refused={text(m): int(n) for m, n in _pairs(refused)},
        owed={text(j) for j in owed},
    )
    for key in held:  # "<placement>|<job id>": the entries themselves carry whole jobs
        holder, _, job_id = text(key).rpartition("|")
        census.held.setdefault(job_id, []).append(holder)
    for runner_id, model, in_flight, sizes, jobs in runners:
        record: dict[str, Any] = json.loads(sizes)
        census.runners[text(runner_id)] = Runner(
            text(runner_id),
            text(model),
            int(in_flight),
            {d: int(n) for d, n in record.items()},
            frozenset(text(p) for p in jobs),
        )
    for device_id, resv, sent in per_device:
        device = text(device_id)
        census.reservations[device] = {text(r): int(n) for r, n in _pairs(resv)}
        census.sent[device] = {text(j): SentJob.parse(raw) for j, raw in _pairs(sent)}
    census.holders = {text(j): text(h) or None for j, h in _pairs(holders)}
    for where, stream in (streams or {}).items():
        try:
            refused = stream.hgetall(keys.CUSTODY_REFUSED)
        except redis.RedisError as exc:  # the control Redis's findings stand
            census.unread[where] = str(exc.__cause__ or exc)  # not the control's advice
            continue
        for move, count in refused.items():
            census.refused[f"{text(move)} on the stream instance {where}"] = int(count)
    return census


def _pairs(flat: list[Any]) -> list[tuple[Any, Any]]:
    return list(zip(flat[::2], flat[1::2], strict=True))


def problems(census: Census, settled: bool = False) -> list[Problem]:
    """What is wrong with the cluster's state (empty: nothing)."""
    found = _jobs(census) + _custody(census) + _reservations(census) + _runners(census)
    found += _deadlines(census)
    if settled:
        found += _left(census)
    return found


def _jobs(census: Census) -> list[Problem]:
    found = []
    for device_id, records in sorted(census.sent.items()):
        for job_id, record in sorted(records.items()):
            subject = f"job {job_id}"
            if record is None:
                found.append(Problem(subject, f"its in-flight record on {device_id} is unreadable"))
            elif census.holders.get(job_id) not in (record.placement.id, None):
                holder = census.holders.get(job_id)
                found.append(
                    Problem(
                        subject,
                        f"in flight on {device_id} as placement {record.placement.id}, but its "
                        f"custody record names {holder}",
                    )
                )
    ids = census.job_ids()
    for job_id in sorted(ids):
        evidence = census.evidence(job_id)
        _state, wrong = state_of(evidence)
        found += [Problem(f"job {job_id}", what) for what in wrong]
        if evidence.parked and job_id not in census.parked_records:
            found.append(Problem(f"job {job_id}", "parked without its record"))
        if evidence.parked != (job_id in census.parked_indexed):
            where = "missing from" if evidence.parked else "left in"
            found.append(Problem(f"job {job_id}", f"{where} its model's index of parked jobs"))
    for job_id in sorted(census.parked_indexed - ids):
        found.append(Problem(f"job {job_id}", "left in its model's index of parked jobs"))
    return found


def _custody(census: Census) -> list[Problem]:
    """Each job's custody record says the state its keys show; a job not ended is
    somewhere; every move was one the table allows."""
    found = []
    for job_id in sorted(census.job_ids() | set(census.custody)):
        evidence = census.evidence(job_id)
        state, _wrong = state_of(evidence)
        recorded = census.custody.get(job_id)
        if recorded is None:
            # not live: ended (or never recorded); a hold is let go of by its holder
            if state is not None and not (state is JobState.PLACING and evidence.held_by):
                found.append(Problem(f"job {job_id}", f"{state.value} with no live record"))
        elif state is None:
            found.append(Problem(f"job {job_id}", f"recorded {recorded or '?'}, found nowhere"))
        elif recorded != state.value:
            found.append(Problem(f"job {job_id}", f"recorded {recorded}, found {state.value}"))
    for move, n in sorted(census.refused.items()):
        found.append(Problem("custody", f"refused {n} moves {move}, which its table denies"))
    for where, why in sorted(census.unread.items()):
        found.append(
            Problem(
                "custody",
                f"the stream instance {where} of GGUFQ_STREAM_REDIS_URLS could not be read: {why}",
            )
        )
    return found


def _reservations(census: Census) -> list[Problem]:
    found = []
    for device_id, resv in sorted(census.reservations.items()):
        for runner_id, size in sorted(resv.items()):
            runner = census.runners.get(runner_id)
            if runner is None:
                found.append(
                    Problem(
                        f"device {device_id}",
                        f"reserves {size} bytes for runner {runner_id}, which is gone",
                    )
                )
            elif runner.devices.get(device_id) != size:
                found.append(
                    Problem(
                        f"device {device_id}",
                        f"reserves {size} bytes for runner "
                        f"{runner_id}, whose record says "
                        f"{runner.devices.get(device_id)}",
                    )
                )
    return found


def _runners(census: Census) -> list[Problem]:
    found = []
    named: dict[str, set[str]] = {}  # runner → the placements in-flight records give it
    for records in census.sent.values():
        for r in records.values():
            if r is not None:
                named.setdefault(r.placement.runner_id, set()).add(r.placement.id)
    for runner in sorted(census.runners.values(), key=lambda r: r.id):
        subject = f"runner {runner.id} ({runner.model})"
        for device_id, size in sorted(runner.devices.items()):
            if device_id not in census.devices:
                found.append(Problem(subject, f"holds {size} bytes on {device_id}, which is gone"))
            elif census.reservations.get(device_id, {}).get(runner.id) != size:
                found.append(Problem(subject, f"its {size} bytes on {device_id} are not reserved"))
        uncounted = named.get(runner.id, set()) - runner.jobs
        if uncounted:
            found.append(
                Problem(
                    subject,
                    f"does not count placements {', '.join(sorted(uncounted))}, which "
                    "in-flight records give it (it would unload mid-job)",
                )
            )
        if runner.in_flight != len(runner.jobs):
            found.append(
                Problem(
                    subject,
                    f"counts {runner.in_flight} jobs in flight, but its job set holds "
                    f"{len(runner.jobs)}",
                )
            )
    return found


def _deadlines(census: Census) -> list[Problem]:
    """What no liveness look would ever find: a device with no beat, a job sent with no
    deadline for its start, a count with no record and no deadline."""
    found = [
        Problem(f"device {d}", "has no beat in ggufq:heartbeats (it would never be reaped)")
        for d in sorted(census.devices - census.beating)
    ]
    recorded: set[str] = set()
    for device_id, records in sorted(census.sent.items()):
        for job_id, record in sorted(records.items()):
            if record is None:
                continue
            recorded.add(record.placement.id)
            due = f"{job_id}|{record.placement.id}|{device_id}"
            if job_id not in census.running and due not in census.due_sent:
                found.append(
                    Problem(
                        f"job {job_id}",
                        f"sent to {device_id} and not started, with no deadline (a lost "
                        "message would never be sent again)",
                    )
                )
    for runner in sorted(census.runners.values(), key=lambda r: r.id):
        for placement in sorted(runner.jobs - recorded):
            if f"{runner.id}|{placement}" not in census.due_counted:
                found.append(
                    Problem(
                        f"runner {runner.id} ({runner.model})",
                        f"counts placement {placement}, which no in-flight record names, "
                        "with no deadline (it would stay busy for good)",
                    )
                )
    return found


def _left(census: Census) -> list[Problem]:
    """What a settled cluster still holds."""
    found = []
    places = {
        "parked": census.parked,
        "among the orphans": census.orphans,
        "held by placement": set(census.held),
        "running": census.running,
        "in flight": set(census.sent_to),
    }
    for where, ids in places.items():
        found += [Problem(f"job {j}", f"still {where} once settled") for j in sorted(ids)]
    for job_id, state in sorted(census.custody.items()):
        found.append(Problem(f"job {job_id}", f"recorded {state or '?'} once settled"))
    for job_id in sorted(census.owed):
        found.append(
            Problem(f"job {job_id}", "owes its stream's Redis its final chunk once settled")
        )
    for runner in sorted(census.runners.values(), key=lambda r: r.id):
        if runner.in_flight:
            found.append(
                Problem(
                    f"runner {runner.id} ({runner.model})",
                    f"counts {runner.in_flight} jobs in flight once settled",
                )
            )
    return found
