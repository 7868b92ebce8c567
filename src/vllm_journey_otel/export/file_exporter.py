"""A span exporter that writes OTLP/JSON lines to a local file, with rotation.

The embedded default for machines with no collector: ``OTEL_TRACES_EXPORTER=otlp_json_file``
(registered in the SDK's ``opentelemetry_traces_exporter`` entry-point group, so
the SDK's own exporter selection finds it). One line per export batch, in the
format of the Collector's file exporter (``otlp_json.py``), so a file can be
summarised and drawn by ``vllm-journey`` or replayed into any OTLP backend.

Disk is bounded: when the file would pass ``VLLM_JOURNEY_OTEL_FILE_MAX_MB`` it is
rotated (``F`` -> ``F.1`` -> ... -> ``F.<keep>``) and the oldest is deleted, so at
most ``(keep + 1) * max_mb`` MB are used.

Thread-safety: ``export`` is called by the export stage's thread; a lock keeps
lines whole if several share one exporter, and an advisory lock on ``F.lock``
(never rotated) does the same between processes: the API server's exporter and
the engine cores' write the same file.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from vllm_journey_otel.config import FileSettings, file_settings
from vllm_journey_otel.export.otlp_json import spans_to_json
from vllm_journey_otel.log import logger

DEFAULT_PATH = FileSettings.path


class OtlpJsonFileExporter(SpanExporter):
    """Append OTLP/JSON lines to ``path``, rotating at ``max_bytes``."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        max_bytes: int | None = None,
        keep: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        settings = file_settings(env)
        self.path = Path(path if path is not None else settings.path)
        self.max_bytes = max_bytes if max_bytes is not None else int(settings.max_mb * 1024 * 1024)
        self.keep = keep if keep is not None else settings.keep
        self._lock = threading.Lock()
        self._stopped = False
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _rotate(self) -> None:
        if self.keep == 0:
            self.path.unlink(missing_ok=True)
            return
        oldest = self.path.with_name(f"{self.path.name}.{self.keep}")
        oldest.unlink(missing_ok=True)
        for i in range(self.keep - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                src.rename(self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.path.exists():
            self.path.rename(self.path.with_name(f"{self.path.name}.1"))

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._stopped:
            return SpanExportResult.FAILURE
        if not spans:
            return SpanExportResult.SUCCESS
        data = (spans_to_json(spans) + "\n").encode()
        try:
            with self._lock, open(f"{self.path}.lock", "ab") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
                size = self.path.stat().st_size if self.path.exists() else 0
                if size and size + len(data) > self.max_bytes:
                    self._rotate()
                with open(self.path, "ab") as f:
                    f.write(data)
        except OSError:
            logger.warning("journey-otel: cannot write %s", self.path, exc_info=True)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._stopped = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is written and closed before it returns
