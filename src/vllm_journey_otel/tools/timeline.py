"""A self-contained HTML timeline of journeys: one row per request, its phases over time.

Rows show queued, each scheduled cycle's prefill and decode, and each preemption,
on one shared time axis. Hover a segment for its attributes; zoom with the
slider or the mouse wheel; filter to preempted, aborted or slow requests, or by
request id. No network fetches: data, CSS and JS are inline.

Pure: builds a string from :class:`~vllm_journey_otel.tools.tracefile.FileSpan` records.
"""

from __future__ import annotations

import heapq
import html
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm_journey_otel import schema as S
from vllm_journey_otel.tools.tracefile import FileSpan

_PHASES = {
    S.SPAN_QUEUED: "queued",
    S.SPAN_PREFILL: "prefill",
    S.SPAN_DECODE: "decode",
    S.SPAN_PREEMPTED: "preempted",
    # Inside a queued or preempted span: drawn over it, thinner.
    S.SPAN_WAIT: "wait",
}
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


@dataclass
class _Row:
    trace_id: str
    start: int
    end: int
    attrs: dict[str, Any]
    segments: list[tuple[str, int, int, dict[str, Any]]] = field(default_factory=list)


def collect(
    read: Callable[[frozenset[str] | None], Iterable[FileSpan]], limit: int = 2000
) -> tuple[list[_Row], int]:
    """Journeys (slowest ``limit`` of them) and how many there were in all.

    Two passes over the file(s), so memory stays bounded by a few numbers per
    journey plus the drawn rows: ``read(attributes_of)`` must return a fresh span
    iterator each time. Pass 1 ranks the roots and maps cycles to roots; pass 2
    keeps the phases of the drawn rows only.
    """
    heap: list[tuple[int, str, _Row]] = []  # (duration, root span id, row), min-heap
    # vllm.scheduled / vllm.queued / vllm.preempted span id -> root span id (their
    # children, phases and waits, are drawn on the root's row)
    cycle_root: dict[str, str] = {}
    total = 0
    for s in read(frozenset({S.SPAN_REQUEST})):
        if s.name == S.SPAN_REQUEST:
            total += 1
            item = (
                s.end_unix_ns - s.start_unix_ns,
                s.span_id,
                _Row(s.trace_id, s.start_unix_ns, s.end_unix_ns, s.attributes),
            )
            if len(heap) < limit:
                heapq.heappush(heap, item)
            elif item[0] > heap[0][0]:
                heapq.heapreplace(heap, item)
        elif s.name in (S.SPAN_SCHEDULED, S.SPAN_QUEUED, S.SPAN_PREEMPTED):
            cycle_root[s.span_id] = s.parent_span_id
    rows = {span_id: row for _, span_id, row in heap}
    if rows:
        for s in read(frozenset(_PHASES)):
            kind = _PHASES.get(s.name)
            if kind is None:
                continue
            row = rows.get(cycle_root.get(s.parent_span_id, s.parent_span_id))
            if row is not None:
                row.segments.append((kind, s.start_unix_ns, s.end_unix_ns, s.attributes))
    ordered = sorted(rows.values(), key=lambda r: r.start)
    return ordered, total


def render(rows: list[_Row], total: int, title: str = "vLLM request journeys") -> str:
    """The HTML page (a string)."""
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
            }
        )
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return (
        _TEMPLATE.replace("__TITLE__", html.escape(title))
        .replace("__SHOWN__", str(len(rows)))
        .replace("__TOTAL__", str(total))
        .replace("__DATA__", payload)
        .replace("__KEYS__", _KEYS)
    )


# What the page's script reads from a root's attributes, named by the schema.
_KEYS = json.dumps({"status": S.FINISH_STATUS, "aborted": S.FINISH_ABORTED})


_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:13px system-ui,sans-serif;margin:12px;color:#222}
#bar{display:flex;gap:14px;align-items:center;flex-wrap:wrap;margin-bottom:8px}
#legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 10px;vertical-align:middle}
#rows{position:relative;border-top:1px solid #ddd}
.row{display:flex;height:16px;border-bottom:1px solid #f1f1f1}
.row:hover{background:#fafafa}
.lab{width:230px;flex:none;overflow:hidden;white-space:nowrap;text-overflow:ellipsis;
 font:11px monospace;line-height:16px}
.track{position:relative;flex:1;overflow:hidden}
.seg{position:absolute;top:2px;height:12px;min-width:1px}
.queued{background:#c9c9c9}.prefill{background:#f0a030}.decode{background:#3a7bd5}
.preempted{background:#d63333}.wait{background:#8e44ad;top:5px;height:6px;z-index:1}
.aborted .lab{color:#b00}.hidden{display:none}
#tip{position:fixed;pointer-events:none;background:#fff;border:1px solid #888;padding:6px;
 font:11px monospace;white-space:pre;display:none;z-index:9;box-shadow:0 2px 6px #0003}
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
 <span id="legend"><span class="queued"></span>queued<span class="prefill"></span>prefill
 <span class="decode"></span>decode<span class="preempted"></span>preempted
 <span class="wait"></span>wait (grammar, LoRA slot, remote KV, next input)</span>
</div>
<div id="axis"><span id="a0"></span><span id="a1"></span></div>
<div id="rows"></div><div id="tip"></div>
<script>
"use strict";
const DATA = __DATA__;
const K = __KEYS__;  // attribute keys and values, from vllm_journey_otel.schema
const rowsEl = document.getElementById("rows"), tip = document.getElementById("tip");
const end = Math.max(1e-9, ...DATA.map(d => d.e));
const durs = DATA.map(d => d.e - d.s).sort((a, b) => a - b);
const p90 = durs.length ? durs[Math.floor(0.9 * (durs.length - 1))] : 0;
let view = {a: 0, b: end};
function fmt(o){return Object.entries(o).map(([k,v]) => k + " = " + v).join("\\n");}
function build(){
  const frag = document.createDocumentFragment();
  for (const d of DATA){
    const row = document.createElement("div");
    row.className = "row" + (d.a[K.status] === K.aborted ? " aborted" : "");
    row.dataset.requestId = d.id;
    row.dataset.preempted = d.seg.some(s => s[0] === "preempted") ? "1" : "0";
    const lab = document.createElement("div"); lab.className = "lab"; lab.textContent = d.id;
    lab.title = "trace " + d.trace + "\\n" + fmt(d.a);
    const track = document.createElement("div"); track.className = "track";
    for (const s of d.seg){
      const el = document.createElement("div");
      el.className = "seg " + s[0]; el.dataset.s = s[1]; el.dataset.e = s[2];
      el.dataset.info = s[0] + "  " + (s[2] - s[1]).toFixed(3) + " ms\\n" + fmt(s[3]);
      track.appendChild(el);
    }
    row.append(lab, track); frag.appendChild(row); d.el = row;
  }
  rowsEl.appendChild(frag);
}
function layout(){
  const span = Math.max(1e-9, view.b - view.a);
  for (const el of rowsEl.querySelectorAll(".seg")){
    const s = +el.dataset.s, e = +el.dataset.e;
    el.style.left = ((s - view.a) / span * 100) + "%";
    el.style.width = Math.max(0, (e - s) / span * 100) + "%";
  }
  document.getElementById("a0").textContent = view.a.toFixed(1) + " ms";
  document.getElementById("a1").textContent = view.b.toFixed(1) + " ms";
}
function filter(){
  const pre = document.getElementById("fPre").checked, ab = document.getElementById("fAb").checked;
  const slow = document.getElementById("fSlow").checked, id = document.getElementById("fId").value;
  let n = 0;
  for (const d of DATA){
    const show = (!pre || d.el.dataset.preempted === "1")
      && (!ab || d.a[K.status] === K.aborted)
      && (!slow || d.e - d.s >= p90) && (!id || d.id.includes(id));
    d.el.classList.toggle("hidden", !show); n += show ? 1 : 0;
  }
  document.getElementById("count").textContent = n;
}
function zoom(){
  const z = +document.getElementById("zoom").value, p = +document.getElementById("pan").value / 1000;
  const w = end / z; view = {a: p * (end - w), b: p * (end - w) + w}; layout();
}
build(); layout();
for (const id of ["fPre", "fAb", "fSlow", "fId"]) document.getElementById(id).addEventListener("input", filter);
for (const id of ["zoom", "pan"]) document.getElementById(id).addEventListener("input", zoom);
rowsEl.addEventListener("wheel", ev => {
  if (!ev.ctrlKey && !ev.altKey) return; ev.preventDefault();
  const z = document.getElementById("zoom"); z.value = Math.min(50, Math.max(1, +z.value - Math.sign(ev.deltaY)));
  zoom();
}, {passive: false});
rowsEl.addEventListener("mousemove", ev => {
  const t = ev.target;
  if (t.classList && t.classList.contains("seg")){
    tip.textContent = t.dataset.info; tip.style.display = "block";
    tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 12) + "px";
  } else tip.style.display = "none";
});
rowsEl.addEventListener("mouseleave", () => { tip.style.display = "none"; });
</script></body></html>
"""
