"""This process's export pipeline: created where the first Scheduler is built,
or, in an API-server process, when its HTTP app starts.

Engine-core process, the thread that constructs the Scheduler (vLLM's engine
core start-up); API-server process, its event loop at the app's start-up;
:func:`flush` from any thread (the Scheduler's shutdown, atexit, the app's
shutdown).
The sink is the exporter process (``process`` mode) or span building here
(``thread`` mode, and the fallback when the exporter cannot start).
"""

from __future__ import annotations

import atexit
import os
import socket
from typing import Any

from vllm_journey_otel import __version__
from vllm_journey_otel import schema as S
from vllm_journey_otel.config import EXPORT_MODE, MODE_PROCESS
from vllm_journey_otel.engine.pipe_sink import PipeSink
from vllm_journey_otel.engine.pipeline import JourneyPipeline
from vllm_journey_otel.engine.sink import Sink
from vllm_journey_otel.engine.state import _STATE
from vllm_journey_otel.export.span_sink import SpanSink
from vllm_journey_otel.log import logger


def dp_rank(parallel_config: Any) -> int:
    """The data-parallel rank of this engine core. vLLM 0.30-0.33 run each rank
    of a dense model as an independent engine: ``EngineCoreProc.run_engine_core``
    sets ``data_parallel_index`` to the rank, then
    ``ParallelConfig.reconfigure_for_independent_dp_rank`` resets
    ``data_parallel_rank`` to 0 (a MoE model's ranks keep both)."""
    for name in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(parallel_config, name, None)
        if isinstance(value, int):
            return value
    return 0


def _resource_attributes(owner: Any, engine: bool = True) -> dict[str, Any]:
    """The resource of ``owner.vllm_config``: a Scheduler's (``engine``), or an
    API server's (an AsyncLLM, an app's state), which under
    ``--data-parallel-size`` > 1 serves every rank and so names none."""
    vc = owner.vllm_config
    model = getattr(vc.model_config, "served_model_name", None) or getattr(
        vc.model_config, "model", ""
    )
    if isinstance(model, list | tuple):
        model = model[0] if model else ""
    # An API server of a data-parallel serve sends to every rank; one serving a
    # single engine (in its own process, or in this one) names its rank.
    size = int(getattr(vc.parallel_config, "data_parallel_size", 1) or 1)
    rank = {S.RES_DP_RANK: dp_rank(vc.parallel_config)} if engine or size <= 1 else {}
    return {
        S.RES_MODEL: str(model),
        **rank,
        **_kv_role(vc, engine),
        S.RES_VLLM_VERSION: _STATE.vllm_version,
        S.RES_PLUGIN_VERSION: __version__,
        S.RES_HOST: socket.gethostname(),
        S.RES_PID: os.getpid(),
    }


def _kv_role(vllm_config: Any, engine: bool) -> dict[str, Any]:
    """Disaggregated serving: this instance's part, from --kv-transfer-config;
    an engine core's connector engine id (an API server's config has the base
    id, which each data-parallel rank's engine core suffixes with its rank)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    role = S.KV_ROLES.get(str(getattr(ktc, "kv_role", None)))
    if ktc is None or role is None:
        return {}
    engine_id = getattr(ktc, "engine_id", None) if engine else None
    return {S.RES_KV_ROLE: role, **({S.RES_KV_ENGINE_ID: str(engine_id)} if engine_id else {})}


def _make_sink(attributes: dict[str, Any]) -> Sink:
    """The exporter process, or span building in this process (thread mode, tests)."""
    if _STATE.exporters is None and _STATE.config.export_mode == MODE_PROCESS:
        try:
            return PipeSink.start(attributes, processes=_STATE.config.exporter_processes)
        except Exception:
            logger.warning(
                "journey-otel: could not start the exporter process; building spans "
                "in this process instead (%s=thread)",
                EXPORT_MODE,
                exc_info=True,
            )
    # No SdkLogQuieter here: the SDK's loggers are shared with vLLM's own tracing
    # in this process; export results are still counted by the export stage.
    return SpanSink.from_env(
        attributes,
        _STATE.exporters,
        threaded=_STATE.batch,
        cpu_priority=_STATE.config.cpu_priority,
        in_engine=True,
    )


def _pipeline_for(owner: Any, engine: bool = True) -> JourneyPipeline:
    """This process's pipeline, created on the first call with the resource of
    ``owner.vllm_config`` (``engine``: a Scheduler; else the API server's)."""
    with _STATE.lock:
        pid = os.getpid()
        if _STATE.pipeline is None or _STATE.pipeline_pid != pid:
            cfg = _STATE.config
            _STATE.pipeline = JourneyPipeline(
                _make_sink(_resource_attributes(owner, engine)),
                max_queue=cfg.queue_size,
                interval_s=cfg.export_interval_ms / 1000.0,
                cpu_priority=cfg.cpu_priority,
            )
            _STATE.pipeline_pid = pid
            # In-process engines exit through atexit; a forked engine core does
            # not run atexit, which is why Scheduler.shutdown flushes too.
            atexit.register(flush, cfg.shutdown_timeout_s)
        return _STATE.pipeline


def flush(timeout_s: float | None = None) -> bool:
    """Export every finished journey of this process within ``timeout_s``."""
    pipeline = _STATE.pipeline
    if pipeline is None or _STATE.pipeline_pid != os.getpid():
        return True
    t = _STATE.config.shutdown_timeout_s if timeout_s is None else timeout_s
    return pipeline.flush(t)


# This process's pid, kept current in a forked child: ``os.getpid`` is a system
# call (and a point where the kernel may preempt the caller), and ``pipeline``
# runs twice per request on the API server's event loop. vLLM's processes are
# started by multiprocessing (fork runs the at-fork handlers; spawn and
# forkserver import this module afresh); a C library's fork() that skips them
# and runs Python on without exec would keep its parent's pid here.
_PID = [os.getpid()]


def _forked() -> None:
    _PID[0] = os.getpid()


os.register_at_fork(after_in_child=_forked)


def pipeline() -> JourneyPipeline | None:
    """This process's export pipeline, if a Scheduler or the API server created
    one (a forked child's inherited one is its parent's: None there)."""
    return _STATE.pipeline if _STATE.pipeline_pid == _PID[0] else None
