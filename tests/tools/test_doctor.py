"""``vllm-journey doctor``: one line per check, the cause named, the exit code.

Real components: the SDK's exporters as the plugin builds them, the repository's
OTLP receiver (gRPC and HTTP on 127.0.0.1), TLS servers with a certificate made
here, closed ports, a server that never answers, the self-check subprocess
against the installed vLLM. Nothing of the exporter is mocked. Timeouts are
short: a failing check takes about a second.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import requires_vllm
from otlp_receiver import Receiver
from vllm_journey_otel.engine import self_check
from vllm_journey_otel.tools import doctor

TIMEOUT = "1.5"


def _run(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *args: str,
    **env: str,
) -> tuple[int, dict[str, dict[str, object]]]:
    """The doctor in this process with only ``env`` of ours and the SDK's set;
    (exit code, checks by name) from its --json output."""
    for name in list(os.environ):
        if name.startswith(("OTEL_", "VLLM_JOURNEY_OTEL", "VLLM_PLUGINS")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = doctor.run(["--json", "--timeout", TIMEOUT, *args])
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == code
    return code, {c["name"]: c for c in report["checks"]}


def _grpc(port: int, scheme: str = "http") -> dict[str, str]:
    return {
        "VLLM_JOURNEY_OTEL": "1",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{scheme}://127.0.0.1:{port}",
    }


def _http(endpoint: str) -> dict[str, str]:
    return {
        "VLLM_JOURNEY_OTEL": "1",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
    }


def _test_spans(receiver: Receiver) -> list[str]:
    return [s.name for s in receiver.spans() if s.name == doctor.TEST_SPAN]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- a journey would arrive -------------------------------------------------------
@requires_vllm
def test_everything_ok_through_the_self_check_and_a_real_receiver(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], receiver: Receiver
) -> None:
    """The whole doctor, the self-check subprocess against the vLLM under test
    included: exit 0, every line ok (the entry point as vLLM's loader sees it, vLLM
    supported with every hooked method), and the receiver got the test span."""
    code, checks = _run(monkeypatch, capsys, **_grpc(receiver.grpc_port))
    assert code == 0, checks
    assert list(checks) == [
        "entry-point", "switch", "vllm", "settings", "sampling", "exporter", "endpoint"
    ]  # fmt: skip
    assert {c["verdict"] for c in checks.values()} == {"ok"}, checks
    assert "journey_otel -> vllm_journey_otel.plugin:register" in str(
        checks["entry-point"]["summary"]
    )
    import vllm  # the release the test runs on (0.32 installed, or 0.30/0.31/0.33 sources)

    assert str(checks["vllm"]["summary"]).startswith(f"vLLM {vllm.__version__}")
    from vllm_journey_otel.engine.compat import TARGETS

    optional = sum(not t.required for t in TARGETS)
    said = f"is supported; the 6 required Scheduler methods and all {optional} optional hooks"
    assert said in str(checks["vllm"]["summary"])
    assert "the test span reached" in str(checks["endpoint"]["summary"])
    assert _test_spans(receiver) == [doctor.TEST_SPAN]
    assert {s.resource.get("service.name") for s in receiver.spans()} == {"vllm"}


def test_http_receiver_ok(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], receiver: Receiver
) -> None:
    url = f"http://127.0.0.1:{receiver.http_port}/v1/traces"
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **_http(url))
    assert code == 0, checks
    assert checks["endpoint"]["verdict"] == "ok"
    assert checks["vllm"]["verdict"] == "warn"  # --skip-vllm says what it did not check
    assert _test_spans(receiver) == [doctor.TEST_SPAN]


def test_text_output_one_line_per_check_with_the_fix_under_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VLLM_JOURNEY_OTEL", "1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    assert doctor.run(["--skip-vllm", "--timeout", TIMEOUT]) == 1
    lines = capsys.readouterr().out.splitlines()
    fail = next(i for i, line in enumerate(lines) if line.startswith("FAIL"))
    assert lines[fail].split()[:4] == ["FAIL", "endpoint", "connection", "refused:"]
    assert lines[fail + 2].strip().startswith("fix: start the collector")
    assert lines[-1] == "1 FAIL, 1 warn: journeys would not arrive (exit 1)"


# -- the endpoint does not answer ----------------------------------------------------
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_closed_port_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], protocol: str
) -> None:
    port = _closed_port()
    env = _grpc(port) if protocol == "grpc" else _http(f"http://127.0.0.1:{port}/v1/traces")
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **env)
    assert code == 1
    endpoint = checks["endpoint"]
    assert endpoint["verdict"] == "FAIL"
    assert endpoint["summary"] == f"connection refused: nothing listens on 127.0.0.1:{port}"
    assert "Connection refused" in str(endpoint["more"])  # the exporter's own words


def test_http_path_without_v1_traces_is_404_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], receiver: Receiver
) -> None:
    base = f"http://127.0.0.1:{receiver.http_port}"
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **_http(base))
    assert code == 1
    endpoint = checks["endpoint"]
    assert (
        endpoint["summary"] == f"HTTP 404 Not Found from {base}: nothing serves OTLP on that path"
    )
    assert f"end it in /v1/traces ({base}/v1/traces)" in str(endpoint["fix"])
    assert _test_spans(receiver) == []


def test_grpc_to_the_http_port_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], receiver: Receiver
) -> None:
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **_grpc(receiver.http_port))
    assert code == 1
    assert str(checks["endpoint"]["summary"]).startswith(
        f"127.0.0.1:{receiver.http_port} is not a gRPC server"
    )
    assert "http/protobuf" in str(checks["endpoint"]["fix"])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A server that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    accepted: list[socket.socket] = []

    def accept() -> None:
        with server:
            while True:
                try:
                    accepted.append(server.accept()[0])
                except OSError:
                    return

    threading.Thread(target=accept, daemon=True).start()
    yield int(server.getsockname()[1])
    server.close()
    for conn in accepted:
        conn.close()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_silent_endpoint_is_a_timeout(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    silent_port: int,
    protocol: str,
) -> None:
    url = f"http://127.0.0.1:{silent_port}"
    env = _grpc(silent_port) if protocol == "grpc" else _http(f"{url}/v1/traces")
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **env)
    assert code == 1
    summary = f"timeout: no answer from 127.0.0.1:{silent_port} within {TIMEOUT} s"
    assert checks["endpoint"]["summary"] == summary


# -- TLS --------------------------------------------------------------------------------
def _self_signed(tmp: Path) -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1, made here, valid one day."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp / "cert.pem", tmp / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


@pytest.fixture
def tls_receiver(tmp_path: Path) -> Iterator[tuple[Receiver, Path]]:
    """An OTLP receiver over TLS (gRPC and HTTPS) with a self-signed certificate."""
    pytest.importorskip("cryptography")
    cert, key = _self_signed(tmp_path)
    receiver = Receiver()
    receiver.start_grpc(tls=(cert.read_bytes(), key.read_bytes()))
    receiver.start_http(tls=(cert, key))
    yield receiver, cert
    receiver.stop()


def _tls_env(receiver: Receiver, protocol: str) -> dict[str, str]:
    if protocol == "grpc":
        return _grpc(receiver.grpc_port, scheme="https")
    return _http(f"https://127.0.0.1:{receiver.http_port}/v1/traces")


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_tls_with_an_untrusted_certificate(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tls_receiver: tuple[Receiver, Path],
    protocol: str,
) -> None:
    receiver, _ = tls_receiver
    env = _tls_env(receiver, protocol)
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **env)
    assert code == 1
    endpoint = checks["endpoint"]
    port = receiver.grpc_port if protocol == "grpc" else receiver.http_port
    assert str(endpoint["summary"]).startswith(
        f"TLS failure: 127.0.0.1:{port}'s certificate is not trusted (self"
    )
    assert "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE" in str(endpoint["fix"])


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_tls_with_the_certificate_named_is_ok(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tls_receiver: tuple[Receiver, Path],
    protocol: str,
) -> None:
    """The fix the line above gives works; a REQUESTS_CA_BUNDLE (set in many images)
    does not defeat it, as it does not in the exporter process."""
    receiver, cert = tls_receiver
    env = {**_tls_env(receiver, protocol), "OTEL_EXPORTER_OTLP_CERTIFICATE": str(cert)}
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **env)
    assert code == 0, checks
    assert f"TLS, CA {cert}" in str(checks["exporter"]["summary"])
    assert _test_spans(receiver) == [doctor.TEST_SPAN]
    assert os.environ["REQUESTS_CA_BUNDLE"] == "/etc/ssl/certs/ca-certificates.crt"  # restored


def test_tls_to_a_plaintext_server(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], receiver: Receiver
) -> None:
    """gRPC without a scheme means TLS: against a plaintext collector, that is named."""
    env = {
        "VLLM_JOURNEY_OTEL": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"127.0.0.1:{receiver.grpc_port}",
    }
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **env)
    assert code == 1
    assert checks["endpoint"]["summary"] == (
        f"TLS failure: 127.0.0.1:{receiver.grpc_port} does not speak TLS "
        "(gRPC without http:// means TLS)"
    )
    assert checks["endpoint"]["fix"] == (
        f"use http://127.0.0.1:{receiver.grpc_port}, or OTEL_EXPORTER_OTLP_TRACES_INSECURE=true"
    )


# -- the settings ------------------------------------------------------------------
def _file_env(path: Path, **more: str) -> dict[str, str]:
    env = {"VLLM_JOURNEY_OTEL": "1", "OTEL_TRACES_EXPORTER": "otlp_json_file"}
    return {**env, "VLLM_JOURNEY_OTEL_FILE": str(path), **more}


def test_switch_unset_fails_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    env = _file_env(tmp_path / "j.jsonl")
    del env["VLLM_JOURNEY_OTEL"]
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **env)
    assert code == 1
    assert checks["switch"]["summary"] == "VLLM_JOURNEY_OTEL is unset: the plugin stays off"
    assert str(checks["switch"]["fix"]).startswith("export VLLM_JOURNEY_OTEL=1 where vllm serve")
    assert [c for c, v in checks.items() if v["verdict"] == "FAIL"] == ["switch"]


def test_switch_words_and_sdk_disabled(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    env = _file_env(tmp_path / "j.jsonl", VLLM_JOURNEY_OTEL="enable")
    _, checks = _run(monkeypatch, capsys, "--skip-vllm", **env)
    assert str(checks["switch"]["summary"]).startswith(
        "VLLM_JOURNEY_OTEL='enable' is not understood; accepted values: 1/true/yes/on"
    )
    env = _file_env(tmp_path / "j.jsonl", OTEL_SDK_DISABLED="true")
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **env)
    assert code == 1
    assert "OTEL_SDK_DISABLED=true keeps the plugin off" in str(checks["switch"]["summary"])


def test_sampler_always_off_drops_every_request(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    env = _file_env(tmp_path / "j.jsonl", OTEL_TRACES_SAMPLER="always_off")
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **env)
    assert code == 1
    sampling = checks["sampling"]
    assert sampling["verdict"] == "FAIL"
    assert sampling["summary"] == (
        "always_off: head sampling drops every request; the tail rule still exports the "
        "preempted/error/aborted/in_flight ones"
    )
    assert "OTEL_TRACES_SAMPLER=parentbased_always_on" in str(sampling["fix"])


@pytest.mark.parametrize(
    ("sampler", "arg", "verdict", "says"),
    [
        ("traceidratio", "0", "FAIL", "traceidratio 0: head sampling drops every request"),
        ("parentbased_traceidratio", "0", "warn", "only requests whose client sends a sampled"),
        ("parentbased_traceidratio", "0.25", "ok", "25 % of requests traced"),
        ("sometimes", "", "FAIL", "OTEL_TRACES_SAMPLER='sometimes' is not one of always_on"),
        ("traceidratio", "2", "FAIL", "OTEL_TRACES_SAMPLER_ARG='2' is not a ratio in [0, 1]"),
    ],
)
def test_sampler_meanings_and_invalid_values(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    sampler: str,
    arg: str,
    verdict: str,
    says: str,
) -> None:
    env = _file_env(tmp_path / "j.jsonl", OTEL_TRACES_SAMPLER=sampler, OTEL_TRACES_SAMPLER_ARG=arg)
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **env)
    assert (checks["sampling"]["verdict"], code) == (verdict, 1 if verdict == "FAIL" else 0)
    assert says in str(checks["sampling"]["summary"])


def test_invalid_plugin_values_and_protocol_fail_with_config_words(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    env = _file_env(tmp_path / "j.jsonl", VLLM_JOURNEY_OTEL_QUEUE_SIZE="0")
    _, checks = _run(monkeypatch, capsys, "--skip-vllm", **env)
    assert checks["settings"]["summary"] == (
        "VLLM_JOURNEY_OTEL_QUEUE_SIZE='0' is not a number in [1, 1e+07]; using the default 16384."
    )
    env = {"VLLM_JOURNEY_OTEL": "1", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **env)
    assert code == 1
    assert checks["exporter"]["summary"] == (
        "Unsupported OTLP protocol 'http/json': use grpc or http/protobuf"
    )
    _, checks = _run(
        monkeypatch, capsys, "--skip-vllm", VLLM_JOURNEY_OTEL="1", OTEL_TRACES_EXPORTER="none"
    )
    assert checks["exporter"]["summary"] == (
        "OTEL_TRACES_EXPORTER=none: journeys are recorded but not exported"
    )


# -- the trace file ----------------------------------------------------------------
def test_trace_file_writable_and_left_as_found(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "journeys.jsonl"
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **_file_env(path))
    assert code == 0, checks
    assert checks["file"]["summary"] == f"{path} is writable (will be created)"
    assert not path.exists()


@pytest.mark.parametrize("where", ["under a file", "a directory"])
def test_trace_file_not_writable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, where: str
) -> None:
    """Two ways even root cannot write the file (the tests may run as root)."""
    (tmp_path / "a-file").write_text("")
    path = tmp_path / "a-file" / "j.jsonl" if where == "under a file" else tmp_path
    code, checks = _run(monkeypatch, capsys, "--skip-vllm", **_file_env(path))
    assert code == 1
    file = checks["file"]
    assert file["verdict"] == "FAIL"
    expected = "File exists" if where == "under a file" else f"cannot write {path}: Is a directory"
    assert expected in str(file["summary"])
    assert str(file["fix"]).startswith("point VLLM_JOURNEY_OTEL_FILE at a file")


# -- the vLLM side ------------------------------------------------------------------------
def test_vllm_plugins_that_leaves_the_plugin_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """As vLLM's envs.py splits VLLM_PLUGINS (commas, no trimming); nothing of vLLM imported."""
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver, journey_otel")
    result = self_check.entry_point_check()
    assert result["verdict"] == "FAIL"
    assert result["summary"].startswith(
        "VLLM_PLUGINS='lora_filesystem_resolver, journey_otel' leaves journey_otel out "
        "(vLLM compares the names exactly: no spaces)"
    )
    assert (
        result["fix"] == "VLLM_PLUGINS=lora_filesystem_resolver,journey_otel, or unset VLLM_PLUGINS"
    )
    monkeypatch.setenv("VLLM_PLUGINS", "journey_otel")
    assert self_check.excluded_by_vllm_plugins() is None


@pytest.mark.parametrize("how", ["crash", "import error"])
def test_a_vllm_that_cannot_be_imported(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    how: str,
) -> None:
    """A broken vLLM install (here: a package named vllm first on PYTHONPATH) takes
    the self-check down, not the doctor: FAIL with the last lines of its stderr."""
    fake = tmp_path / "vllm"
    fake.mkdir()
    body = (
        "import os, sys\nprint('OSError: libcudart.so.12: cannot open shared object file', "
        "file=sys.stderr)\nos._exit(3)\n"
        if how == "crash"
        else "print('a banner on stdout')\n"
        "raise ImportError('libcudart.so.12: cannot open shared object file')\n"
    )
    (fake / "__init__.py").write_text(body)
    env = _file_env(tmp_path / "j.jsonl", PYTHONPATH=str(tmp_path))
    code, checks = _run(monkeypatch, capsys, **env)
    assert code == 1
    vllm = checks["vllm"]
    assert vllm["verdict"] == "FAIL"
    if how == "crash":
        assert "entry-point" not in checks
        assert vllm["summary"] == (
            "the vLLM self-check exited 3 without an answer: importing vLLM fails here "
            "(entry point, vLLM not checked)"
        )
        assert vllm["more"] == ["OSError: libcudart.so.12: cannot open shared object file"]
        assert "-m vllm_journey_otel.engine.self_check" in str(vllm["fix"])
    else:
        assert str(vllm["summary"]).endswith(
            "ImportError: libcudart.so.12: cannot open shared object file"
        )
        assert checks["entry-point"]["verdict"] == "FAIL"
        # What vLLM prints goes to stderr: the self-check's stdout is its JSON alone.
        out = subprocess.run(
            [sys.executable, "-m", doctor.SELF_CHECK], capture_output=True, text=True, check=True
        ).stdout
        assert len(out.splitlines()) == 1 and json.loads(out)["checks"][1] == {
            "name": "vllm", "verdict": "FAIL", "summary": vllm["summary"], "fix": vllm["fix"]
        }  # fmt: skip
    assert checks["file"]["verdict"] == "ok"  # the rest of the report is there
