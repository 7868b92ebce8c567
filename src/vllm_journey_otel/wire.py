"""The wire format the engine core and the exporter process share.

Frames on the exporter's stdin: a 4-byte little-endian length and a
msgpack-encoded :class:`Frame` (finished journeys and sampled engine steps, and
how many journeys the engine core has dropped so far, for the tracer-health
attributes). Written by the engine core (``engine/pipe_sink.py``: the engine
thread, or the drain thread), read by the exporter process's main thread
(:class:`FrameReader`). Back the other way, one counter (:class:`Acks`): how
many of the records it was sent the exporter has accounted for, written by its
threads, read by the engine core when that exporter is gone. Clock:
``time.monotonic()`` for the paced read.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import struct
import time
from collections.abc import Callable, Iterator
from typing import IO

import msgspec

from vllm_journey_otel.journey import Record

FRAME_HEADER = struct.Struct("<I")
# Frames larger than this are refused by the reader (a corrupt length).
MAX_FRAME_BYTES = 256 * 1024 * 1024


class Frame(msgspec.Struct, array_like=True):
    """One message on the exporter pipe."""

    journeys: list[Record]  # finished journeys and sampled engine steps
    # Journeys the engine core dropped so far (full queue, exporter gone).
    engine_dropped: int = 0


# Finished journeys an owner holds (in its queue, or taken and not yet written
# whole) past this share of its queue's bound mean its exporters are behind:
# the owner says so before the queue fills and drops (engine/pipeline.py), and
# an exporter short of CPU says why (export/cpu_share.py).
BEHIND_SHARE = 0.25


class Acks:
    """Two counts shared by the engine core and one exporter it started, in
    sixteen bytes of shared memory (a memfd the engine core creates and passes
    to the exporter). 64-bit aligned stores: a reader never sees half of one.

    * accounted: how many records (journeys, snapshots, steps) sent to the
      exporter it has accounted for: their spans exported, or counted lost in
      its own health (failed to build, failed to export). The exporter writes
      it (``export/span_sink.py``), the engine core reads it when that exporter
      dies: what it was sent minus this was lost with it, uncounted anywhere
      else.
    * held: how many finished journeys the owner (the engine core, an API
      server) still holds, not yet written whole to any exporter, as of its
      last hand-off (``engine/pipe_sink.py``; one exporter's counter carries
      it). The exporter reads it at end-of-file: an owner killed with a backlog
      (vLLM kills an engine core that does not exit at once) cannot say what
      it lost, and this says it for it.
    """

    _COUNT = struct.Struct("<Q")
    _HELD_AT = _COUNT.size

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map = mmap.mmap(fd, 2 * self._COUNT.size)

    @classmethod
    def create(cls) -> Acks | None:
        """A new counter at 0 (None where the platform has no memfd)."""
        if not hasattr(os, "memfd_create"):
            return None
        # Close-on-exec: only the exporter it is passed to (pass_fds) gets it.
        fd = os.memfd_create("vllm-journey-otel-acks", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, 2 * cls._COUNT.size)
            return cls(fd)
        except OSError:
            os.close(fd)
            return None

    def read(self) -> int:
        return int(self._COUNT.unpack_from(self._map)[0])

    def write(self, count: int) -> None:
        self._COUNT.pack_into(self._map, 0, count)

    def held(self) -> int:
        return int(self._COUNT.unpack_from(self._map, self._HELD_AT)[0])

    def write_held(self, count: int) -> None:
        self._COUNT.pack_into(self._map, self._HELD_AT, count)

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(Frame)


# The exporter reads the pipe at most this often while journeys keep coming:
# ten of the engine's hand-off intervals (pipeline.PUBLISH_INTERVAL_NS), so
# a read finds frames waiting and the reader is rarely blocked in read() when
# the engine thread writes, and the exporter's work comes in bursts of many
# journeys: per journey, a burst every 0.5 s cost the exporters of a busy
# `vllm serve` 0.7 to 0.85 of what one every 50 ms did (the wake-ups of its
# threads and caches refilled each time; docs/performance.md). The 1 MiB
# pipe holds over a second of a busy server's frames, and a read of half the
# pipe or more never pauses.
READ_PACE_S = 0.5
_READ_CHUNK = 1 << 20
F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)  # Linux


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
        a read's frames took half the pace or more, or the read brought half
        the pipe or more) and a frame still arriving never pause, so capacity
        is unchanged. A partial frame at end-of-file is dropped.

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
            paced = pace_s > 0 and not draining and not buf
            if paced and _caught_up(stream, last, clock() - read_at, pace_s):
                draining = _pause(read_at + pace_s, stop)
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


def _caught_up(stream: IO[bytes], last: int, handled_s: float, pace_s: float) -> bool:
    """Whether the paced reader may pause: its last read (``last`` bytes; -1:
    none yet) brought less than half the pipe, and handing out its frames took
    less than half the pace. Otherwise the writer is ahead, or the exporter
    is busy enough that a pause would cost it throughput: read again at once."""
    return 0 <= last < _busy_read(stream) and handled_s < pace_s / 2


def _pause(until: float, stop: Callable[[], bool] | None) -> bool:
    """Sleep until ``until`` (monotonic s), in slices so that a stop is noticed
    within _STOP_POLL_S; True when one was."""
    while (rest := until - time.monotonic()) > 0:
        time.sleep(min(rest, _STOP_POLL_S) if stop is not None else rest)
        if stop is not None and stop():
            return True
    return False


def _busy_read(stream: IO[bytes]) -> int:
    """A read of this many bytes or more means the writer is ahead: read again
    at once. Half the pipe's capacity (the engine core sets it after the
    exporter starts, 1 MiB where the system allows, else the 64 KiB default),
    so a pause never lets the pipe fill and the engine side's writes be
    declined; the read size where the stream is not a pipe."""
    try:
        return min(_READ_CHUNK, int(fcntl.fcntl(stream.fileno(), F_GETPIPE_SZ)) // 2)
    except (OSError, ValueError):  # not a pipe, no descriptor (io.UnsupportedOperation)
        return _READ_CHUNK


def read_frames(stream: IO[bytes], pace_s: float = 0.0) -> Iterator[Frame]:
    """Yield decoded :class:`Frame` s from ``stream`` until end-of-file
    (:meth:`FrameReader.frames` with a reader of its own)."""
    return FrameReader().frames(stream, pace_s)
