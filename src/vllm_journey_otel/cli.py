"""``vllm-journey``: summarise journeys from OTLP/JSON trace files.

Exit codes: 0 ok; 1 the files held no journey; 2 usage error or an unreadable
file. Bad lines are reported on stderr (file:line) and skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .summary import format_text, summarize
from .tracefile import TraceFileError, read_spans

EXIT_OK = 0
EXIT_EMPTY = 1
EXIT_USAGE = 2


def _summary(args: argparse.Namespace) -> int:
    bad: list[str] = []

    def on_error(message: str) -> None:
        bad.append(message)
        if len(bad) <= 20:
            print(f"vllm-journey: {message}", file=sys.stderr)

    try:
        summary = summarize(read_spans(args.files, on_error), top=args.top)
    except TraceFileError as e:
        print(f"vllm-journey: {e}", file=sys.stderr)
        return EXIT_USAGE
    if len(bad) > 20:
        print(f"vllm-journey: ... {len(bad)} bad lines in all", file=sys.stderr)
    d = summary.to_dict()
    d["bad_lines"] = len(bad)
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print(format_text(d))
    if summary.journeys == 0:
        print("vllm-journey: no vllm.request spans found", file=sys.stderr)
        return EXIT_EMPTY
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-journey", description="Summarise vLLM request journeys from trace files."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary", help="per-phase latency, preemptions, statuses, tokens")
    s.add_argument("files", nargs="+", help="OTLP/JSON-lines trace files")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--top", type=int, default=10, help="slowest requests to list")
    s.set_defaults(func=_summary)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
