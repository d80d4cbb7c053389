"""Chaos: each fault of the fault model (DESIGN.md) injected into a real local stack, counted.

    .venv/bin/python bench/chaos.py [--trials 3] [--faults worker-kill,redis-outage] [--seed 0]

One stack per fault, reused across its trials: Redis, placement, a worker on host h1 (a
2 GiB virtual GPU) and one on h2 (1 GiB, so binpack loads the slow model there first).
Heartbeats every 0.5 s, device TTL 5 s (the tests' settings), reader lease 3 s. Each trial
puts jobs in flight -- A streams on h2, B waits for A's slot, C streams on h1 (pinned), D
was submitted just before the fault -- injects the fault, and counts within a bound
(``--bound-s``): outcomes (completed, failed with a GgufqError, cancelled, hung), jobs run
twice, streams with a gap or a duplicate ``seq``, what leaked once things settle, processes
that died unasked, failing health checks, and the seconds from the fault's end until a new
short job is served (a probe every 0.5 s until one completes). Between trials dead
processes are started again and every runner is unloaded, so each trial starts alike;
every device must then reserve nothing.

Targets: 0 hung, 0 run twice, 0 silent gaps, 0 leaked, 0 invariant violations (`ggufq fsck
--settled` once each trial settled); serving again within 2 heartbeats of
Redis (or a stalled worker) returning, within GGUFQ_DEVICE_TTL_S + 2 heartbeats of a
worker's or placement's death. A benchmark, never a test: it prints a table, then each
failure with its evidence (log lines from the stack's log dir), then one JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from api_client import (  # noqa: E402
    Client,
    GgufqError,
    Job,
    JobCancelled,
    JobLost,
    JobTimeout,
    RedisUnavailable,
)
from api_client.results import result_key, result_ready  # noqa: E402
from scheduler.local.stack import LocalStack  # noqa: E402
from scheduler.protocol import JobRequest  # noqa: E402
from scheduler.settings import Settings  # noqa: E402
from scheduler.store import fsck, keys  # noqa: E402

# The tests' helpers, imported at run time: tests/ is outside what mypy checks (scheduler,
# workers, api_client), so `mypy bench/chaos.py` checks this file and not them.
_conftest = importlib.import_module("tests.conftest")
_tinymodel = importlib.import_module("tests.tinymodel")
stack_env: Callable[..., dict[str, str]] = _conftest.stack_env
settings_from: Callable[[dict[str, str], str | None], Settings] = _conftest.settings_from
wait_for: Callable[..., bool] = _conftest.wait_for
write_slow_model: Callable[[Path], Path] = _tinymodel.write_slow_model
write_tiny_llama: Callable[[Path], Path] = _tinymodel.write_tiny_llama

GPU_ARGS = {"h1": ["--virtual-gpu", "2GiB"], "h2": ["--virtual-gpu", "1GiB"]}
SHORT = {"temperature": 0, "num_predict": 8, "num_ctx": 8192}  # B: A's runner, after A
PROBE = {"temperature": 0, "num_predict": 4}
PROBE_EVERY_S = 0.5
MAX_PROBES = 60
SETTLE_S = 30.0
READER_LEASE_S = 3.0
CLIENT_TOKENS = 6000  # the dying client's job runs well past its lease


def long_options(tokens: int, num_ctx: int = 8192) -> dict[str, Any]:
    return {"temperature": 0, "num_predict": tokens, "num_ctx": num_ctx}


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    serve: str  # "return": 2 heartbeats after the fault ends; "death": TTL + 2 heartbeats;
    # "failover": FAILOVER_SERVE_S after the sentinels promoted a replica


FAULTS = [
    Fault("worker-kill", "worker SIGKILL", "death"),
    Fault("worker-kill-midstream", "worker SIGKILL as A streams: A goes on elsewhere", "death"),
    Fault("worker-stall", "worker SIGSTOP past the TTL, SIGCONT", "return"),
    Fault("worker-restart", "worker SIGKILL, restarted at once (same host)", "death"),
    Fault("placement-kill", "placement SIGKILL, another started", "death"),
    Fault("placement-stall", "placement SIGSTOP past the TTL, another started, SIGCONT", "return"),
    Fault("redis-restart", "Redis restart with its data", "return"),
    Fault("redis-wipe", "Redis restart without data", "return"),
    Fault("redis-outage", "Redis down N s, back on the same port and dir", "return"),
    Fault("client-dies", "client SIGKILLed mid-stream", "return"),
    Fault("malformed", "garbage on queues, non-UTF-8 on channels", "return"),
    Fault("worker-clock", "h2's worker runs with its clock 30 s behind (2 TTLs)", "return"),
    Fault("redis-crash", "Redis SIGKILLed mid-burst (appendfsync everysec), restarted", "return"),
]
# the hosts whose worker runs with its wall clock behind, by fault (tests/clock_offset)
CLOCK_BEHIND_S = {"worker-clock": {"h2": 30}}
BY_NAME = {f.name: f for f in FAULTS}
# What the fault model says becomes of A (streamed when the fault came), B (waited for A's
# slot, nothing streamed) and C (on the other host); any other job, and any job of a fault
# not listed, may end in any defined outcome (completed, failed with an error, cancelled).
# A streamed when its worker died: it goes on elsewhere from its last token (GGUFQ_RESUME_MAX)
_WORKER_DIES = {"A": {"completed"}, "B": {"completed"}, "C": {"completed"}}
_CANCELLED = {"A": {"cancelled"}, "B": {"completed"}, "C": {"completed"}}
EXPECT = {
    "worker-kill": _WORKER_DIES,
    "worker-kill-midstream": _WORKER_DIES,
    "worker-stall": _WORKER_DIES,
    "worker-restart": _WORKER_DIES,
    "placement-kill": {"A": {"completed"}, "B": {"completed"}, "C": {"completed"}},
    "placement-stall": {"A": {"completed"}, "B": {"completed"}, "C": {"completed"}},
    "client-dies": _CANCELLED,
    "malformed": _CANCELLED,  # the bench cancels A after the garbage: the watchers still hear
    "worker-clock": {"A": {"completed"}, "B": {"completed"}, "C": {"completed"}},
}
DEFINED = {"completed", "failed", "cancelled"}


class SetupFailed(Exception):
    """The jobs of a trial could not be put in flight as planned (no fault injected)."""


# -- the stack ------------------------------------------------------------------------------
class Cluster:
    """The stack of one fault: its processes by role, restarted when a fault killed them."""

    def __init__(self, root: Path, models: Path, behind_s: dict[str, int] | None = None) -> None:
        self.root = root
        self.behind_s = behind_s or {}  # host → seconds its worker's clock is behind
        self.env = stack_env(models, root / "state", host="h1")
        # a streaming reader renews a lease; a client killed without a word has its job
        # cancelled once the lease lapses (GGUFQ_READER_LEASE_S, set below)
        self.env["GGUFQ_READER_LEASE_S"] = str(READER_LEASE_S)
        # B must wait behind A at A's runner (one slot): no replica of it elsewhere
        self.env["GGUFQ_MAX_REPLICAS"] = "1"
        self.settings = settings_from(self.env, None)
        self.log_dir = root / "logs"
        self.stack: LocalStack | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.placement: subprocess.Popen[bytes] | None = None
        self.client: Client | None = None
        self.restarts = 0

    @property
    def hb_s(self) -> float:
        return self.settings.heartbeat_interval_s

    @property
    def ttl_s(self) -> float:
        return self.settings.device_ttl_s

    @property
    def st(self) -> LocalStack:
        assert self.stack is not None
        return self.stack

    @property
    def c(self) -> Client:
        assert self.client is not None
        return self.client

    def start(self) -> None:
        self.stack = LocalStack(
            self.settings, worker_args=GPU_ARGS["h1"], log_dir=self.log_dir, extra_env=self.env
        )
        self.stack.start()
        procs = dict(self.stack.procs)
        self.workers["h1"], self.placement = procs["worker"], procs["placement"]
        self.start_worker("h2")
        self.client = Client(self.stack.redis_url, settings=self.settings, timeout=60)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.stack is not None:
            for proc in self.workers.values():  # a stalled worker would not hear SIGTERM
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
            self.stack.stop()

    def start_worker(self, host: str) -> subprocess.Popen[bytes]:
        self.restarts += 1
        name = f"worker-{host}" if host not in self.workers else f"worker-{host}-{self.restarts}"
        env = {"GGUFQ_HOST_ID": host}
        if host in self.behind_s:
            path = [str(ROOT / "tests" / "clock_offset"), os.environ.get("PYTHONPATH", "")]
            env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
            env["GGUFQ_TEST_CLOCK_OFFSET_S"] = str(-self.behind_s[host])
        proc = self.st.add_worker(name, GPU_ARGS[host], env)
        self.workers[host] = proc
        return proc

    def start_placement(self) -> subprocess.Popen[bytes]:
        self.restarts += 1
        argv = [sys.executable, "-m", "scheduler.placement.process"]
        nice = self.settings.helper_nice
        self.placement = self.st._spawn(f"placement-{self.restarts}", argv, nice=nice)
        return self.placement

    def host_of(self, device_id: str) -> str:
        return device_id.split(":")[1]

    def procs(self) -> dict[str, subprocess.Popen[bytes]]:
        named = {f"worker {h}": p for h, p in self.workers.items()}
        if self.placement is not None:
            named["placement"] = self.placement
        return named

    def child_env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, **self.env, "GGUFQ_REDIS_URL": self.st.redis_url, **extra}

    def ready(self) -> bool:
        """Both hosts registered and heartbeating, placement beating."""
        try:
            devices = self.c.devices()
            health = self.c.health()
        except (redis.RedisError, GgufqError):
            return False
        fresh = [d for d in devices if time.time() - d.heartbeat < self.ttl_s]
        return len(fresh) == 2 and bool(health["placement"])

    def heal(self, timeout_s: float = 90.0) -> list[str]:
        """Start again what a fault killed; wait for both hosts and placement."""
        for host, proc in list(self.workers.items()):
            if proc.poll() is not None:
                self.start_worker(host)
        if self.placement is None or self.placement.poll() is not None:
            self.start_placement()
        if not wait_for(self.ready, timeout=timeout_s):
            return [f"heal: the stack was not back (2 devices, placement) in {timeout_s:.0f} s"]
        return []

    def unload_all(self, timeout_s: float = 30.0) -> list[str]:
        """Unload every runner; afterwards no runner is left and no device reserves a byte."""
        try:
            for model in {r.model for r in self.c.ps()}:
                self.c.unload(model)
        except (redis.RedisError, GgufqError) as exc:
            return [f"unload: {exc}"]
        if wait_for(self._empty, timeout=timeout_s):
            return []
        runners = [f"{r.id} {r.model} {r.state} on {list(r.devices)}" for r in self.c.ps()]
        held = {d.id: d.reserved for d in self.c.devices() if d.reserved}
        return [f"after unloading everything: runners left {runners}, reserved {held}"]

    def _empty(self) -> bool:
        try:
            return not self.c.ps() and not any(d.reserved for d in self.c.devices())
        except redis.RedisError:
            return False

    def health_problems(self) -> list[str]:
        """`python -m scheduler.local.health` for each host and for placement."""
        problems = []
        for role, host in (("worker", "h1"), ("worker", "h2"), ("placement", "h1")):
            env = self.child_env(GGUFQ_HOST_ID=host)
            argv = [sys.executable, "-m", "scheduler.local.health", role]
            try:
                done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
            except subprocess.TimeoutExpired:
                problems.append(f"health {role} {host}: no answer in 30 s")
                continue
            if done.returncode:
                problems.append(f"health {role} {host}: {done.stderr.strip()[-300:]}")
        return problems


# -- logs -----------------------------------------------------------------------------------
class LogMarks:
    """Where each log of a stack ended when a trial began: the trial reads only what is new."""

    def __init__(self, cluster: Cluster) -> None:
        self.files = self._files(cluster)
        self.offsets = {p: p.stat().st_size for p in self.files}
        self.cluster = cluster

    @staticmethod
    def _files(cluster: Cluster) -> list[Path]:
        found = sorted(cluster.log_dir.glob("*.log"))
        redis_log = Path(cluster.settings.state_dir) / "redis" / "redis-server.log"
        return found + ([redis_log] if redis_log.exists() else [])

    def new_text(self) -> dict[str, str]:
        texts = {}
        for path in self._files(self.cluster):
            try:
                with open(path, "rb") as handle:
                    handle.seek(self.offsets.get(path, 0))
                    texts[path.name] = handle.read().decode(errors="replace")
            except OSError:
                continue
        return texts


def grep(texts: dict[str, str], pattern: str, limit: int = 6) -> list[str]:
    found = []
    rx = re.compile(pattern)
    for name, text in texts.items():
        for line in text.splitlines():
            if rx.search(line):
                found.append(f"{name}: {line.strip()[:240]}")
                if len(found) >= limit:
                    return found
    return found


def count_in(texts: dict[str, str], pattern: str, only: str = "") -> int:
    rx = re.compile(pattern)
    return sum(len(rx.findall(t)) for n, t in texts.items() if n.startswith(only))


# -- CPU ------------------------------------------------------------------------------------
def cpu_ticks(pid: int) -> tuple[int, int]:
    """(main thread, whole process) user + system clock ticks; (0, 0) once it is gone."""

    def ticks(stat: Path) -> int:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime

    try:
        return ticks(Path(f"/proc/{pid}/task/{pid}/stat")), ticks(Path(f"/proc/{pid}/stat"))
    except (OSError, IndexError, ValueError):
        return 0, 0


class CpuWatch:
    """How busy each process's main thread was between two moments: a Celery consumer that
    spins on a dead connection takes a core from llama.cpp's threads."""

    HZ = os.sysconf("SC_CLK_TCK")

    def __init__(self, procs: dict[str, subprocess.Popen[bytes]]) -> None:
        self.start = time.monotonic()
        self.before = {name: (p.pid, cpu_ticks(p.pid)) for name, p in procs.items()}

    def hot(self, over: float = 0.6, min_window_s: float = 5.0) -> list[str]:
        window = time.monotonic() - self.start
        if window < min_window_s:
            return []
        found = []
        for name, (pid, (main0, total0)) in self.before.items():
            main1, total1 = cpu_ticks(pid)
            if not main1:
                continue
            main = (main1 - main0) / self.HZ / window
            total = (total1 - total0) / self.HZ / window
            if main > over:
                found.append(
                    f"{name} (pid {pid}): main thread {main:.0%} of a core, process {total:.0%},"
                    f" over the {window:.0f} s after the fault"
                )
        return found


# -- jobs -----------------------------------------------------------------------------------
@dataclass
class Tracked:
    """A job of the trial (or a probe) and what became of it."""

    name: str
    job: Job
    submitted: float
    outcome: str = ""  # completed | failed | cancelled | unclear | hung
    message: str = ""
    ended: float = 0.0
    text: str = ""  # the final result's whole text, when completed
    device: str = ""


class Reader(threading.Thread):
    """Follows a job's stream as a caller would (Job.stream), reopening it after the last
    ``seq`` seen when Redis goes away, as the README tells a reconnecting reader to."""

    def __init__(self, job: Job, bound_s: float) -> None:
        super().__init__(name=f"reader-{job.id[:8]}", daemon=True)
        self.job = job
        self.deadline = time.monotonic() + bound_s
        self.seqs: list[int] = []
        self.arrived: list[float] = []  # when each of ``seqs`` came (monotonic)
        self.end = "running"
        self.reconnects = 0
        self.problem = ""
        self.error: GgufqError | None = None  # the typed error the stream ended with

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            try:
                self._follow()
                return
            except JobTimeout:
                self.end = "timeout"
                return
            except (redis.RedisError, OSError) as exc:  # RedisUnavailable too: before
                self.reconnects += 1  # GgufqError, which it also is
                self.problem = f"{type(exc).__name__}: {exc}"
                time.sleep(0.5)
            except GgufqError as exc:
                self.end = f"error {type(exc).__name__}"
                self.error = exc
                return
            except Exception as exc:  # the reader's own crash is a finding too
                self.end = f"crashed {type(exc).__name__}: {exc}"
                return
        self.end = "bound"

    def _follow(self) -> None:
        after = self.seqs[-1] if self.seqs else 0
        wait = max(1.0, self.deadline - time.monotonic())
        for chunk in self.job.stream(timeout=wait, cancel_on_close=False, after=after):
            self.seqs.append(chunk.seq or -1)
            self.arrived.append(time.monotonic())
            if chunk.done:
                self.end = "done"
                return
        self.end = "ended without a final chunk"


def outcome_of(job: Job) -> tuple[str, str, dict[str, Any]]:
    """(outcome, message, final record) of a job whose result is stored."""
    try:
        final = job.final(timeout=5)
    except JobCancelled as exc:
        return "cancelled", str(exc), {}
    except JobTimeout as exc:
        return "hung", str(exc), {}
    except RedisUnavailable as exc:  # Redis away: nothing said about the job
        return "unclear", f"{type(exc).__name__}: {exc}", {}
    except GgufqError as exc:
        return "failed", f"{type(exc).__name__}: {exc}", {}
    except Exception as exc:  # not a GgufqError: it does not say what happened
        return "unclear", f"{type(exc).__name__}: {exc}", {}
    if final.get("done"):
        return "completed", "", final
    return "unclear", f"final record without done: {str(final)[:200]}", final


def late_read(job: Job) -> str:
    """What Job.stream gives a reader that starts now: an error, or the seqs it yielded."""
    seqs: list[int] = []
    try:
        for chunk in job.stream(timeout=5, cancel_on_close=False):
            seqs.append(chunk.seq or -1)
    except (redis.RedisError, OSError) as exc:  # RedisUnavailable too
        return f"no answer ({exc})"
    except GgufqError as exc:
        return f"error {type(exc).__name__} after seqs {compress(seqs)}"
    return f"was given seqs {compress(seqs)}, no error"


def record_of(client: Client, job_id: str) -> list[dict[str, Any]]:
    r: Any = client.r
    try:
        entries = r.xrange(keys.job_chunks(job_id))
    except redis.RedisError:
        return []
    return [json.loads(fields[b"c"]) for _id, fields in entries]


def attach(client: Client, job_id: str, model: str) -> Job:
    """A handle on a job another process submitted."""
    return Job(client, JobRequest(id=job_id, model=model), resend=False)


# -- a trial --------------------------------------------------------------------------------
@dataclass
class TrialResult:
    fault: str
    trial: int
    setup_failed: str = ""
    load: float = 0.0  # the host's 1-minute load average when the fault came
    jobs: list[Tracked] = field(default_factory=list)
    probes: list[Tracked] = field(default_factory=list)
    serve_s: float | None = None
    a_outcome_s: float | None = None  # from the fault's end to A's outcome
    # A gone on elsewhere: from the fault's end to its next chunk at its reader, and the
    # bound on that (TTL + 2 heartbeats + its model's load where it went on)
    a_resume_s: float | None = None
    a_resume_bound_s: float | None = None
    twice: list[str] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)
    silent_gaps: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    invariants: list[str] = field(default_factory=list)  # ggufq fsck --settled, once settled
    unexpected: list[str] = field(default_factory=list)
    died: list[str] = field(default_factory=list)
    unhealthy: list[str] = field(default_factory=list)
    spinning: list[str] = field(default_factory=list)
    stacks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(t.outcome == outcome for t in self.jobs)

    def note(self, what: str) -> None:
        """Notes repeat (a probe refused every 0.5 s): keep each once, with a count."""
        what = what[:240]
        for i, seen in enumerate(self.notes):
            text, _, times = seen.partition(" [x")
            if text == what:
                self.notes[i] = f"{what} [x{int(times.rstrip(']') or 1) + 1}]"
                return
        self.notes.append(what)


class Trial:
    """One fault injected into jobs in flight, and everything counted afterwards."""

    def __init__(
        self, cluster: Cluster, fault: Fault, number: int, rng: random.Random, args: Any
    ) -> None:
        self.cl = cluster
        self.c = cluster.c
        self.fault = fault
        self.rng = rng
        self.args = args
        self.res = TrialResult(fault.name, number)
        self.jobs: dict[str, Tracked] = {}
        self.readers: dict[str, Reader] = {}
        self.killed: set[int] = set()  # pids the fault itself ended
        self.a_device = ""
        self.fault_end = 0.0
        self.known: dict[str, set[str]] = {}
        self.known_problems: set[str] = set()  # fsck --settled before this trial
        self.progress: dict[str, list[tuple[float, int]]] = {}  # job → (time, chunks)
        self.child: subprocess.Popen[bytes] | None = None  # client-dies: the client of A

    # -- jobs in flight ---------------------------------------------------------------------
    def submit(self, name: str, model: str, options: dict[str, Any], **kw: Any) -> Tracked:
        job = self.c.submit(model, f"{name} {self.rng.randrange(10**6)}", options=options, **kw)
        return self._track(name, job)

    def _track(self, name: str, job: Job, read: bool = True) -> Tracked:
        tracked = Tracked(name, job, time.monotonic())
        self.jobs[name] = tracked
        if read:
            reader = Reader(job, self.args.bound_s + 60)
            reader.start()
            self.readers[name] = reader
        return tracked

    def chunks(self, name: str) -> int:
        try:
            return int(self.c.r.xlen(keys.job_chunks(self.jobs[name].job.id)))  # type: ignore[arg-type]
        except redis.RedisError:
            return 0

    def expect(self, what: str, predicate: Callable[[], object], timeout_s: float = 60) -> None:
        if not wait_for(predicate, timeout=timeout_s):
            raise SetupFailed(f"{what} did not happen within {timeout_s:.0f} s")

    def a_runner_busy(self) -> bool:
        for r in self.c.ps():
            if r.model == "slow" and r.context_length == 8192 and r.in_flight >= 2:
                self.a_device = next(iter(r.devices))
                return True
        return False

    def put_load(self) -> None:
        """A streams on h2, B waits for A's slot, C streams on h1."""
        if self.fault.name == "client-dies":
            self.child_streams_a()
        else:
            self.submit("A", "slow", long_options(self.args.long_tokens))
        streamed = self.rng.randint(2, 5)  # chunks A has streamed when the fault comes
        self.expect("A streaming", lambda: self.chunks("A") >= streamed)
        self.submit("B", "slow", SHORT)
        self.expect("B waiting behind A", self.a_runner_busy, 30)
        options = long_options(self.args.long_tokens * 2 // 3, num_ctx=4096)
        self.submit("C", "slow", options, device="vgpu:h1:0")
        self.expect("C streaming", lambda: self.chunks("C") >= 2)
        if self.cl.host_of(self.a_device) != "h2":
            self.res.note(f"A ran on {self.a_device}, not on h2")

    def burst(self, n: int) -> None:
        """``n`` short jobs, D1, D2, ... numbered on across the trial's bursts (a second
        burst's D1 replaced the first's, whose outcome then went uncounted)."""
        first = 1 + sum(name.startswith("D") for name in self.jobs)
        for i in range(first, first + n):
            self.submit(f"D{i}", "tiny", {"temperature": 0, "num_predict": 64})

    # -- the client that dies ------------------------------------------------------------------
    CHILD = (
        "import sys\n"
        "from api_client import Client\n"
        "with Client(timeout=60) as c:\n"
        "    job = c.submit('slow', 'a client that dies', options={opts})\n"
        "    print(job.id, flush=True)\n"
        "    for chunk in job.stream():\n"
        "        print(chunk.seq, flush=True)\n"
    )

    def child_streams_a(self) -> None:
        code = self.CHILD.replace("{opts}", repr(long_options(CLIENT_TOKENS)))
        child = subprocess.Popen(
            [sys.executable, "-c", code],
            env=self.cl.child_env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.child = child
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 30)
        line = child.stdout.readline().decode().strip() if ready else ""
        if not re.fullmatch(r"[0-9a-f]{32}", line):
            child.kill()
            child.wait()
            raise SetupFailed(f"the client process printed no job id (got {line!r})")
        self._track("A", attach(self.c, line, "slow"), read=False)

    # -- faults ---------------------------------------------------------------------------------
    def victim(self) -> subprocess.Popen[bytes]:
        return self.cl.workers[self.cl.host_of(self.a_device)]

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        self.killed.add(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def inject(self) -> None:
        """Inject the fault; ``fault_end`` is when it ended (what time-to-serve counts from)."""
        self.res.load = os.getloadavg()[0]
        getattr(self, "fault_" + self.fault.name.replace("-", "_"))()
        self.fault_end = time.monotonic()

    def fault_worker_kill(self) -> None:
        self.kill(self.victim())

    def fault_worker_kill_midstream(self) -> None:
        """As worker-kill; what is counted besides: A goes on elsewhere (Trial.went_on)."""
        self.kill(self.victim())

    def fault_worker_stall(self) -> None:
        proc = self.victim()
        proc.send_signal(signal.SIGSTOP)  # as a long GIL-holding call or a paused VM does
        try:
            time.sleep(self.cl.ttl_s + 4 * self.cl.hb_s)
        finally:
            proc.send_signal(signal.SIGCONT)

    def fault_worker_restart(self) -> None:
        host = self.cl.host_of(self.a_device)
        self.kill(self.victim())
        self.cl.start_worker(host)  # as compose's restart policy does after an OOM kill

    def fault_placement_kill(self) -> None:
        """The fault ends when the new placement service beats (its start, mostly imports,
        is not the cluster's recovery)."""
        proc = self.cl.placement
        assert proc is not None
        before = self.placement_names()
        self.burst(2)  # jobs that placement is taking or about to take
        time.sleep(self.rng.uniform(0.0, 0.05))
        self.kill(proc)
        spawned = time.monotonic()
        self.cl.start_placement()
        if wait_for(lambda: self.placement_names() - before, timeout=60):
            self.res.note(f"new placement beat {time.monotonic() - spawned:.1f} s after start")
        else:
            self.res.note("the new placement service did not beat within 60 s")

    def fault_placement_stall(self) -> None:
        """Placement stops mid-burst for longer than the TTL while another one serves, then
        resumes: the jobs it held were put back by the other, and it must do nothing more
        with them. It is killed two heartbeats later (the stack runs one placement)."""
        proc = self.cl.placement
        assert proc is not None
        self.burst(2)
        time.sleep(self.rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGSTOP)
        try:
            self.cl.start_placement()
            time.sleep(self.cl.ttl_s + 4 * self.cl.hb_s)
        finally:
            proc.send_signal(signal.SIGCONT)
        time.sleep(2 * self.cl.hb_s)
        self.kill(proc)

    def placement_names(self) -> set[bytes]:
        try:
            return set(self.c.r.zrange(keys.PLACEMENT_ALIVE, 0, -1))  # type: ignore[arg-type]
        except redis.RedisError:
            return set()

    def redis_down(self, seconds: float, wipe: bool) -> None:
        server = self.cl.st.redis
        assert server is not None
        server.stop()
        if wipe:
            for path in server.data_dir.iterdir():
                if path.name == "redis-server.log":
                    continue
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        time.sleep(seconds)
        server.start()

    def fault_redis_restart(self) -> None:
        self.redis_down(0.0, wipe=False)

    def fault_redis_wipe(self) -> None:
        self.redis_down(0.0, wipe=True)

    def fault_redis_outage(self) -> None:
        self.redis_down(self.args.outage_s, wipe=False)

    def fault_redis_crash(self) -> None:
        """Redis dies without a word mid-burst: with appendfsync everysec up to a second of
        writes (claims, records, chunks) is gone when it comes back from its file."""
        server = self.cl.st.redis
        assert server is not None and server.proc is not None
        self.burst(4)
        time.sleep(self.rng.uniform(0.0, 0.2))
        server.proc.kill()
        server.proc.wait()
        server.start()

    def fault_worker_clock(self) -> None:
        """Nothing happens: A streams on a worker whose clock is 30 s behind for two TTLs,
        in which placement looks at its device's beats at every heartbeat."""
        time.sleep(2 * self.cl.ttl_s)

    def fault_client_dies(self) -> None:
        assert self.child is not None
        self.child.send_signal(signal.SIGKILL)
        self.child.wait(10)

    def fault_malformed(self) -> None:
        r, app = self.c.r, self.c.app
        device_queue = keys.device_queue(self.a_device)
        for queue in (keys.PLACEMENT_QUEUE, device_queue):
            r.lpush(queue, b"\xff\xfe not json \x00", b'{"not": "a kombu message"}', b"[1, 2]")
        # well-formed Celery messages whose bodies are not jobs, and a task nobody knows
        app.send_task(keys.TASK_PLACE, args=[{"garbage": True}], queue=keys.PLACEMENT_QUEUE)
        app.send_task(keys.TASK_RUN, args=[{"x": 1}, {"y": 2}], queue=device_queue)
        app.send_task("ggufq.no_such_task", args=[1], queue=device_queue)
        for channel in (keys.CANCELS, keys.EVENTS):
            r.publish(channel, b"\xff\xfe\xfd not utf-8")
        r.publish(keys.EVENTS, b"{not json")
        r.publish(keys.EVENTS, b'{"event": "handed_back"}')
        # the watchers still hear a cancel after the garbage (published after it: they read
        # it after the garbage): A stops. At once, not after a pause: A (1,000 tokens of the
        # slow model) may end by itself within a second on a quiet machine
        self.c.cancel(self.jobs["A"].job.id)
        time.sleep(2 * self.cl.hb_s)

    # -- afterwards -----------------------------------------------------------------------------
    def collect(self) -> None:
        """Outcomes of the jobs, and probes every 0.5 s from the fault's end until one is
        served; all within ``bound_s`` of the fault's end."""
        deadline = self.fault_end + self.args.bound_s
        next_probe = next_sample = self.fault_end
        while time.monotonic() < deadline:
            now = time.monotonic()
            if self.res.serve_s is None and now >= next_probe:
                self.probe()
                next_probe = now + PROBE_EVERY_S
            pending = [t for t in self.all_tracked() if not t.outcome]
            self.poll(pending)
            if now >= next_sample:  # how far the jobs without an outcome have streamed
                next_sample = now + 1.0
                for t in pending:
                    if t.name in self.jobs:
                        self.progress.setdefault(t.name, []).append((now, self.chunks(t.name)))
            if self.res.serve_s is None:
                self.res.serve_s = self.first_served()
            if not pending and self.res.serve_s is not None:
                return
            time.sleep(0.1)
        self.give_up([t for t in self.all_tracked() if not t.outcome])

    def give_up(self, hung: list[Tracked]) -> None:
        """Jobs without an outcome at the bound: say where each is and whether it still
        streams (a starved CPU, not a stuck job), dump the workers' stacks, cancel them."""
        for tracked in hung:
            tracked.outcome = "hung"
            where = whereabouts(self.c, tracked.job.id)
            tracked.message = f"no outcome {self.args.bound_s:.0f} s after the fault; {where}"
            samples = self.progress.get(tracked.name, [])
            recent = [n for t, n in samples if t >= samples[-1][0] - 30] if samples else []
            if recent and recent[-1] > recent[0]:
                tracked.message += f"; still streaming (+{recent[-1] - recent[0]} chunks in 30 s)"
        if any(t in hung for t in self.jobs.values()):
            self.res.stacks = dump_stacks(self.cl, f"{self.fault.name}-{self.res.trial}")
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            cores = os.cpu_count()
            self.res.note(f"load average at the bound {load} on {cores} cores (all work on it)")
        for tracked in hung:
            self.c.cancel(tracked.job.id)  # so that it does not burden the next trial

    def all_tracked(self) -> list[Tracked]:
        return list(self.jobs.values()) + self.res.probes

    def poll(self, pending: list[Tracked]) -> None:
        """One MGET for the stored results of every pending job."""
        if not pending:
            return
        try:
            raws = self.c.r.mget([result_key(self.c.app, t.job.id) for t in pending])
        except redis.RedisError:
            return
        for tracked, raw in zip(pending, raws, strict=True):  # type: ignore[arg-type]
            reader = self.readers.get(tracked.name)
            if reader is not None and isinstance(reader.error, JobLost):
                # no result will ever be stored: its reader was told the job is gone
                tracked.outcome, tracked.message = "failed", f"JobLost: {reader.error}"
                tracked.ended = time.monotonic()
                continue
            if not result_ready(self.c.app, raw):
                continue
            tracked.outcome, tracked.message, final = outcome_of(tracked.job)
            tracked.ended = time.monotonic()
            tracked.text = str(final.get("response", ""))
            tracked.device = str(final.get("device") or "")

    def probe(self) -> None:
        if len(self.res.probes) >= MAX_PROBES:
            return
        name = f"probe{len(self.res.probes) + 1}"
        try:
            job = self.c.submit("tiny", name, options=PROBE)
        except Exception as exc:  # NoWorkers while the cluster is down, broker errors
            self.res.note(f"a probe was not submitted: {type(exc).__name__}: {exc}")
            return
        self.res.probes.append(Tracked(name, job, time.monotonic()))

    def first_served(self) -> float | None:
        ends = [t.ended for t in self.res.probes if t.outcome == "completed"]
        return min(ends) - self.fault_end if ends else None

    def check_streams(self) -> None:
        for tracked in self.jobs.values():
            record = record_of(self.c, tracked.job.id)
            self._check_record(tracked, record)
            reader = self.readers.get(tracked.name)
            if reader is not None:
                self._check_reader(tracked, reader)

    def _check_record(self, tracked: Tracked, record: list[dict[str, Any]]) -> None:
        label = f"{tracked.name} {tracked.job.id}"
        seqs = [int(c.get("seq", -1)) for c in record]
        finals = sum(bool(c.get("done")) for c in record)
        whole = seqs == list(range(1, len(seqs) + 1))
        if not whole:
            late = late_read(tracked.job)  # a reader from the start, after the fact
            what = f"{label}: record seqs {compress(seqs)} ({tracked.outcome}); a late reader: "
            if late.startswith("error"):
                self.res.gaps.append(what + late)  # the reader is told: not silent
            else:
                self._gap(tracked, what + late)
        if finals > 1:
            self.res.twice.append(f"{label}: {finals} final chunks in its record")
        text = "".join(str(c.get("response", "")) for c in record if not c.get("done"))
        # with every chunk there, a text other than the result's means a second run wrote
        if tracked.outcome == "completed" and record and whole and text != tracked.text:
            self.res.twice.append(
                f"{label}: streamed text ({len(text)} chars) is not the result's "
                f"({len(tracked.text)} chars), though no seq is missing: two runs wrote into it"
            )

    def _check_reader(self, tracked: Tracked, reader: Reader) -> None:
        ended = tracked.outcome in ("completed", "failed", "cancelled")
        # the final chunk is in the record before the result is stored; a reader that lost
        # a message re-reads the record after at most 8 s of quiet
        reader.join(timeout=12.0 if ended else 0.1)
        label = f"{tracked.name} {tracked.job.id}"
        if reader.seqs != list(range(1, len(reader.seqs) + 1)):
            # Job.stream yielded past missing chunks without a word: silent, whatever the end
            what = f"{label}: its reader was given seqs {compress(reader.seqs)}, no error"
            self.res.gaps.append(what)
            self.res.silent_gaps.append(what)
        if ended and (reader.end in ("timeout", "bound", "running") or "crash" in reader.end):
            what = f"the job is {tracked.outcome}, its reader: {reader.end} after seq "
            self._gap(tracked, f"{label}: {what}{reader.seqs[-1] if reader.seqs else 0}")

    def _gap(self, tracked: Tracked, what: str) -> None:
        self.res.gaps.append(what)
        if tracked.outcome in ("completed", "hung", "unclear"):
            self.res.silent_gaps.append(what)

    def check_twice(self, texts: dict[str, str]) -> None:
        """A job runs once, once more when it was re-placed with nothing streamed, or once
        more each time it went on elsewhere from its last token (GGUFQ_RESUME_MAX)."""
        for tracked in self.jobs.values():
            jid = re.escape(tracked.job.id)
            succeeded = count_in(texts, rf"ggufq\.run\[{jid}\] succeeded", only="worker")
            received = count_in(texts, rf"ggufq\.run\[{jid}\] received", only="worker")
            replaced = count_in(texts, rf"re-placing job {jid}", only="placement")
            went_on = count_in(texts, rf"job {jid} goes on from chunk", only="placement")
            label = f"{tracked.name} {tracked.job.id}"
            if succeeded > 1:
                self.res.twice.append(f"{label}: succeeded on workers {succeeded} times")
            if received > 1 + replaced + went_on:
                self.res.twice.append(
                    f"{label}: delivered to workers {received}x, re-placed {replaced}x, "
                    f"went on elsewhere {went_on}x"
                )
            if replaced > 1:
                self.res.twice.append(f"{label}: re-placed {replaced} times")

    def check_outcomes(self) -> None:
        expected = EXPECT.get(self.fault.name, {})
        for tracked in self.jobs.values():
            allowed = expected.get(tracked.name, DEFINED)
            if tracked.outcome in DEFINED and tracked.outcome not in allowed:
                self.res.unexpected.append(
                    f"{tracked.name} {tracked.job.id} {tracked.outcome}, the fault model says "
                    f"{'/'.join(sorted(allowed))}"
                    + (f": {tracked.message}" if tracked.message else "")
                )

    def settle(self) -> None:
        """Once nothing runs: every runner on a live device, reservations = runners' bytes,
        no job or in-flight record left."""
        if not wait_for(lambda: not self.leaks(), timeout=SETTLE_S):
            self.res.leaks += self.leaks()
        # a dead placement process's held jobs are let go a TTL after its last beat
        wait_for(lambda: not self.invariants(), timeout=self.cl.ttl_s + SETTLE_S)
        self.res.invariants = self.invariants()

    def invariants(self) -> list[str]:
        """``ggufq fsck --settled``'s problems, less those left before this trial."""
        try:
            census = fsck.read(self.c.r, self.c.streams.by_address())
            found = [str(p) for p in fsck.problems(census, settled=True)]
        except redis.RedisError as exc:
            return [f"state unreadable: {exc}"]
        return [p for p in found if p not in self.known_problems]

    def leaks(self) -> list[str]:
        try:
            return leak_problems(self.c, self.known)
        except (redis.RedisError, GgufqError) as exc:
            return [f"state unreadable: {exc}"]

    def check_processes(self) -> None:
        for name, proc in self.cl.procs().items():
            if proc.poll() is not None and proc.pid not in self.killed:
                self.res.died.append(f"{name} (pid {proc.pid}) exited with {proc.returncode}")

    def run(self) -> TrialResult:
        marks = LogMarks(self.cl)
        try:
            self.known = job_hashes(self.c)  # a leak of an earlier trial counts there only
            self.known_problems = set(self.invariants())  # the same for fsck's
            self.put_load()
        except (SetupFailed, GgufqError, redis.RedisError) as exc:
            self.res.setup_failed = f"{type(exc).__name__}: {exc}"
            self.cancel_all()
            self.res.evidence = grep(marks.new_text(), r"Traceback|ERROR|Error|CRITICAL", 10)
            return self.res
        self.burst(1)
        self.inject()
        cpu = CpuWatch(self.cl.procs())
        self.collect()
        self.res.spinning = cpu.hot()
        self.check_streams()
        self.check_processes()
        self.settle()
        texts = marks.new_text()
        self.check_twice(texts)
        self.res.jobs = list(self.jobs.values())
        a = self.jobs["A"]
        if a.outcome in DEFINED:
            self.res.a_outcome_s = round(a.ended - self.fault_end, 3)
        if self.fault.name == "worker-kill-midstream":
            self.went_on(a)
        self.check_outcomes()
        self.res.leaks += self.cl.heal()
        self.res.leaks += self.cl.unload_all()
        self.res.unhealthy = self.cl.health_problems()
        self.res.evidence = evidence(self.res, marks.new_text())
        return self.res

    def went_on(self, a: Tracked) -> None:
        """How soon A's reader had its next chunk after the kill, A having gone on elsewhere
        (its final record's ``resumed``), against TTL + 2 heartbeats + its load there."""
        reader = self.readers.get("A")
        try:
            final = a.job.final(timeout=5) if a.outcome == "completed" else {}
        except (GgufqError, redis.RedisError):
            final = {}
        if not final.get("resumed"):
            self.res.unexpected.append(f"A {a.job.id} {a.outcome}: it did not go on elsewhere")
            return
        after = [t for t in (reader.arrived if reader else []) if t > self.fault_end]
        if after:
            self.res.a_resume_s = round(after[0] - self.fault_end, 3)
        load_s = (final.get("load_duration") or 0) / 1e9
        self.res.a_resume_bound_s = round(self.cl.ttl_s + 2 * self.cl.hb_s + load_s, 3)

    def cancel_all(self) -> None:
        for tracked in self.jobs.values():
            try:
                self.c.cancel(tracked.job.id)
            except redis.RedisError:
                pass
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.wait()


def job_hashes(client: Client) -> dict[str, set[str]]:
    """The job ids in the hashes that must empty once nothing runs: in flight per device,
    orphans, running."""
    devices = [d.id for d in client.devices()]
    names = [keys.inflight(d) for d in devices] + [keys.ORPHANS, keys.RUNNING]
    return {n: {k.decode() for k in cast(list[bytes], client.r.hkeys(n))} for n in names}


def leak_problems(client: Client, known: dict[str, set[str]]) -> list[str]:
    """What is left once nothing runs; ``known`` entries were left before this trial."""
    devices = {d.id: d for d in client.devices()}
    runners = client.ps()
    problems = [f"job {j.id} still {j.state}" for j in client.jobs()]
    held: dict[str, int] = {}
    for r in runners:
        gone = [d for d in r.devices if d not in devices]
        if gone:
            problems.append(f"runner {r.id} ({r.model}) on devices gone: {gone}")
        if r.in_flight:
            problems.append(f"runner {r.id} ({r.model}) has {r.in_flight} jobs in flight")
        if r.state != "ready":
            problems.append(f"runner {r.id} ({r.model}) is {r.state}")
        for device_id, size in r.devices.items():
            held[device_id] = held.get(device_id, 0) + size
    for device in devices.values():
        if device.reserved != held.get(device.id, 0):
            problems.append(
                f"{device.id} reserves {device.reserved} bytes, its runners hold "
                f"{held.get(device.id, 0)}"
            )
    for name, ids in job_hashes(client).items():
        jobs = sorted(ids - known.get(name, set()))
        if jobs:
            problems.append(f"{len(jobs)} entries left in {name}: {', '.join(jobs[:4])}")
    return problems


def dump_stacks(cluster: Cluster, label: str) -> list[str]:
    """Every thread's Python stack in each live worker (gdb's py-bt), saved beside the logs;
    returns where each thread is, in one line each."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return ["(no gdb: no stacks of the workers)"]
    lines = []
    for host, proc in cluster.workers.items():
        if proc.poll() is not None:
            continue
        argv = [gdb, "-p", str(proc.pid), "-batch", "-iex", "add-auto-load-safe-path /"]
        try:
            done = subprocess.run(
                [*argv, "-ex", "thread apply all py-bt"], capture_output=True, text=True, timeout=90
            )
        except subprocess.TimeoutExpired:
            lines.append(f"worker {host}: gdb did not answer in 90 s")
            continue
        path = cluster.root / f"stacks-{label}-{host}.txt"
        path.write_text(done.stdout + done.stderr)
        lines.append(f"worker {host} (pid {proc.pid}) threads, in full in {path}:")
        lines += ["  " + t for t in thread_summaries(done.stdout)]
    return lines


def thread_summaries(text: str) -> list[str]:
    """One line per thread of a py-bt dump: its innermost frame, and ours if that is not."""
    out = []
    for block in text.split("Traceback (most recent call first):")[1:]:
        frames = re.findall(r'File "([^"]+)", line (\S+), in (\S+)', block)
        if not frames:
            continue
        short = [(f.replace(str(ROOT) + "/", ""), n, fn) for f, n, fn in frames]
        inner = short[0]
        ours = next((f for f in short if not f[0].startswith(("/", ".venv"))), None)
        where = f"{inner[0].rsplit('/', 1)[-1]}:{inner[1]} {inner[2]}"
        if ours is not None and ours != inner:
            where += f" <- {ours[0]}:{ours[1]} {ours[2]}"
        out.append(where)
    return out


def whereabouts(client: Client, job_id: str) -> str:
    """Where a job without an outcome is: queues, kombu's unacked messages, parked, in
    flight, running, its owner and its stream record."""
    r: Any = client.r  # redis-py's replies are typed as unions of every reply kind
    jid = job_id.encode()
    where = []
    try:
        devices = [d.id for d in client.devices()]
        queues = [keys.PLACEMENT_QUEUE, keys.placement_queue("batch")]
        queues += [keys.device_queue(d, p) for d in devices for p in ("interactive", "batch")]
        where += [f"queued in {q}" for q in queues if any(jid in m for m in r.lrange(q, 0, -1))]
        if any(jid in m for m in r.hvals("unacked")):
            where.append("in kombu's unacked messages (taken by a consumer, not acknowledged)")
        if r.zscore(keys.PARKED, job_id) is not None:
            where.append("parked")
        where += [f"in flight on {d}" for d in devices if r.hexists(keys.inflight(d), job_id)]
        if r.hexists(keys.RUNNING, job_id):
            where.append("running")
        custody = r.hmget(keys.job_custody(job_id), "state", "holder")
        if custody[0]:
            where.append(f"custody {custody[0].decode()} held by {custody[1].decode() or '-'}")
        last = r.xrevrange(keys.job_chunks(job_id), count=1)
        where.append(f"stream up to {last[0][0].decode()}" if last else "no stream record")
    except redis.RedisError as exc:
        where.append(f"state unreadable: {exc}")
    return "where: " + (", ".join(where) or "nowhere (not queued, parked, sent nor running)")


def compress(seqs: list[int]) -> str:
    """1..40 44..50 rather than fifty numbers."""
    if not seqs:
        return "[]"
    runs, start, prev = [], seqs[0], seqs[0]
    for s in seqs[1:]:
        if s != prev + 1:
            runs.append(f"{start}..{prev}" if start != prev else str(start))
            start = s
        prev = s
    runs.append(f"{start}..{prev}" if start != prev else str(start))
    return " ".join(runs)


def evidence(res: TrialResult, texts: dict[str, str]) -> list[str]:
    """Log lines about what went wrong in this trial: each bad job's lines, then errors."""
    lines: list[str] = []
    bad = [t for t in res.jobs + res.probes if t.outcome in ("hung", "unclear")]
    flagged = " ".join(res.twice + res.gaps + res.unexpected)
    bad += [t for t in res.jobs if t.job.id in flagged and t not in bad]
    for tracked in bad[:6]:
        lines += grep(texts, re.escape(tracked.job.id), 4)
    lines += grep(texts, r"Exception in thread|Traceback|CRITICAL|Unrecoverable|is lost", 8)
    lines += grep(texts, r"\bERROR\b|gave up|UnicodeDecodeError|JSONDecodeError", 8)
    lines += grep(texts, r"Cannot connect|Trying again|dropped devices|no longer registered", 8)
    return list(dict.fromkeys(lines))[:16]


# -- a fault's trials ----------------------------------------------------------------------
def run_fault(
    fault: Fault,
    args: Any,
    models: Path,
    work: Path,
    cluster_of: type[Cluster] = Cluster,
    trial_of: type[Trial] = Trial,
) -> list[TrialResult]:
    rng = random.Random(f"{args.seed}-{fault.name}")
    results: list[TrialResult] = []
    cluster = cluster_of(work / fault.name, models, CLOCK_BEHIND_S.get(fault.name))
    try:
        cluster.start()
        ready = wait_for(cluster.ready, timeout=60)
        for number in range(1, args.trials + 1):
            if not ready:
                results.append(TrialResult(fault.name, number, setup_failed="stack not ready"))
                continue
            started = time.monotonic()
            res = trial_of(cluster, fault, number, rng, args).run()
            results.append(res)
            took = time.monotonic() - started
            print(f"  {fault.name} trial {number}: {summary(res)} ({took:.0f} s)")
            ready = cluster.ready() or wait_for(cluster.ready, timeout=60)
    except Exception as exc:
        results.append(TrialResult(fault.name, len(results) + 1, setup_failed=f"stack: {exc}"))
    finally:
        cluster.stop()
    return results


def summary(res: TrialResult) -> str:
    if res.setup_failed:
        return f"setup failed: {res.setup_failed}"
    outcomes = " ".join(f"{t.name}={t.outcome}" for t in res.jobs)
    served = f"{res.serve_s:.2f} s" if res.serve_s is not None else "never"
    flags = [
        f"{label} {len(items)}"
        for label, items in (
            ("twice", res.twice),
            ("gaps", res.gaps),
            ("leaks", res.leaks),
            ("invariants", res.invariants),
            ("died", res.died),
            ("unhealthy", res.unhealthy),
            ("spinning", res.spinning),
        )
        if items
    ]
    return f"{outcomes}; served again after {served}" + ("; " + ", ".join(flags) if flags else "")


# -- the report -----------------------------------------------------------------------------
def jobs_in(problems: list[str]) -> int:
    """How many jobs the problems are about (each starts "<name> <job id>:")."""
    return len({p.split(":", 1)[0] for p in problems})


FAILOVER_SERVE_S = 10.0  # issue 38: served again within 10 s of the promotion


def serve_target_s(fault: Fault, hb_s: float, ttl_s: float) -> float:
    if fault.serve == "failover":
        return FAILOVER_SERVE_S
    return ttl_s + 2 * hb_s if fault.serve == "death" else 2 * hb_s


def figures(fault: Fault, results: list[TrialResult], hb_s: float, ttl_s: float) -> dict[str, Any]:
    ran = [r for r in results if not r.setup_failed]
    serve = [r.serve_s for r in ran if r.serve_s is not None]
    target = serve_target_s(fault, hb_s, ttl_s)
    probes_hung = sum(t.outcome == "hung" for r in ran for t in r.probes)
    out: dict[str, Any] = {
        "what": fault.what,
        "trials": len(ran),
        "setup_failed": len(results) - len(ran),
        "jobs": sum(len(r.jobs) for r in ran),
        **{k: sum(r.count(k) for r in ran) for k in ("completed", "failed", "cancelled")},
        "unclear": sum(r.count("unclear") for r in ran),
        "hung": sum(r.count("hung") for r in ran),
        "probes_hung": probes_hung,
        "run_twice": sum(jobs_in(r.twice) for r in ran),
        "gaps": sum(jobs_in(r.gaps) for r in ran),
        "silent_gaps": sum(jobs_in(r.silent_gaps) for r in ran),
        "leaked": sum(len(r.leaks) for r in ran),
        "invariant_violations": sum(len(r.invariants) for r in ran),
        "unexpected": sum(len(r.unexpected) for r in ran),
        "died": sum(len(r.died) for r in ran),
        "unhealthy": sum(len(r.unhealthy) for r in ran),
        "spinning": sum(len(r.spinning) for r in ran),
        "serve_s": [round(s, 3) for s in serve],
        "serve_p50_s": round(statistics.median(serve), 3) if serve else None,
        "never_served": len(ran) - len(serve),
        "serve_target_s": target,
        "a_outcome_s": [r.a_outcome_s for r in ran],
    }
    if fault.name == "worker-kill-midstream":
        resumed = [r.a_resume_s for r in ran if r.a_resume_s is not None]
        out["a_resume_s"] = [r.a_resume_s for r in ran]
        out["a_resume_bound_s"] = [r.a_resume_bound_s for r in ran]
        out["a_resume_p50_s"] = round(statistics.median(resumed), 3) if resumed else None
        out["a_resumed"] = len(resumed)
    out["targets"] = {
        "hung": out["hung"] + probes_hung == 0,
        "run_twice": out["run_twice"] == 0,
        "silent_gaps": out["silent_gaps"] == 0,
        "leaked": out["leaked"] == 0,
        "invariants": out["invariant_violations"] == 0,
        "serve": bool(ran) and len(serve) == len(ran) and max(serve) <= target,
        # beside the targets: outcomes as the fault model says, nobody died
        "outcomes": out["unexpected"] + out["unclear"] == 0,
        "alive": out["died"] + out["unhealthy"] + out["spinning"] == 0,
    }
    if fault.name == "worker-kill-midstream":  # every A went on, each within its bound
        over = [r for r in ran if (r.a_resume_s or 0) > (r.a_resume_bound_s or 0)]
        out["targets"]["resume"] = out["a_resumed"] == len(ran) and not over
    out["met"] = all(out["targets"].values()) and not out["setup_failed"]
    return out


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = (
        f"{'fault':16}{'trials':>7}{'jobs':>5}{'done':>5}{'fail':>5}{'canc':>5}{'uncl':>5}"
        f"{'hung':>5}{'unexp':>6}{'twice':>6}{'gaps':>5}{'silent':>7}{'leak':>5}{'fsck':>5}"
        f"{'died':>5}"
        f"{'serve p50':>10}{'max':>7}{'target':>7}  met"
    )
    lines = [head, "-" * len(head)]
    for name, f in rows.items():
        p50 = f"{f['serve_p50_s']:.2f}" if f["serve_p50_s"] is not None else "never"
        worst = f"{max(f['serve_s']):.2f}" if f["serve_s"] else "-"
        if f["never_served"]:
            worst = "never"
        hung = f"{f['hung']}" + (f"+{f['probes_hung']}p" if f["probes_hung"] else "")
        lines.append(
            f"{name:16}{f['trials']:>7}{f['jobs']:>5}{f['completed']:>5}{f['failed']:>5}"
            f"{f['cancelled']:>5}{f['unclear']:>5}{hung:>5}{f['unexpected']:>6}"
            f"{f['run_twice']:>6}{f['gaps']:>5}"
            f"{f['silent_gaps']:>7}{f['leaked']:>5}{f['invariant_violations']:>5}"
            f"{f['died']:>5}{p50:>10}{worst:>7}"
            f"{f['serve_target_s']:>7.1f}  {'yes' if f['met'] else 'NO'}"
        )
    return "\n".join(lines)


def problems_of(r: TrialResult, target_s: float) -> list[str]:
    """What went against the fault model in one trial."""
    out = [
        f"{t.name} {t.job.id} {t.outcome}: {t.message}"
        for t in r.jobs + r.probes
        if t.outcome in ("hung", "unclear")
    ]
    out += ["unexpected outcome: " + s for s in r.unexpected]
    out += ["run twice: " + s for s in r.twice] + ["gap: " + s for s in r.gaps]
    out += ["leak: " + s for s in r.leaks] + ["died: " + s for s in r.died]
    out += ["invariant: " + s for s in r.invariants]
    out += ["health check fails: " + s for s in r.unhealthy]
    out += ["spinning: " + s for s in r.spinning]
    if r.serve_s is None or r.serve_s > target_s:
        served = "never" if r.serve_s is None else f"after {r.serve_s:.2f} s"
        out.append(f"served again {served} (target {target_s:.1f} s)")
    return out


def findings(results: Iterable[TrialResult], targets: dict[str, float]) -> list[str]:
    out = []
    for r in results:
        where = f"[{r.fault} #{r.trial}]"
        if r.setup_failed:
            out.append(f"{where} setup failed: {r.setup_failed}")
            out += [f"{where}   log: {line}" for line in r.evidence]
            continue
        problems = problems_of(r, targets[r.fault])
        if problems:
            out += [f"{where} {p}" for p in problems]
            out += [f"{where}   note: {n}" for n in r.notes]
            out += [f"{where}   log: {line}" for line in r.evidence]
            out += [f"{where}   stack: {line}" for line in r.stacks]
    return out


def errors_seen(results: Iterable[TrialResult]) -> list[str]:
    """One message of each kind that jobs failed or were cancelled with, per fault: do they
    say what happened?"""
    seen: dict[tuple[str, str], str] = {}
    for r in results:
        for t in r.jobs:
            if t.outcome in ("failed", "cancelled"):
                kind = re.sub(r"[0-9a-f]{32}|\d+", "#", t.message)[:60]
                seen.setdefault((r.fault, kind), f"[{r.fault}] {t.name} {t.outcome}: {t.message}")
    return list(seen.values())


def parse_args(
    argv: list[str] | None, faults: dict[str, Fault], doc: str | None = __doc__
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="trials per fault (issue: 20)")
    parser.add_argument("--faults", default=",".join(faults), help="comma-separated subset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--outage-s", type=float, default=8.0, help="redis-outage: seconds down")
    parser.add_argument("--bound-s", type=float, default=90.0, help="after it, a job is hung")
    parser.add_argument("--long-tokens", type=int, default=1000, help="tokens of job A")
    parser.add_argument("--workdir", type=Path, default=None, help="kept; default a temp dir")
    args = parser.parse_args(argv)
    unknown = set(args.faults.split(",")) - set(faults)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; known: {', '.join(faults)}")
    return args


def main(
    argv: list[str] | None = None,
    faults: dict[str, Fault] = BY_NAME,
    cluster_of: type[Cluster] = Cluster,
    trial_of: type[Trial] = Trial,
    doc: str | None = __doc__,
    bench: str = "chaos",
) -> None:
    """Run ``faults`` (by name) on stacks made by ``cluster_of``, trials by ``trial_of``."""
    args = parse_args(argv, faults, doc)
    started = time.monotonic()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ggufq-chaos-"))
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    write_slow_model(models / "slow.gguf")
    write_tiny_llama(models / "tiny.gguf")
    print(f"{bench}: {args.trials} trials per fault, seed {args.seed}, logs under {work}")
    settings = Cluster(work / "probe-settings", models).settings
    hb_s, ttl_s = settings.heartbeat_interval_s, settings.device_ttl_s
    all_results: list[TrialResult] = []
    rows: dict[str, dict[str, Any]] = {}
    for name in args.faults.split(","):
        fault = faults[name]
        print(f"{fault.name}: {fault.what}")
        results = run_fault(fault, args, models, work, cluster_of, trial_of)
        all_results += results
        rows[name] = figures(fault, results, hb_s, ttl_s)
    print()
    print(table(rows))
    print(
        f"targets: 0 hung, 0 run twice, 0 silent gaps, 0 leaked; serving again within "
        f"{2 * hb_s:.1f} s (2 heartbeats) of Redis or a process returning, within "
        f"{ttl_s + 2 * hb_s:.1f} s (TTL + 2 heartbeats) of a worker's or placement's death"
    )
    for name, row in rows.items():
        if "a_resume_p50_s" in row:
            bounds = [b for b in row["a_resume_bound_s"] if b is not None]
            bound = statistics.median(bounds) if bounds else None
            print(
                f"{name}: A went on elsewhere in {row['a_resumed']} of {row['trials']} trials; "
                f"kill -> its next chunk at the reader p50 {row['a_resume_p50_s']} s, max "
                f"{max(filter(None, row['a_resume_s']), default=None)} s (bound: TTL + 2 "
                f"heartbeats + its load there, p50 {bound} s)"
            )
    print()
    targets = {name: serve_target_s(faults[name], hb_s, ttl_s) for name in rows}
    found = findings(all_results, targets)
    print("failures found:" if found else "failures found: none")
    for line in found:
        print("  " + line)
    print("errors jobs ended with (as the fault model wants, when they say what happened):")
    for line in errors_seen(all_results):
        print("  " + line)
    seconds = time.monotonic() - started
    print(f"took {seconds:.0f} s; logs under {work}")
    loads = [r.load for r in all_results if not r.setup_failed]
    report = {
        "bench": bench,
        "trials": args.trials,
        "seed": args.seed,
        "heartbeat_interval_s": hb_s,
        "device_ttl_s": ttl_s,
        "outage_s": args.outage_s,
        "bound_s": args.bound_s,
        "load_1m_at_fault": {
            "median": round(statistics.median(loads), 2) if loads else None,
            "max": round(max(loads), 2) if loads else None,
            "cores": os.cpu_count(),
        },
        "faults": rows,
        "met": all(r["met"] for r in rows.values()),
        "seconds": round(seconds, 1),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
