"""Redis ACL users per role: the file `ggufq acl` writes, loaded by a real redis-server, lets
each role do its work and refuses it the rest; the stack's processes run as their roles."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from scheduler.local.embedded import EmbeddedRedis, free_port, redis_server_path, server_major
from scheduler.local.stack import LocalStack
from scheduler.store.acl import Role, Users, with_credentials
from tests.conftest import ggufq

ROLES = ("placement", "worker", "gateway", "monitor")


def servers() -> list[str]:
    """redis-server binaries to try: the one ggufq starts, and a Redis 7 on PATH if any."""
    found = [redis_server_path()]
    on_path = shutil.which("redis-server")
    if on_path and server_major(on_path) >= 7 and server_major(found[0]) < 7:
        found.append(on_path)
    return found


@pytest.fixture(params=servers(), ids=lambda b: f"redis{server_major(b)}")
def acl_redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    """A redis-server loading the ACL file of `ggufq acl`: the URL of each user, by name."""
    binary = request.param
    major = server_major(binary)
    out = ggufq(
        "acl",
        "--out",
        str(tmp_path / "users.acl"),
        "--redis-major",
        str(major),
        env={"REDIS_PASSWORD": "admin-pw"},
    )
    assert out.returncode == 0, out.stderr
    assert "admin-pw" not in (tmp_path / "users.acl").read_text()  # digests only
    printed = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    assert printed["REDIS_PASSWORD"] == "admin-pw"
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        + ["--aclfile", str(tmp_path / "users.acl")],
        stdout=subprocess.DEVNULL,
    )
    base = f"redis://127.0.0.1:{port}/0"
    urls = {"default": with_credentials(base, "", "admin-pw")}
    for role in ROLES:
        urls[role] = with_credentials(base, role, printed[f"GGUFQ_{role.upper()}_PASSWORD"])
    admin = redis.Redis.from_url(urls["default"])
    deadline = time.monotonic() + 10
    while True:
        try:
            admin.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    admin.rpush("ggufq.cpu.h", "a job's message")
    admin.set("ggufq-auth:key:abc", "a key's record")
    admin.set("ggufq:job:j1:custody", "a job's record")
    urls["major"] = str(major)
    try:
        yield urls
    finally:
        admin.close()
        proc.terminate()
        proc.wait(timeout=10)


def refused(client: redis.Redis, *command: str) -> bool:
    try:
        client.execute_command(*command)
    except redis.exceptions.NoPermissionError:
        return True
    return False


def test_every_role_is_refused_administration(acl_redis: dict[str, str]) -> None:
    for role in ROLES:
        client = redis.Redis.from_url(acl_redis[role])
        assert client.ping() and "redis_version" in client.info("server")
        for command in (
            ("CONFIG", "GET", "maxmemory"),
            ("FLUSHALL",),
            ("KEYS", "*"),
            ("ACL", "SETUSER", role, "+@all"),
            ("MODULE", "LIST"),
            ("SHUTDOWN", "NOSAVE"),
        ):
            assert refused(client, *command), f"{role} may run {command}"
        client.close()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(with_credentials(acl_redis["worker"], "worker", "wrong")).ping()


def test_only_the_gateway_touches_the_api_keys(acl_redis: dict[str, str]) -> None:
    for role in ("placement", "worker", "monitor"):
        client = redis.Redis.from_url(acl_redis[role])
        assert refused(client, "GET", "ggufq-auth:key:abc"), role
        assert refused(client, "SET", "ggufq-auth:key:forged", "{}"), role
        client.close()
    gateway = redis.Redis.from_url(acl_redis["gateway"])
    assert gateway.get("ggufq-auth:key:abc") == b"a key's record"
    gateway.close()


def test_services_work_on_the_cluster_keys(acl_redis: dict[str, str]) -> None:
    for role in ("placement", "worker", "gateway"):
        client = redis.Redis.from_url(acl_redis[role])
        assert client.get("ggufq:job:j1:custody") == b"a job's record"
        assert client.llen("ggufq.cpu.h") == 1
        assert client.eval("return redis.call('TIME')[1] ~= nil", 0) == 1
        client.publish("ggufq:cancels", "j1")
        assert refused(client, "GET", "someone-elses-key"), role
        client.close()


def test_the_monitor_reads_queue_lengths_and_no_job(acl_redis: dict[str, str]) -> None:
    monitor = redis.Redis.from_url(acl_redis["monitor"])
    assert monitor.llen("ggufq.cpu.h") == 1
    assert refused(monitor, "LRANGE", "ggufq.cpu.h", "0", "-1")  # no message's content
    assert refused(monitor, "GET", "ggufq:job:j1:custody")
    pubsub = monitor.pubsub()
    with pytest.raises(redis.exceptions.NoPermissionError):
        pubsub.psubscribe("ggufq:*")  # no job's tokens
        pubsub.get_message(timeout=1)
    pubsub.close()
    if int(acl_redis["major"]) >= 7:  # read-only key patterns: it cannot take a job...
        assert refused(monitor, "RPOP", "ggufq.cpu.h")
        # ... nor bind a queue of its own to a job queue's exchange
        assert refused(monitor, "SADD", "_kombu.binding.ggufq.cpu.h", "a copy of every job")
    # its event receiver's own bindings, as kombu keeps them and drops them as it stops
    for table in ("_kombu.binding.celeryev", "_kombu.binding_permanent.celeryev"):
        assert monitor.sadd(table, "x") == 1 and monitor.srem(table, "x") == 1
    monitor.close()


@pytest.mark.parametrize("binary", servers(), ids=lambda b: f"redis{server_major(b)}")
def test_rules_for_a_redis_of_unknown_version_load_on_every_version(
    binary: str, tmp_path: Path
) -> None:
    users = Users.fresh()
    server = EmbeddedRedis(tmp_path / "redis", users=users, binary=binary)
    server.major = 0  # as when `redis-server --version` does not say
    server.start()  # raises StackFailed with the server's log if it refused the file
    try:
        worker = redis.Redis.from_url(server.role_url(Role.WORKER))
        assert worker.ping() and refused(worker, "GET", "ggufq-auth:key:x")
        worker.close()
    finally:
        server.stop()


def test_the_stack_runs_each_process_as_its_role(stack: LocalStack) -> None:
    admin = redis.Redis.from_url(stack.redis_url)
    users = {client["user"] for client in admin.client_list()}
    admin.close()
    assert {"placement", "worker"} <= users, users


def test_a_command_refused_to_its_user_says_so(acl_redis: dict[str, str]) -> None:
    out = ggufq("keys", "list", env={"GGUFQ_REDIS_URL": acl_redis["worker"]})
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "Redis refused this to the user of GGUFQ_REDIS_URL" in out.stderr
    assert "administrator" in out.stderr
    out = ggufq("keys", "list", env={"GGUFQ_REDIS_URL": acl_redis["default"]})
    assert out.returncode == 0, out.stderr
