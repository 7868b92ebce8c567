"""What the tracer lost in one process, each loss with its reason: one account.

Processes: every process that hands records on or builds spans has one account,
shared by its pipeline (``engine/pipeline.py``) and its sink (the engine core's
and each API server's ``engine/pipe_sink.py``; ``export/span_sink.py`` in the
exporter process, or in the engine core in thread mode). Threads: the owner's
thread adds ``QUEUE_FULL`` (``JourneyPipeline.submit``); every other reason is
added by the thread that holds the pipeline's drain lock or the sink's lock.
An addition is an int add under the GIL; a reader may see a count a moment
old, which a health report tolerates. No clock.

Units: records handed on, a finished journey each (engine and API server),
except ``SNAPSHOT``: in-flight snapshots, which are not journeys and do not
count in ``vllm.journey.tracer.dropped_journeys``; the one exception is
``EXPORTER_DIED``, which counts the records of frames an exporter died
holding, snapshots among them (the frames' counts do not tell them apart).
The reasons in ``CARRIED`` are what the engine side lost before an exporter
accounted for it: their sum travels with every frame to the exporter, which
puts it on the roots it exports (``dropped_journeys``). What an exporter then fails to send is
counted in spans by its health (``export/health.py``: ``lost_spans``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from vllm_journey_otel.journey import InFlight, Record


class Loss(enum.Enum):
    """Why records were lost; the value is how a log line says it."""

    QUEUE_FULL = "the hand-off queue was full"
    NO_EXPORTER = "no exporter process was running"
    WRITE_FAILED = "the hand-off to the exporter failed"
    EXPORTER_DIED = "lost with an exporter process that died holding them"
    UNBUILT = "their spans could not be built"
    SNAPSHOT = "in-flight snapshots not handed on"


CARRIED = frozenset({Loss.QUEUE_FULL, Loss.NO_EXPORTER, Loss.WRITE_FAILED, Loss.EXPORTER_DIED})


class LossAccount:
    """Counts per :class:`Loss`; ``carried`` is the sum of the ``CARRIED`` ones."""

    __slots__ = ("_counts", "carried")

    def __init__(self) -> None:
        self._counts = dict.fromkeys(Loss, 0)
        self.carried = 0

    def add(self, reason: Loss, n: int = 1) -> None:
        if n > 0:
            self._counts[reason] += n
            if reason in CARRIED:
                self.carried += n

    def lose(self, reason: Loss, records: Iterable[Record]) -> int:
        """Count a batch lost for ``reason``: its in-flight snapshots as
        ``SNAPSHOT``, the rest as ``reason``. Returns how many records."""
        snapshots = total = 0
        for record in records:
            total += 1
            snapshots += isinstance(record, InFlight)
        self.add(reason, total - snapshots)
        self.add(Loss.SNAPSHOT, snapshots)
        return total

    def __getitem__(self, reason: Loss) -> int:
        return self._counts[reason]

    def by_reason(self) -> dict[str, int]:
        """The reasons with a loss, by name (``queue_full``: 3)."""
        return {r.name.lower(): n for r, n in self._counts.items() if n}

    def describe(self) -> str:
        """One phrase per reason with a loss, for a log line; "" without."""
        return "; ".join(f"{n} {r.value}" for r, n in self._counts.items() if n)
