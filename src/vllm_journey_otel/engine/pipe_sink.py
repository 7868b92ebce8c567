"""The engine side of the exporter pipe: encode batches of journeys, write them.

Engine-core or API-server process: :meth:`PipeSink.may_take` and ``offer`` on
the owner's thread (a poll; an encode, a non-blocking write), the rest on the drain thread
(``pipeline.py``). The exporter processes it writes to are started and replaced
through ``exporter_launch.py``. Clock: ``time.monotonic()`` for deadlines and
the replacements' backoff.

This keeps span building and OTLP encoding off the engine core's GIL, and the
exporter outlives the engine core: vLLM's API server kills the engine-core
process tree at once on SIGTERM (``--shutdown-timeout 0``, the default), so
nothing left inside the engine core at that moment could be flushed.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_journey_otel.engine.exporter_launch import (
    Restarts,
    behind_advice,
    launch_exporters,
    launch_with_acks,
    placement_roots,
)
from vllm_journey_otel.engine.pipe_room import any_room
from vllm_journey_otel.journey import Record
from vllm_journey_otel.log import logger
from vllm_journey_otel.losses import Loss, LossAccount
from vllm_journey_otel.wire import ENCODER, FRAME_HEADER, Acks, Frame

DRAIN_LOCK_S = 0.2  # the drain thread's maintain() waits this long for the lock, at most


class FrameLost(Exception):
    """A frame could not be delivered to any exporter (the catcher counts its records)."""


class PipeSink:
    """Encode batches and write them to one or more detached exporter processes.

    The write ends of the pipes are non-blocking. The engine thread ``offer``s the
    journeys a step finished: one msgspec encode and one ``os.write``, no thread
    hand-off (waking a thread costs the engine thread a GIL switch each time).
    With several exporters (one exporter process builds and encodes ~6,000
    journeys a second; docs/performance.md), each frame goes to the one that has
    been sent the fewest bytes so far, the next one if that pipe is full: frames
    differ in size (a 50 ms hand-off from the engine thread vs. a drain of the
    queue), so plain turns would load one exporter with all the big ones. If
    every pipe is full, or the drain thread is writing, the offer is declined and
    the journeys take the queue; bytes an offer could only partly write are
    written by the owner's next offers, one non-blocking write each, before a
    new frame, and by the drain thread (which may block, the owner never does)
    only when the owner stops handing on.

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
        # This process's loss account (the pipeline adopts it): every record
        # this sink loses is counted there, with its reason.
        self.losses = LossAccount()
        self.broken = not self._fds
        self._lock = threading.Lock()
        self._sent = dict.fromkeys(self._fds, 0)  # bytes written to each pipe
        # The rest of a frame whose start went to ``_pending_fd`` (-1: to none yet),
        # and how many journeys it holds.
        self._pending: bytes | memoryview = b""
        self._pending_fd = -1
        self._pending_journeys = 0
        # Per pipe: records in the frames written whole to it, and its exporter's
        # count of those it accounted for (None: no memfd on this platform).
        self._records_sent: dict[int, int] = dict.fromkeys(self._fds, 0)
        self._acks: dict[int, Acks | None] = {}
        # Replacing lost exporters (drain thread): how to start one, how many to keep.
        self._recipe: tuple[list[str], dict[str, str], str | None] | None = None
        self.wanted = len(self._fds)
        self._pid_of: dict[int, int | None] = dict(zip(self._fds, self.pids, strict=False))
        self.restarts = Restarts()
        # NO_EXPORTER's count when the last exporter went away (the log of
        # its replacement says how many were dropped while none ran).
        self._down_from = 0
        self._closing = False
        # The held count (note_held): the owner's last figure, what was stored
        # in which counter, a partial frame's journeys while its rest is written;
        # the lock of its stores and counters' closing, never held across a write.
        self._held_queue = 0
        self._held_noted: tuple[Acks | None, int] = (None, 0)
        self._writing_journeys = 0
        self._held_lock = threading.Lock()

    @property
    def exporters(self) -> int:
        """Exporter processes still connected."""
        return len(self._fds)

    @property
    def records_in_flight(self) -> int:
        """Records written whole to the exporters still connected and not yet
        accounted for by them (what a death now would lose; 0 without counters)."""
        with self._lock:  # not while a lost exporter's counter is being closed
            acks = self._acks
            return sum(
                sent - counter.read()
                for fd, sent in self._records_sent.items()
                if (counter := acks.get(fd)) is not None
            )

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
            "vllm_journey_otel.export.exporter_process",
            json.dumps(dict(resource_attributes)),
            ",".join(str(pid) for pid in placement_roots()),
        ]
        child_env = dict(os.environ if env is None else env)
        acks = launch_exporters(argv, child_env, python, max(1, processes))
        pid_of = {fd: pid for fd, (pid, _) in acks.items()}
        pids = [pid for pid in pid_of.values() if pid is not None]
        sink = cls(list(acks), pids[0] if pids else None)
        sink.pids = pids
        sink._pid_of = pid_of
        sink._acks = {fd: counter for fd, (_, counter) in acks.items()}
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
        if fd == self._pending_fd:
            # The rest of a frame whose start went there is lost with it; its
            # number must never be written to again (it may be reused).
            _, journeys, _ = self._take_pending()
            self.losses.add(Loss.EXPORTER_DIED, journeys)
        held = self._undelivered(fd)
        with contextlib.suppress(OSError):
            os.close(fd)
        if not self._fds:
            self.broken = True
            self._down_from = self.losses[Loss.NO_EXPORTER]
        if self._recipe is None or self._closing:
            then = "journeys are dropped from now on" if self.broken else "the others go on"
        else:
            delay = self.restarts.lost(time.monotonic())
            then = f"a new one starts in {delay:.1f} s"
            if self.broken:
                then += "; journeys are dropped (and counted) until then"
        logger.warning(
            "journey-otel: exporter process %s is gone (%d left)%s; %s",
            pid if pid is not None else "?",
            len(self._fds),
            ""
            if held is None
            else f"; {held} journeys it had been sent were lost with it "
            "(counted in the next journeys' dropped_journeys)",
            then,
        )
        self._store_held()  # the next one may be the first now: its counter starts at 0

    def _undelivered(self, fd: int) -> int | None:
        """What the exporter behind ``fd`` (gone) had been sent in whole frames and
        not accounted for, counted as lost with it (the next frames carry it);
        None where it had no counter."""
        sent = self._records_sent.pop(fd, 0)
        with self._held_lock:  # not while the held count is stored in it
            acks = self._acks.pop(fd, None)
        if acks is None:
            return None
        held = max(0, sent - acks.read())
        acks.close()
        self.losses.add(Loss.EXPORTER_DIED, held)
        return held

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
            fd, pid, acks = launch_with_acks(argv, env, python)
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
                if acks is not None:
                    acks.close()
                return
            was_broken = self.broken
            self._fds.append(fd)
            self._sent[fd] = 0
            self._records_sent[fd] = 0
            self._acks[fd] = acks
            self._pid_of[fd] = pid
            if pid is not None:
                self.pids.append(pid)
            self.broken = False
            self.restarts.did_start(now, more_wanted=len(self._fds) < self.wanted)
            self._store_held()  # it may be the first now: its counter starts at 0
        logger.warning(
            "journey-otel: exporter process %s started in place of a lost one%s",
            pid if pid is not None else "?",
            f"; {self.losses[Loss.NO_EXPORTER] - self._down_from} journeys were dropped "
            "while none ran"
            if was_broken
            else "",
        )

    takes_offers = True

    @property
    def replacing(self) -> bool:
        return self._recipe is not None and not self._closing and len(self._fds) < self.wanted

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    @property
    def unsent(self) -> int:
        return self._pending_journeys + self._writing_journeys

    @property
    def drop_advice(self) -> str:
        return behind_advice(len(self._fds))

    def may_take(self) -> bool:
        # Without the lock, a hint (offer decides under it): an exporter lost
        # meanwhile makes the poll say "room" (POLLNVAL), and offer then declines.
        # A partial frame's rest goes first, to its own exporter.
        if self.broken or self._lock.locked():
            return False
        fd = self._pending_fd  # read once: the drain thread may finish the rest meanwhile
        return any_room([fd] if self._pending and fd >= 0 else self._fds)

    def offer(self, batch: Sequence[Record], engine_dropped: int = 0) -> bool:
        # Each frame carries this process's ``losses.carried``, the pipeline's
        # ``engine_dropped`` too (one account): the argument is not needed here.
        if self.broken or not self._lock.acquire(blocking=False):
            return False
        try:
            if self._pending and not self._resume_now():  # a partial frame's rest first
                return False
            if not batch:
                return True
            if not any_room(self._fds):  # no encode for nothing (pipe_room.py)
                return False
            data = self._frame(batch, self.losses.carried)
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
                else:
                    self._records_sent[fd] += len(batch)
                return True
            # Declined: every pipe is full, or the last exporter just went away
            # (then the drain thread's consume counts the batch as lost, once).
            return False
        finally:
            self._lock.release()

    def _resume_now(self) -> bool:
        """Under ``_lock``, the owner's thread: one non-blocking write of a
        frame's rest to its exporter (-1: none of it written yet, to any with
        room); True once it is whole (or lost with its exporter, counted). The
        drain thread, whose wake-ups take the GIL from the owner, stays asleep."""
        for fd in [self._pending_fd] if self._pending_fd >= 0 else self._rotation():
            try:
                n = os.write(fd, self._pending)
            except BlockingIOError:
                continue
            except OSError:  # its exporter is gone: a started frame's rest with it, counted
                self._lost_exporter(fd)
                if self._pending:
                    continue
                return True
            break
        else:
            return False
        self._pending_fd = fd
        self._sent[fd] += n
        if n < len(self._pending):  # a view: no copy of a long rest per write
            self._pending = memoryview(self._pending)[n:]
            return False
        with self._held_lock:
            _, journeys, _ = self._take_pending()
        self._records_sent[fd] += journeys
        return True

    def note_held(self, queued: int) -> None:
        """The owner still holds ``queued`` finished journeys: with a frame not
        yet written whole, stored in the first exporter's counter, read if its
        pipe ends (wire.Acks): a kill leaves no time for a word of ours. Waits
        only for another store or a counter's closing, never for a write."""
        self._store_held(queued)

    def _store_held(self, queued: int | None = None) -> None:
        """One aligned store when the figure or the counter changed (a new pipe
        may reuse a number); ``queued`` None: the owner's last figure."""
        with self._held_lock:
            if queued is not None:
                self._held_queue = queued
            try:
                counter = self._acks.get(self._fds[0])
            except IndexError:  # no exporter left
                return
            held = self._held_queue + self._pending_journeys + self._writing_journeys
            if counter is not None and (counter, held) != self._held_noted:
                counter.write_held(held)
                self._held_noted = (counter, held)

    def _write_frame(
        self, data: bytes | memoryview, journeys: int, fd: int = -1, deadline: float | None = None
    ) -> bool:
        """Write one frame: the rest of a partial one to its ``fd``, a new one (-1)
        to the first exporter with room. Blocks until done or ``deadline``; False
        at the deadline (what is left becomes pending). Raises :class:`FrameLost`
        (the caller counts its records) when the exporter that has the start of
        the frame is gone, or none is left.
        """
        view = memoryview(data)
        while view:
            if not self._fds:
                raise FrameLost("no exporter process left")
            if fd >= 0 and fd not in self._fds:  # its exporter went away meanwhile
                raise FrameLost("the exporter of a partial frame is gone")
            targets = [fd] if fd >= 0 else self._rotation()
            for target in targets:
                try:
                    n = os.write(target, view)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    self._lost_exporter(target)
                    if fd >= 0:  # the frame's start went there: it is lost with it
                        raise FrameLost("the exporter went away in the middle of a frame") from exc
                    continue
                self._sent[target] += n
                fd, view = target, view[n:]
                if not view:  # the frame is whole in that pipe
                    self._records_sent[fd] += journeys
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

    def _take_pending(self) -> tuple[bytes | memoryview, int, int]:
        pending = self._pending, self._pending_journeys, self._pending_fd
        self._pending, self._pending_journeys, self._pending_fd = b"", 0, -1
        return pending

    def _resume_pending(self, deadline: float | None) -> bool:
        """Under ``_lock``: write the rest of the partial frame (False: still
        pending at ``deadline``; :class:`FrameLost`, counted, when its exporter
        is gone). Its journeys count as held while they are written."""
        with self._held_lock:
            self._writing_journeys = self._pending_journeys
            data, journeys, fd = self._take_pending()
        try:
            return self._write_frame(data, journeys, fd, deadline)
        except FrameLost:
            self.losses.add(Loss.EXPORTER_DIED, journeys)
            raise
        finally:
            with self._held_lock:  # after any partial rest went back to _pending
                self._writing_journeys = 0

    def consume(
        self, batch: Sequence[Record], engine_dropped: int = 0, deadline: float | None = None
    ) -> int:
        if self.broken:
            return self.losses.lose(Loss.NO_EXPORTER, batch)
        with self._lock:
            if self._pending:
                try:
                    done = self._resume_pending(deadline)
                except FrameLost:
                    done = True
                if not done:
                    # Still pending at the deadline (the engine thread's offer
                    # left it after drain() looked): the new frame goes after it,
                    # to the same exporter, with the next write. Nothing is lost.
                    if batch:
                        frame = self._frame(batch, self.losses.carried)
                        self._pending = bytes(self._pending) + frame
                        self._pending_journeys += len(batch)
                    return 0
            if batch:
                frame = self._frame(batch, self.losses.carried)
                try:
                    self._write_frame(frame, len(batch), deadline=deadline)
                except FrameLost:
                    reason = Loss.WRITE_FAILED if self._fds else Loss.NO_EXPORTER
                    return self.losses.lose(reason, batch)
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
                try:
                    return self._resume_pending(deadline)
                except FrameLost:
                    return False
        finally:
            self._store_held()
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
                with self._held_lock:  # not while the held count is stored in it
                    acks = self._acks.pop(fd, None)
                if acks is not None:
                    acks.close()
            self._fds, self.broken = [], True  # nothing is written from now on
        finally:
            self._lock.release()
