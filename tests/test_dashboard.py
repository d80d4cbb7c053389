"""The Grafana dashboard over ggufq's metrics (examples/monitoring): every metric a panel
names is one the project exports, as a real placement service and a real gateway serve
them; and the compose file that starts Prometheus and Grafana beside the stack is valid."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from scheduler.local.stack import LocalStack
from tests.conftest import needs_tool
from tests.gateway_server import running_gateway
from tests.test_deploy import compose_config

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "examples" / "monitoring" / "grafana" / "dashboards" / "ggufq.json"
METRIC = re.compile(r"\bggufq_[a-z_]+")
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def exported(url: str) -> set[str]:
    """The metric families an endpoint serves (their HELP lines: samples or not; a
    counter's is named with its ``_total``)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {family(line.split()[2]) for line in text.splitlines() if line.startswith("# HELP ")}


def family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def test_every_metric_a_panel_names_is_exported(stack: LocalStack) -> None:
    families = exported(f"http://127.0.0.1:{stack.settings.metrics_port}/metrics")
    with running_gateway(stack.settings) as url:
        families |= exported(f"{url}/metrics")
    dashboard = json.loads(DASHBOARD.read_text())
    named = {
        (panel["title"], family(name))
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in METRIC.findall(target["expr"])
    }
    assert len({title for title, _ in named}) == len(dashboard["panels"])  # each names one
    missing = sorted((title, name) for title, name in named if name not in families)
    assert not missing, f"panels name metrics nobody exports: {missing}"
    assert {"ggufq_device_reserved_bytes", "ggufq_gateway_requests", "ggufq_parked_jobs"} <= {
        n for _, n in named
    }


def test_a_panel_naming_an_unknown_metric_would_be_caught() -> None:
    assert family("ggufq_gateway_requests_total") == "ggufq_gateway_requests"
    assert family("ggufq_gateway_time_to_first_byte_seconds_bucket") == (
        "ggufq_gateway_time_to_first_byte_seconds"
    )
    assert METRIC.findall("sum(rate(ggufq_nonexistent_total[5m]))") == ["ggufq_nonexistent_total"]


@needs_tool("docker-compose", "apt-get install docker-compose")
def test_the_monitoring_compose_file_provisions_prometheus_and_grafana(tmp_path: Path) -> None:
    services = compose_config(tmp_path, "docker-compose.monitoring.yml")["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert any(str(v).endswith(":/etc/prometheus/prometheus.yml:ro") for v in prometheus["volumes"])
    assert any(str(v).endswith(":/etc/grafana/provisioning:ro") for v in grafana["volumes"])
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "change-me-grafana"
    for service in (prometheus, grafana):
        assert "healthcheck" in service
        assert all(str(p).startswith("127.0.0.1:") for p in service["ports"])
    scrape = (ROOT / "examples" / "monitoring" / "prometheus.yml").read_text()
    assert "placement:9464" in scrape  # where compose's placement serves its metrics
