"""A self-contained HTML timeline of journeys: one row per request, its phases over time.

Rows show the whole journey where the file has the API server's spans (its
input and output sides, from receipt to the last byte), queued, each scheduled
cycle's prefill and decode, each preemption, and in-flight snapshots (a tick
where each was taken), on one shared time axis. Hover a segment for its attributes; click a request id
for its explanation (``tools/explain.py``: where its time went, each preemption's
cause); zoom with the slider or the mouse wheel; filter to preempted, aborted or
slow requests, or by request id; ``#request=ID`` in the address scrolls to a
row. Only the rows in view are in the page's DOM, so tens of thousands scroll
smoothly. No network fetches: data, CSS and JS are inline.

Runs in the CLI's process. Times: the spans' epoch ns, drawn as ms after the
earliest row's start. Pure: builds a string from
:class:`~vllm_journey_otel.tools.tracefile.FileSpan` records.
"""

from __future__ import annotations

import heapq
import html
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm_journey_otel import schema as S
from vllm_journey_otel.tools.explain import (
    EXPLAIN_ATTRIBUTES,
    ApiSides,
    Explanation,
    explain,
    label,
)
from vllm_journey_otel.tools.journey_files import JourneyIndex
from vllm_journey_otel.tools.tracefile import FileSpan

_PHASES = {
    S.SPAN_QUEUED: "queued",
    S.SPAN_PREFILL: "prefill",
    S.SPAN_DECODE: "decode",
    S.SPAN_PREEMPTED: "preempted",
    # Inside a queued or preempted span: drawn over it, thinner.
    S.SPAN_WAIT: "wait",
    # The API server's two sides, around the engine's part.
    S.SPAN_API_INPUT: "api_input",
    S.SPAN_API_OUTPUT: "api_output",
    # An in-flight snapshot: a tick where it was taken (its span's end).
    S.SPAN_IN_FLIGHT: "snapshot",
}
_API_SIDES = (S.SPAN_API_INPUT, S.SPAN_API_OUTPUT)
_PASS2 = EXPLAIN_ATTRIBUTES | {S.SPAN_IN_FLIGHT, *_API_SIDES}
_ROOT_KEYS = (
    S.REQUEST_ID,
    S.FINISH_STATUS,
    S.NUM_PREEMPTIONS,
    S.GEN_AI_INPUT_TOKENS,
    S.GEN_AI_OUTPUT_TOKENS,
    S.QUEUED_MS,
    S.TTFT_MS,
    S.PREFILL_MS,
    S.DECODE_MS,
)


# Rows drawn by default (the slowest kept): the page stays responsive with
# this many (docs/performance.md, the timeline in headless Chromium).
DEFAULT_LIMIT = 10_000


@dataclass
class _Row:
    trace_id: str
    start: int  # the outermost span's: vllm.api.request where the file has it
    end: int
    attrs: dict[str, Any]
    segments: list[tuple[str, int, int, dict[str, Any]]] = field(default_factory=list)
    root: FileSpan | None = None
    # Every span below the root, for its explanation.
    spans: list[FileSpan] = field(default_factory=list)
    # The API server's part, where the file has it.
    api: ApiSides | None = None

    def explanation(self) -> Explanation | None:
        if self.root is None and self.api is None:
            return None
        return explain(self.root, self.spans, self.api)


def collect(
    read: Callable[[frozenset[str] | None], Iterable[FileSpan]], limit: int = DEFAULT_LIMIT
) -> tuple[list[_Row], int]:
    """Journeys (slowest ``limit`` of them, by their outermost span) and how many
    there were in all.

    Two passes over the file(s), so memory stays bounded by a few numbers per
    journey plus the drawn rows: ``read(attributes_of)`` must return a fresh span
    iterator each time. Pass 1 (``journey_files.JourneyIndex``, as ``explain``
    reads journeys) ranks the journeys and maps cycles to roots; pass 2 keeps
    the spans of the drawn rows only.
    """
    index = JourneyIndex(read)
    chosen = heapq.nlargest(limit, index.journeys, key=lambda j: j.e2e_ms)
    rows: dict[str, _Row] = {}  # engine root span id -> row
    by_api: dict[str, _Row] = {}  # vllm.api.request span id -> row
    drawn = []
    for j in chosen:
        attrs = {S.REQUEST_ID: j.request_id}
        row = _Row(j.trace_id, j.start, j.end, attrs, api=j.api)
        drawn.append(row)
        if j.engine is not None:
            rows[j.engine.span_id] = row
        if j.api is not None:
            by_api[j.api.span_id] = row
    if drawn:
        for s in read(_PASS2):
            _place(s, rows, by_api, index.root_of)
    return sorted(drawn, key=lambda r: r.start), len(index.journeys)


def _place(
    s: FileSpan, rows: dict[str, _Row], by_api: dict[str, _Row], root_of: dict[str, tuple[str, str]]
) -> None:
    """Pass 2: one span onto its drawn row, if it has one."""
    if s.name == S.SPAN_REQUEST:
        row = rows.get(s.span_id)
        if row is not None:
            row.root, row.attrs = s, s.attributes
        return
    if s.name in _API_SIDES:
        row = by_api.get(s.parent_span_id)
    elif s.name in _PHASES or s.name == S.SPAN_SCHEDULED:
        row = rows.get(root_of.get(s.parent_span_id, (s.parent_span_id, ""))[0])
        if row is not None and s.name != S.SPAN_IN_FLIGHT:
            row.spans.append(s)
    else:
        return
    kind = _PHASES.get(s.name)
    if row is not None and kind is not None:
        start = s.end_unix_ns if s.name == S.SPAN_IN_FLIGHT else s.start_unix_ns
        row.segments.append((kind, start, s.end_unix_ns, s.attributes))


def _explained(row: _Row) -> dict[str, Any] | None:
    """The row's explanation, compact: the page words it when the row is clicked."""
    e = row.explanation()
    if e is None:
        return None

    def r3(v: float | None) -> float | None:
        return None if v is None else round(v, 3)

    return {
        "c": [[label(c), r3(ms)] for c, ms in e.by_cause().items()],
        "adm": list(e.admission) if e.admission is not None else None,
        "pre": [
            [
                r3(p.at_ms),
                p.by,
                p.kv_cache_usage,
                p.num_running,
                p.num_waiting,
                r3(p.preempted_ms),
                r3(p.recompute_ms),
            ]
            for p in e.preemptions
        ],
        "dec": [e.decode_tokens, r3(e.decode_ms_per_token)],
        "pf": [e.prefill_chunks, e.prefill_cached_tokens],
        "e2e": r3(e.e2e_ms),
        # Where it ran (host, data-parallel rank, disaggregated role), its KV hand-off.
        "w": e.where or None,
        "kv": [e.kv_from, r3(e.kv_held_ms), e.kv_role],
    }


def render(
    rows: list[_Row], total: int, title: str = "vLLM request journeys", source: str = ""
) -> str:
    """The HTML page (a string). ``source``: the trace file(s), for the page's
    ``vllm-journey explain`` command lines."""
    t0 = min((r.start for r in rows), default=0)
    data = []
    for r in rows:
        attrs = {k: r.attrs[k] for k in _ROOT_KEYS if k in r.attrs}
        data.append(
            {
                "id": str(r.attrs.get(S.REQUEST_ID, "")),
                "trace": r.trace_id,
                "s": (r.start - t0) / 1e6,
                "e": (r.end - t0) / 1e6,
                "a": attrs,
                "seg": [
                    [kind, (a - t0) / 1e6, (b - t0) / 1e6, {k: v for k, v in at.items()}]
                    for kind, a, b, at in sorted(r.segments, key=lambda x: x[1])
                ],
                "x": _explained(r),
            }
        )
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return (
        _TEMPLATE.replace("__TITLE__", html.escape(title))
        .replace("__SHOWN__", str(len(rows)))
        .replace("__TOTAL__", str(total))
        .replace("__SOURCE__", json.dumps(source).replace("</", "<\\/"))
        .replace("__DATA__", payload)
        .replace("__KEYS__", _KEYS)
    )


# What the page's script reads from a root's attributes, named by the schema.
_KEYS = json.dumps({"status": S.FINISH_STATUS, "aborted": S.FINISH_ABORTED})


_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:13px system-ui,sans-serif;margin:12px;color:#222}
#bar{display:flex;gap:14px;align-items:center;flex-wrap:wrap;margin-bottom:8px;
 position:sticky;top:0;background:#fff;z-index:5;padding:4px 0}
#legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 10px;vertical-align:middle}
#rows{position:relative;border-top:1px solid #ddd}
.row{display:flex;height:16px;border-bottom:1px solid #f1f1f1;position:absolute;left:0;right:0}
.row:hover{background:#fafafa}.row.picked{background:#fff6d5}
.lab{width:230px;flex:none;overflow:hidden;white-space:nowrap;text-overflow:ellipsis;
 font:11px monospace;line-height:16px;cursor:pointer;color:#1a55a8}
.track{position:relative;flex:1;overflow:hidden}
.seg{position:absolute;top:2px;height:12px;min-width:1px}
.queued{background:#c9c9c9}.prefill{background:#f0a030}.decode{background:#3a7bd5}
.preempted{background:#d63333}.wait{background:#8e44ad;top:5px;height:6px;z-index:1}
.api_input{background:#2f9e44}.api_output{background:#63c7b2}
.snapshot{background:#111;top:0;height:16px;min-width:2px;z-index:2}
.aborted .lab{color:#b00}
#tip{position:fixed;pointer-events:none;background:#fff;border:1px solid #888;padding:6px;
 font:11px monospace;white-space:pre;display:none;z-index:9;box-shadow:0 2px 6px #0003}
#explain{position:fixed;right:12px;bottom:12px;width:560px;max-height:45vh;overflow:auto;
 background:#fff;border:1px solid #888;padding:8px;font:12px monospace;white-space:pre-wrap;
 display:none;z-index:8;box-shadow:0 2px 8px #0004}
#axis{display:flex;justify-content:space-between;margin-left:230px;font-size:11px;color:#666}
</style></head><body>
<h3>__TITLE__</h3>
<div id="bar">
 <span>showing <b id="count">__SHOWN__</b> of __TOTAL__ journeys (slowest __SHOWN__ kept)</span>
 <label><input type="checkbox" id="fPre"> preempted only</label>
 <label><input type="checkbox" id="fAb"> aborted only</label>
 <label><input type="checkbox" id="fSlow"> slowest 10%</label>
 <label>request id <input id="fId" size="18"></label>
 <label>zoom <input type="range" id="zoom" min="1" max="50" value="1"></label>
 <label>offset <input type="range" id="pan" min="0" max="1000" value="0"></label>
 <span id="legend"><span class="api_input"></span>API server's input (read, render, hand-off)
 <span class="queued"></span>queued<span class="prefill"></span>prefill
 <span class="decode"></span>decode<span class="preempted"></span>preempted
 <span class="wait"></span>wait (grammar, LoRA slot, remote KV, next input)
 <span class="api_output"></span>API server's output (to the last byte)
 <span class="snapshot" style="width:2px"></span>in-flight snapshot taken</span>
 <span>click a request id: where its time went</span>
 <div id="axis" style="flex-basis:100%"><span id="a0"></span><span id="a1"></span></div>
</div>
<div id="rows"></div><div id="tip"></div><div id="explain"></div>
<script>
"use strict";
const DATA = __DATA__;
const K = __KEYS__;  // attribute keys and values, from vllm_journey_otel.schema
const SOURCE = __SOURCE__;
const ROW_H = 17, EXTRA = 30;
const rowsEl = document.getElementById("rows"), tip = document.getElementById("tip");
const panel = document.getElementById("explain");
let end = 1e-9;
for (const d of DATA){ if (d.e > end) end = d.e; d.pre = d.seg.some(s => s[0] === "preempted"); }
const durs = DATA.map(d => d.e - d.s).sort((a, b) => a - b);
const p90 = durs.length ? durs[Math.floor(0.9 * (durs.length - 1))] : 0;
let view = {a: 0, b: end}, shown = DATA, drawn = [-1, -1], picked = null;
function fmt(o){return Object.entries(o).map(([k,v]) => k + " = " + v).join("\\n");}
function rowEl(d, i){
  const row = document.createElement("div");
  row.className = "row" + (d.a[K.status] === K.aborted ? " aborted" : "") + (d === picked ? " picked" : "");
  row.dataset.requestId = d.id; row.dataset.preempted = d.pre ? "1" : "0";
  row.style.top = (i * ROW_H) + "px";
  const lab = document.createElement("div"); lab.className = "lab"; lab.textContent = d.id;
  lab.title = "trace " + d.trace + "\\n" + fmt(d.a); lab.dataset.i = i;
  const track = document.createElement("div"); track.className = "track";
  const span = Math.max(1e-9, view.b - view.a);
  for (const s of d.seg){
    if (s[2] < view.a || s[1] > view.b) continue;
    const el = document.createElement("div");
    el.className = "seg " + s[0];
    el.style.left = ((s[1] - view.a) / span * 100) + "%";
    el.style.width = Math.max(0, (s[2] - s[1]) / span * 100) + "%";
    el.dataset.info = s[0] + "  " + (s[2] - s[1]).toFixed(3) + " ms\\n" + fmt(s[3]);
    track.appendChild(el);
  }
  row.append(lab, track);
  return row;
}
function draw(force){
  const top = window.scrollY - rowsEl.offsetTop;
  const first = Math.max(0, Math.floor(top / ROW_H) - EXTRA);
  const last = Math.min(shown.length, first + Math.ceil(window.innerHeight / ROW_H) + 2 * EXTRA);
  if (!force && first === drawn[0] && last === drawn[1]) return;
  drawn = [first, last];
  const frag = document.createDocumentFragment();
  for (let i = first; i < last; i++) frag.appendChild(rowEl(shown[i], i));
  rowsEl.replaceChildren(frag);
}
function relayout(){
  rowsEl.style.height = (shown.length * ROW_H) + "px";
  document.getElementById("a0").textContent = view.a.toFixed(1) + " ms";
  document.getElementById("a1").textContent = view.b.toFixed(1) + " ms";
  draw(true);
}
function filter(){
  const pre = document.getElementById("fPre").checked, ab = document.getElementById("fAb").checked;
  const slow = document.getElementById("fSlow").checked, id = document.getElementById("fId").value;
  shown = DATA.filter(d => (!pre || d.pre) && (!ab || d.a[K.status] === K.aborted)
    && (!slow || d.e - d.s >= p90) && (!id || d.id.includes(id)));
  document.getElementById("count").textContent = shown.length;
  relayout();
}
function zoom(){
  const z = +document.getElementById("zoom").value, p = +document.getElementById("pan").value / 1000;
  const w = end / z; view = {a: p * (end - w), b: p * (end - w) + w}; relayout();
}
function n(v){ return v === null || v === undefined ? "not observed" : v; }
function pct(v){ return v === null || v === undefined ? "not observed" : Math.round(100 * v) + "%"; }
function engine(kv, run, wait){
  if (kv == null && run == null && wait == null) return "what the engine looked like then: not observed";
  return n(run) + " running, " + n(wait) + " waiting, KV cache " + pct(kv) + " used";
}
function explainText(d){
  const x = d.x; if (!x) return d.id + ": no explanation";
  const L = [d.id + "  " + (d.a[K.status] || "") + ", " + x.e2e.toFixed(1) + " ms end to end"
    + (x.w ? "; ran on " + x.w : "")];
  let big = null;
  for (const [c, ms] of x.c){ if (!big || ms > big[1]) big = [c, ms]; }
  if (big) L.push("Most of its time: " + big[0] + ", " + big[1].toFixed(1) + " ms ("
    + Math.round(100 * big[1] / Math.max(1e-9, x.e2e)) + "%)");
  for (const [c, ms] of x.c) L.push("  " + c.padEnd(28) + ms.toFixed(1).padStart(10) + " ms");
  if (x.adm) L.push("at admission: " + engine(x.adm[0], x.adm[1], x.adm[2]));
  x.pre.forEach((p, i) => L.push("preemption " + (i + 1) + " at +" + p[0].toFixed(1) + " ms by "
    + n(p[1]) + "; " + engine(p[2], p[3], p[4]) + "; preempted " + p[5].toFixed(1)
    + " ms; recompute prefill " + (p[6] === null ? "never resumed" : p[6].toFixed(1) + " ms")));
  if (x.pf[0] !== null) L.push("prefill: " + n(x.pf[0]) + " chunk(s), " + n(x.pf[1]) + " cached tokens");
  if (x.dec[0] !== null) L.push("decode: " + x.dec[0] + " tokens, "
    + (x.dec[1] === null ? "not observed" : x.dec[1].toFixed(2) + " ms/token"));
  if (x.kv[0] !== null) L.push("its kv_transfer_params name the source of its prompt's KV: " + x.kv[0]);
  if (x.kv[1] !== null) L.push("after its end its KV blocks stayed held for "
    + (x.kv[2] === "prefill" ? "the decode instance " : "its KV connector ") + x.kv[1].toFixed(1) + " ms");
  L.push("", "vllm-journey explain " + (SOURCE || "FILE") + " --request " + d.id);
  return L.join("\\n");
}
function pick(d){
  picked = d; panel.textContent = explainText(d); panel.style.display = "block"; draw(true);
}
function fromHash(){
  let hash = location.hash;
  try { hash = decodeURIComponent(hash); } catch (e) { /* malformed: use it as it is */ }
  const m = /request=([^&]+)/.exec(hash);
  if (!m) return;
  const i = shown.findIndex(d => d.id === m[1]);
  if (i < 0) return;
  window.scrollTo(0, rowsEl.offsetTop + i * ROW_H - 120); pick(shown[i]);
}
window.addEventListener("scroll", () => requestAnimationFrame(() => draw(false)));
window.addEventListener("resize", () => draw(true));
window.addEventListener("hashchange", fromHash);
relayout(); fromHash();
for (const id of ["fPre", "fAb", "fSlow", "fId"]) document.getElementById(id).addEventListener("input", filter);
for (const id of ["zoom", "pan"]) document.getElementById(id).addEventListener("input", zoom);
rowsEl.addEventListener("wheel", ev => {
  if (!ev.ctrlKey && !ev.altKey) return; ev.preventDefault();
  const z = document.getElementById("zoom"); z.value = Math.min(50, Math.max(1, +z.value - Math.sign(ev.deltaY)));
  zoom();
}, {passive: false});
rowsEl.addEventListener("click", ev => {
  const t = ev.target;
  if (t.classList && t.classList.contains("lab")) pick(shown[+t.dataset.i]);
});
rowsEl.addEventListener("mousemove", ev => {
  const t = ev.target;
  if (t.classList && t.classList.contains("seg")){
    tip.textContent = t.dataset.info; tip.style.display = "block";
    tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 12) + "px";
  } else tip.style.display = "none";
});
rowsEl.addEventListener("mouseleave", () => { tip.style.display = "none"; });
// #bench: scroll through every row once, drawing each window, and note the
// times (benchmarks/timeline_bench.py reads them from the DOM).
if (location.hash.includes("bench")){
  const times = [], step = Math.max(1, Math.floor(window.innerHeight / ROW_H));
  for (let i = 0; i < shown.length; i += step){
    const t = performance.now(); window.scrollTo(0, rowsEl.offsetTop + i * ROW_H); draw(false);
    times.push(performance.now() - t);
  }
  times.sort((a, b) => a - b);
  document.body.dataset.scrollFrames = times.length;
  document.body.dataset.scrollMaxMs = (times[times.length - 1] || 0).toFixed(2);
  document.body.dataset.scrollP50Ms = (times[Math.floor(times.length / 2)] || 0).toFixed(2);
}
document.body.dataset.readyMs = performance.now().toFixed(0);
document.body.dataset.rowsInDom = rowsEl.children.length;
document.body.dataset.ready = "1";
</script></body></html>
"""
