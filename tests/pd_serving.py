"""Disaggregated prefill/decode on this machine, for the end-to-end tests and
benchmarks/pd_handoff.py: a prefill and a decode `vllm serve` of the tiny model
(the plugin on, its defaults; each instance's worker on its own CPU), the KV
moved by tests/file_kv_connector.py, and tests/pd_proxy.py in front of them.
Everything binds 127.0.0.1 and is stopped by PID (services.Process).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from services import VENV, Process, VllmServer, free_port, http_json, wait_until

TESTS = Path(__file__).resolve().parent
BLOCK = 32  # the CPU attention backend takes block sizes in multiples of 32


def _server(
    model: Path,
    tmp: Path,
    grpc_port: int,
    role: str,
    cpu: str,
    lease_s: float,
    extra: dict[str, str],
) -> VllmServer:
    config = {
        "kv_connector": "FileKVConnector",
        "kv_connector_module_path": "file_kv_connector",
        "kv_role": role,
        "kv_connector_extra_config": {"dir": str(tmp / "kv"), "lease_s": lease_s},
    }
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{grpc_port}",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
        "VLLM_CPU_OMP_THREADS_BIND": cpu,
        **extra,
    }
    # float32: in bfloat16 (the CPU platform's choice on a CPU with AVX512-BF16)
    # vLLM 0.32's CPU attention takes its AMX path where the CPU has AMX, and on
    # a Xeon with AMX the decode instance's worker died of SIGILL on
    # its first step over the KV that FileKVConnector loaded; float32 takes the
    # vector path on every CPU.
    args = ["--block-size", str(BLOCK), "--dtype", "float32"]
    args += ["--kv-transfer-config", json.dumps(config)]
    return VllmServer(model, tmp / f"vllm-{role}.log", env, args)


@dataclass
class PdServing:
    """Both instances and the proxy, started; ``stop()`` ends them all."""

    prefill: VllmServer
    decode: VllmServer
    proxy_url: str
    kv_dir: Path
    started: list[Process] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        model: Path,
        tmp: Path,
        grpc_port: int,
        lease_s: float,
        env: dict[str, str] | None = None,
    ) -> PdServing:
        """``env``: more variables for both instances."""
        started: list[Process] = []
        try:
            prefill = _server(model, tmp, grpc_port, "kv_producer", "0", lease_s, env or {})
            started.append(prefill)
            decode = _server(model, tmp, grpc_port, "kv_consumer", "1", lease_s, env or {})
            started.append(decode)
            prefill.wait_ready()
            decode.wait_ready()
            port = free_port()
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_"))},
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{grpc_port}",
                "OTEL_BSP_SCHEDULE_DELAY": "200",
            }
            argv = [str(VENV / "bin" / "python"), str(TESTS / "pd_proxy.py"), "--port", str(port),
                    "--prefill", prefill.url, "--decode", decode.url]  # fmt: skip
            proxy = Process("pd proxy", argv, env, tmp / "proxy.log")
            started.append(proxy)
            url = f"http://127.0.0.1:{port}"

            def up() -> bool:
                if not proxy.alive():
                    raise RuntimeError(f"proxy exited:\n{proxy.tail()}")
                try:
                    return bool(http_json(url + "/health", timeout=2))
                except OSError:
                    return False

            wait_until(up, 60, 0.2, "the proxy")
        except BaseException:
            for p in reversed(started):
                p.stop()
            raise
        return cls(prefill, decode, url, tmp / "kv", started)

    def stop(self) -> None:
        for p in reversed(self.started):
            p.stop()
