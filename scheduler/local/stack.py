"""The local stack: private Redis (unless GGUFQ_REDIS_URL is set), placement, one worker.

`ggufq up` runs it in the foreground; `ggufq demo` and the tests start and stop it around
their work. Children die with this process (no orphans) and stop in order on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO

from scheduler.errors import StackFailed
from scheduler.local.embedded import EmbeddedRedis
from scheduler.local.procs import niced_child_preexec
from scheduler.settings import Settings
from scheduler.store.acl import Role, Users
from scheduler.store.connection import clear_runtime, connect, write_runtime
from scheduler.store.readers import ClusterReader

RESTART_FIRST_S = 1.0  # a child that dies again waits this, then twice as long each time
RESTART_MAX_S = 30.0  # ... at most; and up this long, it starts from the first wait again


class LocalStack:
    def __init__(
        self,
        settings: Settings,
        worker_args: list[str] | None = None,
        log_dir: Path | None = None,
        extra_env: dict[str, str] | None = None,
        worker_module: str = "workers.main",
        role_urls: dict[Role, str] | None = None,
    ) -> None:
        self.settings = settings
        self.worker_args = worker_args or []
        self.worker_module = worker_module  # run as ``python -m``: a wrapper of workers.main
        self.log_dir = log_dir  # None: children write to this terminal
        self.extra_env = extra_env or {}
        self.redis: EmbeddedRedis | None = None
        self.redis_url = settings.redis_url or ""
        # each child's Redis user (scheduler/store/acl.py): given, or made with the Redis
        # this stack starts; without them every child uses redis_url
        self.role_urls = dict(role_urls or {})
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._logs: list[IO[bytes]] = []
        # how each child was started, and when one that died may start again
        self._recipes: dict[str, tuple[list[str], dict[str, str] | None, int, Role | None]] = {}
        self._backoff: dict[str, tuple[float, float]] = {}  # name -> (wait s, not before)

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self, timeout_s: float = 120.0) -> None:
        try:
            # Redis and placement give way to the workers' llama.cpp threads on this host
            nice = self.settings.helper_nice
            if not self.redis_url:
                state = Path(self.settings.state_dir).expanduser()
                # passwords of its own each start: another user of this host cannot reach
                # it; ggufq's commands read the administrator's URL from the runtime file
                # (owner-only), and each child gets its role's user
                self.redis = EmbeddedRedis(
                    state / "redis",
                    nice=nice,
                    maxmemory=self.settings.redis_maxmemory,
                    users=Users.fresh(),
                    binary=self.settings.redis_server or None,
                )
                self.redis_url = self.redis.start()
                self.role_urls = {role: self.redis.role_url(role) for role in Role}
                write_runtime(self.settings, self.redis_url, self.role_urls)
            self._spawn(
                "placement",
                [sys.executable, "-m", "scheduler.placement.process"],
                nice=nice,
                role=Role.PLACEMENT,
            )
            self._spawn(
                "worker",
                [sys.executable, "-m", self.worker_module, *self.worker_args],
                role=Role.WORKER,
            )
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def add_worker(
        self,
        name: str,
        worker_args: list[str],
        env: dict[str, str] | None = None,
        module: str = "workers.main",
    ) -> subprocess.Popen[bytes]:
        """Start another worker on this stack's Redis (another host id in ``env`` makes it
        another host); it stops with the stack."""
        return self._spawn(
            name, [sys.executable, "-m", module, *worker_args], env, role=Role.WORKER
        )

    def add_process(
        self,
        name: str,
        module: str,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        role: Role | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start another process of the stack (``python -m module``; the gateway, say) on
        its Redis, as ``role``'s Redis user (the administrator when None); the stack watches
        it and stops it with the rest."""
        return self._spawn(name, [sys.executable, "-m", module, *(args or [])], env, role=role)

    def _spawn(
        self,
        name: str,
        argv: list[str],
        env_overrides: dict[str, str] | None = None,
        nice: int = 0,
        role: Role | None = None,
    ) -> subprocess.Popen[bytes]:
        env = {**os.environ, **self.extra_env, **(env_overrides or {})}
        env["GGUFQ_REDIS_URL"] = (
            self.role_urls.get(role, self.redis_url) if role else self.redis_url
        )
        out: int | IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
            self._logs.append(log)
            out = log
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            stdin=subprocess.DEVNULL,
            preexec_fn=niced_child_preexec(nice),
        )
        self.procs.append((name, proc))
        self._recipes[name] = (argv, env_overrides, nice, role)
        return proc

    def supervise(self, now: float | None = None) -> list[str]:
        """Start again each child that died (its Redis too, on its port, with its data):
        at once the first time, then after 1, 2, 4 ... s, up to RESTART_MAX_S; returns what
        it restarted. A worker killed by its OS (a job that took all memory) comes back, and
        the stack serves on instead of stopping."""
        now = time.monotonic() if now is None else now
        restarted = []
        if self.redis is not None and self.redis.proc is not None:
            if self.redis.proc.poll() is not None and self._due("redis", now):
                self.redis.start()
                restarted.append("redis")
        for index, (name, proc) in enumerate(list(self.procs)):
            if proc.poll() is None:
                if now - self._backoff.get(name, (0.0, 0.0))[1] > RESTART_MAX_S:
                    self._backoff.pop(name, None)  # up long enough: a first wait again
                continue
            if not self._due(name, now):
                continue
            code = proc.returncode
            argv, env, nice, role = self._recipes[name]
            print(
                f"ggufq: the {name} process exited with code {code}; starting it again",
                file=sys.stderr,
                flush=True,
            )
            self.procs.pop(index)
            fresh = self._spawn(name, argv, env, nice, role)
            self.procs.remove((name, fresh))
            self.procs.insert(index, (name, fresh))  # its place in the stopping order
            restarted.append(name)
        return restarted

    def _due(self, name: str, now: float) -> bool:
        wait, not_before = self._backoff.get(name, (RESTART_FIRST_S / 2, 0.0))
        if now < not_before:
            return False
        wait = min(RESTART_MAX_S, wait * 2)
        self._backoff[name] = (wait, now + wait)
        return True

    def wait_ready(self, timeout_s: float) -> None:
        client = connect(self.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                for name, proc in self.procs:
                    if proc.poll() is not None:
                        raise StackFailed(
                            f"the {name} process exited with code {proc.returncode} "
                            f"while starting{self._log_hint(name)}"
                        )
                _devices, placement = ClusterReader(client).alive_counts(self.settings.device_ttl_s)
                workers = {d.worker for d in ClusterReader(client).devices()}
                if placement and any(w.endswith("@" + self.settings.host_id) for w in workers):
                    return
                time.sleep(0.1)
        finally:
            client.close()
        raise StackFailed(
            f"the stack did not become ready within {timeout_s:.0f} s{self._log_hint('worker')}"
        )

    def _tell_refusals(self) -> list[str]:
        """Say what this stack's Redis refused its processes (a role's ACL user that lacks
        a permission): on stderr, as the stack stops; returns the lines."""
        told = self.redis.refusals() if self.redis is not None else []
        for line in told:
            print(f"ggufq: Redis refused the {line}", file=sys.stderr, flush=True)
        return told

    def _log_hint(self, name: str) -> str:
        return f"; see {self.log_dir / (name + '.log')}" if self.log_dir else ""

    def alive(self) -> bool:
        return all(proc.poll() is None for _, proc in self.procs)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Workers first (they unload and deregister), then placement, then Redis."""
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for _name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        if self.redis is not None:
            self._tell_refusals()
            self.redis.stop()
            clear_runtime(self.settings)
            self.redis = None
        for log in self._logs:
            log.close()
        self._logs.clear()
