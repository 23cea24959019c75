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
function line(svg, series, colors) {
  svg.replaceChildren();
  const pts = series.flat().filter(p => p[1] !== null && p[1] !== undefined && isFinite(p[1]));
  if (!pts.length) return;
  const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1), y0 = Math.min(0, ...ys), y1 = Math.max(...ys, y0 + 1e-9);
  const X = x => 40 + (x - x0) / (x1 - x0) * 370, Y = y => 165 - (y - y0) / (y1 - y0) * 150;
  const ns = "http://www.w3.org/2000/svg";
  for (const [y, label] of [[y0, fmt(y0, 2)], [y1, fmt(y1, 2)]]) {
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", 2); t.setAttribute("y", Y(y) + 4); t.setAttribute("font-size", "10"); t.textContent = label;
    svg.appendChild(t);
  }
  series.forEach((s, i) => {
    const ok = s.filter(p => p[1] !== null && p[1] !== undefined && isFinite(p[1]));
    const pl = document.createElementNS(ns, "polyline");
    pl.setAttribute("points", ok.map(p => `${X(p[0])},${Y(p[1])}`).join(" "));
    pl.setAttribute("fill", "none"); pl.setAttribute("stroke", colors[i]); pl.setAttribute("stroke-width", "2");
    svg.appendChild(pl);
  });
}
function heat(v, max) {  // white -> dark blue
  const a = max > 0 ? v / max : 0;
  return `rgb(${Math.round(255 - 225 * a)},${Math.round(255 - 160 * a)},${Math.round(255 - 60 * a)})`;
}
function render(s) {
  document.getElementById("federation").textContent = s.federation;
  const last = s.rounds[s.rounds.length - 1];
  const online = s.devices.filter(d => d.online).length;
  document.getElementById("summary").textContent =
    `${s.rounds.length} rounds closed` + (s.current_round ? `, round ${s.current_round} open` : "") +
    `; ${online} of ${s.devices.length} devices online` + (last ? `; last accuracy ${fmt(last.accuracy)}` : "");
  document.getElementById("strategy").textContent = JSON.stringify(s.strategy, null, 1);
  const alerts = document.getElementById("alerts");
  alerts.replaceChildren(...s.alerts.map(a => el("li", {}, a)));
  document.getElementById("alerts-box").className = s.alerts.length ? "" : "empty";

  const lm = s.rounds.some(r => r.perplexity !== null && r.perplexity !== undefined);
  document.getElementById("quality-title").textContent = lm ? "Perplexity" : "Accuracy and loss";
  const legend = document.getElementById("quality-legend");
  legend.replaceChildren(el("span", {class: "c-acc"}, lm ? "■ perplexity" : "■ accuracy"),
                         ...(lm ? [] : [document.createTextNode(" "), el("span", {class: "c-loss"}, "■ loss")]));
  line(document.getElementById("chart-quality"),
       lm ? [s.rounds.map(r => [r.round, r.perplexity])]
          : [s.rounds.map(r => [r.round, r.accuracy]), s.rounds.map(r => [r.round, r.loss])], ["#1f5fa8", "#c0392b"]);
  line(document.getElementById("chart-bytes"),
       [s.rounds.map(r => [r.round, r.bytes_up / MiB]), s.rounds.map(r => [r.round, r.bytes_down / MiB])],
       ["#2e8b57", "#8e44ad"]);

  const dev = document.querySelector("#devices tbody");
  dev.replaceChildren(...s.devices.map(d => {
    const share = d.peak_bytes && d.budget_bytes ? d.peak_bytes / d.budget_bytes : null;
    const shareCell = el("td", share !== null && share > 1 ? {class: "over"} : {},
                         share === null ? "-" : `${Math.round(100 * share)}%`);
    return row([d.device_id, d.task || "-", d.online ? "yes" : "no",
                d.budget_bytes ? fmt(d.budget_bytes / MiB, 0) : "-", d.baseline_bytes ? fmt(d.baseline_bytes / MiB, 0) : "-",
                d.experts_held === null ? "-" : d.experts_held, d.peak_bytes ? fmt(d.peak_bytes / MiB, 0) : "-",
                shareCell, d.last_round === null ? "-" : d.last_round, d.excluded || ""],
               {"data-device": d.device_id, class: d.online ? "" : "offline"});
  }));

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
    return box;
  }));

  const rt = document.querySelector("#rounds tbody");
  rt.replaceChildren(...s.rounds.slice().reverse().map(r => row(
    [r.round, r.status, `${r.reported}/${r.selected}`, fmt(r.accuracy), fmt(r.loss), fmt(r.perplexity, 1),
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
