"""A request's KV moving between vLLM instances (disaggregated prefill/decode),
as one Scheduler's KV connector shows it.

Engine-core process and thread (vLLM's busy loop), through the tracker, only
when vLLM runs a KV connector. Timestamps are engine monotonic (``*_mono_ns``).

* The prefill side: the connector's ``request_finished`` asked vLLM to keep the
  request's KV blocks after it ended (``delay_free_blocks``: vLLM keeps the
  request in ``Scheduler.requests``) until its worker side reports them sent
  (``finished_sending``: the decode side read them, or the connector's lease ran
  out). The journey waits here meanwhile and is handed on at that report with
  its :class:`KvHeld`; its root's ids go into the ``kv_transfer_params`` vLLM
  returns to the client (under ``KV_LINK_KEY``), which a P/D proxy hands to the
  decode instance with the rest.
* The decode side: a request that came with ``kv_transfer_params`` naming a
  remote request or engine gets a :class:`KvRemote` (and a link to the prefill
  journey's root when the params carry it); an asynchronous load shows as the
  ``remote_kv`` wait and its end (:meth:`KvHandoff.outputs`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_journey_otel import schema as S
from vllm_journey_otel.engine.pipeline import JourneyPipeline
from vllm_journey_otel.engine.request_journey import RequestJourney
from vllm_journey_otel.engine.sampling import client_trace
from vllm_journey_otel.journey import (
    KV_LINK_KEY,
    FinishedJourney,
    KvHeld,
    KvRemote,
    LinkTarget,
    RootIds,
)

_WAIT_REMOTE_KV = S.WAIT_REASONS.index(S.WAIT_REMOTE_KV)
# Ids from a client's params are bounded: a request's params are user input.
_MAX_ID = 256
# Journeys held at once: vLLM holds their blocks too, so this is reached only by
# a connector that never reports sends; past it a journey is handed on at its end.
_MAX_HELD = 65536
_replace = msgspec.structs.replace
# Set on the wrapper of Scheduler._free_blocks (scheduler_wrappers.py): without
# it a hold's end is not seen, and no journey is held.
RELEASE_MARK = "_journey_otel_release"


class KvHandoff:
    """The KV hand-off of one Scheduler's requests (engine-core thread only)."""

    __slots__ = ("engine_id", "held", "pipeline", "scheduler", "sees_release")

    def __init__(self, scheduler: Any, pipeline: JourneyPipeline) -> None:
        self.scheduler = scheduler
        self.pipeline = pipeline
        ktc = getattr(scheduler.vllm_config, "kv_transfer_config", None)
        engine_id = getattr(ktc, "engine_id", None)
        self.engine_id = str(engine_id) if engine_id else None
        # request id -> (its ended journey, its blocks) while vLLM keeps its KV.
        self.held: dict[str, tuple[FinishedJourney, int]] = {}
        free_blocks = getattr(type(scheduler), "_free_blocks", None)
        self.sees_release = bool(getattr(free_blocks, RELEASE_MARK, False))

    def keeps_blocks(self, request: Any, j: RequestJourney) -> bool:
        """After ``_free_request``: True when vLLM kept the ended request's KV
        blocks for the connector (and this process sees when it frees them). A
        prefill-side request's root ids are fixed now: the decode side links to them."""
        if _prefill_side(request.kv_transfer_params):
            j.link_target()
        return self.sees_release and request.request_id in self.scheduler.requests

    def ended(
        self, request: Any, finished: FinishedJourney, kv_params: Any, held: bool
    ) -> FinishedJourney | None:
        """The ended journey to hand on, with what it says of remote KV; None:
        held here until its blocks are released (:meth:`outputs`)."""
        params = request.kv_transfer_params
        if isinstance(params, dict) and params:  # user input: any JSON value
            remote = _remote(params)
            if remote is not None:
                finished = _replace(finished, kv_remote=remote)
            elif (
                _prefill_side(params)
                and isinstance(kv_params, dict)
                and finished.root_ids is not None
            ):
                kv_params[KV_LINK_KEY] = {
                    "traceparent": _traceparent(finished),
                    "request_id": finished.request_id,
                    "engine_id": self.engine_id,
                }
        if not held or len(self.held) >= _MAX_HELD:
            return finished  # past the bound the hold goes unobserved: no vllm.kv_held
        self.held[request.request_id] = (finished, _blocks(self.scheduler, request.request_id))
        return None

    def released(self, request_id: str, t: int) -> None:
        """vLLM freed an ended request's KV blocks (``Scheduler._free_blocks``):
        the worker side reported them sent (``finished_sending``), or, for a
        request that ended while its own load ran, loaded."""
        entry = self.held.pop(request_id, None)
        if entry is not None:
            finished, blocks = entry
            self.pipeline.submit(_replace(finished, kv_held=KvHeld(blocks, t, True)))

    def outputs(self, kco: Any, t: int, step: int, tracker: Any) -> None:
        """A step's ``KVConnectorOutput``: the asynchronous loads the worker side
        reports done (``finished_recving``) or failed (``failed_recving``). Read
        before vLLM processes it: with its default ``kv_load_failure_policy="fail"``
        it ends a failed request in there. O(loads reported)."""
        done = getattr(kco, "finished_recving", None)
        bad = getattr(kco, "failed_recving", None)
        if (done or bad) and tracker.blocked:
            _loads(tracker, kco, done, bad, t, step)

    def release_all(self, t: int) -> None:
        """Shutdown: the journeys still held are handed on, their hold unreleased."""
        held, self.held = self.held, {}
        for finished, blocks in held.values():
            self.pipeline.submit(_replace(finished, kv_held=KvHeld(blocks, t, False)))


def _loads(tracker: Any, kco: Any, done: Any, bad: Any, t: int, step: int) -> None:
    """The ``remote_kv`` waits whose load the worker side reported finished."""
    # Block-level failures (invalid_block_ids, as NIXL reports a failed read):
    # a load failed when one of its request's blocks is among them, as vLLM maps
    # them itself; a request whose blocks cannot be read: unknown, not assumed.
    invalid = getattr(kco, "invalid_block_ids", None)
    manager = tracker.scheduler.kv_cache_manager
    blocked = tracker.blocked
    waits = tracker.status_waits
    for rid in set(done or ()) | set(bad or ()):
        entry = blocked.get(rid)
        if entry is None:
            continue
        req, j, status = entry
        if waits.get(status) != _WAIT_REMOTE_KV:
            continue
        # vLLM fills PrefillStats at the first admission only: after a
        # preemption its count is not this load's (not observed: -1).
        stats = getattr(req, "prefill_stats", None)
        tokens = (
            getattr(stats, "num_external_cached_tokens", -1)
            if stats is not None and not req.num_preemptions
            else -1
        )
        failed = 1 if bad and rid in bad else (_hit(manager, rid, invalid) if invalid else 0)
        j.kv_loaded(t, step, tokens if isinstance(tokens, int) else -1, failed)


def _hit(manager: Any, request_id: str, invalid: set[int]) -> int:
    """1: some block of the request is among the failed ones; -1: not known."""
    try:
        groups = manager.get_block_ids(request_id)
    except Exception:  # a KV-cache manager without the public accessor
        return -1
    return 1 if any(b in invalid for g in groups for b in g) else 0


def _prefill_side(params: Any) -> bool:
    """The request is disaggregated serving's prefill part (its proxy asked for
    a remote decode, as NIXL's own connector tells its prefill side)."""
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


def _blocks(scheduler: Any, request_id: str) -> int:
    """The request's KV blocks (every KV-cache group); -1 if vLLM cannot say."""
    try:
        return sum(len(g) for g in scheduler.kv_cache_manager.get_block_ids(request_id))
    except Exception:  # a KV-cache manager without the public accessor
        return -1


def _traceparent(j: FinishedJourney) -> str:
    """The W3C traceparent of the journey's root: in its client's trace when the
    root is a child there (head-sampled with a valid traceparent), else in the
    trace its own ids start (``root_ids`` is set: :meth:`KvHandoff.keeps_blocks`)."""
    ids = j.root_ids
    assert ids is not None
    headers = j.trace_headers
    client = client_trace(headers.get("traceparent")) if headers and j.head_sampled else None
    trace_id = client[0] if client is not None else (ids.trace_hi << 64) | ids.trace_lo
    return f"00-{trace_id:032x}-{ids.span_id:016x}-01"


def _text(value: Any) -> str | None:
    return value[:_MAX_ID] if isinstance(value, str) and value else None


def _remote(params: dict[str, Any]) -> KvRemote | None:
    """What a decode-side request's params say of the KV computed elsewhere;
    None when they name no remote request or engine (a prefill-side request)."""
    ours = params.get(KV_LINK_KEY)
    ours = ours if isinstance(ours, dict) else {}
    request_id = _text(params.get("remote_request_id")) or _text(ours.get("request_id"))
    engine_id = _text(params.get("remote_engine_id")) or _text(ours.get("engine_id"))
    traceparent = ours.get("traceparent")
    client = client_trace(traceparent) if isinstance(traceparent, str) else None
    link = None
    if client is not None:
        span_id = int(str(traceparent).split("-")[2], 16)
        trace_id = client[0]
        ids = RootIds(trace_id >> 64, trace_id & ((1 << 64) - 1), span_id)
        link = LinkTarget(request_id or "", ids, None)
    if request_id is None and engine_id is None and link is None:
        return None
    return KvRemote(request_id, engine_id, link)
