"""A test KV connector (scheduler side) that loads prompts from a "remote prefill
instance" asynchronously, as disaggregated prefill does: vLLM's scheduler puts the
request into WAITING_FOR_REMOTE_KVS until the worker side reports the load
finished (``KVConnectorOutput.finished_recving``), which tests/harness.py
fabricates when the test says so.

Requests that want remote KV carry ``kv_transfer_params={"do_remote_prefill":
True}``; their whole prompt but the last token is "remote".
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class RemoteKVTestConnector(KVConnectorBase_V1):
    # Worker side: never used (no model runs here).
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    # Scheduler side.
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        remote = request.num_prompt_tokens - 1 - num_computed_tokens
        params["do_remote_prefill"] = False  # loaded once
        return (remote, True) if remote > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
