"""The user manual against the schema and the config module."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from deploy_kit import (
    CONFIG_DOC,
    DOCS,
    GATEWAY_DIMS,
    ROOT,
    TEMPO_DIMS,
    USER_PAGES,
    promql_refs,
    rel,
    schema_token_problems,
    traceql_refs,
)
from traceql_grammar import parse

from vllm_journey_otel import config as C


# ---------------------------------------------------------------------------
# The user manual
# ---------------------------------------------------------------------------
def test_configuration_reference_documents_every_variable() -> None:
    """One table, docs/configuration.md, has every variable config.py parses; the
    README links to it and names no variable the table lacks."""
    doc = CONFIG_DOC.read_text()
    readme = (ROOT / "README.md").read_text()
    for var in C.ALL_VARIABLES:
        assert re.search(rf"^\| `{var}`", doc, re.M), f"{var} has no row in {rel(CONFIG_DOC)}"
    assert "(docs/configuration.md)" in readme
    assert not re.search(r"^\| `VLLM_JOURNEY_OTEL", readme, re.M), "a second table in the README"
    for var in set(re.findall(r"`((?:OTEL|VLLM_JOURNEY_OTEL)_[A-Z_]+)`", readme)):
        assert var in doc, f"{var} (named in the README) is not in {rel(CONFIG_DOC)}"


def test_docs_links_resolve() -> None:
    for page in [*DOCS.glob("*.md"), ROOT / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{rel(page)} links to missing {target}"


@pytest.mark.parametrize("page", USER_PAGES, ids=rel)
def test_manual_queries_use_schema_names(page: Path) -> None:
    """The TraceQL and PromQL a user copies from the manual name real keys."""
    text = page.read_text()
    assert schema_token_problems(text, rel(page)) == []
    checked = 0
    for block in re.findall(r"```\n(.*?)```", text, re.S):
        for line in (raw.strip() for raw in block.splitlines()):
            if line.startswith("{"):
                assert traceql_refs(line)[3] == [], line
                parse(line)  # Tempo's grammar: raises TraceQLError
                checked += 1
            elif "traces_span_metrics_" in line and not line.startswith("#"):
                assert promql_refs(line, "", GATEWAY_DIMS, TEMPO_DIMS)[2] == [], line
                checked += 1
    if page.name in ("howto-tempo.md", "howto-grafana.md"):
        assert checked >= 3, "the how-to's queries were not found"


KIT_PATH = re.compile(
    r"(?<![\w/.-])((?:deploy|collector-config|scripts|benchmarks|examples)/[\w./-]*[\w/]"
    r"|docker-compose\.yml)"
)


@pytest.mark.parametrize(
    "page",
    [ROOT / "README.md", DOCS / "quickstart.md", DOCS / "verification.md"],
    ids=rel,
)
def test_the_quickstart_names_only_files_that_exist(page: Path) -> None:
    named = set(KIT_PATH.findall(page.read_text()))
    assert named, "no file names found: the pattern is wrong"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert missing == [], f"{rel(page)} names files that do not exist"
