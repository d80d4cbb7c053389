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
    finished = ("ggufq_jobs_finished_total", tiny)
    assert after[finished] == before.get(finished, 0) + 1
    tokens = ("ggufq_tokens_generated_total", tiny)
    assert after[tokens] == before.get(tokens, 0) + (result.eval_count or 0)
    assert after[("ggufq_model_loads_total", tiny)] >= 1


def _serving(port: int) -> bool:
    try:
        scrape(port)
        return True
    except OSError:
        return False
