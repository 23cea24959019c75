"""``fedmoe status --store URL [--json]``: the open round, the device and round tables and
the recent rejects and exclusions from an aggregator's store.

Reads only what the aggregator persisted (``cloud.store.Store``: the registered devices,
the open round and its accepted messages, the round records, :mod:`cloud.activity`), so
it works while the service runs (SQLite in WAL mode, PostgreSQL) and after it stopped.
Open round: number, start time, elapsed against its deadline (``round_timeout_s``), the
devices selected, reported, refused (with why), failed (a message refused) and excluded.
Devices: online, last heard from, budget, baseline, experts held and peak vs budget in the
last round they took part in, the last round whose update was accepted, and why the last
round left them out. Rounds: start time, status, devices reported of selected,
accuracy/loss (and perplexity for a causal LM), MiB up and down, seconds, devices
excluded, expert-load CV. Events: the latest rejected messages and exclusions, with time
and reason. ``--json``: :func:`cloud.dashboard.state` as JSON (what the dashboard reads).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

MiB = 2**20


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _when(t: float | None, now: float | None = None) -> str:
    """Unix seconds -> ``YYYY-MM-DD HH:MM:SS`` UTC, with ``(N s ago)`` where ``now`` is given."""
    if t is None:
        return "-"
    text = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))
    return text if now is None else f"{text} ({max(0, now - t):.0f} s ago)"


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def device_rows(devices: list[dict], now: float | None = None) -> list[list[str]]:
    """One row per device of :func:`cloud.dashboard.state` (see the module docstring);
    ``now`` (Unix seconds) adds how long ago each was last seen."""
    rows = []
    for d in devices:
        budget, peak, base = d["budget_bytes"], d["peak_bytes"], d["baseline_bytes"]
        rows.append([d["device_id"], d["task"] or "-", "yes" if d["online"] else "no", _when(d["last_seen"], now),
                     _fmt(budget / MiB if budget else None, ".0f"), _fmt(base / MiB if base else None, ".0f"),
                     "-" if d["experts_held"] is None else str(d["experts_held"]),
                     "-" if peak is None or not budget else f"{peak / MiB:.0f} ({100 * peak / budget:.0f}%)",
                     str(d["last_round"] if d["last_round"] is not None else "-"), str(d["excluded"] or "")[:80]])
    return rows


def round_rows(rounds: list[dict]) -> list[list[str]]:
    """One row per round of :func:`cloud.dashboard.state` (see the module docstring)."""
    return [[str(r["round"]), _when(r.get("started")), str(r["status"]), f"{r['reported']}/{r['selected']}",
             _fmt(r["accuracy"]), _fmt(r["loss"]), _fmt(r["perplexity"], ".1f"),
             _fmt((r["bytes_up"] or 0) / MiB, ".2f"), _fmt((r["bytes_down"] or 0) / MiB, ".2f"),
             _fmt(r["seconds"], ".1f"), str(len(r["excluded"])), _fmt(r["cv"])] for r in rounds]


def open_round_text(o: dict | None) -> str:
    """The open round of :func:`cloud.dashboard.open_round` as a few lines."""
    if o is None:
        return "Open round: none"
    waiting = [d for d in o["selected"] if d not in o["reported"] and d not in o["refused"] and d not in o["failed"]]
    return "\n".join([
        f"Open round {o['round']}: started {_when(o['started'])} UTC, {o['elapsed_s']:.0f} s of {o['timeout_s']:.0f} s "
        f"(deadline {_when(o['deadline'])} UTC{', passed' if o['elapsed_s'] > o['timeout_s'] else ''})",
        f"  reported {len(o['reported'])}/{len(o['selected'])}: {', '.join(o['reported']) or '-'}",
        f"  waiting for: {', '.join(waiting) or '-'}",
        *(f"  {what}: {'; '.join(f'{d}: {r[:120]}' for d, r in sorted(o[what].items())) or '-'}"
          for what in ("refused", "failed", "excluded"))])


def event_rows(events: list[dict]) -> list[list[str]]:
    """One row per :mod:`cloud.activity` event (time, kind, device, round, reason)."""
    return [[_when(e.get("time")), str(e.get("kind")), str(e.get("device") or "-"),
             "-" if e.get("round") is None else str(e["round"]), str(e.get("reason") or "")[:120]] for e in events]


def status_state(store_url: str) -> dict:
    """:func:`cloud.dashboard.state` of the store at ``store_url``, plus ``"completed"``
    (the last closed round).

    Raises:
        FileNotFoundError: a SQLite store file that does not exist (nothing is created).
        cloud.store.StoreError: the database cannot be opened or read.
    """
    from cloud.dashboard import state
    from cloud.store import Store

    u = urlparse(store_url)
    if u.scheme in ("sqlite", "", "file") and store_url not in (":memory:", "sqlite://"):
        path = store_url[len("sqlite:///"):] if store_url.startswith("sqlite:///") else (u.path or store_url)
        if not Path(path).is_file():
            raise FileNotFoundError(f"no aggregator store at {path}")
    store = Store(store_url)
    try:
        return {**state(store), "completed": store.get_json("last_round", 0)}
    finally:
        store.close()


def status_text(store_url: str, last: int = 20, as_json: bool = False, events: int = 20) -> str:
    """The open round, the device table, the last ``last`` rounds and the last ``events``
    rejects/exclusions of the store at ``store_url`` (``as_json``: :func:`status_state` as
    JSON instead). Raises as :func:`status_state`."""
    view = status_state(store_url)
    if as_json:
        return json.dumps(view, indent=1, default=str) + "\n"
    devices, done, now = view["devices"], view["completed"], view["now"]
    online = sum(1 for d in devices if d["online"])
    first = view.get("initial") or {}
    before = "; before round 1: " + (f"perplexity {_fmt(first['perplexity'], '.1f')}" if first.get("perplexity")
                                     else f"accuracy {_fmt(first.get('accuracy'))}") if first else ""
    head = f"{len(devices)} devices registered, {online} online; {done} rounds completed{before}"
    dev = _table(["device", "task", "online", "last seen (UTC)", "budget MiB", "baseline MiB", "experts held",
                  "last peak MiB", "last round", "excluded in last round"], device_rows(devices, now))
    rnd = _table(["round", "started (UTC)", "status", "reported", "accuracy", "loss", "perplexity", "MiB up",
                  "MiB down", "s", "excluded", "load CV"], round_rows(view["rounds"][-last:]))
    ev = _table(["time (UTC)", "kind", "device", "round", "reason"], event_rows(view["events"][:events]))
    return (f"{head}\n\n{open_round_text(view['open_round'])}\n\nDevices\n{dev}\n\n"
            f"Rounds (last {min(last, len(view['rounds']))})\n{rnd}\n\n"
            f"Rejected messages and exclusions (last {min(events, len(view['events']))})\n{ev}\n")
