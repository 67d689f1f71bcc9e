"""Prometheus metrics of one gateway process (its own registry, so several apps can live in one process)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from gateway.sizedlru import CacheSize

MAX_UNKNOWN_FIELD_LABELS = 64  # distinct unknown field names kept as label values; the rest count as "_other"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _CacheCollector:
    """Reads the caches' sizes when /metrics is scraped (nothing on a turn's path)."""

    def __init__(self, sizes: Callable[[], Iterable[CacheSize]]) -> None:
        self.sizes = sizes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        entries = GaugeMetricFamily("agentrl_gateway_cache_entries", "entries held by an in-process cache",
                                    labels=["cache"])
        fill = GaugeMetricFamily("agentrl_gateway_cache_fill",
                                 "share of an in-process cache's bound it holds (1: full; its memory stops "
                                 "growing)", labels=["cache"])
        for size in self.sizes():
            entries.add_metric([size.name], size.entries)
            fill.add_metric([size.name], size.used / size.limit if size.limit > 0 else 0.0)
        yield entries
        yield fill


def cache_gauges(text: str) -> dict[str, dict[str, float]]:
    """The cache gauges of a /metrics text: ``{cache: {"entries": n, "fill": share of its bound}}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("agentrl_gateway_cache_entries", "agentrl_gateway_cache_fill"):
            for sample in family.samples:
                out.setdefault(sample.labels["cache"], {})[family.name.rsplit("_", 1)[1]] = sample.value
    return out


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("agentrl_gateway_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.latency = Histogram("agentrl_gateway_request_seconds", "HTTP request latency by route",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.interactions = Counter("agentrl_gateway_interactions_recorded",
                                    "interactions (turns) recorded", ["kind"], registry=r)
        self.roots = Counter("agentrl_gateway_root_turns",
                             "turns recorded without a parent, by reason", ["reason"], registry=r)
        self.drift = Counter("agentrl_gateway_template_drift",
                             "child turns whose template re-render differs from the stitched tokens "
                             "(stitched anyway), or that could not be stitched, by reason", ["reason"],
                             registry=r)
        self.drift_checks = Counter("agentrl_gateway_template_drift_checks",
                                    "child turns whose history was re-rendered to look for template drift "
                                    "(a sample of the long ones: --drift-check-messages)", registry=r)
        self.tokens = Counter("agentrl_gateway_tokens", "tokens by kind (prompt sent, output recorded)",
                              ["kind"], registry=r)
        self.engine_seconds = Histogram("agentrl_gateway_engine_seconds", "engine time per choice",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.record_seconds = Histogram("agentrl_gateway_record_seconds",
                                        "time to durably record a response's turns",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.resumed = Counter("agentrl_gateway_resumed_generations",
                               "generations continued after an abort (pause/resume or engine loss)",
                               registry=r)
        self.held = Gauge("agentrl_gateway_held_generations", "generations held while engines are paused",
                          registry=r)
        self.pause_expired = Counter("agentrl_gateway_pause_expired",
                                     "pauses that outlived --pause-timeout-s and were resumed by the gateway",
                                     registry=r)
        self.weight_version = Gauge("agentrl_gateway_weight_version", "current policy weight version",
                                    registry=r)
        self.unknown_fields = Counter("agentrl_gateway_unknown_fields",
                                      "unknown request fields accepted and ignored (the first "
                                      f"{MAX_UNKNOWN_FIELD_LABELS} names seen; later ones as _other)",
                                      ["field"], registry=r)
        self._unknown_names: set[str] = set()
        self._caches: _CacheCollector | None = None

    def count_unknown_field(self, name: str) -> None:
        """Count an unknown request field. Its name comes from the client, so the label set is bounded:
        a client sending random field names must not grow the registry (and /metrics) without end."""
        label = name[:64]
        if label not in self._unknown_names:
            if len(self._unknown_names) >= MAX_UNKNOWN_FIELD_LABELS:
                label = "_other"
            else:
                self._unknown_names.add(label)
        self.unknown_fields.labels(label).inc()

    def watch_caches(self, sizes: Callable[[], Iterable[CacheSize]]) -> None:
        """Export the bounded caches' sizes (``agentrl_gateway_cache_entries`` / ``_fill``), read at scrape
        time. A second call (the app started again) replaces the first's source."""
        if self._caches is None:
            self._caches = _CacheCollector(sizes)
            self.registry.register(self._caches)  # type: ignore[arg-type]
        self._caches.sizes = sizes

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI middleware counting requests by route template and status (no per-request task)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_wrapper(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)
