"""Whether any exporter's pipe has room, asked before a frame is encoded.

Engine-core process (the engine thread's hand-off) and an API server's (its
event loop's), inside ``PipeSink.offer``. No timestamps.

An exporter that has fallen behind leaves its pipe full. The owner hands its
whole queue on in one frame, and encoding a queue of 16,384 finished journeys
takes milliseconds (7 ms on a 2-vCPU AMD EPYC guest), only for a write that
then takes nothing: every hand-off interval, on the engine thread or the event
loop, for as long as the exporter stays behind. A zero-timeout ``poll`` (one
system call; ``select`` would fail past descriptor 1023, which a vLLM process
may use) says whether a write would take any of it.
"""

from __future__ import annotations

import select
from collections.abc import Iterable


def any_room(fds: Iterable[int]) -> bool:
    """True when a write to some pipe of ``fds`` would take bytes now (or one
    of them is closed at the other end: the write then says so)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLOUT)
    return bool(poller.poll(0))
