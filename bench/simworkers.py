"""Simulated workers for bench/control_plane.py: one process that speaks the worker's
protocol for many virtual devices without llama.cpp (issue 38).

Each host beats for its devices (heartbeat.lua) and takes its devices' Celery messages off
their queues (BRPOP, one connection a host, as a worker's consumer does). Each job marks
its runner ready on its first job (as after a load), starts (start.lua), writes its tokens
at a set rate as a worker's writer does (a chunk every 0.1 s, append.lua, on the stream's
own Redis with GGUFQ_STREAM_REDIS_URLS, claimed first), ends (end.lua) and stores its
Celery result. What they counted (jobs ended, the longest gap between a
host's beats, devices found reaped) is in ``ggufq:bench:workers`` for the bench to read.
"""

from __future__ import annotations

import base64
import heapq
import json
import signal
import threading
import time
from typing import Any

import redis

from scheduler.cluster import DeviceInfo
from scheduler.protocol import JobRequest, Placement
from scheduler.settings import Settings
from scheduler.store import keys
from scheduler.store.celery_app import close_app, make_app
from scheduler.store.scripts import execute
from scheduler.store.shards import stream_shards
from scheduler.store.streams import queue_chunk
from scheduler.store.worker_state import WorkerState

CHUNK_S = 0.1  # a worker's writer batches a job's tokens this long
HB_S, TTL_S = 1.0, 10.0  # the bench's placement processes run with these
TALLY = "ggufq:bench:workers"  # the simulated workers' counts, for the bench to read


class Workers:
    """Every host's worker, played: beats, takes, and runs jobs on a clock of events."""

    def __init__(self, url: str, args: Any, size: int) -> None:
        settings = Settings(redis_url=url)  # its stream TTL, and the Celery app's
        self.url, self.settings, self.stop = url, settings, threading.Event()
        self.tokens, self.token_rate = args.tokens, args.token_rate
        hosts, per_host = args.hosts, args.devices
        self.r = redis.Redis.from_url(url)
        # the jobs' streams: here, or on GGUFQ_STREAM_REDIS_URLS (--stream-instances)
        self.streams = stream_shards(self.r, settings.stream_redis_urls, redis.Redis.from_url)
        self.state = WorkerState(self.r, self.streams)
        self.app = make_app(url, settings)
        self.hosts = {
            f"h{h:03d}": [f"vgpu:h{h:03d}:{d}" for d in range(per_host)] for h in range(hosts)
        }
        self.size = size
        for host, devices in self.hosts.items():
            for device_id in devices:
                info = DeviceInfo(device_id, host, f"w@{host}", "v", "vgpu", size, size, True)
                self.state.register_device(info)
        self.ready: set[str] = set()
        self.events: list[tuple[float, int, Any]] = []  # (when, n, step)
        self.n = 0
        self.lock = threading.Condition()
        self.reaped = 0
        self.beat_gap_s = 0.0
        self.threads = [threading.Thread(target=self._beats, daemon=True)]
        self.threads += [threading.Thread(target=self._run, daemon=True) for _ in range(2)]
        self.threads += [
            threading.Thread(target=self._take, args=(h,), daemon=True) for h in self.hosts
        ]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def close(self) -> None:
        self.stop.set()
        with self.lock:
            self.lock.notify_all()
        for thread in self.threads:
            thread.join(timeout=5)
        close_app(self.app)
        for client in self.streams.others:
            client.close()
        self.r.close()

    def _beats(self) -> None:
        last = {h: time.monotonic() for h in self.hosts}
        while not self.stop.wait(HB_S):
            for host, devices in self.hosts.items():
                gone = self.state.heartbeat({d: self.size for d in devices}, "", TTL_S / 3)
                now = time.monotonic()
                self.beat_gap_s, last[host] = max(self.beat_gap_s, now - last[host]), now
                self.reaped += len(gone)
            self.r.hset(TALLY, mapping={"beat_gap_s": self.beat_gap_s, "reaped": self.reaped})

    def _take(self, host: str) -> None:
        r = redis.Redis.from_url(self.url)
        queues = [
            keys.device_queue(d, p) for d in self.hosts[host] for p in ("interactive", "batch")
        ]
        while not self.stop.is_set():
            got = r.brpop(queues, timeout=1)
            if got is not None:
                body = json.loads(base64.b64decode(json.loads(got[1])["body"]))
                req, placement = JobRequest(**body[0][0]), Placement(**body[0][1])
                self._at(time.monotonic(), lambda q=req, p=placement: self._begin(q, p))
        r.close()

    def _at(self, when: float, step: Any) -> None:
        with self.lock:
            self.n += 1
            heapq.heappush(self.events, (when, self.n, step))
            self.lock.notify()

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                while not self.stop.is_set() and (
                    not self.events or self.events[0][0] > time.monotonic()
                ):
                    wait = self.events[0][0] - time.monotonic() if self.events else 1.0
                    self.lock.wait(max(0.0, min(wait, 1.0)))
                if self.stop.is_set():
                    return
                _when, _n, step = heapq.heappop(self.events)
            step()

    def _begin(self, req: JobRequest, placement: Placement) -> None:
        if placement.runner_id not in self.ready:
            self.state.update_runner(placement.runner_id, {"state": "ready", "worker": "w"})
            self.ready.add(placement.runner_id)
        now = time.time()
        if self.state.start(placement.device_id, req.id, placement.id, req.id, now) is None:
            return
        self.state.claim_stream(req.id, placement.id)
        chunks = max(1, round(self.tokens / self.token_rate / CHUNK_S))
        started = time.monotonic()
        for n in range(1, chunks + 1):
            write = (req, placement, n, n == chunks)
            self._at(started + n * CHUNK_S, lambda w=write: self._write(*w))

    def _write(self, req: JobRequest, placement: Placement, seq: int, last: bool) -> None:
        ttl = self.settings.stream_ttl_s
        pipe = self.streams.of(req.id).pipeline(transaction=False)
        queue_chunk(pipe, req.id, seq, {"response": "x" * 8, "done": False}, ttl, placement.id)
        execute(pipe)
        if not last:
            return
        final = {"done": True, "response": "", "eval_count": self.tokens}
        self.state.end(placement, req.id, (seq + 1, final), time.time(), None, ttl)
        self.app.backend.store_result(req.id, final, "SUCCESS")
        self.r.hincrby(TALLY, "ended", 1)  # the bench's own count: one command a job


def play(args: Any) -> None:
    """The simulated workers' process: until SIGTERM."""
    url, size = args.as_workers
    work = Workers(url, args, int(size))
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    work.start()
    done.wait()
    work.close()
