"""The SDK's span exporters, the resource and the span limits, from the OTEL_* variables.

Process: the exporter process (``process`` mode) or the engine core (``thread``
mode), once, where the export stage is built. No timestamps.

Exporters are chosen as the SDK's auto-configuration chooses them, through the
public ``opentelemetry_traces_exporter`` entry-point group:
``OTEL_TRACES_EXPORTER=otlp|console|none|otlp_json_file|<any registered name>``,
``otlp`` resolved by ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL=grpc|http/protobuf``.
Each exporter reads its own OTEL_* settings (endpoint, headers, TLS, timeouts,
compression). Head sampling and the tail rule were decided per request in the
engine (``sampling.py``): every span that reaches here is exported.

Nothing is installed as a global provider: vLLM may have its own tracing
(``--otlp-traces-endpoint``), and the two must not fight.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import entry_points

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.util.types import AttributeValue

from vllm_journey_otel import schema as S
from vllm_journey_otel.config import TRACES_EXPORTER, exporter_names, user_span_limits
from vllm_journey_otel.export.otlp_exporters import FAST_EXPORTERS

ENTRY_POINT_GROUP = "opentelemetry_traces_exporter"
# A vllm.step span links every traced journey of its batch: the SDK's default
# limit (128 links) is below vLLM's usual max_num_seqs, so ours is this, unless
# the user set OTEL_SPAN_LINK_COUNT_LIMIT. Journey spans carry at most one link.
MAX_LINKS = 16384


def build_exporters(env: Mapping[str, str] | None = None) -> list[SpanExporter]:
    """Instantiate the configured exporters; each reads its own OTEL_* settings.

    The SDK's OTLP exporters are built as their subclasses of
    ``otlp_exporters.py`` (the same settings; our OTLP encoding).
    Raises ValueError naming an exporter no installed package registers.
    """
    registered = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    exporters = []
    for name in exporter_names(env):
        if name not in registered:
            raise ValueError(
                f"{TRACES_EXPORTER}: no installed package provides the span exporter {name!r} "
                f"(registered: {', '.join(sorted(registered))})"
            )
        cls = registered[name].load()
        # The SDK's OTLP exporters, with our encoder (otlp_exporters.py).
        exporters.append(FAST_EXPORTERS.get(cls, cls)())
    return exporters


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


def span_limits(env: Mapping[str, str] | None = None) -> SpanLimits:
    """The SDK's limits from OTEL_*_LIMIT variables; unless set there, attribute
    values are cut at 1024 characters and a span keeps up to MAX_LINKS links (a
    vllm.step span links its whole batch). ``span_builder.SpanBuilder`` applies
    the attribute length and link count.
    """
    user_length, user_links = user_span_limits(env)
    # None: the SDK reads the user's OTEL_* limit (or its own default).
    return SpanLimits(
        max_attribute_length=None if user_length else DEFAULT_ATTRIBUTE_VALUE_LENGTH,
        max_links=None if user_links else MAX_LINKS,
    )
