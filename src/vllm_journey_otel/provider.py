"""A private OpenTelemetry TracerProvider configured from the standard OTEL_* variables.

Its sampler is always-on: head sampling and the tail rule are decided per
request in the engine (``sampling.py``), from the same OTEL_TRACES_SAMPLER values.

Private: never installed as the global provider, since vLLM may have set its own
(``--otlp-traces-endpoint``) and the two must not fight. Everything the SDK reads
itself (endpoint, headers, TLS, timeouts, OTEL_BSP_*, OTEL_TRACES_SAMPLER,
OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES) stays with the SDK; we only choose
which exporter classes to build, through the SDK's own entry-point registry, so
``OTEL_TRACES_EXPORTER=otlp|console|none`` and
``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL=grpc|http/protobuf`` behave as the SDK's
auto-configuration documents.

Created in the engine-core process only (after fork or spawn), when the first
Scheduler is built.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.util.types import AttributeValue

from . import schema as S
from .config import logger
from .health import ExportHealth, HealthExporter
from .spans import PresetIdGenerator

TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
LINK_COUNT_LIMIT = "OTEL_SPAN_LINK_COUNT_LIMIT"
# A vllm.step span links every traced journey of its batch: the SDK's default
# limit (128 links) is below vLLM's usual max_num_seqs, so ours is this, unless
# the user set OTEL_SPAN_LINK_COUNT_LIMIT. Journey spans carry at most one link.
MAX_LINKS = 16384
SDK_DISABLED = "OTEL_SDK_DISABLED"


def sdk_disabled(env: Mapping[str, str] | None = None) -> bool:
    """True when OTEL_SDK_DISABLED asks for no telemetry at all."""
    env = os.environ if env is None else env
    return env.get(SDK_DISABLED, "").strip().lower() == "true"


def exporter_names(env: Mapping[str, str] | None = None) -> list[str]:
    """Entry-point names of the span exporters asked for; ``otlp`` when unset."""
    env = os.environ if env is None else env
    raw = env.get(TRACES_EXPORTER, "otlp").strip() or "otlp"
    if raw.lower() == "none":
        return []
    from opentelemetry.sdk._configuration import _get_exporter_entry_point

    return [_get_exporter_entry_point(name.strip(), "traces") for name in raw.split(",")]


def build_exporters(env: Mapping[str, str] | None = None) -> list[SpanExporter]:
    """Instantiate the configured exporters; each reads its own OTEL_* settings."""
    from opentelemetry.sdk._configuration import _import_exporters

    names = exporter_names(env)
    classes, _, _ = _import_exporters(names, [], [])
    return [cls() for cls in classes.values()]


class _Resource(Resource):
    """A Resource that computes its hash once.

    The SDK's OTLP encoder groups the spans of a batch by resource, hashing it
    for every span, and ``Resource.__hash__`` is a sorted JSON dump of all its
    attributes: ~4.6 us a span, ~8 % of the exporter process's CPU. A Resource
    is immutable (its attributes cannot change after creation), so the hash can
    be kept; equality is unchanged.
    """

    _hash: int | None = None

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = super().__hash__()
        return self._hash


def make_resource(attributes: Mapping[str, AttributeValue]) -> Resource:
    """Our resource attributes, overridden by OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME.

    ``service.name`` defaults to ``vllm`` (not the SDK's ``unknown_service:...``)
    unless the user named the service.
    """
    env_resource = Resource.create({})
    user = dict(env_resource.attributes)
    if str(user.get(S.RES_SERVICE_NAME, "")).startswith("unknown_service"):
        del user[S.RES_SERVICE_NAME]
    ours = Resource({S.RES_SERVICE_NAME: S.DEFAULT_SERVICE_NAME, **attributes})
    # In Resource.merge the argument's values win: the user's settings override ours.
    merged = ours.merge(Resource(user, env_resource.schema_url))
    return _Resource(merged.attributes, merged.schema_url)


# Our string attributes are short except the request id, which a client may set
# (X-Request-Id): without a limit, a megabyte id would travel in every span.
DEFAULT_ATTRIBUTE_VALUE_LENGTH = 1024
_LENGTH_VARIABLES = ("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT")


def span_limits(env: Mapping[str, str] | None = None) -> SpanLimits:
    """The SDK's limits from OTEL_*_LIMIT variables; unless set there, attribute
    values are cut at 1024 characters and a span keeps up to MAX_LINKS links (a
    vllm.step span links its whole batch). The SDK's other defaults stay (128
    attributes and events per span).
    """
    env = os.environ if env is None else env
    user_length = any(env.get(name, "").strip() for name in _LENGTH_VARIABLES)
    user_links = bool(env.get(LINK_COUNT_LIMIT, "").strip())
    # None: the SDK reads the user's OTEL_* limit (or its own default).
    return SpanLimits(
        max_attribute_length=None if user_length else DEFAULT_ATTRIBUTE_VALUE_LENGTH,
        max_links=None if user_links else MAX_LINKS,
    )


def make_tracer_provider(
    resource_attributes: Mapping[str, AttributeValue],
    exporters: Sequence[SpanExporter] | None = None,
    batch: bool = True,
    health: ExportHealth | None = None,
) -> TracerProvider:
    """A private provider exporting through ``exporters`` (default: from OTEL_* env).

    ``batch=False`` uses a SimpleSpanProcessor (tests with an in-memory exporter).
    With ``health``, every exporter is wrapped to count exported and failed spans.
    """
    # Sampling was decided per request in the engine (sampling.py): build all.
    # PresetIdGenerator: a journey's root gets ids chosen in the engine when other
    # spans link to it (the span that a preemption's cause is, for instance).
    provider = TracerProvider(
        resource=make_resource(resource_attributes),
        sampler=ALWAYS_ON,
        id_generator=PresetIdGenerator(),
        span_limits=span_limits(),
    )
    if exporters is None:
        exporters = build_exporters()
        if not exporters:
            logger.info("%s=none: journeys are recorded but not exported.", TRACES_EXPORTER)
    for i, exporter in enumerate(exporters):
        if health is not None and i == 0:
            # The first exporter's outcomes are the health counts (one exported /
            # failed count per span built); others (OTEL_TRACES_EXPORTER=a,b) are
            # left as the SDK made them.
            exporter = HealthExporter(exporter, health)
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
    return provider
