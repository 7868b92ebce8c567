"""What the pipeline hands finished journeys to: the :class:`Sink` protocol.

Engine-core or API-server process: the owner's thread (the engine thread, or
the API server's event loop) calls ``may_take`` and ``offer``; the pipeline's
drain thread the rest (``pipeline.py``). Two sinks implement it: ``PipeSink``
(the exporter pipe, ``pipe_sink.py``) and ``SpanSink`` (spans built in this
process, ``export/span_sink.py``). No clock of its own: ``consume``'s deadline
is ``time.monotonic()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from vllm_journey_otel.journey import Record
from vllm_journey_otel.losses import LossAccount


class Sink(Protocol):
    """Receives batches of finished journeys from the pipeline.

    ``losses`` is this process's loss account (``losses.py``): the pipeline
    adopts the sink's; the sink counts there whatever it loses, with the
    reason. ``engine_dropped`` is the engine side's count of journeys lost so
    far (``LossAccount.carried``); it ends up on the roots as the tracer-health
    attribute.
    """

    losses: LossAccount
    # No receiving end (every exporter gone): what it is given is lost, counted.
    broken: bool

    def may_take(self) -> bool:
        """The owner's thread, before it takes its queue out: whether an offer
        now could go through (no encode, no write; ``offer`` decides). False:
        the queue stays where it is."""

    def offer(self, batch: Sequence[Record], engine_dropped: int = 0) -> bool:
        """The owner's thread: take the batch now if that cannot block; False = queue it.
        The rest of a partial frame goes first (an empty batch: only that)."""

    @property
    def pending(self) -> bool:
        """Whether bytes taken by ``offer`` still wait to be written (the
        owner's next offer, or the drain thread once the owner stops)."""

    @property
    def takes_offers(self) -> bool:
        """Whether :meth:`offer` can ever take a batch (False: always queue)."""

    @property
    def unsent(self) -> int:
        """Journeys it has taken and not yet written whole (a partial frame)."""

    @property
    def replacing(self) -> bool:
        """Whether :meth:`maintain` has a lost exporter to replace (it is then
        called every interval, so the replacement starts when its backoff says)."""

    def consume(
        self, batch: Sequence[Record], engine_dropped: int = 0, deadline: float | None = None
    ) -> int:
        """Handle a batch; returns how many records it lost (counted in
        ``losses`` with their reason). ``deadline``
        (``time.monotonic()``): stop waiting for the receiving end then; what is
        not taken stays pending (None: wait as long as it takes)."""

    def maintain(self) -> None:
        """Drain thread, every wake-up: notice and replace what went away."""

    def note_held(self, queued: int) -> None:
        """After a hand-off: ``queued`` finished journeys still wait in the
        pipeline, for whoever would report them if this process died now."""

    def flush(self, timeout_s: float) -> bool:
        """Push everything out within ``timeout_s``; True when done."""

    def shutdown(self, timeout_s: float) -> None:
        """Flush and release resources."""

    @property
    def drop_advice(self) -> str:
        """What to change when the engine's queue overflows because this sink is behind."""
