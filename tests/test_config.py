"""VLLM_JOURNEY_OTEL* parsing: clear messages, safe defaults, never an exception."""

from __future__ import annotations

import logging

import pytest

from vllm_journey_otel import config


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " yes ", "on"])
def test_enabled_values(value: str) -> None:
    assert config.from_env({config.ENABLE: value}).enabled


@pytest.mark.parametrize("value", ["", "0", "false", "off", "no"])
def test_disabled_values(value: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.journey_otel"):
        assert not config.from_env({config.ENABLE: value}).enabled
    assert caplog.text == ""


def test_unset_is_off() -> None:
    assert config.from_env({}) == config.Config(enabled=False)


def test_bad_flag_warns_and_stays_off(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.journey_otel"):
        assert not config.from_env({config.ENABLE: "maybe"}).enabled
    assert config.ENABLE in caplog.text and "accepted values" in caplog.text


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        (config.QUEUE_SIZE, "lots"),
        (config.QUEUE_SIZE, "0"),
        (config.EXPORT_INTERVAL_MS, "-5"),
        (config.SHUTDOWN_TIMEOUT_S, "nan"),
        (config.SHUTDOWN_TIMEOUT_S, "1e9"),
    ],
)
def test_bad_numbers_warn_and_use_default(name: str, raw: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.journey_otel"):
        cfg = config.from_env({config.ENABLE: "1", name: raw})
    assert cfg.enabled
    default = config.Config()
    assert (cfg.queue_size, cfg.export_interval_ms, cfg.shutdown_timeout_s) == (
        default.queue_size,
        default.export_interval_ms,
        default.shutdown_timeout_s,
    )
    assert name in caplog.text and "using the default" in caplog.text


def test_good_numbers() -> None:
    cfg = config.from_env(
        {
            config.ENABLE: "1",
            config.QUEUE_SIZE: "100",
            config.EXPORT_INTERVAL_MS: "20",
            config.SHUTDOWN_TIMEOUT_S: "1.5",
        }
    )
    assert (cfg.queue_size, cfg.export_interval_ms, cfg.shutdown_timeout_s) == (100, 20, 1.5)


def test_step_view_settings(caplog) -> None:
    on = {config.ENABLE: "1"}
    assert (config.from_env(on).steps, config.from_env(on).steps_ratio) == (False, 1.0)
    cfg = config.from_env({**on, config.STEPS: "1", config.STEPS_RATIO: "0.05"})
    assert (cfg.steps, cfg.steps_ratio) == (True, 0.05)
    with caplog.at_level(logging.WARNING, logger="vllm.journey_otel"):
        cfg = config.from_env({**on, config.STEPS: "sometimes", config.STEPS_RATIO: "2"})
    assert cfg.enabled and not cfg.steps and cfg.steps_ratio == 1.0
    assert "The step view stays off" in caplog.text and config.STEPS_RATIO in caplog.text
    # The step view alone does not turn tracing on.
    assert not config.from_env({config.STEPS: "1"}).enabled


def test_exporter_processes() -> None:
    assert config.from_env({config.ENABLE: "1"}).exporter_processes == 1
    cfg = config.from_env({config.ENABLE: "1", config.EXPORTER_PROCESSES: "3"})
    assert cfg.exporter_processes == 3
    assert (
        config.from_env({config.ENABLE: "1", config.EXPORTER_PROCESSES: "0"}).exporter_processes
        == 1
    )
