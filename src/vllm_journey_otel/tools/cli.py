"""``vllm-journey``: explain, summarise, compare (diff), draw, convert (Perfetto) and
replay journeys from OTLP/JSON trace files.

Exit codes: 0 ok; 1 the files held no journey (``doctor``: a check failed, no
journey would arrive; ``diff``: a --fail-if rule failed); 2 usage error or an
unreadable file; 3 a replay that could not reach its endpoint, or a --png
without Chromium. A closed pipe (``| head``) ends quietly with the shell's
code for it (141). Bad lines are reported on stderr (file:line) and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from vllm_journey_otel.tools import diff as D
from vllm_journey_otel.tools import doctor, perfetto
from vllm_journey_otel.tools.diff_report import format_text as format_diff
from vllm_journey_otel.tools.diff_report import render_html as render_diff
from vllm_journey_otel.tools.explain_text import format_journey, format_share
from vllm_journey_otel.tools.journey_files import (
    BY_E2E,
    BY_TTFT,
    Selection,
    explanations,
    file_share,
)
from vllm_journey_otel.tools.replay import PROTOCOLS, replay
from vllm_journey_otel.tools.summary import SUMMARY_ATTRIBUTES, format_text, summarize
from vllm_journey_otel.tools.timeline import DEFAULT_LIMIT, collect, render
from vllm_journey_otel.tools.tracefile import FileSpan, TraceFileError, read_spans

# Headless Chromium with no network chatter (the machine may have no network).
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)

EXIT_OK = 0
EXIT_EMPTY = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_PIPE = 128 + 13  # SIGPIPE, as the shell reports a reader that went away
MAX_REPORTED = 20


class _Errors:
    """Collects bad-line messages; prints the first few to stderr."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, message: str) -> None:
        self.count += 1
        if self.count <= MAX_REPORTED:
            print(f"vllm-journey: {message}", file=sys.stderr)

    def done(self) -> None:
        if self.count > MAX_REPORTED:
            print(f"vllm-journey: ... {self.count} bad lines in all", file=sys.stderr)


class _Progress:
    """Bytes read so far, on stderr, when it is a terminal."""

    def __init__(self, files: Sequence[str]) -> None:
        self.total = sum(Path(f).stat().st_size for f in files if Path(f).is_file())
        self.enabled = sys.stderr.isatty() and self.total > 8 * 1024 * 1024
        self.last = 0.0

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if self.enabled and now - self.last > 0.25:
            self.last = now
            pct = 100 * done / max(1, self.total)
            print(
                f"\rreading {done >> 20} / {self.total >> 20} MiB ({pct:.0f}%)",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def done(self) -> None:
        if self.enabled:
            print("\r" + " " * 60 + "\r", end="", file=sys.stderr, flush=True)


def _summary(args: argparse.Namespace) -> int:
    errors, progress = _Errors(), _Progress(args.files)
    try:
        spans = read_spans(args.files, errors, progress, attributes_of=SUMMARY_ATTRIBUTES)
        summary = summarize(spans, top=args.top)
    except TraceFileError as e:
        print(f"vllm-journey: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        progress.done()
    errors.done()
    d = summary.to_dict()
    d["bad_lines"] = errors.count
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print(format_text(d))
    if summary.journeys == 0:
        print("vllm-journey: no vllm.request spans found", file=sys.stderr)
        return EXIT_EMPTY
    return EXIT_OK


def _reader(
    files: list[str], errors: _Errors, progress: _Progress
) -> Callable[[frozenset[str] | None], Iterable[FileSpan]]:
    """A fresh span iterator per call (tools read the files twice); bad lines
    are reported on the first pass only."""
    first = [True]

    def read(attributes_of: frozenset[str] | None) -> Iterable[FileSpan]:
        report = errors if first[0] else None
        first[0] = False
        return read_spans(files, report, progress, attributes_of=attributes_of)

    return read


def _explain(args: argparse.Namespace) -> int:
    errors, progress = _Errors(), _Progress(args.files)
    sel = Selection(
        frozenset(args.request or ()), frozenset(args.trace or ()), args.slowest or 0, args.by
    )
    whole = not (sel.request_ids or sel.trace_ids or sel.slowest)
    try:
        read = _reader(args.files, errors, progress)
        if whole:
            share = file_share(read, top=args.top)
            found = share.journeys
        else:
            explained, found = explanations(read, sel)
    except TraceFileError as e:
        print(f"vllm-journey: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        progress.done()
    errors.done()
    if found == 0:
        print("vllm-journey: no vllm.request spans found", file=sys.stderr)
        return EXIT_EMPTY
    if whole:
        print(json.dumps(share.to_dict(), indent=2) if args.json else format_share(share))
        return EXIT_OK
    if not explained:
        print("vllm-journey: no journey matches the given --request / --trace", file=sys.stderr)
        return EXIT_EMPTY
    if args.json:
        print(json.dumps([e.to_dict() for e in explained], indent=2))
    else:
        print("\n\n".join(format_journey(e) for e in explained))
    return EXIT_OK


def _timeline(args: argparse.Namespace) -> int:
    errors, progress = _Errors(), _Progress(args.files)
    try:
        rows, total = collect(_reader(args.files, errors, progress), limit=args.limit)
    except TraceFileError as e:
        print(f"vllm-journey: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        progress.done()
    errors.done()
    if not rows:
        print("vllm-journey: no vllm.request spans found", file=sys.stderr)
        return EXIT_EMPTY
    out = Path(args.output)
    out.write_text(render(rows, total, source=" ".join(args.files)), encoding="utf-8")
    print(f"{out}: {len(rows)} of {total} journeys")
    if args.png:
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium is None:
            print("vllm-journey: --png needs Chromium (apt-get install chromium)", file=sys.stderr)
            return EXIT_UNAVAILABLE
        height = min(16000, 160 + 17 * len(rows))
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                 f"--window-size=1400,{height}", f"--screenshot={Path(args.png).resolve()}",
                 out.resolve().as_uri()],
                capture_output=True, timeout=120, check=False,
            )  # fmt: skip
        if not Path(args.png).exists():
            print("vllm-journey: Chromium wrote no screenshot", file=sys.stderr)
            return EXIT_UNAVAILABLE
        print(f"{args.png}: rendered")
    return EXIT_OK


def _diff(args: argparse.Namespace) -> int:
    try:
        rules = [D.parse_rule(r) for r in args.fail_if or ()]
    except ValueError as e:
        print(f"vllm-journey: {e}", file=sys.stderr)
        return EXIT_USAGE
    samples = []
    for name in (args.base, args.new):
        errors, progress = _Errors(), _Progress([name])
        try:
            samples.append(D.from_reader(_reader([name], errors, progress)))
        except TraceFileError as e:
            print(f"vllm-journey: {e}", file=sys.stderr)
            return EXIT_USAGE
        finally:
            progress.done()
        errors.done()
    base, new = samples
    for name, sample in ((args.base, base), (args.new, new)):
        if sample.count == 0:
            print(f"vllm-journey: {name}: no vllm.request spans found", file=sys.stderr)
            return EXIT_EMPTY
    d = D.diff(base, new)
    failures = [why for why in (r.check(d) for r in rules) if why is not None]
    if args.html:
        page = render_diff(d, base, new, args.base, args.new)
        try:
            Path(args.html).write_text(page, encoding="utf-8")
        except OSError as e:
            print(f"vllm-journey: {args.html}: cannot write: {e.strerror or e}", file=sys.stderr)
            return EXIT_USAGE
    if args.json:
        print(json.dumps({**d.to_dict(), "failed": failures}, indent=2))
    else:
        print(format_diff(d, args.base, args.new, failures))
    for why in failures:
        print(f"vllm-journey: --fail-if {why}", file=sys.stderr)
    return EXIT_EMPTY if failures else EXIT_OK


def _replay(args: argparse.Namespace) -> int:
    for f in args.files:
        if not Path(f).is_file():
            print(f"vllm-journey: {f}: cannot open", file=sys.stderr)
            return EXIT_USAGE
    errors = _Errors()
    try:
        sent, spans = replay(args.files, args.endpoint, args.protocol, on_error=errors)
    except ValueError as e:
        print(f"vllm-journey: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        print(f"vllm-journey: replay to {args.endpoint} failed: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    errors.done()
    print(f"sent {spans} spans in {sent} requests to {args.endpoint} ({args.protocol})")
    return EXIT_OK if sent else EXIT_EMPTY


def _add_diff_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser(
        "diff",
        help="what got slower between two runs, where, and for whom",
        description="Per phase (the causes explain uses, server TTFT, end to end, decode per "
        "token) and per group (model, LoRA adapter, DP rank, instance), each file's count "
        "and p50/p90/p99, the change, and whether it is beyond the noise (95%% intervals "
        "of each quantile from order statistics apart; a Mann-Whitney U test of the whole "
        "distribution). Exit codes: 0 ok, 1 a --fail-if rule failed or a file held no "
        "journey, 2 usage error or an unreadable file.",
    )
    d.add_argument("base", help="OTLP/JSON-lines trace file of the baseline run")
    d.add_argument("new", help="OTLP/JSON-lines trace file of the run to judge")
    d.add_argument(
        "--fail-if",
        action="append",
        metavar="RULE",
        help="PHASE.pQ OP CHANGE, e.g. 'queued.p99 > +20%%' or 'e2e.p50 > 5ms' (repeatable): "
        "exit 1 when the change meets it beyond the noise, or the phase is not observed",
    )
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--html", metavar="FILE", help="also write the distributions side by side")
    d.set_defaults(func=_diff)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-journey",
        description="Summarise vLLM request journeys from trace files.",
        epilog="Exit codes: 0 ok; 1 no journey in the files (doctor: a check failed; diff: "
        "a --fail-if rule failed); 2 usage error or an unreadable file; 3 a replay that could "
        "not reach its endpoint, or --png without Chromium; 141 the output pipe closed.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser(
        "explain",
        help="where a request's time went, or a file's (share of each cause)",
        description="For the requests named (--request, --trace, --slowest): where each "
        "one's time went, in words and a text waterfall. For a whole file (none of "
        "them): the share of all request-time in each cause, and the requests that "
        "dominate it. With the API server's spans in the file (the default), a journey is "
        "what the user waited: vllm.api.request, split into the read before vLLM's stamp, "
        "rendering and hand-off, the engine's input queue, the engine's phases, and the "
        "output side; without them, the engine's vllm.request. "
        "Exit codes: 0 ok, 1 no (matching) journey, 2 unreadable file.",
    )
    e.add_argument("files", nargs="+", help="OTLP/JSON-lines trace files")
    e.add_argument("--request", action="append", metavar="ID", help="a request id (repeatable)")
    e.add_argument("--trace", action="append", metavar="ID", help="a trace id (repeatable)")
    e.add_argument("--slowest", type=_positive, metavar="N", help="the N slowest requests")
    e.add_argument(
        "--by",
        choices=(BY_E2E, BY_TTFT),
        default=BY_E2E,
        help="--slowest by end to end (the outermost span) or by server TTFT",
    )
    e.add_argument("--top", type=_positive, default=3, help="whole file: requests per cause")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.set_defaults(func=_explain)
    s = sub.add_parser(
        "summary",
        help="per-phase latency, preemptions, statuses, tokens",
        description="Per-phase latency percentiles, preemptions, waits, finish statuses, "
        "tokens and the slowest requests. Exit codes: 0 ok, 1 no journey, 2 unreadable file.",
    )
    s.add_argument("files", nargs="+", help="OTLP/JSON-lines trace files")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--top", type=_positive, default=10, help="slowest requests to list")
    s.set_defaults(func=_summary)
    t = sub.add_parser(
        "timeline",
        help="a self-contained HTML page of every journey",
        description="One row per request (the slowest --limit kept), its phases over time. "
        "Exit codes: 0 ok, 1 no journey, 2 unreadable file, 3 --png without Chromium.",
    )
    t.add_argument("files", nargs="+", help="OTLP/JSON-lines trace files")
    t.add_argument("-o", "--output", default="journeys.html", help="HTML file to write")
    t.add_argument(
        "--limit", type=_positive, default=DEFAULT_LIMIT, help="rows to draw (the slowest kept)"
    )
    t.add_argument("--png", help="also render to this PNG with headless Chromium")
    t.set_defaults(func=_timeline)
    perfetto.add_parser(sub)
    doctor.add_parser(sub)
    _add_diff_parser(sub)
    r = sub.add_parser(
        "replay",
        help="send trace files to an OTLP endpoint",
        description="Send trace files' spans to an OTLP endpoint. Exit codes: 0 ok, "
        "1 nothing sent, 2 unreadable file, 3 the endpoint could not be reached.",
    )
    r.add_argument("files", nargs="+", help="OTLP/JSON-lines trace files")
    r.add_argument("--endpoint", required=True, help="e.g. http://127.0.0.1:4317")
    r.add_argument("--protocol", default="grpc", choices=PROTOCOLS)
    r.set_defaults(func=_replay)
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if isinstance(getattr(args, "files", None), list):
        # A file named twice is read once (every tool counts what it reads).
        args.files = list(dict.fromkeys(args.files))
    try:
        code = int(args.func(args))
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (``| head``): end quietly, as a shell tool does.
        # stdout is pointed at /dev/null so the interpreter's final flush cannot
        # raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
