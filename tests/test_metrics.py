"""Prometheus metrics, scraped from the placement service of the real stack."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from api_client import Client
from scheduler.local.stack import LocalStack
from tests.conftest import wait_for

GREEDY = {"temperature": 0, "num_predict": 4}


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_endpoint_reports_devices_runners_jobs_and_counters(
    stack: LocalStack, client: Client
) -> None:
    port = stack.settings.metrics_port
    assert wait_for(lambda: _serving(port))
    before = scrape(port)
    result = client.generate("tiny", "the sky is", options=GREEDY)
    finished = ("ggufq_jobs_finished_total", (("model", "tiny"),))
    # the counters follow the job's end, which its reader saw first
    assert wait_for(lambda: scrape(port).get(finished, 0) == before.get(finished, 0) + 1)
    after = scrape(port)
    device = (("device", "cpu:testhost"), ("kind", "cpu"), ("worker", "ggufq-cpu@testhost"))
    assert after[("ggufq_device_total_bytes", device)] > 0
    assert after[("ggufq_device_up", device)] == 1
    assert after[("ggufq_device_reserved_bytes", device)] >= 0
    assert after[("ggufq_runners", (("model", "tiny"), ("state", "ready")))] >= 1
    for state in ("parked", "queued", "running"):  # counted from key sizes: none left
        assert after[("ggufq_jobs", (("state", state),))] == 0
    assert not [k for k in after if k[0] == "ggufq_parked_jobs"]  # no model has one parked
    tiny = (("model", "tiny"),)
    tokens = ("ggufq_tokens_generated_total", tiny)
    assert after[tokens] == before.get(tokens, 0) + (result.eval_count or 0)
    assert after[("ggufq_model_loads_total", tiny)] >= 1
    # the job's timings: one more observation in each histogram, in a bucket its value fits
    waited = (("model", "tiny"), ("tenant", "default"))
    for name, labels in (
        ("ggufq_job_queue_wait_seconds", waited),
        ("ggufq_job_time_to_first_token_seconds", tiny),
        ("ggufq_job_tokens_per_second", tiny),
    ):
        count = (f"{name}_count", labels)
        assert after[count] == before.get(count, 0) + 1, name
        assert after[(f"{name}_sum", labels)] > before.get((f"{name}_sum", labels), 0)
        inf = (f"{name}_bucket", tuple(sorted((*labels, ("le", "+Inf")))))
        assert after[inf] == after[count]


def test_an_expired_runner_is_counted(stack: LocalStack, client: Client) -> None:
    port = stack.settings.metrics_port
    expiries = ("ggufq_model_expiries_total", (("model", "tiny"),))
    before = scrape(port).get(expiries, 0)
    client.generate("tiny", "hi", options=GREEDY, keep_alive=0)  # unloads as it ends
    assert wait_for(lambda: scrape(port).get(expiries, 0) >= before + 1)


def _serving(port: int) -> bool:
    try:
        scrape(port)
        return True
    except OSError:
        return False
