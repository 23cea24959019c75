// fedmoe dashboard: polls /api/state and redraws. No libraries, nothing fetched from elsewhere.
"use strict";
const MiB = 1048576;
const fmt = (v, d = 3) => (v === null || v === undefined ? "-" : Number(v).toFixed(d));
function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function row(cells, attrs) {
  const tr = el("tr", attrs || {});
  for (const c of cells) tr.appendChild(typeof c === "object" && c !== null ? c : el("td", {}, String(c)));
  return tr;
}
// series: [[x, y]...] per line; log: a log10 y axis (values <= 0 are left out), with a line per decade;
// zero: the linear axis starts at 0 (else at the smallest value: a loss that moves by 1% stays visible)
function line(svg, series, colors, {log = false, zero = true} = {}) {
  svg.replaceChildren();
  const good = p => p[1] !== null && p[1] !== undefined && isFinite(p[1]) && (!log || p[1] > 0);
  const pts = series.flat().filter(good);
  svg.setAttribute("data-points", String(pts.length));
  if (!pts.length) return;
  const T = y => (log ? Math.log10(y) : y);
  const xs = pts.map(p => p[0]), ys = pts.map(p => T(p[1]));
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  const lo = Math.min(...ys), hi = Math.max(...ys), pad = zero ? 0 : Math.max((hi - lo) * 0.1, Math.abs(hi) * 1e-3, 1e-9);
  const y0 = log ? Math.floor(lo) : zero ? Math.min(0, lo) : lo - pad;
  const y1 = log ? Math.max(Math.ceil(hi), y0 + 1) : Math.max(hi + pad, y0 + 1e-9);
  const X = x => 46 + (x - x0) / (x1 - x0) * 364, Y = y => 165 - (y - y0) / (y1 - y0) * 150;
  const ns = "http://www.w3.org/2000/svg";
  const ticks = log ? Array.from({length: y1 - y0 + 1}, (_, i) => [y0 + i, String(+(10 ** (y0 + i)).toPrecision(3))])
                    : [y0, (y0 + y1) / 2, y1].map(y => [y, fmt(y, y1 - y0 < 0.1 ? 4 : 2)]);
  for (const [y, label] of ticks) {
    const g = document.createElementNS(ns, "line");
    g.setAttribute("x1", 44); g.setAttribute("x2", 410); g.setAttribute("y1", Y(y)); g.setAttribute("y2", Y(y));
    g.setAttribute("stroke", "#e4e4e4");
    svg.appendChild(g);
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", 2); t.setAttribute("y", Y(y) + 4); t.setAttribute("font-size", "10"); t.textContent = label;
    svg.appendChild(t);
  }
  for (const x of [x0, x1]) {
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", X(x) - 4); t.setAttribute("y", 178); t.setAttribute("font-size", "10"); t.textContent = x;
    svg.appendChild(t);
  }
  series.forEach((s, i) => {
    const ok = s.filter(good);
    const pl = document.createElementNS(ns, "polyline");
    pl.setAttribute("points", ok.map(p => `${X(p[0])},${Y(T(p[1]))}`).join(" "));
    pl.setAttribute("fill", "none"); pl.setAttribute("stroke", colors[i]); pl.setAttribute("stroke-width", "2");
    svg.appendChild(pl);
    for (const p of ok.length === 1 ? ok : []) {  // one point draws no line
      const c = document.createElementNS(ns, "circle");
      c.setAttribute("cx", X(p[0])); c.setAttribute("cy", Y(T(p[1]))); c.setAttribute("r", 3);
      c.setAttribute("fill", colors[i]);
      svg.appendChild(c);
    }
  });
}
// Unix seconds -> "YYYY-MM-DD HH:MM:SS" UTC; ago: seconds before now, as "12 s" / "3 min" / "2 h"
const when = t => (t === null || t === undefined ? "-" : new Date(t * 1000).toISOString().slice(0, 19).replace("T", " "));
function ago(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  const s = Math.max(0, seconds);
  return s < 120 ? `${Math.round(s)} s` : s < 7200 ? `${Math.round(s / 60)} min` : `${Math.round(s / 3600)} h`;
}
function renderOpenRound(o, now) {
  const box = document.getElementById("open-round");
  const title = document.getElementById("open-title");
  const tb = document.querySelector("#open-devices tbody");
  if (!o) {
    box.setAttribute("data-round", "");
    title.textContent = "Open round: none";
    document.getElementById("open-progress").replaceChildren();
    tb.replaceChildren();
    return;
  }
  box.setAttribute("data-round", String(o.round));
  const elapsed = Math.max(0, now - o.started), late = elapsed > o.timeout_s;
  title.textContent = `Open round ${o.round}: ${o.reported.length} of ${o.selected.length} reported`;
  const share = o.timeout_s > 0 ? Math.min(1, elapsed / o.timeout_s) : 1;
  const fill = el("div", {class: late ? "fill late" : "fill"});
  fill.style.width = `${(100 * share).toFixed(1)}%`;  // CSSOM: the page's CSP forbids style attributes
  const bar = el("div", {class: "bar", title: `deadline ${when(o.deadline)} UTC`});
  bar.appendChild(fill);
  document.getElementById("open-progress").replaceChildren(bar, el("span", {class: "bar-text"},
    `${Math.round(elapsed)} s of ${Math.round(o.timeout_s)} s (round_timeout_s)` +
    ` · started ${when(o.started)} UTC` + (late ? " · deadline passed" : "")));
  const rows = o.selected.map(d => {
    const st = o.reported.includes(d) ? ["reported", ""] : d in o.refused ? ["refused", o.refused[d]]
      : d in o.failed ? ["failed", o.failed[d]] : o.accepted.includes(d) ? ["training", ""] : ["waiting for ack", ""];
    return row([d, el("td", {class: `st-${st[0].split(" ")[0]}`}, st[0]), st[1]], {"data-device": d, "data-state": st[0]});
  });
  for (const [d, why] of Object.entries(o.excluded))
    rows.push(row([d, el("td", {class: "st-excluded"}, "excluded"), why], {"data-device": d, "data-state": "excluded"}));
  tb.replaceChildren(...rows);
}
function heat(v, max) {  // white -> dark blue
  const a = max > 0 ? v / max : v;
  return `rgb(${Math.round(255 - 225 * a)},${Math.round(255 - 160 * a)},${Math.round(255 - 60 * a)})`;
}
function render(s) {
  document.getElementById("federation").textContent = s.federation;
  const last = s.rounds[s.rounds.length - 1];
  const online = s.devices.filter(d => d.online).length;
  document.getElementById("summary").textContent =
    `${s.rounds.length} rounds closed` + (s.open_round ? `, round ${s.open_round.round} open` : "") +
    `; ${online} of ${s.devices.length} devices online` + (last ? `; last accuracy ${fmt(last.accuracy)}` : "");
  renderOpenRound(s.open_round, s.now);
  document.getElementById("strategy").textContent = JSON.stringify(s.strategy, null, 1);
  const alerts = document.getElementById("alerts");
  alerts.replaceChildren(...s.alerts.map(a => el("li", {}, a)));
  document.getElementById("alerts-box").className = s.alerts.length ? "" : "empty";

  // accuracy (or a causal LM's perplexity) and loss on charts of their own: their scales differ
  const lm = s.rounds.some(r => r.perplexity !== null && r.perplexity !== undefined);
  document.getElementById("quality-title").textContent = lm ? "Perplexity (global model)" : "Accuracy (global model)";
  // round 0: the global model before training (the aggregator's initial evaluation)
  const by_round = s.initial ? [{round: 0, ...s.initial}, ...s.rounds] : s.rounds;
  line(document.getElementById("chart-quality"), [by_round.map(r => [r.round, lm ? r.perplexity : r.accuracy])],
       ["#1f5fa8"]);
  line(document.getElementById("chart-loss"), [by_round.map(r => [r.round, r.loss])], ["#c0392b"], {zero: false});
  // log scale: round 1 carries the base model's shards (hundreds of MiB), later rounds adapters only
  line(document.getElementById("chart-bytes"),
       [s.rounds.map(r => [r.round, r.bytes_up / MiB]), s.rounds.map(r => [r.round, r.bytes_down / MiB])],
       ["#2e8b57", "#8e44ad"], {log: true});

  const dev = document.querySelector("#devices tbody");
  dev.replaceChildren(...s.devices.map(d => {
    const share = d.peak_bytes && d.budget_bytes ? d.peak_bytes / d.budget_bytes : null;
    const shareCell = el("td", share !== null && share > 1 ? {class: "over"} : {},
                         share === null ? "-" : `${Math.round(100 * share)}%`);
    const seen = el("td", {title: d.last_seen ? `${when(d.last_seen)} UTC` : ""},
                    d.last_seen ? `${ago(s.now - d.last_seen)} ago` : "-");
    return row([d.device_id, d.task || "-", d.online ? "yes" : "no", seen,
                d.budget_bytes ? fmt(d.budget_bytes / MiB, 0) : "-", d.baseline_bytes ? fmt(d.baseline_bytes / MiB, 0) : "-",
                d.experts_held === null ? "-" : d.experts_held, d.peak_bytes ? fmt(d.peak_bytes / MiB, 0) : "-",
                shareCell, d.last_round === null ? "-" : d.last_round, d.excluded || ""],
               {"data-device": d.device_id, class: d.online ? "" : "offline"});
  }));

  const ev = document.querySelector("#events tbody");
  ev.replaceChildren(...s.events.map(e => row([el("td", {title: `${ago(s.now - e.time)} ago`}, when(e.time)), e.kind,
    e.device || "-", e.round === null ? "-" : e.round, e.reason], {class: `ev-${e.kind}`})));
  document.getElementById("events-empty").hidden = s.events.length > 0;

  const hm = document.getElementById("heatmap");
  hm.replaceChildren(...Object.entries(s.heatmap).sort((a, b) => a[0] - b[0]).map(([layer, h]) => {
    const box = el("div", {class: "heat", "data-layer": layer});
    box.appendChild(el("div", {}, `MoE layer ${layer}`));
    const t = el("table");
    const max = Math.max(0, ...h.load.flat());
    const head = el("tr"); head.appendChild(el("th", {}, "round"));
    (h.load[0] || []).forEach((_, e) => head.appendChild(el("th", {}, e % 4 === 0 ? String(e) : "")));
    t.appendChild(head);
    h.rounds.forEach((r, i) => {
      const tr = el("tr"); tr.appendChild(el("th", {}, String(r)));
      h.load[i].forEach((v, e) => {
        const td = el("td", {"data-round": r, "data-expert": e, "data-load": v,
                             title: `layer ${layer}, round ${r}, expert ${e}: ${v} tokens`});
        td.style.background = heat(v, max);
        tr.appendChild(td);
      });
      t.appendChild(tr);
    });
    box.appendChild(t);
    // the colour scale: 0 -> white, the layer's largest count -> dark blue
    const scale = el("div", {class: "scale"});
    const ramp = el("span", {class: "ramp"});
    ramp.style.background = `linear-gradient(to right, ${heat(0, 1)}, ${heat(0.5, 1)}, ${heat(1, 1)})`;
    scale.append(el("span", {}, "0"), ramp, el("span", {class: "scale-max"}, `${Math.round(max)} tokens`));
    box.appendChild(scale);
    return box;
  }));

  const rt = document.querySelector("#rounds tbody");
  rt.replaceChildren(...s.rounds.slice().reverse().map(r => row(
    [r.round, when(r.started), r.status, `${r.reported}/${r.selected}`, fmt(r.accuracy), fmt(r.loss), fmt(r.perplexity, 1),
     fmt((r.bytes_up || 0) / MiB, 2), fmt((r.bytes_down || 0) / MiB, 2), fmt(r.seconds, 1),
     Object.keys(r.excluded).length, fmt(r.cv)], {"data-round": r.round})));
  document.body.setAttribute("data-rounds", String(s.rounds.length));
}
async function poll() {
  try {
    const r = await fetch("api/state", {cache: "no-store"});
    if (r.ok) render(await r.json());
    else document.getElementById("summary").textContent = `state unavailable (${r.status})`;
  } catch (e) {
    document.getElementById("summary").textContent = "aggregator not reachable";
  }
  setTimeout(poll, 2000);
}
poll();
