"""Prometheus metrics of the whole cluster, served by each placement service.

Gauges are read from Redis at scrape time (devices, runners, jobs); counters and the job
timings' histograms are kept in Redis by the workers (``ggufq:stats``, ``ggufq:timings``),
so any placement service reports the same totals.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import redis
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from scheduler.store import keys
from scheduler.store.clock import redis_now
from scheduler.store.readers import ClusterReader
from scheduler.store.stats import COUNTERS, TIMINGS, histograms

log = logging.getLogger(__name__)


class ClusterCollector(Collector):
    def __init__(self, client: redis.Redis, device_ttl_s: float) -> None:
        self.r = client
        self.state = ClusterReader(client)
        self.device_ttl_s = device_ttl_s

    def collect(self) -> Iterator[Metric]:
        yield from self._devices()
        yield from self._runners()
        yield from self._jobs()
        yield from self._batches()
        yield from self._counters()
        yield from self._timings()

    def _devices(self) -> Iterator[Metric]:
        labels = ["device", "worker", "kind"]
        families = {
            "total": GaugeMetricFamily("ggufq_device_total_bytes", "Device memory.", labels=labels),
            "reserved": GaugeMetricFamily(
                "ggufq_device_reserved_bytes", "Memory reserved by runners.", labels=labels
            ),
            "free": GaugeMetricFamily(
                "ggufq_device_free_bytes",
                "Free memory: min(reported free, total - reserved).",
                labels=labels,
            ),
            "up": GaugeMetricFamily(
                "ggufq_device_up", "1 while the device heartbeats.", labels=labels
            ),
        }
        now = redis_now(self.state.r)  # beats are stamped on Redis's clock
        for d in self.state.devices():
            values = [d.id, d.worker, d.kind]
            up = now - d.heartbeat <= self.device_ttl_s
            for name, value in (("total", d.total), ("reserved", d.reserved), ("free", d.free)):
                families[name].add_metric(values, value)
            families["up"].add_metric(values, 1.0 if up else 0.0)
        yield from families.values()

    def _runners(self) -> Iterator[Metric]:
        runners = GaugeMetricFamily(
            "ggufq_runners", "Loaded runners (model instances).", labels=["model", "state"]
        )
        busy = GaugeMetricFamily(
            "ggufq_runner_jobs_in_flight", "Jobs assigned to runners.", labels=["model"]
        )
        counts: Counter[tuple[str, str]] = Counter()
        in_flight: Counter[str] = Counter()
        for r in self.state.runners():
            counts[(r.model, r.state)] += 1
            in_flight[r.model] += r.in_flight
        for (model, state), n in sorted(counts.items()):
            runners.add_metric([model, state], n)
        for model, n in sorted(in_flight.items()):
            busy.add_metric([model], n)
        yield runners
        yield busy

    def _jobs(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily(
            "ggufq_jobs", "Jobs not ended, by state (parked, queued, running).", labels=["state"]
        )
        for state, count in self.state.job_counts().items():
            jobs.add_metric([state], count)
        yield jobs
        parked = GaugeMetricFamily(
            "ggufq_parked_jobs", "Jobs parked (waiting for memory or a slot).", labels=["model"]
        )
        by_model: dict[bytes, bytes] = self.r.hgetall(keys.PARKED_MODELS)  # type: ignore[assignment]
        for model, n in sorted(by_model.items()):
            if int(n) > 0:
                parked.add_metric([model.decode()], float(n))
        yield parked

    def _batches(self) -> Iterator[Metric]:
        """Server-side batches not ended (api_client/batches), by state, and their lines."""
        batches = GaugeMetricFamily(
            "ggufq_batches", "Server-side batches not ended, by state.", labels=["state"]
        )
        lines = GaugeMetricFamily(
            "ggufq_batch_lines",
            "Lines of the batches not ended: total, completed, failed.",
            labels=["count"],
        )
        states: Counter[str] = Counter()
        counts: Counter[str] = Counter()
        pipe = self.r.pipeline(transaction=False)
        active: set[bytes] = self.r.smembers(keys.BATCHES_ACTIVE)  # type: ignore[assignment]
        for batch_id in sorted(active):
            pipe.hmget(keys.batch(batch_id.decode()), "state", "total", "completed", "failed")
        for state, *numbers in pipe.execute():
            if state is not None:
                states[state.decode()] += 1
                for name, n in zip(("total", "completed", "failed"), numbers, strict=True):
                    counts[name] += int(n or 0)
        for state, n in sorted(states.items()):
            batches.add_metric([state], n)
        for name in ("total", "completed", "failed"):
            lines.add_metric([name], counts[name])
        yield batches
        yield lines

    def _counters(self) -> Iterator[Metric]:
        families = {
            key: CounterMetricFamily(name, doc, labels=["model"])
            for key, (name, doc) in COUNTERS.items()
        }
        raw: dict[bytes, bytes] = self.r.hgetall(keys.STATS)  # type: ignore[assignment]
        for field, value in sorted(raw.items()):
            name, _, model = field.decode().partition("|")
            if name in families:
                families[name].add_metric([model], float(value))
        yield from families.values()

    def _timings(self) -> Iterator[Metric]:
        families = {
            name: HistogramMetricFamily(t.metric, t.doc, labels=list(t.labels))
            for name, t in TIMINGS.items()
        }
        raw: dict[bytes, bytes] = self.r.hgetall(keys.TIMINGS)  # type: ignore[assignment]
        for hist in sorted(histograms(raw), key=lambda h: (h.name, h.labels)):
            families[hist.name].add_metric(list(hist.labels), hist.buckets(), hist.total)
        yield from families.values()


def serve_metrics(client: redis.Redis, port: int, device_ttl_s: float, host: str) -> Any:
    """Serve /metrics on ``host``:``port``; None (with a warning) when the port is taken."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(client, device_ttl_s))
    try:
        return start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.warning("metrics not served: port %d: %s (set GGUFQ_METRICS_PORT)", port, exc)
        return None
