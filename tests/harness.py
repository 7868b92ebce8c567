"""Drive a real vLLM v1 Scheduler on the CPU, as vLLM's own tests/v1/core do.

What is real: vLLM's ``Scheduler``/``AsyncScheduler``, its KV-cache manager,
prefix cache, request queues and ``Request`` objects. What is fabricated, because
no model runs here: the ``KVCacheConfig`` (a block count instead of GPU memory)
and the ``ModelRunnerOutput`` of each step (one sampled token per request whose
prefill is complete, as the GPU model runner would return). The model config is a
local config.json with no weights (never loaded by the scheduler).

Async scheduling is driven like vLLM's EngineCore batch queue: ``schedule(N+1)``
runs before ``update_from_output(N)``.
"""

from __future__ import annotations

import json
import tempfile
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

try:
    from vllm.utils.hashing import sha256
except ImportError:  # pragma: no cover - older layouts
    from vllm.utils import sha256  # type: ignore[no-redef]

BLOCK_SIZE = 16
EOS = 2
TOKEN = 7  # what the fabricated model samples, unless told otherwise

_MODEL_DIR: Path | None = None
_HASH_READY = False


def model_dir() -> Path:
    """A Llama config.json with no weights: enough for ModelConfig."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        d = Path(tempfile.mkdtemp(prefix="vjo-model-"))
        (d / "config.json").write_text(
            json.dumps(
                {
                    "architectures": ["LlamaForCausalLM"],
                    "model_type": "llama",
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 4,
                    "num_hidden_layers": 2,
                    "vocab_size": 1024,
                    "max_position_embeddings": 4096,
                    "rms_norm_eps": 1e-6,
                    "torch_dtype": "float32",
                    "bos_token_id": 1,
                    "eos_token_id": EOS,
                }
            )
        )
        _MODEL_DIR = d
    return _MODEL_DIR


class AcceptAllGrammar:
    """A compiled grammar that accepts every token (no tokenizer here to compile one)."""

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens

    def rollback(self, num_tokens: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        pass


class Engine:
    """A real Scheduler plus a fabricated model runner."""

    def __init__(
        self,
        *,
        async_scheduling: bool = False,
        num_blocks: int = 1000,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        max_model_len: int = 2048,
        enable_prefix_caching: bool = True,
        long_prefill_token_threshold: int = 0,
        v2_runner_layout: bool = False,
        policy: str = "fcfs",
        num_spec_tokens: int = 0,
        max_loras: int = 0,
        remote_kv: bool | str = False,
        spec_metrics: str = "none",
        otlp_traces_endpoint: str | None = None,
    ) -> None:
        global _HASH_READY
        if not _HASH_READY:
            init_none_hash(sha256)
            _HASH_READY = True
        self._hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        sc = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            long_prefill_token_threshold=long_prefill_token_threshold,
            async_scheduling=async_scheduling,
            is_encoder_decoder=False,
            policy=policy,
        )
        mc = ModelConfig(model=str(model_dir()), skip_tokenizer_init=True, dtype="float32", seed=0)
        cc = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
        extra: dict[str, Any] = {}
        if num_spec_tokens:
            from vllm.config import SpeculativeConfig

            # The n-gram proposer: no draft model to load. Drafts are fabricated
            # below (propose), as the model runner would hand them over.
            extra["speculative_config"] = SpeculativeConfig(
                # vLLM allows async scheduling with the GPU n-gram proposer only.
                method="ngram_gpu" if async_scheduling else "ngram",
                num_speculative_tokens=num_spec_tokens,
                prompt_lookup_max=4,
                prompt_lookup_min=2,
            )
        if spec_metrics != "none" or otlp_traces_endpoint is not None:
            from vllm.config import ObservabilityConfig

            # vLLM's own per-request draft counts (--per-request-spec-decode-metrics)
            # and its own tracing (--otlp-traces-endpoint).
            extra["observability_config"] = ObservabilityConfig(
                per_request_spec_decode_metrics=spec_metrics,
                otlp_traces_endpoint=otlp_traces_endpoint,
            )
        if max_loras:
            from vllm.config import LoRAConfig

            extra["lora_config"] = LoRAConfig(max_loras=max_loras, max_lora_rank=8)
        if remote_kv:
            from vllm.config import KVTransferConfig

            if remote_kv in ("nixl", "nixl-prefill"):
                # vLLM's own NIXL connector, scheduler side only (its worker side,
                # which moves the blocks, needs the NIXL library and a GPU; the
                # test reports transfers done as that worker side would), on the
                # decode side or (nixl-prefill) the prefill side.
                role = "kv_producer" if remote_kv == "nixl-prefill" else "kv_consumer"
                extra["kv_transfer_config"] = KVTransferConfig(
                    kv_connector="NixlConnector", kv_role=role
                )
            else:
                # tests/remote_kv_connector.py: asynchronous loads the test finishes.
                extra["kv_transfer_config"] = KVTransferConfig(
                    kv_connector="RemoteKVTestConnector",
                    kv_connector_module_path="remote_kv_connector",
                    kv_role="kv_consumer",
                )
            sc.disable_hybrid_kv_cache_manager = True
        vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc, **extra)
        kv = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"],
                    FullAttentionSpec(
                        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
                    ),
                )
            ],
        )
        cc.num_gpu_blocks = num_blocks
        cls = AsyncScheduler if async_scheduling else Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.scheduler = cls(
            vllm_config=vc,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=BLOCK_SIZE,
            log_stats=True,
        )
        if v2_runner_layout:
            # The V2 model runner (0.33's GPU default) needs Triton and cannot be
            # selected on this CPU; its scheduler-side effect is this flag, which
            # makes schedule() list resumed requests in scheduled_new_reqs.
            self.scheduler.use_v2_model_runner = True
        self.async_scheduling = async_scheduling
        self.num_spec_tokens = num_spec_tokens
        # Speculative decoding: how many of a step's drafts the fabricated model
        # accepts, from (request id, verify steps so far, drafts scheduled).
        self.accept_for: Callable[[str, int, int], int] = lambda rid, i, n: n
        # request id -> [(drafts proposed, drafts accepted)] per verify step, as
        # the fabricated model decided them.
        self.verify_log: dict[str, list[tuple[int, int]]] = {}
        self.stale_verify: dict[str, list[tuple[int, int]]] = {}
        # Outputs scheduled but not yet processed (the batch queue).
        self._in_flight: deque[tuple[Any, dict[str, bool]]] = deque()
        self.token_for: Callable[[str, int], int] = lambda rid, n: TOKEN
        self.requests: dict[str, Request] = {}
        # KV connector: remote loads the next processed step reports finished.
        self.kv_loaded: set[str] = set()
        # ... of which these failed (KVConnectorOutput.failed_recving).
        self.kv_failed: set[str] = set()
        # Prefill side: held blocks the next processed step reports sent.
        self.kv_sent: set[str] = set()
        # request id -> the kv_transfer_params of its final output (the connector's).
        self.kv_params: dict[str, Any] = {}
        self.prefill_stats: dict[str, Any] = {}
        # request id -> token ids delivered to the client, in order
        self.outputs: dict[str, list[int]] = {}
        # request id -> how many of its outputs carried trace headers
        self.outputs_with_headers: dict[str, int] = {}

    # -- requests ------------------------------------------------------------
    def add(
        self,
        rid: str,
        prompt_len: int = 32,
        max_tokens: int = 8,
        *,
        prompt: list[int] | None = None,
        stop_token_ids: list[int] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        ignore_eos: bool = True,
        lora: Any = None,
        json_schema: str | None = None,
        remote_prefill: bool = False,
        remote_decode: bool = False,
        kv_params: dict[str, Any] | None = None,
        resumable: bool = False,
    ) -> Request:
        # crc32, not hash(): str hashes change with PYTHONHASHSEED between runs.
        fill = 100 + zlib.crc32(rid.encode()) % 800
        tokens = prompt if prompt is not None else [fill] * prompt_len
        extra: dict[str, Any] = {}
        if json_schema is not None:
            from vllm.sampling_params import StructuredOutputsParams

            # The request waits for its grammar (WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)
            # until the test sets one: compile_grammar().
            extra["structured_outputs"] = StructuredOutputsParams(json=json_schema)
        if remote_prefill:
            # What a disaggregated-serving proxy passes to the decode instance
            # (the fields vLLM's NIXL connector reads; the test connector reads
            # only the first).
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": "prefill-engine",
                "remote_request_id": f"prefill-{rid}",
                "remote_block_ids": list(range(-(-len(tokens) // BLOCK_SIZE))),
                "remote_host": "127.0.0.1",
                "remote_port": 1,
                "tp_size": 1,
            }
            extra["extra_args"] = {"kv_transfer_params": params}
        elif remote_decode or kv_params is not None:
            # The prefill instance's request (what a P/D proxy sends it first), or
            # the decode instance's with the params the prefill side returned.
            params = dict(kv_params) if kv_params is not None else {"do_remote_decode": True}
            extra["extra_args"] = {"kv_transfer_params": params}
        sp = SamplingParams(
            max_tokens=max_tokens, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, **extra
        )
        req = Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=sp,
            pooling_params=None,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            trace_headers=trace_headers,
            block_hasher=self._hasher,
            lora_request=lora,
            resumable=resumable,
        )
        self.requests[rid] = req
        self.scheduler.add_request(req)
        return req

    def send_input(self, rid: str, prompt_len: int = 8, max_tokens: int = 4) -> None:
        """Streaming input: the next input chunk of session ``rid`` (a Request with
        the same id, as EngineCore hands it to the scheduler)."""
        fill = 100 + zlib.crc32(f"{rid}/{prompt_len}".encode()) % 800
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        chunk = Request(
            request_id=rid,
            prompt_token_ids=[fill] * prompt_len,
            sampling_params=sp,
            pooling_params=None,
            arrival_time=time.time(),
            block_hasher=self._hasher,
            resumable=True,
        )
        self.scheduler.add_request(chunk)

    def end_session(self, rid: str) -> None:
        """Streaming input: the client closed the session (a non-resumable add)."""
        sp = SamplingParams(max_tokens=1)
        end = Request(
            request_id=rid,
            prompt_token_ids=[TOKEN],
            sampling_params=sp,
            pooling_params=None,
            arrival_time=time.time(),
            block_hasher=self._hasher,
        )
        self.scheduler.add_request(end)

    def compile_grammar(self, rid: str, error: bool = False) -> None:
        """The grammar of a structured-output request is ready (or failed), as the
        StructuredOutputManager's compile thread would leave it."""
        sor = self.requests[rid].structured_output_request
        assert sor is not None
        sor.grammar = ValueError("bad schema") if error else AcceptAllGrammar()  # type: ignore[assignment]

    def abort(self, *rids: str) -> None:
        self.scheduler.finish_requests(list(rids), RequestStatus.FINISHED_ABORTED)

    def shutdown_abort(self) -> None:
        """What EngineCore does on shutdown: abort everything, then shut down."""
        self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        self.scheduler.shutdown()

    # -- steps ---------------------------------------------------------------
    def schedule(self) -> Any:
        so = self.scheduler.schedule()
        # Decided at schedule time, as the model runner does: a request whose
        # scheduled tokens complete its prompt samples a token this step.
        sample = {
            rid: not self.scheduler.requests[rid].is_prefill_chunk
            for rid in so.num_scheduled_tokens
        }
        self._in_flight.append((so, sample))
        return so

    def update(self) -> dict[int, Any]:
        so, sample = self._in_flight.popleft()
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.requests.get(rid)
            n = req.num_output_tokens if req is not None else 0
            tokens = [self.token_for(rid, n)] if sample[rid] else []
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            # (A request finished meanwhile, async: vLLM discards this output.)
            if drafts and tokens and req is not None and not req.is_finished():
                log = self.verify_log.setdefault(rid, [])
                accepted = min(len(drafts), self.accept_for(rid, len(log), len(drafts)))
                log.append((len(drafts), accepted))
                if req.num_stale_output_tokens > 0:
                    # Async: the request was preempted while this step was in
                    # flight; vLLM still delivers (and counts) its output.
                    self.stale_verify.setdefault(rid, []).append((len(drafts), accepted))
                # The accepted drafts, then the token sampled after them (with
                # async scheduling the scheduled drafts are placeholders, -1).
                tokens = [TOKEN] * accepted + tokens
            sampled.append(tokens)
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        if self.kv_loaded or self.kv_sent:
            from vllm.v1.outputs import KVConnectorOutput

            mro.kv_connector_output = KVConnectorOutput(
                finished_sending=set(self.kv_sent),
                finished_recving=set(self.kv_loaded),
                failed_recving=self.kv_failed & self.kv_loaded,
            )
            self.kv_failed -= self.kv_loaded
            self.kv_loaded.clear()
            self.kv_sent.clear()
        outputs = self.scheduler.update_from_output(so, mro)
        for eco in outputs.values():
            for out in eco.outputs:
                # vLLM's own prompt-cache accounting (what becomes the OpenAI
                # usage.prompt_tokens_details.cached_tokens).
                if getattr(out, "prefill_stats", None) is not None:
                    self.prefill_stats[out.request_id] = out.prefill_stats
                if getattr(out, "kv_transfer_params", None) is not None:
                    self.kv_params[out.request_id] = out.kv_transfer_params
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.trace_headers is not None:
                    seen = self.outputs_with_headers
                    seen[out.request_id] = seen.get(out.request_id, 0) + 1
        if self.num_spec_tokens and not self.async_scheduling:
            # Async scheduling drafts in the worker: the AsyncScheduler schedules
            # placeholders itself (EngineCore.post_step skips this too).
            self.propose()
        return outputs

    def propose(self) -> None:
        """What the engine does after a step with a drafter: hand the scheduler
        ``num_spec_tokens`` draft tokens for every running request."""
        from vllm.v1.outputs import DraftTokenIds

        ids = [r.request_id for r in self.scheduler.running]
        drafts = [[TOKEN] * self.num_spec_tokens for _ in ids]
        self.scheduler.update_draft_token_ids(DraftTokenIds(ids, drafts))

    def step(self) -> Any:
        """One engine step: sync = schedule then update; async = schedule N+1, update N."""
        so = self.schedule()
        if not self.async_scheduling or len(self._in_flight) > 1 or not so.num_scheduled_tokens:
            self.update()
        return so

    def drain_in_flight(self) -> None:
        while self._in_flight:
            self.update()

    def run(self, max_steps: int = 10_000) -> int:
        """Step until no request is left; returns the number of steps."""
        for i in range(max_steps):
            if not self.scheduler.requests:
                self.drain_in_flight()
                return i
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")
