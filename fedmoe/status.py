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

MiB = 2**20


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def device_rows(devices: list[dict]) -> list[list[str]]:
    """One row per device of :func:`cloud.dashboard.state` (see the module docstring)."""
    rows = []
    for d in devices:
        budget, peak, base = d["budget_bytes"], d["peak_bytes"], d["baseline_bytes"]
        rows.append([d["device_id"], d["task"] or "-", "yes" if d["online"] else "no",
                     _fmt(budget / MiB if budget else None, ".0f"), _fmt(base / MiB if base else None, ".0f"),
                     "-" if d["experts_held"] is None else str(d["experts_held"]),
                     "-" if peak is None or not budget else f"{peak / MiB:.0f} ({100 * peak / budget:.0f}%)",
                     str(d["last_round"] if d["last_round"] is not None else "-"), str(d["excluded"] or "")[:80]])
    return rows


def round_rows(rounds: list[dict]) -> list[list[str]]:
    """One row per round of :func:`cloud.dashboard.state` (see the module docstring)."""
    return [[str(r["round"]), str(r["status"]), f"{r['reported']}/{r['selected']}", _fmt(r["accuracy"]),
             _fmt(r["loss"]), _fmt(r["perplexity"], ".1f"), _fmt((r["bytes_up"] or 0) / MiB, ".2f"),
             _fmt((r["bytes_down"] or 0) / MiB, ".2f"), _fmt(r["seconds"], ".1f"), str(len(r["excluded"])),
             _fmt(r["cv"])] for r in rounds]


def status_text(store_url: str, last: int = 20) -> str:
    """The device table and the last ``last`` rounds of the store at ``store_url``.

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
        view = state(store)
        done = store.get_json("last_round", 0)
    finally:
        store.close()
    devices = view["devices"]
    online = sum(1 for d in devices if d["online"])
    head = f"{len(devices)} devices registered, {online} online; {done} rounds completed"
    dev = _table(["device", "task", "online", "budget MiB", "baseline MiB", "experts held", "last peak MiB",
                  "last round", "excluded in last round"], device_rows(devices))
    rnd = _table(["round", "status", "reported", "accuracy", "loss", "perplexity", "MiB up", "MiB down", "s",
                  "excluded", "load CV"], round_rows(view["rounds"][-last:]))
    return f"{head}\n\nDevices\n{dev}\n\nRounds (last {min(last, len(view['rounds']))})\n{rnd}\n"
