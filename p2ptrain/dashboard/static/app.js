// The dashboard page: renders each state snapshot the node pushes over /events (SSE).
"use strict";
const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";

function fmt(x, d = 4) { return x === null || x === undefined ? "-" : Number(x).toFixed(d); }
function bytes(n) {
  const u = ["B", "kB", "MB", "GB", "TB"]; let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return (i ? n.toFixed(1) : n) + " " + u[i];
}
function el(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}

function lossChart(steps) {
  const svg = $("loss-chart");
  svg.replaceChildren();
  svg.dataset.steps = String(steps.length);
  const W = 720, H = 220, L = 50, R = 12, T = 10, B = 22;
  const pts = steps.flatMap((s) => [s.loss, s.val_loss]).filter((v) => v !== null);
  if (!steps.length || !pts.length) {
    svg.appendChild(el("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "waiting for the first committed step"));
    return;
  }
  let lo = Math.min(...pts), hi = Math.max(...pts);
  if (hi - lo < 1e-6) { lo -= 0.5; hi += 0.5; }
  const pad = (hi - lo) * 0.08; lo -= pad; hi += pad;
  const x0 = steps[0].step, x1 = steps[steps.length - 1].step;
  const X = (s) => L + (x1 === x0 ? (W - L - R) / 2 : (s - x0) / (x1 - x0) * (W - L - R));
  const Y = (v) => T + (hi - v) / (hi - lo) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const v = lo + (hi - lo) * i / 4;
    svg.appendChild(el("line", { x1: L, x2: W - R, y1: Y(v), y2: Y(v), class: "grid" }));
    svg.appendChild(el("text", { x: L - 6, y: Y(v) + 4, "text-anchor": "end" }, v.toFixed(2)));
  }
  const ticks = Math.min(steps.length, 10);
  for (let i = 0; i < ticks; i++) {
    const s = steps[Math.round(i * (steps.length - 1) / Math.max(1, ticks - 1))].step;
    svg.appendChild(el("text", { x: X(s), y: H - 8, "text-anchor": "middle" }, String(s)));
  }
  for (const key of ["loss", "val_loss"]) {
    const cls = key === "loss" ? "train" : "val";
    const s = steps.filter((p) => p[key] !== null);
    if (!s.length) continue;
    svg.appendChild(el("polyline", { class: cls, points: s.map((p) => X(p.step) + "," + Y(p[key])).join(" ") }));
    for (const p of s) svg.appendChild(el("circle", { class: cls, cx: X(p.step), cy: Y(p[key]), r: 3 }));
  }
}

function timeChart(steps) {
  const svg = $("time-chart");
  svg.replaceChildren();
  const W = 720, H = 120, L = 50, B = 18;
  const recent = steps.slice(-60);
  const hi = Math.max(1e-3, ...recent.map((s) => s.seconds_inner + s.seconds_comm));
  const bw = Math.min(40, (W - L) / Math.max(recent.length, 1));
  svg.appendChild(el("text", { x: L - 6, y: 12, "text-anchor": "end" }, hi.toFixed(1) + " s"));
  recent.forEach((s, i) => {
    const hInner = s.seconds_inner / hi * (H - B - 4), hComm = s.seconds_comm / hi * (H - B - 4);
    const x = L + i * bw + 1, w = Math.max(1, bw - 2);
    svg.appendChild(el("rect", { class: "inner", x, width: w, y: H - B - hInner, height: hInner }));
    svg.appendChild(el("rect", { class: "comm", x, width: w, y: H - B - hInner - hComm, height: hComm }));
    if (recent.length <= 20 || i % 5 === 0) svg.appendChild(el("text", { x: x + w / 2, y: H - 4, "text-anchor": "middle" }, String(s.step)));
  });
}

function peers(list) {
  const body = $("peers").tBodies[0];
  body.replaceChildren();
  for (const p of list) {
    const tr = document.createElement("tr");
    tr.dataset.peer = p.peer;
    if (p.self) tr.className = "self";
    cell(tr, p.peer, "peer");
    const k = cell(tr, "");
    const span = document.createElement("span");
    span.className = "kind " + p.kind; span.textContent = p.kind; k.appendChild(span);
    cell(tr, (p.role || "-") + (p.in_group ? " · in group" : ""));
    cell(tr, p.step === null ? "-" : String(p.step));
    cell(tr, fmt(p.loss)); cell(tr, fmt(p.val_loss));
    cell(tr, Object.entries(p.links).map(([k, n]) => n + " " + k).join(", ") || "-");
    body.appendChild(tr);
  }
  $("peer-count").textContent = "(" + list.length + ")";
}

function rejected(list) {
  const body = $("rejected").tBodies[0];
  body.replaceChildren();
  if (!list.length) { const tr = document.createElement("tr"); cell(tr, "none", "muted").colSpan = 3; body.appendChild(tr); }
  for (const r of list.slice().reverse()) {
    const tr = document.createElement("tr");
    cell(tr, String(r.step)); cell(tr, r.remote, "peer"); cell(tr, r.reason);
    body.appendChild(tr);
  }
}

function render(s) {
  $("me").textContent = s.me || "-";
  $("run").textContent = s.run ? s.run.slice(0, 16) + "…" : "-";
  $("step").textContent = s.step === null ? "-" : String(s.step);
  $("phase").textContent = s.phase + " · " + s.committed + " committed";
  $("group").textContent = String(s.group.length);
  const last = s.steps.length ? s.steps[s.steps.length - 1] : {};
  $("loss").textContent = fmt(last.loss);
  $("valloss").textContent = "val " + fmt(last.val_loss);
  $("bytes").textContent = bytes(s.totals.bytes_sent) + " / " + bytes(s.totals.bytes_recv);
  const u = s.utilization;
  $("util").textContent = u === null ? "-" : (100 * u).toFixed(0) + " %";
  $("util-inner").style.width = u === null ? "0" : (100 * u) + "%";
  $("util-comm").style.width = u === null ? "0" : (100 * (1 - u)) + "%";
  $("util-sub").textContent = s.totals.seconds_inner.toFixed(1) + " s inner · " + s.totals.seconds_comm.toFixed(1) + " s comm";
  $("rejected-total").textContent = String(s.rejected_total);
  $("skipped").textContent = s.skipped + " steps skipped";
  lossChart(s.steps);
  timeChart(s.steps);
  peers(s.peers);
  rejected(s.rejected);
}

function connect() {
  const es = new EventSource("/events");
  es.onopen = () => { $("live").textContent = "live"; $("live").className = "badge on"; };
  es.onmessage = (m) => render(JSON.parse(m.data));
  // EventSource reconnects by itself; the badge says when the node is gone.
  es.onerror = () => { $("live").textContent = "disconnected"; $("live").className = "badge off"; };
}
connect();
