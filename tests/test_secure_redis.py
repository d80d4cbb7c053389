"""Redis with a password, and over TLS (rediss://), end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from api_client import Client
from scheduler.local.embedded import EmbeddedRedis
from scheduler.local.stack import LocalStack
from tests.conftest import settings_from, stack_env
from tests.tlsproxy import TLSProxy


def test_password_and_tls_end_to_end(models_dir: Path, tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", password="s3cret-pw")
    server.start()
    try:
        with TLSProxy(server.port, tmp_path) as proxy:
            url = (
                f"rediss://:s3cret-pw@127.0.0.1:{proxy.port}/0"
                f"?ssl_cert_reqs=required&ssl_ca_certs={proxy.ca_file}"
            )
            env = stack_env(models_dir, tmp_path / "state", host="secure")
            settings = settings_from(env, url)
            with LocalStack(settings, log_dir=tmp_path / "logs", extra_env=env) as st:
                with Client(st.redis_url, settings=settings, timeout=60) as client:
                    result = client.generate("tiny", "hi", options={"num_predict": 4})
                    assert result.done and result.device == "cpu:secure"
                    chunks = list(client.generate("tiny", "hi", stream=True))
                    assert chunks[-1].done
            wrong = url.replace("s3cret-pw", "wrong")
            with Client(wrong, settings=settings_from(env, wrong)) as bad:
                with pytest.raises(Exception, match="password"):
                    bad.health()
    finally:
        server.stop()
