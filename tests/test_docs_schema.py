"""docs/spans.md documents exactly what the schema module defines."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_journey_otel import schema as S

DOC = (Path(__file__).parent.parent / "docs" / "spans.md").read_text()


def _table(heading: str) -> list[list[str]]:
    section = DOC.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_span_names_documented() -> None:
    documented = [re.sub(r"`", "", row[0]) for row in _table("Tree")]
    assert documented == list(S.SPAN_NAMES)


def test_attributes_documented_on_the_right_spans() -> None:
    rows = _table("Attributes")
    documented = {row[0].strip("`"): tuple(s.strip() for s in row[1].split(",")) for row in rows}
    assert len(documented) == len(rows), "an attribute is documented twice"
    expected = {a.key: a.spans for a in S.ATTRIBUTES}
    assert documented.keys() == expected.keys()
    for key, spans in expected.items():
        assert set(documented[key]) == set(spans), key
    for row, spec in zip(rows, S.ATTRIBUTES, strict=True):
        assert row[2] == spec.type, spec.key


def test_resource_documented() -> None:
    assert [row[0].strip("`") for row in _table("Resource")] == list(S.RESOURCE_ATTRIBUTES)


def test_enumerated_values_documented() -> None:
    for value in (
        *S.FINISH_STATUSES,
        S.SCHEDULE_FIRST,
        S.SCHEDULE_RESUME,
        S.SCHEDULE_NEXT_INPUT,
        S.PHASE_PREFILL,
        S.PHASE_DECODE,
        *S.WAIT_REASONS,
        *S.IN_FLIGHT_STATES,
    ):
        assert f"`{value}`" in DOC, value


def test_every_loss_reason_documented_with_its_unit_and_where_it_shows() -> None:
    """docs/reliability.md's table of losses is losses.Loss: every reason, no
    other; the journey reasons that reach the roots are exactly CARRIED."""
    from vllm_journey_otel.losses import CARRIED, Loss

    doc = (Path(__file__).parent.parent / "docs" / "reliability.md").read_text()
    section = doc.split("## What is lost, and why", 1)[1].split("\n## ", 1)[0]
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| `")
    ]
    assert [row[0].strip("`") for row in rows] == [r.name.lower() for r in Loss]
    on_roots = {row[0].strip("`") for row in rows if row[3] == "`dropped_journeys`"}
    assert on_roots == {r.name.lower() for r in CARRIED}
