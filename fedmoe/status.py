"""``fedmoe status --store URL``: the device and round tables from an aggregator's store.

Reads only what the aggregator persisted (``cloud.store.Store``: the registered devices and
the round records), so it works while the service runs (SQLite in WAL mode, PostgreSQL) and
after it stopped. Devices: online, budget, baseline, experts held and peak vs budget in the
last round they took part in, the last round whose update was accepted, and why the last
round left them out. Rounds: status, devices reported of selected, accuracy/loss (and
perplexity for a causal LM), MiB up and down, seconds, devices excluded, expert-load CV.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from .report import budget_peak

MiB = 2**20


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def device_rows(devices: dict[str, dict], records: list[dict]) -> list[list[str]]:
    """One row per registered device (see the module docstring)."""
    last_seen: dict[str, dict] = {}
    for r in records:
        for d, v in (r.get("devices") or {}).items():
            last_seen[d] = {**v, "round": r["round"]}
    excluded = (records[-1].get("excluded") or {}) if records else {}
    rows = []
    for d, info in sorted(devices.items()):
        seen = last_seen.get(d, {})
        peak = budget_peak(seen) if seen else None
        held = sum(len(e) for e in (seen.get("experts") or {}).values()) if seen else None
        budget = info.get("budget_bytes")
        rows.append([d, info.get("task", "-"), "yes" if info.get("online") else "no",
                     _fmt(budget / MiB if budget else None, ".0f"),
                     _fmt(info["runtime_bytes"] / MiB if info.get("runtime_bytes") else None, ".0f"),
                     "-" if held is None else str(held),
                     "-" if peak is None or not budget else f"{peak / MiB:.0f} ({100 * peak / budget:.0f}%)",
                     str(seen.get("round", "-")), str(excluded.get(d, ""))[:80]])
    return rows


def round_rows(records: list[dict]) -> list[list[str]]:
    """One row per round record (see the module docstring)."""
    rows = []
    for r in records:
        ppl = r.get("perplexity")
        rows.append([str(r["round"]), str(r.get("status", "ok")),
                     f"{len(r.get('devices') or {})}/{len(r.get('selected') or [])}", _fmt(r.get("accuracy")),
                     _fmt(r.get("loss")), _fmt(ppl, ".1f"),
                     _fmt((r.get("bytes_up") or 0) / MiB, ".2f"), _fmt((r.get("bytes_down") or 0) / MiB, ".2f"),
                     _fmt(r.get("seconds"), ".1f"), str(len(r.get("excluded") or {})), _fmt(r.get("cv"))])
    return rows


def status_text(store_url: str, last: int = 20) -> str:
    """The device table and the last ``last`` rounds of the store at ``store_url``.

    Raises:
        FileNotFoundError: a SQLite store file that does not exist (nothing is created).
        cloud.store.StoreError: the database cannot be opened or read.
    """
    from cloud.store import Store

    u = urlparse(store_url)
    if u.scheme in ("sqlite", "", "file") and store_url not in (":memory:", "sqlite://"):
        path = store_url[len("sqlite:///"):] if store_url.startswith("sqlite:///") else (u.path or store_url)
        if not Path(path).is_file():
            raise FileNotFoundError(f"no aggregator store at {path}")
    store = Store(store_url)
    try:
        devices, records = store.devices(), store.rounds()
        done = store.get_json("last_round", 0)
    finally:
        store.close()
    online = sum(1 for d in devices.values() if d.get("online"))
    head = f"{len(devices)} devices registered, {online} online; {done} rounds completed"
    dev = _table(["device", "task", "online", "budget MiB", "baseline MiB", "experts held", "last peak MiB",
                  "last round", "excluded in last round"], device_rows(devices, records))
    rnd = _table(["round", "status", "reported", "accuracy", "loss", "perplexity", "MiB up", "MiB down", "s",
                  "excluded", "load CV"], round_rows(records[-last:]))
    return f"{head}\n\nDevices\n{dev}\n\nRounds (last {min(last, len(records))})\n{rnd}\n"
