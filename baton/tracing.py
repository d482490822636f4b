"""OpenTelemetry tracing: one trace per request across the router, the prefill worker and the decode
worker, exported by OTLP over gRPC (what Jaeger and the OpenTelemetry Collector receive).

Off unless an endpoint is given (``baton serve --otlp-endpoint`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); off, every tracer is OpenTelemetry's no-op tracer and no
context is injected anywhere. The standard variables configure the rest: ``OTEL_SERVICE_NAME``
(default ``baton-router``, ``baton-prefill``, ``baton-decode``), ``OTEL_TRACES_SAMPLER`` and
``OTEL_TRACES_SAMPLER_ARG``, ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_BSP_*``. The launcher hands the
``OTEL_*`` variables it sees to the workers, which may run in other processes or on other nodes.

Context crosses process boundaries as W3C ``traceparent`` / ``tracestate``: in gRPC metadata between
client, router and workers, and in an explicit dict argument of the Ray actor call that pulls KV.
Each process has its own ``Tracing`` (provider, exporter, tracer); nothing is set globally, so
several stacks can share a process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


@dataclass(frozen=True)
class TracingConfig:
    endpoint: str | None = None  # OTLP/gRPC, e.g. http://127.0.0.1:4317; None: from the environment
    env: Mapping[str, str] = field(default_factory=dict)  # OTEL_* variables for processes started elsewhere

    @classmethod
    def from_env(cls, endpoint: str | None = None) -> TracingConfig:
        return cls(endpoint, {k: v for k, v in os.environ.items() if k.startswith("OTEL_")})

    @property
    def enabled(self) -> bool:
        if self.env.get("OTEL_SDK_DISABLED", "").lower() == "true" or self.env.get("OTEL_TRACES_EXPORTER") == "none":
            return False
        return bool(self.endpoint or any(self.env.get(v) for v in _ENDPOINT_VARS))


class Tracing:
    """A process's tracer: the SDK with an OTLP exporter when enabled, the no-op tracer otherwise."""

    def __init__(self, config: TracingConfig | None, component: str, instance: str | None = None) -> None:
        self.enabled = config is not None and config.enabled
        self._provider = None
        if not self.enabled:
            self.tracer: trace.Tracer = trace.NoOpTracer()
            return
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        for k, v in config.env.items():  # a worker process takes the launcher's settings
            os.environ.setdefault(k, v)
        attrs = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or f"baton-{component}",
                 "baton.component": component}
        if instance:
            attrs["service.instance.id"] = instance
        # The sampler comes from OTEL_TRACES_SAMPLER(_ARG) (parent-based always-on by default).
        self._provider = TracerProvider(resource=Resource.create(attrs))
        exporter = OTLPSpanExporter(endpoint=config.endpoint) if config.endpoint else OTLPSpanExporter()
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self._provider.get_tracer("baton")

    def force_flush(self, timeout_s: float = 5.0) -> None:
        if self._provider is not None:
            self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None

    # -- context across processes ---------------------------------------------------------------------

    def inject(self, span: Span | None = None) -> dict[str, str]:
        """The W3C carrier for ``span`` (default: the current span); empty when tracing is off."""
        if not self.enabled:
            return {}
        carrier: dict[str, str] = {}
        ctx = trace.set_span_in_context(span) if span is not None else None
        _PROPAGATOR.inject(carrier, context=ctx)
        return carrier

    def metadata(self, span: Span | None = None) -> list[tuple[str, str]]:
        """gRPC metadata carrying ``span``'s context."""
        return list(self.inject(span).items())


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> otel_context.Context:
    """A parent context from a W3C carrier: a dict or gRPC metadata (pairs). Empty: a new trace."""
    if carrier is None:
        return otel_context.Context()
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    return _PROPAGATOR.extract({k.lower(): v for k, v in items if isinstance(v, str)})


def to_ns(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1e9)


def child_span(tracer: trace.Tracer, name: str, parent: Span, start: float | None, end: float | None,
               attributes: Mapping | None = None) -> None:
    """A finished child span from recorded times (wall-clock seconds), e.g. a queue wait measured by the
    engine. Nothing when either time is unknown."""
    if start is None or end is None:
        return
    span = tracer.start_span(name, context=trace.set_span_in_context(parent), start_time=to_ns(start),
                             attributes=dict(attributes or {}))
    span.end(end_time=to_ns(max(end, start)))


def record_error(span: Span, error: BaseException | str, cancelled: bool = False) -> None:
    """Mark ``span`` failed (or cancelled: an attribute and an event, not an error)."""
    if cancelled:
        span.set_attribute("baton.cancelled", True)
        span.add_event("cancelled")
        return
    if isinstance(error, BaseException):
        span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, str(error)))


def record_rpc_error(span: Span, context, error: BaseException) -> None:
    """End-of-handler bookkeeping for a gRPC servicer: the status it aborted with (an abort raises a bare
    exception), or cancelled when the client went away."""
    if not context.is_active():
        record_error(span, error, cancelled=True)
        return
    code, details = context.code(), context.details()
    details = details.decode(errors="replace") if isinstance(details, bytes) else details
    record_error(span, f"{code.name}: {details}" if code is not None else error)
    if code is not None:
        span.set_attribute("rpc.grpc.status_code", code.value[0])


__all__ = ["Tracing", "TracingConfig", "child_span", "extract", "record_error", "record_rpc_error", "to_ns"]
