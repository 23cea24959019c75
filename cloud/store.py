"""Durable state of the aggregator: SQLite by default, PostgreSQL by URL.

Holds what the aggregator needs to resume after a crash and what reports read:
registered devices, round records, the global adapter state (safetensors), the round
in flight with the updates already accepted in it, and small JSON documents (strategy
state, load window). Every write is its own transaction, and :meth:`Store.transaction`
groups writes that must land together (closing a round: new global state, round
record, ``last_round``), so a kill at any instant leaves a consistent store and a
round is never applied twice.

URLs: ``sqlite:///path/to/file.db`` (or a plain path; ``sqlite://`` / ``:memory:``
for an in-memory store) and ``postgresql://user@host:port/db`` (needs ``psycopg``
3, the ``postgres`` extra).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

log = logging.getLogger(__name__)

_TABLES = (
    ("kv", "key TEXT PRIMARY KEY, value TEXT NOT NULL"),
    ("blobs", "key TEXT PRIMARY KEY, value {blob} NOT NULL"),
    ("devices", "device_id TEXT PRIMARY KEY, info TEXT NOT NULL"),
    ("rounds", "round INTEGER PRIMARY KEY, record TEXT NOT NULL"),
)
_KEYS = {"kv": "key", "blobs": "key", "devices": "device_id", "rounds": "round"}


class StoreError(RuntimeError):
    """The store cannot be opened or a read/write failed (message says which URL)."""


def url_problem(url: str) -> str | None:
    """Why ``url`` names no store kind :class:`Store` opens (checked before anything is
    built), or None: ``sqlite:///path``, a plain path, ``:memory:`` or ``postgresql://``."""
    if url in (":memory:", "sqlite://") or urlparse(url).scheme in ("sqlite", "", "file", "postgresql", "postgres"):
        return None
    return f"unsupported store URL {url!r} (use sqlite:///path.db or postgresql://...)"


class Store:
    """Key-value, blob, device and round-record storage.

    Args:
        url: see the module docstring.

    Raises:
        ValueError: an unsupported URL scheme.
        StoreError: the database cannot be opened (missing driver, server down).
    """

    def __init__(self, url: str):
        problem = url_problem(url)
        if problem:
            raise ValueError(problem)
        self.url = url
        u = urlparse(url)
        self._lock = threading.RLock()
        self._depth = 0
        if u.scheme in ("postgresql", "postgres"):
            self.kind = "postgresql"
            try:
                import psycopg
            except ImportError:
                raise StoreError("a postgresql:// store needs psycopg 3: pip install 'fedmoe[postgres]'") from None
            try:
                self._db = psycopg.connect(url, autocommit=True, connect_timeout=10)
            except psycopg.Error as e:
                raise StoreError(f"cannot open store {_redact(url)}: {e}") from None
            self._ph = "%s"
            self._errors: tuple[type[BaseException], ...] = (psycopg.Error,)
            blob = "BYTEA"
        else:
            self.kind = "sqlite"
            if url in (":memory:", "sqlite://"):
                path = ":memory:"
            elif u.scheme == "sqlite":
                path = url[len("sqlite:///"):] if url.startswith("sqlite:///") else u.path
            else:  # "" or file: (url_problem admitted nothing else)
                path = u.path or url
            try:
                if path != ":memory:":
                    Path(path).parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
                if path != ":memory:":
                    self._db.execute("PRAGMA journal_mode=WAL")
            except (sqlite3.Error, OSError) as e:
                raise StoreError(f"cannot open store {url}: {e}") from None
            self._ph = "?"
            self._errors = (sqlite3.Error,)
            blob = "BLOB"
        for name, cols in _TABLES:
            self._exec(f"CREATE TABLE IF NOT EXISTS {name} ({cols.format(blob=blob)})")

    def _exec(self, sql: str, args: tuple = ()) -> list[tuple]:
        sql = sql.replace("?", self._ph)
        with self._lock:
            try:
                cur = self._db.execute(sql, args)
                return cur.fetchall() if cur.description is not None else []
            except self._errors as e:
                raise StoreError(f"store {_redact(self.url)}: {e}") from None

    def _upsert(self, table: str, key: Any, value: Any) -> None:
        k = _KEYS[table]
        col = {"kv": "value", "blobs": "value", "devices": "info", "rounds": "record"}[table]
        self._exec(f"INSERT INTO {table} VALUES (?, ?) ON CONFLICT ({k}) DO UPDATE SET {col} = excluded.{col}",
                   (key, value))

    @contextmanager
    def transaction(self) -> Iterator["Store"]:
        """Group writes atomically (nestable; the outermost block commits, an exception
        rolls everything back)."""
        with self._lock:
            if self._depth == 0:
                self._exec("BEGIN")
            self._depth += 1
            try:
                yield self
            except BaseException:
                self._depth -= 1
                if self._depth == 0:
                    self._exec("ROLLBACK")
                raise
            self._depth -= 1
            if self._depth == 0:
                self._exec("COMMIT")

    # kv
    def put_json(self, key: str, value: Any) -> None:
        """Insert or replace JSON document ``key``. Raises TypeError (not JSON-serialisable) or StoreError."""
        self._upsert("kv", key, json.dumps(value))

    def get_json(self, key: str, default: Any = None) -> Any:
        """The decoded JSON document ``key``, or ``default`` when absent. Raises StoreError."""
        rows = self._exec("SELECT value FROM kv WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else default

    def delete(self, key: str) -> None:
        """Remove a JSON document or blob ``key`` (missing keys are fine)."""
        self._exec("DELETE FROM kv WHERE key = ?", (key,))
        self._exec("DELETE FROM blobs WHERE key = ?", (key,))

    def delete_prefix(self, prefix: str) -> None:
        """Remove every JSON document and blob whose key starts with ``prefix``."""
        pattern = _like(prefix)
        self._exec("DELETE FROM kv WHERE key LIKE ? ESCAPE '\\'", (pattern,))
        self._exec("DELETE FROM blobs WHERE key LIKE ? ESCAPE '\\'", (pattern,))

    def move_prefix(self, prefix: str, to: str) -> None:
        """Rename every JSON document and blob key starting with ``prefix`` to start with
        ``to`` instead (e.g. quarantine a failed round's in-flight messages)."""
        pattern = _like(prefix)
        with self.transaction():
            for table in ("kv", "blobs"):
                self._exec(f"DELETE FROM {table} WHERE key LIKE ? ESCAPE '\\'", (_like(to),))
                self._exec(f"UPDATE {table} SET key = ? || substr(key, ?) WHERE key LIKE ? ESCAPE '\\'",
                           (to, len(prefix) + 1, pattern))

    # blobs
    def put_blob(self, key: str, value: bytes) -> None:
        """Insert or replace blob ``key`` (bytes). Raises StoreError."""
        self._upsert("blobs", key, bytes(value))

    def get_blob(self, key: str) -> bytes | None:
        """The bytes of blob ``key``, or None when absent. Raises StoreError."""
        rows = self._exec("SELECT value FROM blobs WHERE key = ?", (key,))
        return bytes(rows[0][0]) if rows else None

    def blob_keys(self, prefix: str) -> list[str]:
        """Keys of the blobs starting with ``prefix`` (literally; ``%``/``_`` escaped), sorted."""
        pattern = _like(prefix)
        return [k for (k,) in self._exec("SELECT key FROM blobs WHERE key LIKE ? ESCAPE '\\' ORDER BY key",
                                          (pattern,))]

    # devices
    def save_device(self, device_id: str, info: dict[str, Any]) -> None:
        """Insert or replace a device's JSON-serialisable ``info``. Raises TypeError or StoreError."""
        self._upsert("devices", device_id, json.dumps(info))

    def devices(self) -> dict[str, dict[str, Any]]:
        """device id -> the ``info`` last saved for it."""
        return {d: json.loads(i) for d, i in self._exec("SELECT device_id, info FROM devices")}

    # rounds
    def save_round(self, record: dict[str, Any]) -> None:
        """Insert or replace the record of round ``record["round"]``. Raises KeyError (no ``round``),
        TypeError (not JSON-serialisable) or StoreError."""
        self._upsert("rounds", int(record["round"]), json.dumps(record))

    def rounds(self) -> list[dict[str, Any]]:
        """Every round record, by ascending round."""
        return [json.loads(r) for (r,) in self._exec("SELECT record FROM rounds ORDER BY round")]

    def is_empty(self) -> bool:
        """True if nothing was ever written (a fresh federation)."""
        return not any(self._exec(f"SELECT 1 FROM {t} LIMIT 1") for t in ("kv", "blobs", "rounds"))

    def drop_all(self) -> None:
        """Delete every row (tests, ``--fresh``)."""
        for t in _KEYS:
            self._exec(f"DELETE FROM {t}")

    def close(self) -> None:
        """Close the database connection (driver errors while closing are ignored)."""
        with self._lock:
            try:
                self._db.close()
            except self._errors:
                pass


def _like(prefix: str) -> str:
    """A LIKE pattern (with ``ESCAPE '\\'``) matching keys that start with ``prefix``."""
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _redact(url: str) -> str:
    u = urlparse(url)
    if u.password:
        return url.replace(f":{u.password}@", ":***@")
    return url
