"""Hand-off from the thread that owns the journeys to a sink, off that thread's back.

The owning thread (the engine thread in an engine core; the event loop in an API
server) calls :meth:`JourneyPipeline.submit` with a finished journey: one length
check and one ``deque.append`` (atomic under the GIL), nothing else. When the
queue is full the journey is dropped and counted, never blocking the owner. The
owner hands the queue to the sink itself, at a moment it chooses (the end of a
step; an API request's end, or a timer on the event loop): ``publish_due``, at
most every ``PUBLISH_INTERVAL_NS``, only if that cannot block.

While the owner keeps calling, a declined hand-off (every exporter pipe full)
and the rest of a frame that a pipe could take only in part are the owner's
own to retry at its next call: one non-blocking write each.

A daemon thread ("vllm-journey-otel"; ``journey-drain`` where the OS shows
threads) is the backstop. It sleeps until the owner says it is about to idle
with something left (``publish_due(idle=True)``), and otherwise wakes once
every ``MAINTAIN_S`` to notice and replace a lost exporter, to take in-flight
snapshots, and to drain what an owner left behind (it stopped calling). It
never wakes on a timer that the owner's hand-off makes useless, not even while
the exporters are behind: it runs at nice 19 and shares the process's
GIL, and on a saturated CPU every wake-up of such a thread makes the owner wait
for it (CPython hands the GIL to a waiting thread and waits until that thread
has run, however long the kernel keeps it in the run queue; docs/performance.md,
"Free by default"). In ``thread`` mode (span building in this process)
the sink takes no offers and the thread does all the work, every ``interval``.

Process: an engine-core or API-server process, created after fork/spawn.
Thread-safety: ``submit`` and ``publish_due`` are called by one thread (the
owner); draining is serialised by a lock so :meth:`flush` may be called from any
thread. Clock: ``time.monotonic_ns()`` (the engine's monotonic clock) for the
owner's calls, ``time.monotonic()`` for deadlines.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from vllm_journey_otel.config import Config
from vllm_journey_otel.cpu_yield import lower_priority
from vllm_journey_otel.engine.sink import Sink
from vllm_journey_otel.journey import Record
from vllm_journey_otel.log import logger
from vllm_journey_otel.losses import Loss
from vllm_journey_otel.wire import BEHIND_SHARE

_DROP_LOG_PERIOD_S = 60.0
# The drain thread writes for at most this long per wake-up (the rest of a frame
# stays pending for the next one), so a flush or shutdown with a deadline never
# waits longer than this for the sink.
DRAIN_WRITE_S = 0.2
# The owner hands finished journeys on at most this often (publish_due).
# The exporter's paced read (wire.READ_PACE_S) is many times this, so that
# each of its reads takes many hand-offs at once.
PUBLISH_INTERVAL_NS = 50_000_000
# Journeys the owner hands on per call, at most: a queue that grew while the
# exporters were behind goes on in parts, each one encode of a few ms at most
# on the owner's thread (20 calls a second: 80,000 journeys/s, past what the
# exporters take), the rest at its next calls.
OWNER_BATCH = 4096
# In-flight snapshots the drain thread hands on per wake-up, at most.
WATCH_BATCH = 256
# The drain thread's wake-up while the owner hands on by itself: in-flight
# snapshots ("about once a second"), a lost exporter's replacement, a queue left
# behind by an owner that stopped.
MAINTAIN_S = 1.0


# The drain thread's name where the OS shows threads (top -H, ps -L, /proc's
# comm, py-spy): which thread of a vLLM process is ours.
DRAIN_THREAD_COMM = "journey-drain"


def _name_os_thread(name: str) -> None:
    """Linux: the calling thread's comm (15 bytes at most). Never raises."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


class JourneyPipeline:
    """Bounded queue of finished journeys plus the thread that drains it into a sink."""

    def __init__(
        self,
        sink: Sink,
        max_queue: int = Config.queue_size,
        interval_s: float = Config.export_interval_ms / 1000.0,
        start_thread: bool = True,
        cpu_priority: str = Config.cpu_priority,
        maintain_s: float = MAINTAIN_S,
    ) -> None:
        self.sink = sink
        self._maintain_s = maintain_s
        self._queue: deque[Record] = deque()
        self._max_queue = max_queue
        self._interval_s = interval_s
        self._cpu_priority = cpu_priority
        self._drain_lock = threading.Lock()
        self._stop = False
        # Set by the owner when it needs the drain thread (or by shutdown).
        self._wake = threading.Event()
        # Counters: ``published`` by the owner, ``exported`` by whichever thread
        # holds the drain lock (the loss account says who writes what).
        # ``_declined`` is set by the owner and cleared by either (publish_due, drain).
        self._last_publish_ns = 0
        # When the owner's next hand-off is due (engine monotonic clock): the
        # engine thread compares a step's stamp with it before it calls
        # publish_due, one attribute read per step instead of a call. Never,
        # with a sink that takes no offers (the drain thread does the work).
        self.due_ns = 0 if sink.takes_offers else 1 << 62
        # Written by the owner in publish_due, read by the drain thread
        # (engine monotonic clock): the engine's last call, and whether its last
        # offer was declined.
        self._engine_seen_ns = 0
        # Set by the owner's last call when it said no call would follow soon.
        self._owner_idle = False
        # A sink that never takes offers (span building in this process): the
        # drain thread does all the work, the engine thread none.
        self._offers = sink.takes_offers
        self._declined = not self._offers
        # This process's losses, by reason: the sink's account, one for both.
        self.losses = sink.losses
        self.published = 0
        self.exported = 0
        self._dropped_logged = 0
        self._last_drop_log = -_DROP_LOG_PERIOD_S  # the first drop is reported at once
        self._last_behind_log = -_DROP_LOG_PERIOD_S
        # Drain thread: sources of records it hands on itself (in-flight snapshots).
        self._watchers: list[Callable[[int, int], Sequence[Record]]] = []
        # Journeys the drain thread, and the owner, have taken from the queue
        # and not yet handed on or put back: still held (_note_held).
        self._in_hand = 0
        self._owner_in_hand = 0
        self._held_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="vllm-journey-otel", daemon=True)
            self._thread.start()

    # -- the owner's thread ------------------------------------------------
    def submit(self, journey: Record) -> None:
        """Queue a finished journey (the owner). O(1), never blocks, never raises."""
        if len(self._queue) >= self._max_queue:
            self.losses.add(Loss.QUEUE_FULL)
            return
        self._queue.append(journey)

    def publish_due(self, now_ns: int, force: bool = False, idle: bool = False) -> None:
        """The owner (the engine thread at the end of a step; the API server's
        event loop): hand the queue to the sink now, at most once per
        ``PUBLISH_INTERVAL_NS``, if that cannot block.

        With the exporter pipe this is one msgspec encode and one non-blocking
        write, no thread hand-off (waking a thread costs the engine thread a GIL
        switch), so finished journeys leave the engine core within about 50 ms
        under load, and at once when the engine is about to idle: an abrupt
        kill of a busy engine core loses at most the last 50 ms. (A frame has
        a fixed cost, cold, of about 50 us on the engine thread, which more
        journeys share at 50 ms than at 25; docs/performance.md.) A frame's rest
        that a full pipe left is written first, at the next call. While the
        owner calls, whatever is declined or left is its own to retry: the drain
        thread sleeps (each wake-up of it would take the GIL from the owner).
        ``force`` skips the interval (the engine is about to idle, the API
        server's timer fired). ``idle``: no later call will come soon (the
        engine about to idle, the API server's timer with no request ended
        since it was set); what is left is then the drain thread's, woken here.
        """
        self._engine_seen_ns = now_ns
        self._owner_idle = idle
        queue = self._queue
        if (
            (queue or self.sink.pending)
            and self._offers
            and (force or now_ns - self._last_publish_ns >= PUBLISH_INTERVAL_NS)
        ):
            self._hand_on(now_ns)
        if idle and (queue or self.sink.pending):
            self._wake.set()

    def _hand_on(self, now_ns: int) -> None:
        self._last_publish_ns = now_ns
        self.due_ns = now_ns + PUBLISH_INTERVAL_NS
        queue = self._queue
        if not self.sink.may_take():
            # Every pipe full, or a frame's rest that cannot go on yet: the
            # queue stays put. Taking a full queue out and back is O(queue),
            # 0.3 ms or more of the owner's at 16,384 journeys, every interval
            # while the exporters are behind (docs/performance.md, "vLLM's
            # spin-waits and the exporter").
            self._decline()
            self._note_held()
            return
        batch: list[Record] = []
        take = self._owner_in_hand = min(len(queue), OWNER_BATCH)  # before they leave
        try:
            try:
                for _ in range(take):
                    batch.append(queue.popleft())
            except IndexError:
                pass  # empty (the drain thread may have taken some: each goes once)
            self._owner_in_hand = len(batch)
            if self.sink.offer(batch, self.losses.carried):
                self.published += len(batch)
                self._declined = False
            else:
                with self._held_lock:  # back in the queue and out of hand at once
                    queue.extendleft(reversed(batch))
                    self._owner_in_hand = 0
                self._decline()
        finally:
            self._owner_in_hand = 0  # the sink's now, or back in the queue
        self._note_held()

    def _decline(self) -> None:
        """The owner's hand-off was declined: its own to retry at its next call,
        unless no exporter is left (the drain thread, woken once, counts what
        comes lost from then on)."""
        if self.sink.broken and not self._declined:
            self._wake.set()
        self._declined = True

    def _note_held(self) -> None:
        """Owner or drain thread, after moving journeys: what is still held, for
        the sink to keep where its exporter can read it (``Sink.note_held``).
        Each thread counts a batch before it takes it from the queue and
        forgets it only once it is back (under ``_held_lock``, as this sum is
        taken and stored) or the sink's: a batch in motion is counted once or,
        until the next store, twice; never missed."""
        with self._held_lock:
            self.sink.note_held(len(self._queue) + self._in_hand + self._owner_in_hand)

    # -- drain thread ------------------------------------------------------
    def _run(self) -> None:
        _name_os_thread(DRAIN_THREAD_COMM)
        # The drain thread yields to vLLM's (cpu_yield.py: nice 19, vLLM's CPUs).
        applied = lower_priority(self._cpu_priority, shares_gil=True)
        logger.debug("journey-otel: drain thread at %s", applied)
        failures = 0
        # The next wake-up for maintenance (time.monotonic()); a wake-up by the
        # owner between does not move it (in-flight checks stay ~1 s apart).
        due = time.monotonic() + self._maintain_s
        while True:
            # Every interval only while it has the owner's work (or a lost
            # exporter's replacement) to do: while the owner calls, it retries
            # its own declined hand-offs and partial frames.
            busy = (
                not self._offers
                or self.sink.replacing
                or ((self._declined or self.sink.pending) and not self.engine_hands_on())
            )
            wait = self._interval_s if busy else max(0.0, due - time.monotonic())
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop:
                return
            now = time.monotonic()
            if now >= due:
                due = now + self._maintain_s
            try:
                self.sink.maintain()  # a lost exporter is noticed and replaced here
                self._watch()
                if self.engine_hands_on():
                    with self._drain_lock:
                        self._report_drops()
                        self._report_backlog()
                    continue
                self.drain(time.monotonic() + DRAIN_WRITE_S)
            except Exception:  # the backstop must outlive a bug of ours
                failures += 1
                if failures == 1 or failures % 1000 == 0:
                    logger.warning(
                        "journey-otel: drain failed (%d times so far); retrying",
                        failures,
                        exc_info=True,
                    )

    def watch(self, source: Callable[[int, int], Sequence[Record]]) -> None:
        """Have the drain thread call ``source(now_ns, room)`` on each wake-up and
        hand what it returns (at most ``room`` records) to the sink itself: the
        engine thread never encodes them."""
        self._watchers.append(source)

    def _watch(self) -> None:
        if not self._watchers:
            return
        now_ns = time.monotonic_ns()
        records: list[Record] = []
        for source in self._watchers:
            records.extend(source(now_ns, WATCH_BATCH - len(records)))
        if not records:
            return
        with self._drain_lock:
            lost = self.sink.consume(records, self.losses.carried, time.monotonic() + DRAIN_WRITE_S)
        if lost:  # the sink counted them (as snapshots)
            total = self.losses[Loss.SNAPSHOT]
            if total == lost or total % 1000 < lost:
                logger.warning(
                    "journey-otel: %d in-flight snapshots could not be handed on so far; %s",
                    total,
                    self.sink.drop_advice,
                )

    def engine_hands_on(self, now_ns: int | None = None) -> bool:
        """Drain thread: whether the owner is handing on: it called
        :meth:`publish_due` within three intervals (the engine thread calls it
        at the first step's end after ``due_ns``) and did not say it was about
        to idle. Then whatever is queued, declined or left of a frame is the
        owner's to hand on at its next call, and the drain thread leaves it:
        every drain takes the GIL from the owner, and would split its frames.
        Otherwise (an owner idle or stopped, a sink that never takes offers,
        or one with no exporter: what it is given is counted lost at once,
        not left to fill the queue) it drains.
        """
        if self._owner_idle or not self._offers or self.sink.broken:
            return False
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        return now_ns - self._engine_seen_ns < 3 * PUBLISH_INTERVAL_NS

    def drain(self, deadline: float | None = None) -> int:
        """Hand every queued journey to the sink, in one batch; returns how many.

        ``deadline`` (``time.monotonic()``): give up waiting for the lock, or for
        the sink to take the bytes, at that moment (what is left stays pending or
        queued, counted as before). None: as long as it takes (the drain thread).
        """
        timeout = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._drain_lock.acquire(timeout=timeout):
            return 0
        try:
            # The rest of a frame blocks the pipe: finish it in time, or let the
            # queue wait (a new frame cannot go after a partial one).
            if (
                deadline is not None
                and self.sink.pending
                and not self.sink.flush(max(0.0, deadline - time.monotonic()))
            ):
                self._report_drops()
                return 0
            if self._offers:
                # From here the owner's offers may go through again; one declined
                # while this drain writes (the sink's lock is taken) sets it back,
                # and the owner retries it at its next call.
                self._declined = False
            queue = self._queue
            batch: list[Record] = []
            self._in_hand = len(queue)  # before they leave the queue
            try:
                # The owner's publish_due may pop some meanwhile: each journey
                # goes once, by whichever thread popped it.
                for _ in range(len(queue)):
                    batch.append(queue.popleft())
            except IndexError:
                pass
            n = self._in_hand = len(batch)
            if n or self.sink.pending:
                try:
                    lost = self.sink.consume(batch, self.losses.carried, deadline)
                except Exception:
                    self.losses.lose(Loss.WRITE_FAILED, batch)  # counted, never silent
                    raise
                self.exported += n - lost
            self._report_drops()
        finally:
            try:
                self._in_hand = 0
                self._note_held()  # after any write, or none
                self._report_backlog()
            finally:
                self._drain_lock.release()
        return n

    def _report_drops(self) -> None:
        dropped = self.losses[Loss.QUEUE_FULL]
        now = time.monotonic()
        if dropped > self._dropped_logged and now - self._last_drop_log >= _DROP_LOG_PERIOD_S:
            logger.warning(
                "journey-otel: %d finished journeys dropped so far (queue full at %d); %s",
                dropped,
                self._max_queue,
                self.sink.drop_advice,
            )
            self._dropped_logged = dropped
            self._last_drop_log = now

    def _report_backlog(self) -> None:
        """Drain thread: journeys waiting for a hand-off past ``BEHIND_SHARE`` of
        the queue's bound, said before the queue fills (spans arrive late)."""
        waiting = len(self._queue) + self.sink.unsent
        now = time.monotonic()
        if (
            waiting >= max(1, int(self._max_queue * BEHIND_SHARE))
            and now - self._last_behind_log >= _DROP_LOG_PERIOD_S
        ):
            self._last_behind_log = now
            logger.warning(
                "journey-otel: %d finished journeys wait in this process to be handed "
                "on (past %d the queue drops them): their spans arrive late; %s",
                waiting,
                self._max_queue,
                self.sink.drop_advice,
            )

    # -- any thread --------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Drain the queue and flush the sink within ``timeout_s``.

        Returns True if everything queued was handed on in time.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        self.drain(deadline)
        ok = self.sink.flush(max(0.0, deadline - time.monotonic()))
        return ok and not self._queue

    def shutdown(self, timeout_s: float) -> bool:
        """Stop the thread, drain, and shut the sink down within ``timeout_s``."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        deadline = time.monotonic() + max(0.0, timeout_s)
        self.drain(deadline)
        self.sink.shutdown(max(0.0, deadline - time.monotonic()))
        lost = self.losses.describe()
        if lost:  # one line for the operator: what this process lost, and why
            logger.warning("journey-otel: records lost in this process over its run: %s", lost)
        return not self._queue

    @property
    def queued(self) -> int:
        """Journeys waiting to be handed on."""
        return len(self._queue)

    @property
    def left(self) -> bool:
        """Journeys queued, or a frame's rest not yet written: the owner's next
        call hands them on (or the drain thread, once the owner is idle)."""
        return bool(self._queue) or self.sink.pending
