"""The gateway's Prometheus metrics, served at GET /metrics: requests by route, status and
API key, and the time to the first byte of each answer (for a stream: of its first chunk,
or of a keep-alive line when the job waited)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.responses import Response

_TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ggufq_gateway_requests",
            "HTTP requests answered by the gateway",
            ["route", "status", "key"],
            registry=self.registry,
        )
        self.ttfb = Histogram(
            "ggufq_gateway_time_to_first_byte_seconds",
            "From a request's arrival to the first byte of its answer's body",
            ["route"],
            buckets=_TTFB_BUCKETS,
            registry=self.registry,
        )

    def observe(self, route: str, status: int, key: str, ttfb_s: float | None) -> None:
        self.requests.labels(route, str(status), key).inc()
        if ttfb_s is not None:
            self.ttfb.labels(route).observe(ttfb_s)

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
