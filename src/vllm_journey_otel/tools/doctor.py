"""``vllm-journey doctor``: would a journey arrive? One line per check: ok, warn or FAIL.

Process: the operator's shell, where ``vllm serve`` will run (same Python and
environment). Main thread; a short-lived ``journey-doctor-export`` thread sends the
test span; a child process, started first and read last, runs the vLLM side
(``python -m vllm_journey_otel.engine.self_check``: the tools never import the
engine side, and a vLLM whose import crashes takes the child down, not us). Clocks:
``time.monotonic()`` for durations, ``time.time_ns()`` for the test span. The span
goes through the exporters ``export.exporters.build_exporters`` builds, in the
exporter process's environment, with a ``--timeout`` deadline; the SDK's exporters
say why an export failed only in log records, captured here (and kept off the
terminal) to name the cause, or else a direct connection does. Exit: 0 no FAIL, 1 a
FAIL, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from vllm_journey_otel import config, rng
from vllm_journey_otel import schema as S
from vllm_journey_otel.export import exporter_process
from vllm_journey_otel.export.exporters import build_exporters, make_resource
from vllm_journey_otel.export.file_exporter import OtlpJsonFileExporter
from vllm_journey_otel.export.health import SDK_LOGGERS
from vllm_journey_otel.log import logger
from vllm_journey_otel.switch import ENABLE, FALSE_WORDS, TRUE_WORDS

OK, WARN, FAIL = "ok", "warn", "FAIL"
EXIT_OK, EXIT_FAIL = 0, 1
SELF_CHECK = "vllm_journey_otel.engine.self_check"
SELF_CHECK_TIMEOUT_S = 180.0  # a cold import of vLLM and torch can take a minute
DEFAULT_TIMEOUT_S = 3.0
TEST_SPAN = "vllm-journey doctor"
# Captured ahead of the SDK's own DuplicateFilter (one record of a kind per 20 s).
CAPTURED = (*SDK_LOGGERS, "opentelemetry.exporter.otlp.proto.http._common", logger.name)
_V = config.OTLP
TRACES_ENDPOINT, ENDPOINT = config.OTLP_TRACES_ENDPOINT, config.OTLP_ENDPOINT
TRACES_TIMEOUT = config.OTLP_TRACES_TIMEOUT
FIX_FILE = f"point {config.FILE_PATH} at a file in a directory vllm serve's user can write"
FIX_ON = f"export {ENABLE}=1 where vllm serve runs (compose, Kubernetes: the container's env)"
if "grpc" not in sys.modules:  # before its import: else its C core prints TLS failures itself
    os.environ.setdefault(config.GRPC_VERBOSITY, "ERROR")


@dataclass
class Check:
    """One line of the report; ``more``: lines printed under it."""

    name: str
    verdict: str
    summary: str
    fix: str = ""
    more: list[str] = field(default_factory=list)


@contextmanager
def captured() -> Iterator[list[str]]:
    """The warnings of our logger and the SDK's exporters in the block, kept off the terminal."""
    said: list[str] = []
    loggers = [logging.getLogger(name) for name in CAPTURED]

    def keep(r: logging.LogRecord) -> bool:
        exc = r.exc_info[1] if r.exc_info else None
        if r.levelno >= logging.WARNING:
            said.append(r.getMessage() + (f" ({type(exc).__name__}: {exc})" if exc else ""))
        return False

    for lg in loggers:
        lg.filters.insert(0, keep)
    try:
        yield said
    finally:
        for lg in loggers:
            lg.removeFilter(keep)


# -- the switch, our settings, sampling ---------------------------------------------
def switch_check(env: Mapping[str, str]) -> Check:
    raw, sdk = env.get(ENABLE), env.get(config.SDK_DISABLED)
    value = (raw or "").strip().lower()
    if raw is None or value in FALSE_WORDS:
        said = "is unset" if raw is None else f"={raw!r} is off"
        return Check("switch", FAIL, f"{ENABLE} {said}: the plugin stays off", FIX_ON)
    if value not in TRUE_WORDS:
        with captured() as grab:
            config.from_env({ENABLE: raw})
        return Check("switch", FAIL, "; ".join(grab), FIX_ON)
    if config.sdk_disabled(env):
        why = f"{ENABLE}={raw!r} is on, but {config.SDK_DISABLED}=true keeps the plugin off"
        return Check("switch", FAIL, why, f"unset {config.SDK_DISABLED}")
    sdk_said = " unset" if sdk is None else f"={sdk!r} (only 'true' disables)"
    return Check("switch", OK, f"{ENABLE}={raw!r}: on; {config.SDK_DISABLED}{sdk_said}")


def settings_check(env: Mapping[str, str]) -> Check:
    """Every VLLM_JOURNEY_OTEL_* and OTEL_BSP_* value, as config.py parses it."""
    with captured() as grab:
        cfg = config.from_env({**env, ENABLE: "1"})
        config.batching_from_env(env)
        config.file_settings(env)
        tail = config.tail_rule(env)[0]
    if grab:
        fix = "use an accepted value (docs/configuration.md): the plugin would use the default"
        return Check("settings", FAIL, "; ".join(grab), fix)
    n = cfg.exporter_processes
    rule = ",".join(r for r in config.TAIL_REASONS if r in tail) or "none"
    summary = f"export mode {cfg.export_mode} ({n} exporter process{'es' * (n > 1)}), "
    summary += f"tail rule {rule}, step view {'on' if cfg.steps else 'off'}"
    unknown = sorted(v for v in env if v.startswith(f"{ENABLE}_") and v not in config.ALL_VARIABLES)
    ignored = f"; not the plugin's, ignored: {', '.join(unknown)}" if unknown else ""
    return Check("settings", WARN if unknown else OK, summary + ignored, "a typo?" * bool(unknown))


def sampling_check(env: Mapping[str, str]) -> Check:
    """OTEL_TRACES_SAMPLER(_ARG) as the engine's head sampler reads them."""
    with captured() as grab:
        parent_based, ratio = config.head_sampling(env)
    if grab:
        fix = f"{config.SAMPLER}: one of {', '.join(config.SAMPLERS)}; {config.SAMPLER_ARG}: 0..1"
        return Check("sampling", FAIL, "; ".join(grab), fix)
    name = env.get(config.SAMPLER, "").strip().lower() or "parentbased_always_on"
    label = f"{name} {ratio:g}" if name.endswith("traceidratio") else name
    with captured():  # its warnings are the settings line's
        tail = [r for r in config.TAIL_REASONS if r in config.tail_rule(env)[0]]
    kept = f"; the tail rule still exports the {'/'.join(tail)} ones" if tail else ""
    if ratio >= 1.0:
        rest = "unless its client's traceparent says sampled=0" if parent_based else "always"
        return Check("sampling", OK, f"{label}: every request is traced, {rest}")
    if ratio > 0.0:
        client = " (a client's traceparent decides for its requests)" * parent_based
        return Check("sampling", OK, f"{label}: {ratio * 100:g} % of requests traced{client}{kept}")
    fix = f"{config.SAMPLER}=parentbased_always_on (the default), or {config.SAMPLER_ARG} above 0"
    if parent_based:
        why = f"{label}: only requests whose client sends a sampled traceparent are traced"
        return Check("sampling", WARN, f"{why}, every other request is dropped{kept}", fix)
    kept = kept or f"; nothing is exported ({config.TAIL}=none)"
    return Check("sampling", FAIL, f"{label}: head sampling drops every request{kept}", fix)


# -- where the exporters send ---------------------------------------------------------
def describe(exporter: str, env: Mapping[str, str]) -> str:
    if exporter.startswith("otlp_proto"):
        t = config.otlp_target(exporter, env)
        security = f"TLS, CA {t.ca}" if t.ca else "TLS, system CAs" if t.tls else "plaintext"
        headers = ", headers set" * t.headers
        where = f"otlp over {t.protocol} to {t.url} ({t.source})"
        return f"{where}, {security}{headers}, export timeout {t.timeout} s"
    if exporter == "otlp_json_file":
        f = config.file_settings(env)
        return f"otlp_json_file to {f.path} (rotated at {f.max_mb:g} MB, {f.keep} kept)"
    console = "console: spans printed on the exporter process's stdout (vllm serve's)"
    return console if exporter == "console" else f"{exporter} (another package's; not tested)"


# -- the test span --------------------------------------------------------------------
def send_test_span(exporter: SpanExporter, timeout: float) -> tuple[bool, list[str], float, int]:
    """One span through ``exporter``: (accepted, its messages, seconds, trace id)."""
    now, trace_id = time.time_ns(), rng.trace_id()
    span = ReadableSpan(
        TEST_SPAN,
        SpanContext(trace_id, rng.span_id(), False, TraceFlags(TraceFlags.SAMPLED)),
        resource=make_resource({}),
        start_time=now - 1_000_000,
        end_time=now,
        instrumentation_scope=InstrumentationScope(S.SCOPE_NAME, None, None, None),
    )
    outcome: list[object] = []

    def export() -> None:
        try:
            outcome.append(exporter.export([span]))
        except Exception as exc:
            outcome.append(exc)

    with captured() as grab:
        start = time.monotonic()
        worker = threading.Thread(target=export, name="journey-doctor-export", daemon=True)
        worker.start()
        worker.join(timeout + 2.0)
        elapsed = time.monotonic() - start
        with suppress(Exception):
            exporter.shutdown()
    messages = grab
    if not outcome:
        messages.append(f"the exporter did not return within {timeout + 2.0:g} s: timed out")
    elif isinstance(outcome[0], Exception):
        messages.append(f"the exporter raised {type(outcome[0]).__name__}: {outcome[0]}")
    return outcome[:1] == [SpanExportResult.SUCCESS], messages, elapsed, trace_id


_NO_CAUSE = re.compile(r"due to timeout, max retries or shutdown")
_CERT = f"{_V}TRACES_CERTIFICATE (or {_V}CERTIFICATE)"
_HEADERS = f"set {_V}TRACES_HEADERS (e.g. authorization=Bearer%20TOKEN)"
# An exporter's messages -> (cause, fix); the first match wins; {fields}: _fields().
CAUSES: tuple[tuple[str, str, str], ...] = (
    (r"batch code: 404", "HTTP {status} from {url}: nothing serves OTLP on that path", "{fix404}"),
    (r"batch code: 40[13]", "HTTP {status} from {url}: the backend refused the credentials",
     _HEADERS),
    (r"batch code: \d{3}", "HTTP {status} from {url}", "check that it is the collector's "
     "OTLP/HTTP receiver, and its logs"),
    (r"connection refused|errno 111", "connection refused: nothing listens on {hostport}",
     f"start the collector, or point {TRACES_ENDPOINT} where it listens (OTLP gRPC 4317, "
     "OTLP/HTTP 4318); in a container, localhost is the container itself"),
    (r"name or service not known|domain name not found|resolv|nodename",
     "{host} does not resolve (DNS)", "fix the host name in {source}"),
    (r"wrong.version.number|packet length too long|unknown protocol",
     "TLS failure: {hostport} does not speak TLS{bare}", "use http://{hostport}{insecure}"),
    (r"certificate.required|alert.certificate", "TLS failure: {hostport} wants a client "
     "certificate (mutual TLS)", f"set {_V}TRACES_CLIENT_CERTIFICATE and {_V}TRACES_CLIENT_KEY"),
    (r"certificate|self.signed|unknown ca|hostname mismatch|issuer",
     "TLS failure: {hostport}'s certificate is not trusted ({why})", "{cert_fix}"),
    (r"ssl|tls|handshake", "TLS failure talking to {hostport}",
     f"check the scheme (https: TLS) and {_CERT}"),
    (r"failed parsing http/2|http1|expected settings frame",
     "{hostport} is not a gRPC server (it answered HTTP/1.x: an OTLP/HTTP port?)",
     f"for OTLP/HTTP: {_V}TRACES_PROTOCOL=http/protobuf and {TRACES_ENDPOINT}="
     "{scheme}://{host}:4318/v1/traces; for gRPC: port 4317"),
    (r"badstatusline|connection aborted|remotedisconnected",
     "{hostport} is not an HTTP/1.1 server (a gRPC port such as 4317?)",
     f"for gRPC: {_V}TRACES_PROTOCOL=grpc; for OTLP/HTTP: port 4318, path /v1/traces"),
    (r"unimplemented", "{hostport} speaks gRPC but has no OTLP trace service",
     "point at the collector's OTLP receiver"),
    (r"unauthenticated|permission_denied", "the backend refused the credentials", _HEADERS),
    (r"transient error [a-z]+( [a-z]+)+ encountered", "the backend answered {reason} on every try",
     "check the collector's health and logs"),
    (r"deadline.exceeded|timed out|timeout|no answer",
     "timeout: no answer from {hostport} within {timeout:g} s",
     "a firewall dropping packets, or an overloaded backend; the plugin waits {configured} s "
     f"an export ({TRACES_TIMEOUT})"),
)  # fmt: skip


def _fields(text: str, t: config.OtlpTarget, timeout: float) -> dict[str, object]:
    why = re.search(r"certificate verify failed: ([^()')]*)|VERIFY_FAILED: ([^:]*)", text)
    reason = re.search(r"Transient error ([A-Z][a-z]+(?: [A-Z][a-z]+)+) encountered", text)
    status = re.search(r"batch code: (\d{3}), reason: ([^,]*)", text)
    grpc, base = t.protocol == "grpc", f"{'https' if t.tls else 'http'}://{t.hostport}"
    return {
        **asdict(t), "timeout": timeout, "configured": t.timeout,
        "scheme": "https" if t.tls else "http",
        "why": (why[1] or why[2]).strip() if why else "verification failed",
        "reason": f"'{reason[1]}'" if reason else "an error",
        "bare": " (gRPC without http:// means TLS)" if grpc and "://" not in t.url else "",
        "insecure": f", or {_V}TRACES_INSECURE=true" if grpc else "",
        "status": f"{status[1]} {status[2].strip()}" if status else "",
        "fix404": f"{TRACES_ENDPOINT} is used as is: end it in /v1/traces ({base}/v1/traces), "
        f"or set {ENDPOINT}={base}" if t.source == TRACES_ENDPOINT
        else f"{ENDPOINT} is the collector's base URL ({base}): the SDK appends /v1/traces",
        "cert_fix": f"the CA in {t.ca} did not sign it, or it is not for {t.host}" if t.ca
        else f"set {_CERT} to the CA certificate (PEM) that signed the server's",
    }  # fmt: skip


def classify(text: str, t: config.OtlpTarget, timeout: float) -> tuple[str, str] | None:
    """(cause, fix) named by an exporter's messages; None when they name none."""
    for pattern, cause, fix in CAUSES:
        if re.search(pattern, text, re.IGNORECASE):
            fields = _fields(text, t, timeout)
            return cause.format(**fields), fix.format(**fields)
    return None


def endpoint_check(exporter: SpanExporter, t: config.OtlpTarget, timeout: float) -> Check:
    ok, messages, elapsed, trace_id = send_test_span(exporter, timeout)
    if ok:
        service = make_resource({}).attributes.get(S.RES_SERVICE_NAME)
        reached = f"the test span reached {t.url} in {elapsed * 1000:.0f} ms"
        return Check("endpoint", OK, f"{reached} (trace {trace_id:032x}, service.name {service})")
    named = [m for m in messages if not _NO_CAUSE.search(m)]
    verdict, shown = classify(" | ".join(named), t, timeout), named[-1:]
    if verdict is None:  # the SDK's HTTP exporter names no cause on its last try: connect
        try:
            with socket.create_connection((t.host, t.port), timeout=timeout) as sock:
                if t.tls:
                    ctx = ssl.create_default_context(cafile=t.ca or None)
                    ctx.wrap_socket(sock, server_hostname=t.host).close()
            direct = "it connects, but the export got no answer"
        except OSError as exc:
            direct = f"{type(exc).__name__}: {exc}"
        shown = [*messages[-1:], f"direct connection: {direct}"]
        verdict = classify(direct, t, timeout) or (f"export to {t.url} failed", "see above")
    return Check("endpoint", FAIL, verdict[0], verdict[1], [m[:400] for m in shown])


def file_check(exporter: OtlpJsonFileExporter, env: Mapping[str, str]) -> Check:
    path, existed = exporter.path.absolute(), exporter.path.exists()
    relative = "" if Path(config.file_settings(env).path).is_absolute() else ", relative to the cwd"
    fix = FIX_FILE
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        return Check("file", FAIL, f"cannot write {path}: {exc.strerror or exc}", fix)
    if not existed:
        path.unlink(missing_ok=True)
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return Check("file", FAIL, f"cannot create or rotate files in {path.parent}", fix)
    size = f"{path.stat().st_size / 2**20:.1f} MB so far" if existed else "will be created"
    return Check("file", OK, f"{path} is writable ({size}{relative})")


@contextmanager
def _as_the_exporter_process(env: Mapping[str, str], timeout: float) -> Iterator[None]:
    """os.environ as the plugin's exporter sees it, with our deadline; restored after."""
    saved = dict(os.environ)
    os.environ[TRACES_TIMEOUT] = f"{timeout:g}"
    with captured():
        mode = config.from_env({**env, ENABLE: "1"}).export_mode
    if mode == config.MODE_PROCESS:
        exporter_process._certificate_wins()  # what that process does first
    try:
        yield
    finally:  # only what changed: gRPC's threads may read the environment meanwhile
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        os.environ.update({k: v for k, v in saved.items() if os.environ.get(k) != v})


def exporter_checks(env: Mapping[str, str], timeout: float) -> list[Check]:
    """The ``exporter`` line, then a test per exporter (``env``: os.environ, as they read it)."""
    try:
        names = config.exporter_names(env)
    except ValueError as exc:
        return [Check("exporter", FAIL, str(exc), f"{_V}TRACES_PROTOCOL=grpc or http/protobuf")]
    if not names:
        none = f"{config.TRACES_EXPORTER}=none: journeys are recorded but not exported"
        return [Check("exporter", FAIL, none, f"{config.TRACES_EXPORTER}=otlp (the default)")]
    with captured() as grab:
        try:
            for built in build_exporters(env):  # exactly as the plugin builds them
                built.shutdown()
        except Exception as exc:
            file = isinstance(exc, OSError) and "otlp_json_file" in names
            what = f"{config.FILE_PATH}: cannot create its directory" if file else "cannot be built"
            why = f"{what} ({type(exc).__name__}: {exc}): the plugin would export nothing"
            fix = FIX_FILE if file else f"check {config.TRACES_EXPORTER} and the {_V}* values"
            return [Check("file" if file else "exporter", FAIL, why, fix)]
    summary, fix = "; ".join(describe(n, env) for n in names), "the SDK took a default" * bool(grab)
    checks = [Check("exporter", WARN if grab else OK, summary, fix, grab)]
    with _as_the_exporter_process(env, timeout):
        for name, exporter in zip(names, build_exporters(env), strict=True):
            if name.startswith("otlp_proto"):
                checks.append(endpoint_check(exporter, config.otlp_target(name, env), timeout))
            elif isinstance(exporter, OtlpJsonFileExporter):
                checks.append(file_check(exporter, env))
    return checks


# -- the vLLM side (a child process) --------------------------------------------------
class SelfCheck:
    """``python -m vllm_journey_otel.engine.self_check``, started now, read later (a
    child that fills its pipes waits for the read; it cannot deadlock)."""

    def __init__(self) -> None:
        self.command = [sys.executable, "-m", SELF_CHECK]
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(self.command, stdout=pipe, stderr=pipe, errors="replace")

    def results(self, timeout: float = SELF_CHECK_TIMEOUT_S) -> list[Check]:
        fix = f"vllm serve would fail the same way; to see it all: {' '.join(self.command)}"
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return [Check("vllm", FAIL, f"importing vLLM took more than {timeout:g} s", fix)]
        try:
            said = json.loads(out.splitlines()[-1])["checks"]
            checks = [Check(c["name"], c["verdict"], c["summary"], c["fix"]) for c in said]
            if {c.verdict for c in checks} - {OK, WARN, FAIL}:
                raise ValueError("a verdict it should not give")
        except (IndexError, ValueError, KeyError, TypeError):
            rc, tail = self.proc.returncode, [line for line in err.splitlines() if line.strip()]
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited {rc}"
            why = f"the vLLM self-check {how} without an answer: importing vLLM fails here"
            return [Check("vllm", FAIL, f"{why} (entry point, vLLM not checked)", fix, tail[-5:])]
        return checks


def diagnose(timeout: float = DEFAULT_TIMEOUT_S, skip_vllm: bool = False) -> list[Check]:
    """Every check, in the report's order (``os.environ`` is the environment checked)."""
    self_check, env = None if skip_vllm else SelfCheck(), os.environ
    local = [settings_check(env), sampling_check(env), *exporter_checks(env, timeout)]
    note = "not checked (--skip-vllm): the plugin's entry point, the vLLM version"
    skipped = Check("vllm", WARN, note, "run it without --skip-vllm where vllm serve runs")
    side = self_check.results() if self_check else [skipped]
    entry = [c for c in side if c.name == "entry-point"]
    return [*entry, switch_check(env), *(c for c in side if c not in entry), *local]


def format_text(checks: Sequence[Check]) -> str:
    width = max(len(c.name) for c in checks)
    pad, lines = " " * (width + 8), []
    for c in checks:
        lines.append(f"{c.verdict:<4}  {c.name:<{width}}  {c.summary}")
        lines.extend(f"{pad}| {m}" for m in c.more)
        lines.extend([f"{pad}fix: {c.fix}"] if c.fix else [])
    fails, warns = (sum(c.verdict == v for c in checks) for v in (FAIL, WARN))
    arrive = "journeys would not arrive" if fails else "a journey would arrive"
    code = EXIT_FAIL if fails else EXIT_OK
    return "\n".join([*lines, f"{fails} FAIL, {warns} warn: {arrive} (exit {code})"])


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``doctor`` subcommand of ``vllm-journey``."""
    p = sub.add_parser(
        "doctor",
        help="check, where vllm serve will run, that journeys would arrive",
        description="Checks the entry point, VLLM_JOURNEY_OTEL, vLLM, the OTEL_* settings and the "
        "endpoint (one test span): ok, warn or FAIL, with the fix. Exit codes: 0 a journey would "
        "arrive, 1 a check failed, 2 usage error.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    timeout = "seconds the test span may take, 0.1 to 60 (default %(default)g)"
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help=timeout)
    p.add_argument("--skip-vllm", action="store_true", help="only the OTLP side: no vLLM import")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    checks = diagnose(min(max(args.timeout, 0.1), 60.0), skip_vllm=args.skip_vllm)
    code = EXIT_FAIL if any(c.verdict == FAIL for c in checks) else EXIT_OK
    if args.json:
        report = {"exit_code": code, "python": sys.executable, "checks": checks}
        print(json.dumps(report, indent=2, default=asdict))
    else:
        print(format_text(checks))
    return code


def run(argv: Sequence[str] | None = None) -> int:
    """``vllm-journey doctor ARGV...``, without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="vllm-journey")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


main = run

if __name__ == "__main__":
    sys.exit(run())
