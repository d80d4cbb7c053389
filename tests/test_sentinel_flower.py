"""Flower behind Sentinel (issue 38): ``ggufq flower`` on a Redis URL that names sentinels
shows the workers before a failover of the primary, and after it, without a restart: the
workers it lists answer its inspection again, and the task events of the jobs run after it
reconnected reach it (its event receiver found the new primary by itself). Celery's events
are pub/sub: those sent while Flower reconnects are lost, and a job that ran in that
window stays unknown to Flower (its stream and result are not lost)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from api_client import Client
from scheduler.local.stack import LocalStack
from tests.conftest import settings_from, stack_env, wait_for
from tests.sentinels import Group, sentinel_group
from tests.test_flower import answers, flower_on, get
from tests.test_sentinel import SHORT, needs_tls_server, serves

WORKER = "ggufq-cpu@flowersentinel"
QUEUES = {"ggufq.cpu.flowersentinel", "ggufq.cpu.flowersentinel.batch"}


@pytest.fixture(params=[False, True], ids=["plain", "tls"])
def group(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Group]:
    """The sentinels and their primary over TCP, and over TLS only (rediss+sentinel://)."""
    if request.param:
        needs_tls_server()
    with sentinel_group(tmp_path / "redis", tls=request.param) as found:
        yield found


def test_flower_behind_sentinel_shows_the_workers_through_a_failover(
    group: Group, models_dir: Path, tmp_path: Path
) -> None:
    env = stack_env(models_dir, tmp_path / "state", host="flowersentinel")
    settings = settings_from(env, group.url)
    env["GGUFQ_REDIS_URL"] = group.url  # the children's
    logs = tmp_path / "logs"
    with (
        LocalStack(settings, log_dir=logs, extra_env=env) as stack,
        Client(group.url, settings=settings, timeout=60) as client,
        flower_on(group.url, stack.extra_env, tmp_path / "flower.log") as flower,
    ):

        def listed() -> bool:
            try:
                return WORKER in get(flower + "/api/workers?refresh=1")
            except (OSError, ValueError):  # Flower's inspection failed: not yet
                return False

        def queues() -> set[str]:  # the lengths of the queues the workers consume
            try:
                get(flower + "/api/workers?refresh=1")
                return {q["name"] for q in get(flower + "/api/queues/length")["active_queues"]}
            except (OSError, ValueError, KeyError):
                return set()

        def seen(job_id: str) -> bool:  # its task events reached Flower: it ran there
            info = flower + f"/api/task/info/{job_id}"
            return answers(info) and get(info)["state"] == "SUCCESS"

        assert wait_for(listed, timeout=60), f"see {tmp_path}"
        assert wait_for(lambda: QUEUES <= queues(), timeout=60)  # its broker page's data
        before = client.submit("tiny", "before", options=SHORT)
        assert before.result(timeout=60).done
        assert wait_for(lambda: seen(before.id), timeout=60)

        group.kill_primary()
        assert wait_for(lambda: group.primary_port() == group.replica, timeout=60)

        assert wait_for(lambda: serves(client), timeout=90), f"see {logs}"

        def a_new_job_is_seen() -> bool:
            # events are pub/sub: those sent while Flower reconnects are lost, so a job
            # that ran then stays unknown to it; the jobs after are seen
            job = client.submit("tiny", "after the failover", options=SHORT)
            assert job.result(timeout=60).done
            return wait_for(lambda: seen(job.id), timeout=5)

        # the same Flower, not restarted: its events and its inspection follow the failover
        assert wait_for(a_new_job_is_seen, timeout=120), f"see {tmp_path / 'flower.log'}"
        assert wait_for(listed, timeout=60)
        assert get(flower + "/api/workers?status=true").get(WORKER) is True
        assert wait_for(lambda: QUEUES <= queues(), timeout=60)  # read on the new primary
