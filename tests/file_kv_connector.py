"""FileKVConnector: a test stand-in for NIXL that really moves KV cache between a
prefill and a decode ``vllm serve`` (disaggregated prefill) through files in a
shared directory, on the CPU platform.

It copies WHOLE BLOCKS by block id (never per token through the slot mapping,
which breaks on the CPU backend): each layer's cache from ``register_kv_caches``
is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` on CPU (K and V
side by side in the last dim), so ``kv[block_ids]`` is a request's whole KV.

Config (``kv_connector_extra_config``): ``dir`` (shared directory), ``mode``
(``"sync"``: load before the forward; ``"async"``: load in a thread while the
request waits in WAITING_FOR_REMOTE_KVS; a request's ``kv_transfer_params``
"load" overrides it), ``lease_s`` (default 30), ``load_delay_s`` (async only,
default 0: stretches the wait to observe it). A load writes its own wall-clock
stamps to ``load.<request id>.json`` in the directory.

Where each part runs:
* Scheduler side (EngineCore process, scheduler): decides what to save
  (``do_remote_decode``) and load (``do_remote_prefill``), keeps the prefill
  blocks after ``request_finished`` and ships block ids to the worker in
  ``FileKVMeta`` from ``build_connector_meta``.
* Worker side (the model-runner process: on CPU a separate VllmWorker process
  under the multiproc executor): saves in ``wait_for_save`` after the forward,
  loads in ``start_load_kv`` (sync, before the forward) or in a background
  thread of that process (async), reports completions from ``get_finished``.

Protocol: the prefill worker writes ``<engine>.<req>.kv`` (layer -> the
request's blocks in order, written atomically). The decode worker loads it into
its own block ids, then writes ``<engine>.<req>.ack``; on the ack (or when
``lease_s`` has passed since the request finished) the prefill worker reports
the request in ``finished_sending`` and vLLM frees its blocks. A missing or
unreadable file is a load failure: its local block ids are reported through
``get_block_ids_with_load_errors`` and vLLM's ``kv_load_failure_policy`` applies.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.file_kv_connector")


@dataclass
class _Load:
    req_id: str
    remote_engine_id: str
    remote_req_id: str
    src_idx: list[int]  # positions in the remote request's block list
    dst_ids: list[int]  # local block ids, same length
    is_async: bool


@dataclass
class FileKVMeta(KVConnectorMetadata):
    saves: dict[str, list[int]] = field(default_factory=dict)  # req -> block ids
    sending: list[str] = field(default_factory=list)  # blocks now held for decode
    drops: list[str] = field(default_factory=list)  # aborted: delete their file
    loads: list[_Load] = field(default_factory=list)
    acks: list[tuple[str, str]] = field(default_factory=list)  # release, no load


class FileKVConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.dir: str = extra["dir"]
        self.is_async: bool = extra.get("mode", "sync") == "async"
        self.lease_s = float(extra.get("lease_s", 30.0))
        self.load_delay_s = float(extra.get("load_delay_s", 0.0))
        self.engine_id = str(self._kv_transfer_config.engine_id)
        self.block_size: int = vllm_config.cache_config.block_size
        os.makedirs(self.dir, exist_ok=True)
        # Scheduler side.
        self._producing: dict[str, Request] = {}  # do_remote_decode, not yet saved
        self._meta = FileKVMeta()
        # Worker side.
        self._kv: dict[str, torch.Tensor] = {}
        self._leases: dict[str, float] = {}  # req -> deadline
        self._recving: dict[str, Future[set[int]]] = {}
        self._invalid: set[int] = set()
        self._pool = ThreadPoolExecutor(1, "file-kv-load")

    def _path(self, engine_id: str, req_id: str, ext: str) -> str:
        return os.path.join(self.dir, f"{engine_id}.{req_id}.{ext}")

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or not params.get("remote_block_ids"):
            return 0, False
        count = request.num_prompt_tokens - 1 - num_computed_tokens
        return (count, self._async(params)) if count > 0 else (0, False)

    def _async(self, params: dict[str, Any]) -> bool:
        """This request's path: the params' "load" ("sync"/"async", which the
        test proxy sets from a request header), else the configured mode."""
        return bool(params.get("load", "async" if self.is_async else "sync") == "async")

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._producing[request.request_id] = request
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        remote = (str(params.get("remote_engine_id")), str(params.get("remote_request_id")))
        if num_external_tokens <= 0 or not params.get("remote_block_ids"):
            if params.get("remote_block_ids"):
                self._meta.acks.append(remote)  # nothing to load: release them now
            return
        local = blocks.get_block_ids()[0]
        first = (request.num_prompt_tokens - 1 - num_external_tokens) // self.block_size
        last = min(len(local), len(params["remote_block_ids"]))
        idx = list(range(first, last))
        is_async = self._async(params)
        self._meta.loads.append(
            _Load(request.request_id, *remote, idx, [local[i] for i in idx], is_async)
        )
        logger.info(
            "FileKV: %s loads %d tokens (%d blocks, %s) from %s",
            request.request_id,
            num_external_tokens,
            len(idx),
            "async" if is_async else "sync",
            remote[1],
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FileKVMeta:
        assert self._kv_cache_manager is not None
        for req_id, req in list(self._producing.items()):
            n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if n and req.num_computed_tokens + n >= req.num_prompt_tokens:
                nblocks = -(-req.num_prompt_tokens // self.block_size)
                ids = self._kv_cache_manager.get_block_ids(req_id)[0][:nblocks]
                self._meta.saves[req_id] = ids  # prompt done this step: save it
                del self._producing[req_id]
        meta, self._meta = self._meta, FileKVMeta()
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        req_id = request.request_id
        if params.get("do_remote_prefill"):  # never scheduled (aborted/rejected)
            params["do_remote_prefill"] = False
            if params.get("remote_block_ids"):
                self._meta.acks.append(
                    (str(params.get("remote_engine_id")), str(params.get("remote_request_id")))
                )
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        self._producing.pop(req_id, None)
        done = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if request.status not in done or not block_ids:
            self._meta.drops.append(req_id)  # aborted: free now, delete any file
            return False, None
        self._meta.sending.append(req_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_request_id": req_id,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": list(block_ids),
            "remote_host": "file://" + self.dir,
            "remote_port": 0,
            "tp_size": 1,
        }

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = kv_caches
        name, kv = next(iter(kv_caches.items()))
        logger.info(
            "FileKV worker (pid %d): %d layers, e.g. %s %s %s",
            os.getpid(),
            len(kv_caches),
            name,
            tuple(kv.shape),
            kv.dtype,
        )
        assert kv.shape[2] == self.block_size, "expects [blocks, heads, block, 2*dim]"

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FileKVMeta)
        for engine_id, req_id in meta.acks:
            if os.path.exists(self._path(engine_id, req_id, "kv")):  # else gone
                self._write_ack(engine_id, req_id)
        for load in meta.loads:
            if not load.is_async:
                self._invalid |= self._load(load)
            else:
                self._recving[load.req_id] = self._pool.submit(self._load, load)

    def _load(self, load: _Load) -> set[int]:
        """Copy the file's blocks into the local blocks; return the failed ids."""
        if self.load_delay_s and load.is_async:
            time.sleep(self.load_delay_s)
        t0 = time.monotonic()
        start_unix_ns = time.time_ns()
        try:
            saved = torch.load(
                self._path(load.remote_engine_id, load.remote_req_id, "kv"),
                weights_only=True,
            )
            src = torch.tensor(load.src_idx, dtype=torch.long)
            dst = torch.tensor(load.dst_ids, dtype=torch.long)
            for name, kv in self._kv.items():
                kv.index_copy_(0, dst, saved[name].index_select(0, src).to(kv.dtype))
            # The load's own wall-clock stamps, for the tests to hold spans against.
            with open(os.path.join(self.dir, f"load.{load.req_id}.json"), "w") as f:
                json.dump({"start_unix_ns": start_unix_ns, "end_unix_ns": time.time_ns()}, f)
        except Exception as e:  # missing/short/corrupt file: a load failure
            logger.warning("FileKV: load for %s failed: %r", load.req_id, e)
            return set(load.dst_ids)
        finally:
            self._write_ack(load.remote_engine_id, load.remote_req_id)
        logger.info(
            "FileKV: %s loaded %d blocks in %.1f ms",
            load.req_id,
            len(load.dst_ids),
            1e3 * (time.monotonic() - t0),
        )
        return set()

    def _write_ack(self, engine_id: str, req_id: str) -> None:
        with open(self._path(engine_id, req_id, "ack"), "w"):
            pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # whole blocks are saved in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FileKVMeta)
        for req_id, ids in meta.saves.items():
            idx = torch.tensor(ids, dtype=torch.long)
            path = self._path(self.engine_id, req_id, "kv")
            torch.save({n: kv.index_select(0, idx) for n, kv in self._kv.items()}, path + ".tmp")
            os.replace(path + ".tmp", path)  # readers never see half a file
            logger.info("FileKV: saved %s (%d blocks)", req_id, len(ids))
        for req_id in meta.sending:
            self._leases[req_id] = time.monotonic() + self.lease_s
        for req_id in meta.drops:
            self._cleanup(req_id)

    def _cleanup(self, req_id: str) -> None:
        for ext in ("kv", "ack"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path(self.engine_id, req_id, ext))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent: set[str] = set()
        now = time.monotonic()
        for req_id, deadline in list(self._leases.items()):
            acked = os.path.exists(self._path(self.engine_id, req_id, "ack"))
            if acked or now >= deadline:
                if not acked:
                    logger.warning("FileKV: lease of %s ran out, freeing", req_id)
                del self._leases[req_id]
                self._cleanup(req_id)
                sent.add(req_id)
        recvd: set[str] = set()
        for req_id, fut in list(self._recving.items()):
            if fut.done():
                del self._recving[req_id]
                self._invalid |= fut.result()
                recvd.add(req_id)
        if sent:
            logger.info("FileKV: finished_sending %s", sorted(sent))
        return sent or None, recvd or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
