"""Durable state of the aggregator (SQLite by default).

Holds what the aggregator needs to resume after a crash and what reports read:
registered devices, round records, the global adapter state per round (safetensors),
and small JSON documents (strategy state, load window). Every write is its own
transaction, so a kill between writes leaves a consistent store.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blobs (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS devices (device_id TEXT PRIMARY KEY, info TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (round INTEGER PRIMARY KEY, record TEXT NOT NULL);
"""


class Store:
    """Key-value, blob, device and round-record storage.

    Args:
        url: ``sqlite:///path/to/file.db``, a plain file path, or ``sqlite://`` /
            ``:memory:`` for an in-memory store.

    Raises:
        ValueError: an unsupported URL scheme.
    """

    def __init__(self, url: str):
        self.url = url
        u = urlparse(url)
        if url in (":memory:", "sqlite://"):
            path = ":memory:"
        elif u.scheme == "sqlite":
            path = url[len("sqlite:///"):] if url.startswith("sqlite:///") else u.path
        elif u.scheme in ("", "file"):
            path = u.path or url
        else:
            raise ValueError(f"unsupported store URL {url!r} (use sqlite:///path.db)")
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL") if path != ":memory:" else None
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def _exec(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # kv
    def put_json(self, key: str, value: Any) -> None:
        self._exec("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, json.dumps(value)))

    def get_json(self, key: str, default: Any = None) -> Any:
        rows = self._exec("SELECT value FROM kv WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else default

    # blobs
    def put_blob(self, key: str, value: bytes) -> None:
        self._exec("INSERT OR REPLACE INTO blobs VALUES (?, ?)", (key, sqlite3.Binary(value)))

    def get_blob(self, key: str) -> bytes | None:
        rows = self._exec("SELECT value FROM blobs WHERE key = ?", (key,))
        return bytes(rows[0][0]) if rows else None

    # devices
    def save_device(self, device_id: str, info: dict[str, Any]) -> None:
        self._exec("INSERT OR REPLACE INTO devices VALUES (?, ?)", (device_id, json.dumps(info)))

    def devices(self) -> dict[str, dict[str, Any]]:
        return {d: json.loads(i) for d, i in self._exec("SELECT device_id, info FROM devices")}

    # rounds
    def save_round(self, record: dict[str, Any]) -> None:
        self._exec("INSERT OR REPLACE INTO rounds VALUES (?, ?)", (int(record["round"]), json.dumps(record)))

    def rounds(self) -> list[dict[str, Any]]:
        return [json.loads(r) for (r,) in self._exec("SELECT record FROM rounds ORDER BY round")]

    def close(self) -> None:
        with self._lock:
            self._db.close()
