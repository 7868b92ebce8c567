"""The exporter process: finished journeys in on stdin, OTLP out.

Started by :meth:`vllm_journey_otel.engine.pipe_sink.PipeSink.start` from the engine core,
detached from its process tree. Its main thread reads msgpack-encoded frames
(finished journeys, sampled steps, the engine side's drop count) from stdin and
builds the SDK's ReadableSpans (clock conversion, span plan, ``span_builder``);
the export stage (``export_stage.py``) batches them and exports them through
the SDK's exporters chosen by the inherited OTEL_* variables, on a thread of its
own. While export is behind, the main thread waits and does not read: the pipe
is the queue. On end-of-file (the engine core closed the pipe or died) or
SIGTERM it flushes for at most VLLM_JOURNEY_OTEL_SHUTDOWN_TIMEOUT_S (at least
10 s), shuts the exporters down within the same deadline and exits, logging
what it delivered and lost.

Clock: CLOCK_MONOTONIC is system-wide, so this process's wall-mono-wall anchor
converts the engine core's ``*_mono_ns`` stamps correctly (same host).

It runs at the lowest CPU priority and off the CPUs vLLM binds its threads to
(export/cpu_placement.py), applied before it starts any thread.

    python -m vllm_journey_otel.export.exporter_process '<resource attributes as JSON>' \
        [<pids whose process trees hold vLLM's bound threads, comma-separated>] [<acks fd>]
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from vllm_journey_otel.config import (
    CA_BUNDLE_VARIABLES,
    CERTIFICATE_VARIABLES,
    first_set,
    from_env,
)
from vllm_journey_otel.export.cpu_placement import ExporterPlacement
from vllm_journey_otel.export.cpu_share import CpuShareWatch
from vllm_journey_otel.export.health import ExportHealth, SdkLogQuieter
from vllm_journey_otel.export.span_sink import SpanSink
from vllm_journey_otel.log import logger
from vllm_journey_otel.losses import Loss
from vllm_journey_otel.schema import RES_PID
from vllm_journey_otel.wire import READ_PACE_S, Acks, FrameReader

# The exporter is not bound by vLLM's kill deadline; give the final export time.
MIN_FINAL_FLUSH_S = 10.0

# Cyclic GC of this process. Each span allocates dozens of container objects
# (SDK span, attribute dicts, protobuf messages), and the default first
# generation of 700 makes the collector walk them (and, every 100 young
# collections, everything alive: modules, the span queue) for nothing: spans
# and their OTLP messages form no reference cycles, refcounting frees them.
# That was ~25 % of this process's CPU (benchmarks/export_bench.py: ~400 vs
# ~300 us per journey with the collector off). Collections stay on, rarer; the
# objects of the imports are frozen out of them.
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class _Term:
    """SIGTERM (a container or cgroup being stopped; vLLM itself ends us with
    end-of-file) is a flag, never an exception: an exception in the middle of a
    frame would lose the rest of it, or of the frames already read, uncounted.
    The reader and the export stage's wait for room check it; what is already
    in the pipe is still exported, without waiting for room."""

    requested = False


def _on_sigterm(signum: int, frame: Any) -> None:
    _Term.requested = True


def _stopping() -> bool:
    return _Term.requested


def _certificate_wins() -> None:
    """Make OTEL_EXPORTER_OTLP_(TRACES_)CERTIFICATE hold for OTLP/HTTP too.

    The SDK's HTTP exporter puts the certificate on its ``requests`` session, and
    ``requests`` lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE (common in corporate
    images) override a session's ``verify``: the certificate the user named would
    be ignored and every export fail verification. This process is ours alone,
    so the bundles are dropped from its environment when a certificate is named.
    """
    if first_set(os.environ, *CERTIFICATE_VARIABLES)[0]:
        for name in CA_BUNDLE_VARIABLES:
            if os.environ.pop(name, None):
                logger.debug("journey-otel exporter: %s ignored: a certificate is set", name)


def _acks(argv: list[str]) -> Acks | None:
    """The engine core's counter of what this process accounted for (``wire.Acks``),
    whose fd is the last argument; None without one."""
    if len(argv) > 3 and argv[3].isdigit():
        try:
            return Acks(int(argv[3]))
        except OSError:
            logger.warning("journey-otel exporter: no delivery counter (fd %s)", argv[3])
    return None


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format=f"(journey-otel exporter pid={os.getpid()}) %(levelname)s %(message)s",
    )
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C of vllm serve: finish via EOF
    attributes = json.loads(argv[1]) if len(argv) > 1 else {}
    roots = [int(p) for p in argv[2].split(",") if p.isdigit()] if len(argv) > 2 else []
    config = from_env()
    # First, before any thread exists: the threads started below inherit it.
    placement = ExporterPlacement(config.cpu_priority, config.exporter_cpus, roots)
    logger.info("journey-otel exporter: %s", placement.apply())
    placement.start_rechecks()
    _certificate_wins()
    health = ExportHealth()
    SdkLogQuieter(health).install()
    sink = SpanSink.from_env(
        attributes, health=health, stop=_stopping, cpu_priority=config.cpu_priority
    )
    sink.acks = _acks(argv)
    tune_gc()
    reader = FrameReader()
    starved = CpuShareWatch(config.queue_size)  # behind for want of CPU: said (cpu_share.py)
    end_of_file = False
    try:
        for frame in reader.frames(sys.stdin.buffer, READ_PACE_S, stop=_stopping):
            sink.consume(frame.journeys, frame.engine_dropped)
            held = sink.acks.held() if sink.acks is not None else 0
            note = starved.check(held, health.engine_dropped, sink.stage.waited_s)
            if note:
                logger.warning(note)
        end_of_file = not _stopping()
    except Exception:
        logger.warning("journey-otel exporter: bad input, stopping", exc_info=True)
    finally:
        # The owner is gone (not a stop request, nor bad input while it lives on
        # and hands its queue to a replacement): what it still held is lost.
        held = sink.acks.held() if sink.acks is not None and end_of_file else 0
        if held:
            logger.warning(
                "journey-otel exporter: its owner%s ended holding %d finished "
                "journeys it had not handed on: lost with it (killed before it could: an "
                "owner hands journeys on within 50 ms, later while its exporters fall behind)",
                f" (pid {attributes[RES_PID]})" if RES_PID in attributes else "",
                held,
            )
        sink.shutdown(max(config.shutdown_timeout_s, MIN_FINAL_FLUSH_S))
        health.settle()
        unbuilt = sink.losses.describe()  # journeys this process could not build spans for
        lost = health.lost_spans + health.engine_dropped + sink.losses[Loss.UNBUILT] + held
        # One line for the operator: what this run delivered and what it lost.
        level = logging.WARNING if lost else logging.INFO if health.journeys else logging.DEBUG
        logger.log(
            level,
            "journey-otel exporter: %s%s; %.3f s of CPU",
            health.summary(),
            f"; {unbuilt}" if unbuilt else "",
            # This process's CPU in all (every thread, start-up included): what
            # exporting cost the host (benchmarks/serve_short.py reads it).
            time.process_time(),
        )
        if sink.stage.waited_s >= 1.0:
            # Export was the bottleneck: the pipe and the engine side's queue took the excess.
            logger.info(
                "journey-otel exporter: waited %.1f s in all for the backend "
                "(export slower than span building)",
                sink.stage.waited_s,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
