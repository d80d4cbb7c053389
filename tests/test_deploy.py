"""The deployment files: docker-compose.yml validated by a compose implementation
(Debian's docker-compose; .ci/run installs it), and the container health check."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler.local.health import check
from scheduler.redis_urls import parse as parse_redis_url
from scheduler.settings import Settings, get_settings
from tests.conftest import needs_tool

ROOT = Path(__file__).resolve().parent.parent


def compose_config(tmp_path: Path, *files: str) -> dict[str, Any]:
    names = ("docker-compose.yml", "Dockerfile", "Dockerfile.cuda", ".env.example", *files)
    for name in names:
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copy(ROOT / ".env.example", tmp_path / ".env")
    shutil.copy(ROOT / "ggufq.env.example", tmp_path / "ggufq.env")
    chosen = [arg for name in ("docker-compose.yml", *files) for arg in ("-f", name)]
    out = subprocess.run(
        ["docker-compose", *chosen, "config"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)  # type: ignore[no-any-return]


@needs_tool("docker-compose", "apt-get install docker-compose")
def test_compose_file_is_valid_and_complete(tmp_path: Path) -> None:
    config = compose_config(tmp_path)
    services = config["services"]
    assert {"redis", "placement", "worker-gpu0", "worker-gpu1", "flower"} <= set(services)
    assert services["worker-cpu"]["profiles"] == ["cpu"]  # started with --profile cpu
    assert services["worker-cpu"]["command"] == ["worker", "--cpu"]
    redis_cmd = services["redis"]["command"]
    assert "noeviction" in redis_cmd and "--appendonly" in redis_cmd
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no health check"
    for index in (0, 1):
        worker = services[f"worker-gpu{index}"]
        (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [str(index)] and device["capabilities"] == ["gpu"]
        assert worker["environment"]["GGUFQ_HOST_ID"] == f"gpuhost-{index}"
        assert worker["build"]["dockerfile"] == "Dockerfile.cuda"
        assert any(str(v).endswith("/models:ro") for v in worker["volumes"])
    assert redis_cmd[redis_cmd.index("--aclfile") + 1] == "/etc/redis/users.acl"
    assert "--requirepass" not in redis_cmd  # the ACL file's default user has it
    assert any(str(v).endswith(":/etc/redis/users.acl:ro") for v in services["redis"]["volumes"])
    for name, service in services.items():  # each process as its role's ACL user
        if name != "redis":
            env = service["environment"]
            url = env["GGUFQ_REDIS_URL"]
            assert url.startswith(f"redis://{ROLES[name]}:change-me-{ROLES[name]}@redis:6379/0")
            assert env["GGUFQ_NUM_PARALLEL"] == "4"  # ggufq.env's settings
            # and no other password: not the administrator's, not another role's
            assert not [k for k in env if k.endswith("PASSWORD")], name
            assert not [v for v in env.values() if "change-me" in str(v) and v != url], name


ROLES = {
    "placement": "placement",
    "worker-gpu0": "worker",
    "worker-gpu1": "worker",
    "worker-cpu": "worker",
    "flower": "monitor",
}


@needs_tool("docker-compose", "apt-get install docker-compose")
def test_the_tls_override_puts_every_process_on_tls(tmp_path: Path) -> None:
    services = compose_config(tmp_path, "docker-compose.tls.yml")["services"]
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--port") + 1] == "0"  # no plain port
    assert redis_cmd[redis_cmd.index("--tls-port") + 1] == "6380"
    assert "noeviction" in redis_cmd and "--aclfile" in redis_cmd
    for name, service in services.items():
        if name == "redis":
            continue
        url = service["environment"]["GGUFQ_REDIS_URL"]
        role = ROLES[name]
        assert url.startswith(f"rediss://{role}:change-me-{role}@redis:6380/0?ssl_cert_reqs="), name
        assert any(str(v).endswith("/tls:ro") for v in service["volumes"]), name
        assert any(str(v).endswith("/models:ro") for v in service["volumes"]), name


def test_health_check_sees_the_stack(stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGUFQ_REDIS_URL", stack.redis_url)
    monkeypatch.setenv("GGUFQ_HOST_ID", stack.settings.host_id)
    get_settings.cache_clear()
    try:
        assert check("placement") is None
        assert check("worker") is None
        monkeypatch.setenv("GGUFQ_HOST_ID", "elsewhere")
        get_settings.cache_clear()
        assert check("worker") == "no device of host 'elsewhere' is registered and heartbeating"
    finally:
        get_settings.cache_clear()


@needs_tool("docker-compose", "apt-get install docker-compose")
def test_the_sentinel_override_puts_every_process_behind_three_sentinels(tmp_path: Path) -> None:
    services = compose_config(tmp_path, "docker-compose.sentinel.yml")["services"]
    replica = services["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1 :][:2] == ["redis", "6379"]
    for name in ("redis", "redis-replica"):  # either may be the primary after a failover
        command = services[name]["command"]
        assert command[command.index("--masterauth") + 1] == "change-me", name
        assert "noeviction" in command and "--aclfile" in command, name
    for n in (1, 2, 3):
        script = " ".join(services[f"sentinel{n}"]["entrypoint"])
        assert "sentinel monitor ggufq redis 6379 2" in script
        assert "down-after-milliseconds ggufq 2000" in script
        assert services[f"sentinel{n}"]["environment"]["REDIS_PASSWORD"] == "change-me"
    for name, role in ROLES.items():
        url = services[name]["environment"]["GGUFQ_REDIS_URL"]
        parsed = parse_redis_url(url)
        assert parsed.master == "ggufq" and parsed.username == role, name
        assert parsed.password == f"change-me-{role}", name
        assert parsed.sentinels == tuple((f"sentinel{n}", 26379) for n in (1, 2, 3)), name
        assert Settings(redis_url=url).redis_url == url  # the settings take it as it is
