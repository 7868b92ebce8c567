"""serve_short.py: each mode's figures against `off`, adjusted for the CPUs' speed.

On this shared virtual machine the same pure-Python work runs at 0.6 to 1.2
times its mean speed from one second to the next, and a round's requests/s
moves with it: that, not the server, is much of the spread between two rounds
of the same mode. ``cpu_gauge.py`` times a fixed piece of work on each CPU
twenty times a second (a round's gauge: its mean CPU time per CPU during the
load, ns; larger is slower). Over every round of every mode this fits, by
least squares,

    log(figure) = round + mode + sum over CPUs c of a_c * log(gauge of c)

(``round``: one level per round, so each mode is compared within its rounds;
``mode``: one level per mode, ``off`` the reference; ``a_c`` fitted, not
assumed; where each row names the state that ran just before it, as
``plugin_toggle.py``'s windows do, a carry-over level per previous state too:
what a state leaves to the next window, such as its exporters' backlog, and
a mode's steady effect is its own level plus its carry-over, the mode after
itself) and reports each mode's ``exp(mode)`` with a 90 % interval
(Student's t on the residuals), beside the same fit without the gauges: how
much of the spread the speed explained. A goal is resolved when the A/A
control's interval is narrower than its margin and the mode's interval is on
one side of the goal. Runs in the benchmark's process, after the rounds.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

FIGURES = {
    "requests_per_s": lambda row: row["requests_per_s"],
    "api_server_cpu_per_request": lambda row: row["cpu_us_per_request"]["api_server"],
}


def _t95(df: int) -> float:
    """Student's t at 0.95 (a two-sided 90 % interval)."""
    try:
        from scipy.stats import t  # vLLM depends on SciPy

        return float(t.ppf(0.95, df))
    except ImportError:  # the normal quantile, a little narrow for few rounds
        return 1.645


def _interval(b: float, var: float, t: float) -> dict[str, Any]:
    se = math.sqrt(max(var, 0.0))
    return {
        "ratio": round(math.exp(b), 3),
        "90ci": (round(math.exp(b - t * se), 3), round(math.exp(b + t * se), 3)),
    }


def fit(rows: list[dict[str, Any]], figure: str, with_gauges: bool) -> dict[str, Any] | None:
    """The model above over ``rows`` (each: mode, round, the figure, gauge_ns;
    where rows say which state ran ``after``, a carry-over level per previous
    state too, and each mode's steady effect: itself after itself)."""
    gauges = sorted({g for r in rows for g in r.get("gauge_ns", {})}) if with_gauges else []
    rows = [r for r in rows if all(g in r.get("gauge_ns", {}) for g in gauges)]
    modes = sorted({r["mode"] for r in rows} - {"off"})
    rounds = sorted({r["round"] for r in rows})
    carried = sorted({r["after"] for r in rows if "after" in r} - {"off"})
    width = len(rounds) + len(modes) + len(carried) + len(gauges)
    if not modes or len(rows) < width + 3:
        return None
    columns: list[list[float]] = []
    for row in rows:
        x = [float(row["round"] == k) for k in rounds]
        x += [float(row["mode"] == m) for m in modes]
        x += [float(row.get("after") == m) for m in carried]
        x += [math.log(row["gauge_ns"][g]) for g in gauges]
        columns.append(x)
    X = np.array(columns)
    y = np.array([math.log(FIGURES[figure](row)) for row in rows])
    beta, _, rank, _ = np.linalg.lstsq(X, y, rcond=None)
    df = len(y) - rank
    if df < 2:
        return None
    resid = y - X @ beta
    s2 = float(resid @ resid) / df
    cov = s2 * np.linalg.pinv(X.T @ X)
    t = _t95(df)
    out: dict[str, Any] = {"rows": len(rows), "residual_sd": round(math.sqrt(s2), 4)}
    first_carry = len(rounds) + len(modes)
    for i, mode in enumerate(modes, start=len(rounds)):
        if not carried:
            out[f"{mode}/off"] = _interval(float(beta[i]), float(cov[i, i]), t)
            continue
        out[f"{mode}/off"] = {"direct": _interval(float(beta[i]), float(cov[i, i]), t)}
        if mode in carried:
            j = first_carry + carried.index(mode)
            out[f"{mode}/off"]["on the next window"] = _interval(
                float(beta[j]), float(cov[j, j]), t
            )
            out[f"{mode}/off"]["steady (after itself)"] = _interval(
                float(beta[i] + beta[j]), float(cov[i, i] + cov[j, j] + 2 * cov[i, j]), t
            )
    if gauges:
        base = first_carry + len(carried)
        out["gauge_exponents"] = {g: round(float(beta[base + k]), 2) for k, g in enumerate(gauges)}
    return out


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: the fit with the gauges and without them."""
    return {
        figure: {
            "speed-adjusted": fit(rows, figure, with_gauges=True),
            "rounds only (no gauges)": fit(rows, figure, with_gauges=False),
        }
        for figure in FIGURES
    }
