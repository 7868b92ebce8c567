"""plugin_toggle.py: switch the plugin in a running `vllm serve` by signal.

Imported by every Python process that has this folder on ``PYTHONPATH`` and
``VJO_TOGGLE_PROBE`` set (the path of a state file): the API server, and the
engine core and model worker that inherit its environment. On ``SIGUSR1``, in
the main thread (Python runs signal handlers there, between two bytecodes of
the event loop or of the engine's busy loop), it reads the state file and
applies it to this process's plugin:

* ``on``: tracing on, the API-server spans on (the defaults);
* ``api-off``: tracing on, the API-server spans off for the requests received
  after it (what ``VLLM_JOURNEY_OTEL_API_SPANS=0`` does at start-up: the
  middleware reads the setting at each request's receipt);
* ``api-norecord``: as ``on``, but the API server's records are not handed
  to its exporter (this process's pipeline reads as absent to the
  middleware): the middleware, its hooks and the traceparent to the engine
  stay, the records, their hand-off and the API server's exporter's work go;
* ``exp-stopped``: as ``on`` here (the benchmark stops the exporter processes
  themselves for the window);
* ``unpaced``: as ``on`` here; in the exporter processes (signalled too when
  the run has this state) their threads stop offering their CPU back
  (``cpu_pacing.Pacer`` does nothing), and every other state puts it back;
* ``paced-<N>us`` (``paced-200us``): as ``unpaced``, with the exporters'
  threads offering their CPU once per N µs of work instead of the default's;
* ``off`` (and ``off-2``): tracing off, as after an internal error
  (``state._fail``): every wrapper calls vLLM's own method at once, and the
  engine's trackers drop what they held; so does each pipeline (its queue,
  and a frame none of which was written: with the exporters behind, a drain
  thread retrying them would charge an off window with the on windows'
  work; a started frame's rest stays, for the exporter's stream). What
  stays of the plugin: one check per wrapped call, the drain threads (a
  wake-up a second) and the exporter processes (with what they were sent).

A process whose plugin failed for real is never switched back on. The plugin
must start with the API-server spans on (its middleware is installed when the
app is built). A benchmark tool, not part of the package.
"""

import dataclasses
import os
import signal
import sys

_STATE_FILE = os.environ.get("VJO_TOGGLE_PROBE")
_PIPELINE: list = []  # api_server.pipeline, while another stands in for it
_PACE: list = []  # cpu_pacing.Pacer.__call__, while a no-op stands in for it


def _exporter_process() -> bool:
    return bool(sys.argv) and sys.argv[0].endswith("exporter_process.py")


def _paced_every(every_ns: int):
    """Pacer.__call__ and Pacer.restart with another interval."""

    def call(self) -> None:
        if self._clock() >= self._due_mono_ns:
            self._give()
            self.yields += 1
            self._due_mono_ns = self._clock() + every_ns

    def restart(self) -> None:
        self._due_mono_ns = self._clock() + every_ns

    return call, restart


def _pace_in_exporter(state: str) -> None:
    from vllm_journey_otel.export.cpu_pacing import Pacer

    if not _PACE:
        _PACE.extend([Pacer.__call__, Pacer.restart])
    call, restart = _PACE
    if state == "unpaced":
        call = lambda self: None  # noqa: E731
    elif state.startswith("paced-") and state.endswith("us"):
        call, restart = _paced_every(int(state[len("paced-") : -len("us")]) * 1000)
    Pacer.__call__, Pacer.restart = call, restart


def _forget_backlog(pipeline) -> None:
    """Without the plugin there is no backlog: what the windows before left
    queued (exporters behind: their pipes full) is dropped, and so is a frame
    none of which was written yet, so that an off window's drain thread has
    next to nothing to retry (the plugin's cost falls on its own windows). The
    rest of a frame whose start is in a pipe stays (dropping it would break
    the exporter's stream): at most one frame's rest per process."""
    if pipeline is None:
        return
    pipeline._queue.clear()
    sink = pipeline.sink
    lock = getattr(sink, "_lock", None)
    # Not blocking: this handler may have interrupted the owner inside offer().
    if lock is not None and lock.acquire(blocking=False):
        try:
            if getattr(sink, "_pending", b"") and sink._pending_fd < 0:
                sink._take_pending()
        finally:
            lock.release()
    pipeline._declined = False


if _STATE_FILE:

    def _switch(signum: int, frame: object) -> None:
        with open(_STATE_FILE) as f:
            state = f.read().strip()
        if _exporter_process():  # before any import of the engine side's
            _pace_in_exporter(state)
            return
        from vllm_journey_otel.engine.state import _STATE

        # Loaded in the API server only (the engine core has no middleware).
        api_server = sys.modules.get("vllm_journey_otel.engine.api_server")
        if api_server is not None and _PIPELINE:
            api_server.pipeline = _PIPELINE[0]
        if api_server is not None and state == "api-norecord":
            _PIPELINE[:] = [api_server.pipeline]
            api_server.pipeline = lambda: None
        if state in ("off", "off-2"):
            _STATE.enabled = False
            for tracker in list(_STATE.trackers):
                tracker.drop_state()
            _forget_backlog(_STATE.pipeline)
            return
        api = state in ("on", "api-norecord", "exp-stopped", "unpaced") or state.startswith(
            "paced-"
        )
        _STATE.config = dataclasses.replace(_STATE.config, api_spans=api)
        _STATE.enabled = _STATE.installed and not _STATE.failed

    signal.signal(signal.SIGUSR1, _switch)
