"""The TraceQL checker against cases from Tempo v2.8.2's own tests.

The tables paraphrase pkg/traceql/test_examples.yaml (its valid, validate_fails and
unsupported queries all parse; its parse_fails must not), parse_test.go and
lexer_test.go, plus the string-escape cases behind the dashboard's regex filters.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from traceql_grammar import TEMPO_VERSION, TraceQLError, _tables, parse

# Queries Tempo's parser accepts.
VALID = [
    # spanset filters, comparisons, statics
    "{}",
    "{ }",
    "{ true }",
    "{ !true }",
    "{ true && false }",
    "{ 1 >= 2 }",
    "{ -1 = 2 }",
    '{ "test" =~ "test" }',
    '{ "test" !~ "test" }',
    "{ .a }",
    "{ -.a = 2 }",
    '{ .a != "test" }',
    '{ !("test" != .c || ((true && .b) || 3 < .a)) }',
    "{ status = ok }",
    "{ status != error }",
    "{ span:status = unset }",
    '{ statusMessage =~ ".*" }',
    "{ kind = consumer }",
    "{ kind = unspecified || kind = internal || kind = server || kind = producer }",
    "{ traceDuration > 1s }",
    '{ rootServiceName = "foo" }',
    '{ rootName != "foo" }',
    "{ 1 <= 1.1 }",
    "{ 1 = 1. }",
    "{ .1 + 1 }",
    "{ .foo * -1. = -1 }",
    "{ span.foo != 3.0 }",
    "{ childCount > 2 }",
    "{ nestedSetLeft > 3 }",
    "{ .a = 1 || .b = 2 }",
    "{ (.a + .b) * .c ^ 2 % 3 > 1 }",
    "{ .a != nil }",
    "{ nil != .a }",
    "{ nil = nil }",
    # scopes and attribute names
    "{ resource.a != 3 } && { span.a != 3 } && { parent.a != 3 }",
    '{ event.foo = "bar" } && { link.foo = "bar" } && { instrumentation.foo = "bar" }',
    "{ parent.resource.a && true }",
    "{ parent.span.a > 3 }",
    "{ parent.duration = 1h }",
    "{ .foo.bar.baz = 1 }",
    "{ .foo.3 = 1 }",
    "{ .http-status = 1 }",
    "{ .http+ = 1 }",
    "{ .\U0001f61d = 1 }",
    '{ ."bar z".foo = 1 }',
    '{ span."bar z".foo."bar" = 1 }',
    '{ .foo."bar \\" baz" = 1 }',
    '{ .foo."bar \\\\ baz" = 1 }',
    '{ ."foo.bar" = 1 }',
    "{ .count = 1 && .max = 2 && .status = 3 }",
    "{ span.resource.foo = 1 }",
    "{ span.vllm.journey.queued_ms >= 0 }",
    "{.a=1}",
    # scoped intrinsics
    "{ trace:duration > 2s }",
    '{ trace:rootName = "a" }',
    '{ trace:rootService = "a" }',
    '{ trace:id = "aasdf4ergf" }',
    "{ span:duration > 2s }",
    "{ span:kind = client }",
    '{ span:name = "a" && span:statusMessage = "b" }',
    '{ span:id = "61626364656667" && span:parentID = "84737586494" }',
    '{ event:name = "exception" }',
    "{ event:timeSinceStart > 1s }",
    '{ link:traceID = "f1f1" && link:spanID = "f1f1" }',
    '{ instrumentation:name = "grpc" && instrumentation:version = "v3.34" }',
    # durations
    "{ duration > 1ns }",
    "{ duration > 1us }",
    "{ duration > 1\u00b5s }",
    "{ duration > 5ms }",
    "{ duration > 1.5s }",
    "{ duration > 1.5m }",
    "{ duration > 1h15m30.918273645s }",
    "{ duration > 1d }",
    "{ duration > 1w }",
    "{ duration > 1y }",
    "{ 1 < .24h }",
    "{ duration > 1s * 2s }",
    # spanset operators
    "{ true } && { true }",
    "{ true } || { true }",
    "{ true } >> { true }",
    "{ true } << { true }",
    "{ true } > { true }",
    "{ true } < { true }",
    "{ true } ~ { true }",
    "{ true } !> { true }",
    "{ true } !< { true }",
    "{ true } !~ { true }",
    "{ true } !>> { true }",
    "{ true } !<< { true }",
    "{ true } &> { true }",
    "{ true } &< { true }",
    "{ true } &~ { true }",
    "{ true } &>> { true }",
    "{ true } &<< { true }",
    "{ true } && { false } >> { `a` }",
    "({ true } >> { false }) && { `a` }",
    "({ true }) && ({ false })",
    "({ .a } | { .b }) > (({ .a } | { .b }) && ({ .a } | { .b }))",
    "({ true } | count() > 1 | { false }) ~ ({ true } | count() > 1 | { false })",
    "({ true } | count() > 1 | { false }) || ({ true } | count() > 1 | { false })",
    # pipelines, scalar filters, aggregates
    "avg(.field) > 1",
    "max(duration) >= 1s",
    "count() > 1",
    "sum(true) > 1",
    "avg(`c`) > 1",
    "avg(.foo) > count() + sum(.bar)",
    "{ true } | max(duration) = 1h",
    "{ true } | min(duration) = 1h",
    "{ true } | sum(duration) = 1h",
    "{ true } | max((1 + .a) * 2) = 1",
    "max(duration) > 3s | { status = error || .http.status = 500 }",
    "{ true } | { .a }",
    "{ true } | count() = 1 | { true }",
    "{ .a } | count() > 2",
    "{ .a } | avg(duration) > 1s",
    "{ .a } | by(.namespace) | coalesce() | avg(duration) = 1s ",
    "{ true } | by(3 * .field - 2) | max(duration) < 1s",
    "by(.a) | { true }",
    "select(.a)",
    "{} | select(.a,.b,.c)",
    "{ } >> { kind = server } | select(nestedSetLeft, nestedSetRight, nestedSetParent)",
    "({ .a } | count()) = ({ .a } | count())",
    "({ true } | count()) + ({ true } | count()) = 1",
    "3 = 2",
    "avg(.field) > 1 - 3",
    # metrics and second stage
    "{} | rate()",
    "{} | count_over_time() by (name) with(sample=0.1)",
    "{ } | count_over_time() by(name, span.http.status_code)",
    "{} | min_over_time(duration) by (span.http.path)",
    "{} | max_over_time(duration) by (span.http.path)",
    "{} | avg_over_time(duration) by (span:name) | topk(10)",
    "{} | sum_over_time(duration) by (span.http.path)",
    "{} | quantile_over_time(duration, 0, 0.9, 1) by (span.http.path)",
    "{} | quantile_over_time(duration, .5, .9)",
    "{} | histogram_over_time(duration)",
    "{} | histogram_over_time(duration) by (resource.service.name)",
    "{} | rate() by (span.client_ip) | bottomk(10)",
    "{} | count_over_time() by (name) | topk(10) with(sample=0.1)",
    "{} | compare({status=error})",
    "{} | compare({status=error}, 5, 0, 10)",
    '{ } | rate() with(foo="bar")',
    # comments, whitespace
    "{ .a = 1 } // a comment",
    "{ .a = 1 } /* a comment */ | rate()",
    "{\n  .a = 1\n}",
]

# Queries Tempo's parser rejects.
INVALID = [
    "",
    "true",
    "[ true ]",
    "( true )",
    "wharblgarbl",
    "{ . }",
    "{ < }",
    "{ .a < }",
    "{ .a < 3",
    "{ (.a < 3 }",
    "{ attribute = 4 }",
    "{ .attribute == 4 }",
    "{ span. }",
    "{ parent. }",
    "{ . foo }",
    '{ . "foo" }',
    "{ .foo .bar }",
    '{ ."foo }',
    ".3foo",
    "{ 2 <> 3}",
    "{ + }",
    "{ .a } | { .b",
    "{ .a | .b }",
    "({ .a } | { .b }",
    "{ true } &&",
    "{ true } + { true }",
    "{ true } = { true }",
    "{ true } >= { true }",
    'max(name) = "foo"',
    "max(status) = ok",
    "avg(.field) + 1",
    "min(childCount) && 2",
    "select(.a",
    "select()",
    'select(1 + "string")',
    "coalesce()",
    "coalesce() | { true }",
    "count() > 3 && { true }",
    "{ true } | count()",
    "{ true } | notAnAggregate() = 1",
    "{ true } | count = 1",
    "{ true } | max() = 1",
    "{ true } | by()",
    "by(.a) && { .b }",
    "count(",
    "count(avg)",
    "count(.thing)",
    "({ true }) && (count())",
    "({ true } | count()) && ({ true } | count()) = 1",
    "(by(namespace) | count()) > 2 * 2",
    "2 < (by(namespace) | count())",
    "(avg(.foo) > count()) + sum(.bar)",
    "{ trace:status = error }",
    '{ trace:name = "a" }',
    '{ trace:rootServiceName = "a" }',
    '{ span:rootName = "bar" }',
    "{ :duration > 1s }",
    "{ parent:id = 1 }",
    "{} | topk(10)",
    "{} | bottomk(10) with(sample=0.1)",
    "{} | rate() | topk(-1)",
    "{ parent = nil }",
    "{ .foo = nil }",
    "{ duration > 1t }",
    "{ duration > 1.5d }",
    "{} | quantile_over_time(duration)",
    "{} | rate(duration)",
    "{} | count_over_time() | rate()",
    "{ .a = 1 } /* unterminated",
]

# The dashboard's shapes, with Grafana's variables rendered.
MODEL_REGEX = r"Qwen\/Qwen2\.5-0\.5B-Instruct"  # ${model:regex} for Qwen/Qwen2.5-0.5B-Instruct
HOST_REGEX = r"vllm-0\.node-a\.svc"
SELECT = "select(span.vllm.request.id, span.vllm.journey.ttft_ms, span.gen_ai.usage.input_tokens)"


def _filter(model: str, host: str, quote: str = '"') -> str:
    return (
        f'{{name="vllm.request" && resource.vllm.model.name=~{quote}{model}{quote}'
        f" && resource.host.name=~{quote}{host}{quote}}}"
    )


@pytest.mark.parametrize("query", VALID)
def test_tempo_accepts(query: str) -> None:
    parse(query)


@pytest.mark.parametrize("query", INVALID)
def test_tempo_rejects(query: str) -> None:
    with pytest.raises(TraceQLError):
        parse(query)


@pytest.mark.parametrize(
    ("query", "ok"),
    [
        (r'{ .a = "Qwen\/Qwen2\.5" }', False),  # strconv.Unquote: \/ and \. do not exist
        (r'{ .a =~ "a\.b" }', False),
        (r'{ .a =~ "a\/b" }', False),
        (r'{ .a =~ "a\\.b" }', True),  # an escaped backslash, then a dot
        (r'{ .a =~ "Qwen\\/Qwen2\\.5" }', True),
        (r'{ .a = "true\"" }', True),
        (r'{ .a = "\a\b\f\n\r\t\v" }', True),
        (r'{ .a = "\101\x41\u00e9\U0001F600" }', True),
        (r'{ .a = "\400" }', False),  # octal above \377
        (r'{ .a = "\ud800" }', False),  # a surrogate half
        (r'{ .a = "\x4" }', False),
        (r"{ .a = '\'' }", False),  # a 'c' char literal lexes as an identifier
        (r'{ .a = "\'" }', False),  # \' only exists inside single quotes
        ('{ .a = "a\nb" }', False),  # a newline ends a "string"
        ('{ .a = "open }', False),
        (r"{ .a =~ `Qwen\/Qwen2\.5` }", True),  # raw strings take backslashes literally
        ("{ .a = `a\nb` }", True),
        ("{ .a = `open }", False),
        ('{ ."a\\.b" = 1 }', False),  # quoted attribute names allow only \" and \\
    ],
)
def test_string_escapes(query: str, ok: bool) -> None:
    if ok:
        parse(query)
    else:
        with pytest.raises(TraceQLError):
            parse(query)


def test_regex_formatted_variable_in_double_quotes_is_rejected() -> None:
    query = _filter(MODEL_REGEX, HOST_REGEX) + " | quantile_over_time(duration, .5, .95, .99)"
    offset = query.index("\\/")
    with pytest.raises(TraceQLError, match=rf"invalid char escape \\/ .* at offset {offset} in: "):
        parse(query)


@pytest.mark.parametrize(
    ("model", "host"),
    [
        (MODEL_REGEX, HOST_REGEX),  # one value each
        (rf"({MODEL_REGEX}|meta-llama\/Llama-3\.1-8B)", HOST_REGEX),  # several values
        (".*", ".*"),  # All: the variables' allValue, not escaped
    ],
)
def test_regex_formatted_variable_in_backticks_parses(model: str, host: str) -> None:
    base = _filter(model, host, quote="`")
    for tail in [
        " | quantile_over_time(duration, .5, .95, .99)",
        " | quantile_over_time(span.vllm.journey.queued_ms, .95)",
        " | sum_over_time(span.gen_ai.usage.cache_read.input_tokens)",
        " | max_over_time(span.vllm.journey.tracer.lost_spans) by (resource.host.name)",
        " | rate()",
        " | " + SELECT,
    ]:
        parse(base + tail)
    parse(base.replace("}", " && duration > 10s && span.vllm.journey.num_preemptions >= 1}"))


def test_pipe_formatted_variable_in_double_quotes_parses() -> None:
    parse(_filter("Qwen/Qwen2.5-0.5B-Instruct|meta-llama/Llama-3.1-8B", "vllm-0.node-a.svc"))


def test_yacc_conflict_is_resolved_like_goyacc() -> None:
    # expr.y's one unresolved shift/reduce conflict: after `( {...}` a `)` is shifted, so the
    # parenthesised filter becomes a spanset expression, which cannot join a pipeline.
    parse("({ .a } | count() > 1) && ({ .b })")
    with pytest.raises(TraceQLError, match=r"unexpected '\|'"):
        parse("({ .a }) && ({ .b } | count() > 1)")


def test_automaton_matches_goyacc() -> None:
    tables = _tables()
    # goyacc on v2.8.2's expr.y: 213 rules (with $accept), 428 states, 1 shift/reduce conflict.
    assert len(tables.rules) == 213
    assert len(tables.actions) == 428
    assert [token for _, token in tables.unresolved] == [")"]


def test_parent_scope_is_sticky() -> None:
    # lexer.go keeps the last scope; after parent.x, `.span.y` lexes as `.`, `span.`.
    parse("{ parent.x = 1 && span.y = 2 }")
    with pytest.raises(TraceQLError, match=r"unexpected 'span\.'"):
        parse("{ parent.x = 1 && .span.y = 2 }")


def test_numbers() -> None:
    for good in ["{ .a = 0755 }", "{ .a = 1e3 }", "{ .a = 0x1p-2 }", "{ .a = 1_0.5 }"]:
        parse(good)
    for bad in ["{ .a = 08 }", "{ .a = 0x1F }", "{ .a = 1_000 }", "{ .a = 1e }", "{ .a = 1e400 }"]:
        with pytest.raises(TraceQLError):
            parse(bad)


def test_error_names_the_offset() -> None:
    with pytest.raises(TraceQLError, match=r"syntax error at offset 5: unexpected '\|'"):
        parse("{ .a | .b }")


def test_the_grammar_is_the_one_of_the_tempo_the_kit_runs() -> None:
    """The compose file's default Tempo (and the manual's table of defaults) is the
    release this checker was written from: a dashboard query checked here is one
    that Tempo parses. A user who picks another TEMPO_VERSION runs unchecked queries."""
    root = Path(__file__).resolve().parents[2]
    compose = (root / "docker-compose.yml").read_text()
    (pinned,) = re.findall(r"grafana/tempo:\$\{TEMPO_VERSION:-([^}]+)\}", compose)
    assert pinned == TEMPO_VERSION
    table = (root / "docs" / "configuration.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| `OTELCOL_VERSION`"))
    names = re.findall(r"`([A-Z_]+_VERSION)`", row.split("|")[1])
    values = re.findall(r"`([^`]+)`", row.split("|")[2])
    assert dict(zip(names, values, strict=True))["TEMPO_VERSION"] == TEMPO_VERSION
