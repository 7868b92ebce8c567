"""Where batches of finished journeys go once they leave the engine thread.

* :class:`SpanSink` builds and exports spans in this process (clock conversion,
  span plan, SDK tracer). Used inside the exporter process, and in the engine
  core itself in ``thread`` mode.
* :class:`PipeSink` encodes the batch with msgspec and writes it to the stdin of a
  separate exporter process, or one of several
  (``python -m vllm_journey_otel.exporter_process``),
  which owns the SDK. This keeps span building and OTLP encoding off the engine
  core's GIL, and the exporter outlives the engine core: vLLM's API server kills
  the engine-core process tree at once on SIGTERM (``--shutdown-timeout 0``, the
  default), so nothing left inside the engine core at that moment could be
  flushed. The exporter is started through a short-lived launcher so it is not a
  descendant of the engine core (vLLM's ``kill_process_tree`` kills descendants);
  it exits on end-of-file after exporting everything it received.

Wire format (stdin of the exporter): frames of a 4-byte little-endian length and
a msgpack-encoded :class:`Frame`: the records (finished journeys and
sampled engine steps), and how many journeys the engine core has dropped so
far, for the tracer-health attributes.

Threading: ``consume`` is called by the pipeline's drain thread only.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any, Protocol

import msgspec
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter

from . import schema as S
from .clock import ClockAnchor
from .config import EXPORT_MODE, EXPORTER_PROCESSES, QUEUE_SIZE, batching_from_env, logger
from .cpu_yield import placement_roots
from .export_stage import ExportStage
from .exporter_launch import Restarts, launch
from .exporters import (
    TRACES_EXPORTER,
    build_exporters,
    exporter_names,
    make_resource,
    span_limits,
)
from .health import ExportHealth, endpoint_name
from .journey import Record, StepRecord
from .span_builder import SpanBuilder
from .spans import ROOT, plan_spans, plan_step, root_context

FRAME_HEADER = struct.Struct("<I")
# Frames larger than this are refused by the reader (a corrupt length).
MAX_FRAME_BYTES = 256 * 1024 * 1024


class Frame(msgspec.Struct, array_like=True):
    """One message on the exporter pipe."""

    journeys: list[Record]  # finished journeys and sampled engine steps
    # Journeys the engine core dropped so far (full queue, exporter gone).
    engine_dropped: int = 0


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(Frame)


class Sink(Protocol):
    """Receives batches of finished journeys from the pipeline.

    ``engine_dropped`` is the pipeline's count of journeys dropped so far; it
    ends up on the roots as the tracer-health attribute.
    """

    def offer(self, batch: Sequence[Record], engine_dropped: int = 0) -> bool:
        """Engine thread: take the batch now if that cannot block; False = queue it."""

    @property
    def pending(self) -> bool:
        """Whether bytes taken by ``offer`` still wait for the drain thread."""

    @property
    def takes_offers(self) -> bool:
        """Whether :meth:`offer` can ever take a batch (False: always queue)."""

    def consume(
        self, batch: Sequence[Record], engine_dropped: int = 0, deadline: float | None = None
    ) -> int:
        """Handle a batch; returns how many journeys failed. ``deadline``
        (``time.monotonic()``): stop waiting for the receiving end then; what is
        not taken stays pending (None: wait as long as it takes)."""

    def maintain(self) -> None:
        """Drain thread, every wake-up: notice and replace what went away."""

    def flush(self, timeout_s: float) -> bool:
        """Push everything out within ``timeout_s``; True when done."""

    def shutdown(self, timeout_s: float) -> None:
        """Flush and release resources."""

    @property
    def drop_advice(self) -> str:
        """What to change when the engine's queue overflows because this sink is behind."""


class SpanSink:
    """Build spans in this process and hand them to the export stage."""

    def __init__(
        self,
        builder: SpanBuilder,
        stage: ExportStage,
        clock: ClockAnchor | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        self.builder = builder
        self.stage = stage
        self.health = stage.health
        self._clock = clock or ClockAnchor()
        self._stop = stop
        self.failed = 0

    @classmethod
    def from_env(
        cls,
        resource_attributes: Mapping[str, Any],
        exporters: Sequence[SpanExporter] | None = None,
        threaded: bool = True,
        health: ExportHealth | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> SpanSink:
        """Exporters, resource, limits and batching from the OTEL_* variables
        (``exporters`` given: those, for tests)."""
        names: list[str] = []
        if exporters is None:
            try:
                names = exporter_names()
                exporters = build_exporters()
            except Exception as exc:  # a bad OTEL_TRACES_EXPORTER must not stop vLLM
                logger.warning("journey-otel: %s; journeys are recorded but not exported", exc)
                exporters = []
            else:
                if not exporters:
                    logger.info("%s=none: journeys are recorded but not exported.", TRACES_EXPORTER)
        batching = batching_from_env()
        stage = ExportStage(
            exporters,
            health or ExportHealth(),
            max_batch=batching.max_batch,
            delay_s=batching.delay_ms / 1000.0,
            max_pending=batching.max_pending,
            threaded=threaded,
            endpoint=endpoint_name(names),
        )
        builder = SpanBuilder(make_resource(resource_attributes), span_limits())
        return cls(builder, stage, stop=stop)

    def offer(self, batch: Sequence[Record], engine_dropped: int = 0) -> bool:
        return False  # building spans is not for the engine thread: always queue

    takes_offers = False

    @property
    def drop_advice(self) -> str:
        return (
            f"building spans in this process cannot keep up: use {EXPORT_MODE}=process, "
            f"lower the sampling ratio, or raise {QUEUE_SIZE} for bursts"
        )

    @property
    def pending(self) -> bool:
        return False

    def maintain(self) -> None:
        pass  # nothing here goes away

    def consume(
        self, batch: Sequence[Record], engine_dropped: int = 0, deadline: float | None = None
    ) -> int:
        # Building spans takes CPU, not a wait; the stage may make us wait for
        # the backend (backpressure), not bounded by ``deadline``.
        failed = 0
        health = self.health
        health.engine_dropped = max(health.engine_dropped, engine_dropped)
        built: list[ReadableSpan] = []
        for journey in batch:
            try:
                offset_ns = self._clock.anchor.offset_ns
                if isinstance(journey, StepRecord):
                    built.append(self.builder.build_step(plan_step(journey, offset_ns)))
                else:
                    health.journeys += 1
                    anchor = self._clock.anchor
                    plan = plan_spans(journey, anchor.offset_ns, anchor.uncertainty_ns)
                    root = plan[ROOT].attributes
                    root[S.TRACER_DROPPED_JOURNEYS] = health.engine_dropped
                    root[S.TRACER_LOST_SPANS] = health.lost_spans
                    built.extend(self.builder.build(plan, *root_context(journey)))
            except Exception:
                failed += 1
                if self.failed + failed == 1:
                    logger.warning(
                        "journey-otel: could not build spans for a journey; "
                        "later failures are counted silently",
                        exc_info=True,
                    )
            if len(built) >= ADD_SPANS:
                health.spans_built += len(built)
                self.stage.add(built, self._stop)
                built = []
        health.spans_built += len(built)
        self.stage.add(built, self._stop)
        self.failed += failed
        return failed

    def flush(self, timeout_s: float) -> bool:
        """Export what was built within ``timeout_s``."""
        return self.stage.flush(timeout_s)

    def shutdown(self, timeout_s: float) -> None:
        self.stage.shutdown(timeout_s)


# Spans handed to the export stage at a time: a large frame (a drain of the
# whole queue) waits for room piecewise instead of holding all its spans.
ADD_SPANS = 512


# The drain thread's maintain() waits at most this long for the sink's lock.
DRAIN_LOCK_S = 0.2


class FrameLost(Exception):
    """A frame could not be delivered to any exporter (its journeys are counted)."""


class PipeSink:
    """Encode batches and write them to one or more detached exporter processes.

    The write ends of the pipes are non-blocking. The engine thread ``offer``s the
    journeys a step finished: one msgspec encode and one ``os.write``, no thread
    hand-off (waking a thread costs the engine thread a GIL switch each time).
    With several exporters (one exporter process builds and encodes ~3,500
    journeys a second; docs/performance.md), each frame goes to the one that has
    been sent the fewest bytes so far, the next one if that pipe is full: frames
    differ in size (a 25 ms hand-off from the engine thread vs. a drain of the
    queue), so plain turns would load one exporter with all the big ones. If
    every pipe is full, or the drain thread is writing, the offer is declined and
    the journeys take the queue; bytes an offer could only partly write are
    finished by the drain thread, which may block (the engine thread never does).

    An exporter that is gone (its pipe broke, seen by a write or by the drain
    thread's :meth:`maintain`) is left out and, when the sink was started with
    :meth:`start`, replaced on the drain thread after a backoff
    (``exporter_launch.Restarts``: 0.5 s doubling to 30 s, at most 4 starts a
    minute). While none is left the sink is ``broken``: journeys are dropped and
    counted, and the count reaches the roots of the journeys exported after the
    replacement (``vllm.journey.tracer.dropped_journeys``).
    """

    def __init__(self, fd: int | Sequence[int], pid: int | None = None) -> None:
        self._fds: list[int] = [fd] if isinstance(fd, int) else list(fd)
        for each in self._fds:
            os.set_blocking(each, False)
        # The first exporter's pid; ``pids`` has all of them (set by ``start``).
        self.pid = pid
        self.pids: list[int] = [] if pid is None else [pid]
        self.failed = 0
        self.broken = not self._fds
        self._lock = threading.Lock()
        self._sent = dict.fromkeys(self._fds, 0)  # bytes written to each pipe
        # The rest of a frame whose start went to ``_pending_fd`` (-1: to none yet),
        # and how many journeys it holds.
        self._pending = b""
        self._pending_fd = -1
        self._pending_journeys = 0
        # Journeys lost with a partial frame (its exporter went away): the
        # pipeline never hears of them (``offer`` had returned True), so the next
        # frames add them to the engine's drop count they carry.
        self.lost_pending = 0
        # Replacing lost exporters (drain thread): how to start one, how many to keep.
        self._recipe: tuple[list[str], dict[str, str], str | None] | None = None
        self.wanted = len(self._fds)
        self._pid_of: dict[int, int | None] = dict(zip(self._fds, self.pids, strict=False))
        self.restarts = Restarts()
        self.dropped_down = 0  # journeys refused since the last exporter went away
        self._closing = False

    @property
    def exporters(self) -> int:
        """Exporter processes still connected."""
        return len(self._fds)

    @classmethod
    def start(
        cls,
        resource_attributes: Mapping[str, Any],
        env: Mapping[str, str] | None = None,
        python: str | None = None,
        processes: int = 1,
    ) -> PipeSink:
        """Start ``processes`` exporters (detached from this process tree), connect to them."""
        argv = [
            python or sys.executable,
            "-m",
            "vllm_journey_otel.exporter_process",
            json.dumps(dict(resource_attributes)),
            ",".join(str(pid) for pid in placement_roots()),
        ]
        child_env = dict(os.environ if env is None else env)
        fds: list[int] = []
        pids: list[int] = []
        try:
            for _ in range(max(1, processes)):
                fd, pid = launch(argv, child_env, python)
                fds.append(fd)
                if pid is not None:
                    pids.append(pid)
        except BaseException:
            for fd in fds:  # EOF: the ones already started exit
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        sink = cls(fds, pids[0] if pids else None)
        sink.pids = pids
        sink._pid_of = dict(zip(fds, pids, strict=False))
        sink._recipe = (argv, child_env, python)
        return sink

    @staticmethod
    def _frame(batch: Sequence[Record], engine_dropped: int) -> bytes:
        payload = ENCODER.encode(Frame(list(batch), engine_dropped))
        return FRAME_HEADER.pack(len(payload)) + payload

    def _rotation(self) -> list[int]:
        """The pipes in the order to try for the next frame: least sent first."""
        fds = self._fds
        if len(fds) < 2:
            return fds  # safe to iterate: losing the only one ends the loop
        return sorted(fds, key=self._sent.__getitem__)

    def _lost_exporter(self, fd: int) -> None:
        """The exporter behind ``fd`` is gone: stop writing to it, plan its replacement."""
        if fd not in self._fds:
            return
        self._fds.remove(fd)
        pid = self._pid_of.pop(fd, None)
        with contextlib.suppress(OSError):
            os.close(fd)
        if not self._fds:
            self.broken = True
            self.dropped_down = 0
        if self._recipe is None or self._closing:
            then = "journeys are dropped from now on" if self.broken else "the others go on"
        else:
            delay = self.restarts.lost(time.monotonic())
            then = f"a new one starts in {delay:.1f} s"
            if self.broken:
                then += "; journeys are dropped (and counted) until then"
        logger.warning(
            "journey-otel: exporter process %s is gone (%d left); %s",
            pid if pid is not None else "?",
            len(self._fds),
            then,
        )

    def maintain(self) -> None:
        """Drain thread: notice exporters gone while nothing was written (the
        pipe's reader closed), and start their replacements when due."""
        if self._closing:
            return
        if self._fds and self._lock.acquire(timeout=DRAIN_LOCK_S):
            try:
                poller = select.poll()
                for fd in self._fds:
                    poller.register(fd, 0)  # POLLERR/POLLHUP are always reported
                for fd, _ in poller.poll(0):
                    self._lost_exporter(fd)
            finally:
                self._lock.release()
        now = time.monotonic()
        if (
            self._recipe is None
            or len(self._fds) >= self.wanted
            or not self.restarts.may_start(now)
        ):
            return
        argv, env, python = self._recipe
        try:
            fd, pid = launch(argv, env, python)
        except Exception:
            self.restarts.did_start(now, more_wanted=True)
            logger.warning(
                "journey-otel: could not start a new exporter process; trying again later",
                exc_info=True,
            )
            return
        os.set_blocking(fd, False)
        with self._lock:
            if self._closing:  # shut down meanwhile: the new one sees end-of-file
                os.close(fd)
                return
            was_broken = self.broken
            self._fds.append(fd)
            self._sent[fd] = 0
            self._pid_of[fd] = pid
            if pid is not None:
                self.pids.append(pid)
            self.broken = False
            self.restarts.did_start(now, more_wanted=len(self._fds) < self.wanted)
        logger.warning(
            "journey-otel: exporter process %s started in place of a lost one%s",
            pid if pid is not None else "?",
            f"; {self.dropped_down} journeys were dropped while none ran" if was_broken else "",
        )

    takes_offers = True

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    @property
    def drop_advice(self) -> str:
        # Engine-side drops mean the pipes stayed full: the exporters are short
        # of CPU, or wait for a backend that answers slowly (they build spans
        # only as fast as they export them; their log says which). A backend
        # that is down does not show here: the exporters then drop in their own
        # span queues instead.
        return (
            f"the {len(self._fds)} exporter process(es) cannot keep up: short of CPU "
            f"(one builds and exports ~3,500 journeys/s on a free core: raise "
            f"{EXPORTER_PROCESSES}) or a slow backend (the exporter logs 'export is "
            f"slower than the traffic'); or lower the sampling ratio, or raise "
            f"{QUEUE_SIZE} for bursts"
        )

    def offer(self, batch: Sequence[Record], engine_dropped: int = 0) -> bool:
        if self.broken or not batch or not self._lock.acquire(blocking=False):
            return False
        try:
            if self._pending:
                return False  # the drain thread finishes the partial frame first
            data = self._frame(batch, engine_dropped + self.lost_pending)
            for fd in self._rotation():
                try:
                    n = os.write(fd, data)
                except BlockingIOError:
                    continue  # this exporter is behind: the next one
                except OSError:
                    self._lost_exporter(fd)
                    continue
                self._sent[fd] += n
                if n < len(data):
                    self._pending, self._pending_fd = data[n:], fd
                    self._pending_journeys = len(batch)
                return True
            # Declined: every pipe is full, or the last exporter just went away
            # (then the drain thread's consume counts the batch as failed, once).
            return False
        finally:
            self._lock.release()

    def _write_frame(
        self, data: bytes, journeys: int, fd: int = -1, deadline: float | None = None
    ) -> bool:
        """Write one frame: the rest of a partial one to its ``fd``, a new one (-1)
        to the first exporter with room. Blocks until done or ``deadline``; False
        at the deadline (what is left becomes pending). Raises :class:`FrameLost`
        (its journeys counted in ``failed``) when the exporter that has the start
        of the frame is gone, or none is left.
        """
        view = memoryview(data)
        while view:
            if not self._fds:
                self.failed += journeys
                raise FrameLost("no exporter process left")
            targets = [fd] if fd >= 0 else self._rotation()
            for target in targets:
                try:
                    n = os.write(target, view)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    self._lost_exporter(target)
                    if fd >= 0:  # the frame's start went there: it is lost with it
                        self.failed += journeys
                        raise FrameLost("the exporter went away in the middle of a frame") from exc
                    continue
                self._sent[target] += n
                fd, view = target, view[n:]
                break
            else:
                if not self._fds:
                    continue  # raises above
                wait = 1.0 if deadline is None else deadline - time.monotonic()
                if wait <= 0:
                    self._pending, self._pending_fd = bytes(view), fd
                    self._pending_journeys = journeys
                    return False
                select.select([], [t for t in targets if t in self._fds], [], min(wait, 1.0))
        return True

    def _take_pending(self) -> tuple[bytes, int, int]:
        pending = self._pending, self._pending_journeys, self._pending_fd
        self._pending, self._pending_journeys, self._pending_fd = b"", 0, -1
        return pending

    def consume(
        self, batch: Sequence[Record], engine_dropped: int = 0, deadline: float | None = None
    ) -> int:
        if self.broken:
            self.dropped_down += len(batch)
            return len(batch)
        with self._lock:
            if self._pending:
                data, journeys, fd = self._take_pending()
                try:
                    done = self._write_frame(data, journeys, fd, deadline)
                except FrameLost:
                    self.lost_pending += journeys  # also in ``failed``
                    done = True
                if not done:
                    # Still pending at the deadline (the engine thread's offer
                    # left it after drain() looked): the new frame goes after it,
                    # to the same exporter, with the next write. Nothing is lost.
                    if batch:
                        frame = self._frame(batch, engine_dropped + self.lost_pending)
                        self._pending += frame
                        self._pending_journeys += len(batch)
                    return 0
            if batch:
                frame = self._frame(batch, engine_dropped + self.lost_pending)
                try:
                    self._write_frame(frame, len(batch), deadline=deadline)
                except FrameLost:
                    return len(batch)
        return 0

    def flush(self, timeout_s: float) -> bool:
        # Once written, the bytes are in the kernel's pipe, which survives this
        # process; the exporter exports them. Only unwritten bytes remain here.
        if self.broken:
            return False
        deadline = time.monotonic() + max(0.0, timeout_s)
        # The drain thread may be writing (a bounded while, DRAIN_WRITE_S).
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            return False
        try:
            if self._pending:
                data, journeys, fd = self._take_pending()
                try:
                    return self._write_frame(data, journeys, fd, deadline)
                except FrameLost:
                    self.lost_pending += journeys
                    return False
        finally:
            self._lock.release()
        return True

    def shutdown(self, timeout_s: float) -> None:
        self._closing = True  # no replacement from now on
        deadline = time.monotonic() + max(0.0, timeout_s)
        self.flush(timeout_s)
        # Not under a writer's feet: a descriptor closed (and its number reused)
        # while another thread writes to it would send bytes elsewhere. If the
        # lock cannot be had in time, the descriptors close with the process.
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            logger.debug("journey-otel: pipe sink busy at shutdown; pipes close at exit")
            return
        try:
            for fd in self._fds:  # EOF: each exporter exports what it has and exits
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds = []
        finally:
            self._lock.release()


# The exporter reads the pipe at most this often while journeys keep coming:
# twice the engine's hand-off interval (pipeline.PUBLISH_INTERVAL_NS), so a
# read mostly finds a frame waiting and the reader is rarely blocked in read()
# when the engine thread writes.
READ_PACE_S = 0.05
_READ_CHUNK = 1 << 20


# While a stop may be requested, the reader waits in select() this long at a
# time, so a SIGTERM is noticed within it (a signal handler that does not raise
# cannot interrupt a blocking read: PEP 475 retries it).
_STOP_POLL_S = 0.25


class FrameReader:
    """Decodes :class:`Frame` s from a byte stream (exporter side, main thread).

    The buffer belongs to the reader, not to one iteration: frames already read
    but not yet handed out survive an interrupted iteration, and a frame is
    taken off the buffer as it is handed out, so none is handed out twice.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0

    def frames(
        self,
        stream: IO[bytes],
        pace_s: float = 0.0,
        stop: Callable[[], bool] | None = None,
    ) -> Iterator[Frame]:
        """Yield frames until end-of-file.

        ``pace_s`` > 0: after a read that left no partial frame and did not fill
        the read buffer, the next read comes no sooner than ``pace_s`` after it
        returned (handling its frames counts toward the pause). A writer whose
        reader is blocked in ``read`` pays for waking it inside its ``write``
        (~8-12 us instead of ~1 us here, more when the woken reader takes the
        writer's core): paced, the exporter is asleep or busy when the engine
        thread writes, and blocks (no CPU) only when nothing came during the
        pause. Frames wait at most ``pace_s`` longer; a busy exporter (handling
        takes longer, or a full read) and a frame still arriving never pause, so
        capacity is unchanged. A partial frame at end-of-file is dropped.

        ``stop`` (the exporter's SIGTERM flag): once it returns True, what is
        already in the pipe is read without waiting and the iteration ends.
        Given, the stream's descriptor is read directly (``os.read``).
        A non-blocking stream with nothing to read ends the iteration too.
        """
        size_of = FRAME_HEADER.unpack_from
        header = FRAME_HEADER.size
        buf = self._buf
        clock = time.monotonic
        fd = stream.fileno() if stop is not None else -1
        draining = False
        last = -1  # bytes of the last read (-1: none yet)
        read_at = 0.0
        while True:
            while len(buf) - self._pos >= header:
                (size,) = size_of(buf, self._pos)
                if size > MAX_FRAME_BYTES:
                    raise ValueError(f"frame of {size} bytes exceeds the {MAX_FRAME_BYTES} limit")
                end = self._pos + header + size
                if len(buf) < end:
                    break
                payload = buf[self._pos + header : end]
                self._pos = end
                yield DECODER.decode(payload)
            del buf[: self._pos]
            self._pos = 0
            if stop is not None and not draining and stop():
                draining = True
            if pace_s > 0 and not draining and 0 <= last < _READ_CHUNK and not buf:
                rest = read_at + pace_s - clock()
                if rest > 0:
                    time.sleep(rest)
            if stop is not None:
                if not draining:
                    while not select.select([fd], [], [], _STOP_POLL_S)[0]:
                        if stop():
                            draining = True
                            break
                if draining:
                    os.set_blocking(fd, False)
                try:
                    chunk: bytes | None = os.read(fd, _READ_CHUNK)
                except BlockingIOError:
                    return
            else:
                try:
                    chunk = stream.read1(_READ_CHUNK)  # type: ignore[attr-defined]
                except BlockingIOError:
                    return
            if not chunk:  # end-of-file (None: non-blocking and empty)
                return
            read_at = clock()
            last = len(chunk)
            buf += chunk


def read_frames(stream: IO[bytes], pace_s: float = 0.0) -> Iterator[Frame]:
    """Yield decoded :class:`Frame` s from ``stream`` until end-of-file
    (:meth:`FrameReader.frames` with a reader of its own)."""
    return FrameReader().frames(stream, pace_s)
