"""A Redis primary, its replica and three sentinels on loopback, for the failover tests: the
sentinels promote the replica within a few seconds of the primary's death
(down-after-milliseconds 1000)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from scheduler.local.embedded import free_port, redis_server_path
from tests.conftest import wait_for

MASTER = "ggufq"


@dataclass
class Group:
    primary: int
    replica: int
    sentinels: list[int]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # how each was started: name -> (argv, its directory), to start it again
    started: dict[str, tuple[list[str], Path]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinels)
        return f"redis+sentinel://{hosts}/0?master={MASTER}"

    def primary_port(self) -> int | None:
        """The primary's port, as the first sentinel names it now."""
        client = redis.Redis(port=self.sentinels[0], socket_timeout=2)
        try:
            found = client.sentinel_get_master_addr_by_name(MASTER)
            return int(found[1]) if found else None
        except redis.RedisError:
            return None
        finally:
            client.close()

    def kill_primary(self) -> None:
        self.procs["primary"].kill()
        self.procs["primary"].wait(timeout=10)

    def server_on(self, port: int) -> str:
        """The name of the Redis server on ``port``: "primary" or "replica" as started."""
        return "primary" if port == self.primary else "replica"

    def start_again(self, name: str) -> None:
        """Start ``name`` again, as it was started (on its port, in its directory); a
        primary the sentinels replaced comes back as the new primary's replica."""
        argv, home = self.started[name]
        with open(home / "log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                argv, cwd=home, stdout=log, stderr=subprocess.STDOUT
            )

    def replicated(self) -> bool:
        """Whether the primary the sentinels name has a replica whose link is up."""
        port = self.primary_port()
        if port is None:
            return False
        client = redis.Redis(port=port, socket_timeout=2)
        try:
            info = client.info("replication")
        except redis.RedisError:
            return False
        finally:
            client.close()
        return any(
            isinstance(v, dict) and v.get("state") == "online"
            for k, v in info.items()
            if k.startswith("slave")
        )


@contextmanager
def sentinel_group(root: Path) -> Iterator[Group]:
    binary = redis_server_path()
    group = Group(free_port(), free_port(), [free_port() for _ in range(3)])
    logs = []

    def start(name: str, args: list[str]) -> None:
        home = root / name
        home.mkdir(parents=True)
        log = open(home / "log", "ab")  # noqa: SIM115 - closed at the end
        logs.append(log)
        group.started[name] = ([binary, *args], home)
        group.procs[name] = subprocess.Popen(
            [binary, *args], cwd=home, stdout=log, stderr=subprocess.STDOUT
        )

    common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    start("primary", ["--port", str(group.primary), *common])
    start("replica", ["--port", str(group.replica), *common])
    try:
        assert wait_for(lambda: _answers(group.replica), timeout=30)
        redis.Redis(port=group.replica).execute_command(
            "REPLICAOF", "127.0.0.1", str(group.primary)
        )
        for n, port in enumerate(group.sentinels):
            conf = root / f"sentinel-{n}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {group.primary} 2\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 5000\n"
                f"sentinel parallel-syncs {MASTER} 1\n"
            )
            start(f"sentinel-{n}", [str(conf), "--sentinel"])
        assert wait_for(lambda: all(_ready(port) for port in group.sentinels), timeout=60)
        yield group
    finally:
        for proc in group.procs.values():
            proc.kill()
            proc.wait(timeout=10)
        for log in logs:
            log.close()


def _answers(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def _ready(port: int) -> bool:
    """A sentinel that knows the primary, its replica and the two other sentinels."""
    try:
        info = redis.Redis(port=port, socket_timeout=1).sentinel_master(MASTER)
        return int(info.get("num-slaves", 0)) >= 1 and int(info.get("num-other-sentinels", 0)) >= 2
    except (redis.RedisError, ValueError, TypeError):
        return False
