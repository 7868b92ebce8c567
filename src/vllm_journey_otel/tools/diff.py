"""``vllm-journey diff BASE NEW``: what got slower between two runs, where, and for whom.

Runs in the CLI's process (one thread). Figures are milliseconds (decode per
token: ms per output token), from the spans' epoch-ns times through the same
causes ``explain`` gives each journey (``tools/journey_files.py``), so a
phase here is a cause there.

Per phase (each cause, the server TTFT, end to end, decode per output token)
and per group (model, LoRA adapter, DP rank, instance: where a file has more
than one): each file's count and p50/p90/p99 and the change. Whether a
quantile's change is beyond the noise of the two samples: each file's 95 %
interval of that quantile from order statistics (distribution-free: the ranks
n*q +- 1.96*sqrt(n*q*(1-q))), and the change counts only when the two
intervals are apart; where a rank falls outside a sample the quantile is not
resolved (too few journeys), never called beyond the noise. Whether the whole
distribution shifted: the Mann-Whitney U rank test (normal approximation, tie
and continuity corrections), its p-value. Both measure sampling noise only:
two runs on a noisy machine also differ by the machine (an A/A pair of runs
shows how much).

Missing is not zero: a journey contributes to a phase only where its spans
observe that phase (an engine phase where the engine's phases are in the file,
an API-server side where its ``vllm.api.*`` spans are); a journey that was
observed and never preempted contributes 0 ms preempted.

Memory: one float per journey and phase (``array('d')``), not the spans.
"""

from __future__ import annotations

import math
import operator
import re
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm_journey_otel.tools.explain import (
    AFTER,
    API_AFTER,
    API_BEFORE,
    API_INPUT,
    API_OUTPUT,
    API_READ,
    API_RENDER,
    BEFORE,
    CAUSES,
    DECODE,
    ENGINE_HANDBACK,
    ENGINE_INPUT,
    ENGINE_UNSEEN,
    WAIT,
    label,
)
from vllm_journey_otel.tools.journey_files import GROUPS, JourneyCauses, Reader, journey_causes
from vllm_journey_otel.tools.summary import percentile

E2E = "e2e"
TTFT = "ttft"
DECODE_PER_TOKEN = "decode_per_token"
QUANTILES = (50, 90, 99)
TOTALS = (E2E, TTFT)  # whole-request figures, listed first
_API_CAUSES = frozenset((*API_BEFORE, *API_AFTER))
_SPLIT = (API_READ, API_RENDER)  # the input side's parts, where vLLM's stamp splits it
_DERIVED_LABELS = {
    E2E: "end to end",
    TTFT: "server TTFT",
    DECODE_PER_TOKEN: "decode per output token",
}
Z95 = 1.96
NAN = float("nan")


def phase_label(phase: str) -> str:
    return _DERIVED_LABELS.get(phase) or label(phase)


def _applies(cause: str, jc: JourneyCauses) -> bool:
    """The journey's spans observe this cause (0 ms then means 0 ms)."""
    j = jc.journey
    api = j.api
    if api is None:
        return jc.phases_observed and cause not in _API_CAUSES and cause != ENGINE_UNSEEN
    if cause in (API_INPUT, *_SPLIT):
        return api.handoff is not None
    if cause == ENGINE_INPUT:
        return j.engine is not None
    if cause == API_OUTPUT:
        return api.output_start is not None
    if cause == ENGINE_HANDBACK:
        return api.output_start is not None and jc.phases_observed
    if cause == AFTER:  # an API request without an output side: last phase to the end
        return api.output_start is None and jc.phases_observed
    return cause != BEFORE and cause != ENGINE_UNSEEN and jc.phases_observed


class Sample:
    """One file's figures: per phase, one value per journey (NaN: not observed),
    and each journey's group values."""

    def __init__(self, journeys: Iterable[JourneyCauses], count: int) -> None:
        self.count = count
        self.values: dict[str, array[float]] = {}
        self.groups: list[list[str]] = [[] for _ in GROUPS]
        self.observed = array("b")  # the journey's engine phases are in the file
        self.with_api = 0  # journeys whose outermost span is the API server's
        for jc in journeys:
            figures = self._figures(jc)
            for phase in figures.keys() - self.values.keys():
                # A phase first seen now: earlier journeys did not have it (a wait
                # reason: those observed spent 0 ms in it).
                self.values[phase] = self._absent(phase)
            for phase, column in self.values.items():
                column.append(figures.get(phase, self._missing(phase, jc.phases_observed)))
            self.observed.append(1 if jc.phases_observed else 0)
            self.with_api += jc.journey.api is not None
            engine = jc.journey.engine
            for i, value in enumerate(engine.groups if engine else ("",) * len(GROUPS)):
                self.groups[i].append(value)

    @staticmethod
    def _missing(phase: str, observed: bool) -> float:
        """A journey without this figure: a wait it never had took 0 ms (its
        phases observed); anything else was not observed."""
        return 0.0 if observed and phase.startswith(WAIT) else NAN

    def _absent(self, phase: str) -> array[float]:
        return array("d", (self._missing(phase, bool(o)) for o in self.observed))

    @staticmethod
    def _figures(jc: JourneyCauses) -> dict[str, float]:
        j = jc.journey
        out = {} if j.api is not None and not j.api.responded else {E2E: j.e2e_ms}
        if j.ttft_ms is not None:
            out[TTFT] = j.ttft_ms
        for cause in CAUSES:
            if _applies(cause, jc) and cause not in _SPLIT:
                out[cause] = jc.causes.get(cause, 0.0)
        if API_INPUT in out:
            # The input side whole (its split into read and render only where observed).
            out[API_INPUT] = sum(jc.causes.get(c, 0.0) for c in (*_SPLIT, API_INPUT))
            for c in _SPLIT:
                if c in jc.causes:
                    out[c] = jc.causes[c]
        for cause, ms in jc.causes.items():
            if cause.startswith(WAIT):
                out[cause] = ms
        tokens = j.engine.output_tokens if j.engine else None
        if jc.causes.get(DECODE) and tokens is not None and tokens > 1:
            out[DECODE_PER_TOKEN] = jc.causes[DECODE] / (tokens - 1)
        return out

    def sorted_values(self, phase: str, group: tuple[int, str] | None = None) -> list[float]:
        """The phase's observed values (a wait this file never had: 0 ms for each
        journey whose phases are in it), of one group's journeys if given."""
        column = self.values.get(phase)
        if column is None:
            column = self._absent(phase)
        if group is None:
            vals = [v for v in column if v == v]
        else:
            keys = self.groups[group[0]]
            vals = [v for v, k in zip(column, keys, strict=True) if k == group[1] and v == v]
        vals.sort()
        return vals


def from_reader(read: Reader) -> Sample:
    each, count = journey_causes(read)
    return Sample(each, count)


def quantile_interval(sorted_values: list[float], q: float) -> tuple[float, float]:
    """A distribution-free 95 % interval of the q-quantile (q in 0..1): the order
    statistics at ranks n*q -+ 1.96*sqrt(n*q*(1-q)). A rank outside the sample
    leaves that side open (-inf or inf): too few values to bound it (a p99 needs
    about 560, a p90 about 55, a p50 about 8)."""
    n = len(sorted_values)
    half = Z95 * math.sqrt(n * q * (1 - q))
    lo, hi = math.floor(n * q - half), math.ceil(n * q + half)
    return (
        sorted_values[lo] if lo >= 0 else -math.inf,
        sorted_values[hi] if hi <= n - 1 else math.inf,
    )


def mann_whitney_p(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test (normal approximation with
    the tie and continuity corrections): how likely a shift this large is
    between two samples of one distribution."""
    n1, n2 = len(a), len(b)
    if n1 == 0 or n2 == 0:
        return NAN
    merged = sorted([(v, 0) for v in a] + [(v, 1) for v in b])
    n = n1 + n2
    rank_b = 0.0
    ties = 0.0
    i = 0
    while i < n:
        j = i
        while j + 1 < n and merged[j + 1][0] == merged[i][0]:
            j += 1
        t = j - i + 1
        mid = (i + j) / 2 + 1
        rank_b += mid * sum(1 for k in range(i, j + 1) if merged[k][1] == 1)
        ties += t**3 - t
        i = j + 1
    u = rank_b - n2 * (n2 + 1) / 2
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))) if n > 1 else 0.0
    if var <= 0:
        return 1.0
    # With the continuity correction: U moves in steps of 1 (scipy's default too).
    z = max(0.0, abs(u - n1 * n2 / 2) - 0.5) / math.sqrt(var)
    return math.erfc(z / math.sqrt(2))


@dataclass
class QuantileChange:
    q: int
    base: float
    new: float
    beyond_noise: bool  # the two files' intervals of this quantile are apart
    resolved: bool = True  # both intervals are bounded: enough journeys to tell

    @property
    def change(self) -> float:
        return self.new - self.base

    @property
    def relative(self) -> float | None:
        """The change over the base (None: a base of 0 and a change)."""
        if self.base == 0:
            return 0.0 if self.new == 0 else None
        return self.change / self.base


@dataclass
class PhaseDiff:
    phase: str
    base_n: int
    new_n: int
    quantiles: list[QuantileChange] = field(default_factory=list)
    shift_p: float = NAN

    def at(self, q: int) -> QuantileChange | None:
        return next((c for c in self.quantiles if c.q == q), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "label": phase_label(self.phase),
            "count": [self.base_n, self.new_n],
            "quantiles": {
                f"p{c.q}": {
                    "base": c.base,
                    "new": c.new,
                    "change": c.change,
                    "relative": c.relative,
                    "beyond_noise": c.beyond_noise,
                    "resolved": c.resolved,
                }
                for c in self.quantiles
            },
            "shift_p": None if math.isnan(self.shift_p) else self.shift_p,
        }


def compare_values(phase: str, base: list[float], new: list[float]) -> PhaseDiff:
    d = PhaseDiff(phase, len(base), len(new))
    if base and new:
        for q in QUANTILES:
            blo, bhi = quantile_interval(base, q / 100)
            nlo, nhi = quantile_interval(new, q / 100)
            resolved = all(math.isfinite(v) for v in (blo, bhi, nlo, nhi))
            apart = resolved and (nlo > bhi or nhi < blo)
            c = QuantileChange(q, percentile(base, q), percentile(new, q), apart, resolved)
            d.quantiles.append(c)
        d.shift_p = mann_whitney_p(base, new)
    return d


def tail(d: PhaseDiff) -> QuantileChange | None:
    """The highest quantile both files have enough journeys to bound."""
    return next((c for c in reversed(d.quantiles) if c.resolved), None)


def _tail_move(d: PhaseDiff) -> float:
    c = tail(d)
    return abs(c.change) if c is not None else -1.0


@dataclass
class Diff:
    base: Sample
    new: Sample
    phases: list[PhaseDiff]  # e2e and TTFT first, then by how far each moved its tail
    groups: dict[str, dict[str, list[PhaseDiff]]]  # dimension -> value -> e2e, TTFT
    notes: list[str] = field(default_factory=list)  # what to keep in mind reading it

    def phase(self, name: str) -> PhaseDiff | None:
        return next((p for p in self.phases if p.phase == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "journeys": [self.base.count, self.new.count],
            "phases": [p.to_dict() for p in self.phases],
            "notes": self.notes,
            "groups": {
                dim: {v: [p.to_dict() for p in ps] for v, ps in values.items()}
                for dim, values in self.groups.items()
            },
        }


def diff(base: Sample, new: Sample) -> Diff:
    names = base.values.keys() | new.values.keys()
    phases = [compare_values(p, base.sorted_values(p), new.sorted_values(p)) for p in names]
    head = [p for k in TOTALS for p in phases if p.phase == k]
    rest = sorted((p for p in phases if p not in head), key=lambda p: (-_tail_move(p), p.phase))
    groups: dict[str, dict[str, list[PhaseDiff]]] = {}
    for i, dim in enumerate(GROUPS):
        if len(set(base.groups[i])) < 2 and len(set(new.groups[i])) < 2:
            continue  # one model, one rank... in each file: the whole is the group
        values = sorted(set(base.groups[i]) | set(new.groups[i]))
        groups[dim] = {
            v: [
                compare_values(p, base.sorted_values(p, (i, v)), new.sorted_values(p, (i, v)))
                for p in TOTALS
            ]
            for v in values
        }
    notes = []
    if (base.with_api == 0) != (new.with_api == 0):
        notes.append(
            "one file has the API server's spans and the other not: end to end and TTFT "
            "compare vllm.api.request in one with the engine's vllm.request in the other"
        )
    return Diff(base, new, head + rest, groups, notes)


# ---------------------------------------------------------------------------
# --fail-if rules: PHASE.pQ OP CHANGE, e.g. "queued.p99 > +20%", "e2e.p50 > 5ms"
# ---------------------------------------------------------------------------
_RULE = re.compile(
    r"^\s*(?P<phase>[a-z_][a-z0-9_:]*)\.p(?P<q>\d+)\s*(?P<op>>=|<=|>|<)\s*"
    r"(?P<value>[+-]?\d+(?:\.\d+)?)\s*(?P<unit>%|ms)\s*$"
)
_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


@dataclass(frozen=True)
class Rule:
    text: str
    phase: str
    q: int
    op: str
    value: float
    relative: bool  # %: the change over the base; ms: the change itself

    def check(self, d: Diff) -> str | None:
        """Why the rule fails, or None when it holds. It fails on a change that
        meets it and is beyond the noise, or when it cannot be evaluated (the
        phase is not observed in one of the files, or too few journeys to bound
        that quantile): a gate must not pass blind."""
        p = d.phase(self.phase)
        c = p.at(self.q) if p is not None else None
        if c is None or p is None:
            return f"{self.text}: {self.phase} is not observed in both files"
        if not c.resolved:
            return (
                f"{self.text}: {p.base_n} and {p.new_n} journeys are too few to tell a "
                f"change of p{self.q} from noise; use a lower quantile or more journeys"
            )
        change = c.relative if self.relative else c.change
        if change is None:  # from 0 to something: an infinite relative change
            change = math.inf if c.change > 0 else -math.inf
        shown = f"{100 * change:+.1f}%" if self.relative else f"{change:+.2f} ms"
        if _OPS[self.op](change * (100 if self.relative else 1), self.value) and c.beyond_noise:
            return (
                f"{self.text}: p{self.q} {c.base:.2f} -> {c.new:.2f} ms ({shown}), beyond the noise"
            )
        return None


def parse_rule(text: str) -> Rule:
    m = _RULE.match(text)
    if m is None:
        raise ValueError(
            f"--fail-if {text!r}: expected PHASE.pQ OP CHANGE, e.g. 'queued.p99 > +20%' "
            "or 'e2e.p50 > 5ms' (OP one of > >= < <=; CHANGE in % or ms)"
        )
    phase, q = m["phase"], int(m["q"])
    if q not in QUANTILES:
        raise ValueError(f"--fail-if {text!r}: quantile p{q}: use one of p50, p90, p99")
    known = {*CAUSES, E2E, TTFT, DECODE_PER_TOKEN}
    if phase not in known and not phase.startswith(WAIT):
        raise ValueError(
            f"--fail-if {text!r}: unknown phase {phase!r}; phases: {', '.join(sorted(known))}, "
            "wait:<reason>"
        )
    return Rule(text, phase, q, m["op"], float(m["value"]), m["unit"] == "%")
