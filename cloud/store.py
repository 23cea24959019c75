"""Durable state of the aggregator: SQLite by default, PostgreSQL by URL.

Holds what the aggregator needs to resume after a crash and what reports read:
registered devices, round records, the global adapter state (safetensors), the round
in flight with the updates already accepted in it, and small JSON documents (strategy
state, load window). Every write is its own transaction, and :meth:`Store.transaction`
groups writes that must land together (closing a round: new global state, round
record, ``last_round``), so a kill at any instant leaves a consistent store and a
round is never applied twice.

One aggregator process at a time uses a store (:meth:`Store.acquire_leader`): a
PostgreSQL session advisory lock, or for a SQLite file a POSIX lock on ``{file}.leader``;
both die with the process, so a standby (``fedmoe aggregator --standby``) takes over within
about a second of the leader being killed and resumes its round from the store.

URLs: ``sqlite:///path/to/file.db`` (or a plain path; ``sqlite://`` / ``:memory:``
for an in-memory store) and ``postgresql://user@host:port/db`` (needs ``psycopg``
3, the ``postgres`` extra). SQLAlchemy Core builds the SQL for either; the tables
(``kv``, ``blobs``, ``devices``, ``rounds``) are created when missing, and existing ones
are used as they are.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator
from urllib.parse import urlparse

from sqlalchemy import (Column, Integer, LargeBinary, MetaData, Table, Text, create_engine, delete, event, func,
                        literal, select, update)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import StaticPool

log = logging.getLogger(__name__)

_META = MetaData()
_KV = Table("kv", _META, Column("key", Text, primary_key=True), Column("value", Text, nullable=False))
_BLOBS = Table("blobs", _META, Column("key", Text, primary_key=True), Column("value", LargeBinary, nullable=False))
_DEVICES = Table("devices", _META, Column("device_id", Text, primary_key=True), Column("info", Text, nullable=False))
_ROUNDS = Table("rounds", _META, Column("round", Integer, primary_key=True, autoincrement=False),
                Column("record", Text, nullable=False))


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

    One store serialises its callers (thread-safe): a :meth:`transaction` block holds
    the store until it ends.

    Args:
        url: see the module docstring.

    Raises:
        ValueError: an unsupported URL scheme.
        StoreError: the database cannot be opened (missing driver, server down or not
            answering within 10 s, unopenable path); the message names the URL without
            its password.
    """

    def __init__(self, url: str):
        problem = url_problem(url)
        if problem:
            raise ValueError(problem)
        self.url = url
        self._name = redact_url(url)
        self._lock = threading.RLock()
        self._conn: Connection | None = None  # the open transaction() block's connection
        self._failed: StoreError | None = None  # a statement that failed inside it
        self._leader: Connection | IO | None = None  # what holds the leader lock
        self._path: str | None = None  # the SQLite file
        u = urlparse(url)
        try:
            with self._guard("cannot open store"):
                if u.scheme in ("postgresql", "postgres"):
                    self.kind, self._insert = "postgresql", postgresql.insert
                    # a pool that replaces connections the server dropped (restart, idle timeout)
                    self._engine = create_engine(make_url(url).set(drivername="postgresql+psycopg"),
                                                 connect_args={"connect_timeout": 10}, pool_pre_ping=True)
                else:
                    self.kind, self._insert = "sqlite", sqlite.insert
                    if url in (":memory:", "sqlite://"):
                        path = ":memory:"
                    elif u.scheme == "sqlite":
                        path = url[len("sqlite:///"):] if url.startswith("sqlite:///") else u.path
                    else:  # "" or file: (url_problem admitted nothing else)
                        path = u.path or url
                    if path == ":memory:":  # one database shared by every thread
                        self._engine = create_engine("sqlite://", poolclass=StaticPool,
                                                     connect_args={"check_same_thread": False})
                    else:  # a pool of connections usable from any thread (SQLAlchemy's default for files)
                        self._path = path
                        Path(path).parent.mkdir(parents=True, exist_ok=True)
                        self._engine = create_engine(URL.create("sqlite", database=path))
                        event.listen(self._engine, "connect", _sqlite_pragmas)
                if self.kind == "postgresql":  # processes sharing a new schema (workers) create its tables once
                    with self._engine.begin() as c:
                        c.exec_driver_sql("SELECT pg_advisory_xact_lock(hashtextextended(current_database() || '.' "
                                          "|| current_schema() || '.fedmoe-tables', 0))")
                        _META.create_all(c)
                        # blobs are tensors and chunks: PostgreSQL's attempt to compress each (pglz)
                        # fails and cost 5 of 9 ms per 256 KiB chunk written here
                        if c.exec_driver_sql("SELECT attstorage FROM pg_attribute WHERE attrelid = 'blobs'::regclass "
                                             "AND attname = 'value'").scalar() != "e":
                            c.exec_driver_sql("ALTER TABLE blobs ALTER COLUMN value SET STORAGE EXTERNAL")
                else:
                    _META.create_all(self._engine)
        except ImportError:
            raise StoreError(f"cannot open store {self._name}: a postgresql:// store needs psycopg 3: "
                             "pip install 'fedmoe[postgres]'") from None
        except OSError as e:  # the SQLite file's folder
            raise StoreError(f"cannot open store {self._name}: {e}") from None
        log.debug("opened store %s", self._name)

    @contextmanager
    def _guard(self, what: str = "store") -> Iterator[None]:
        """Turn a database error into StoreError naming the URL without its password."""
        try:
            yield
        except SQLAlchemyError as e:
            error = StoreError(f"{what} {self._name}: {getattr(e, 'orig', None) or e}")
            if self._conn is not None:  # the open transaction() block must not commit what is left
                self._failed = error
            raise error from None

    def _exec(self, *stmts: Any) -> list[Any]:
        """Run ``stmts`` in the open :meth:`transaction` or in one of their own; the last one's rows."""
        with self.transaction():
            rows: list[Any] = []
            for stmt in stmts:
                with self._guard():
                    result = self._conn.execute(stmt)
                    rows = result.all() if result.returns_rows else []
            return rows

    def _upsert(self, table: Table, key: Any, value: Any) -> None:
        k, v = table.c
        stmt = self._insert(table).values({k.name: key, v.name: value})
        self._exec(stmt.on_conflict_do_update(index_elements=[k], set_={v.name: stmt.excluded[v.name]}))

    @contextmanager
    def transaction(self) -> Iterator["Store"]:
        """Group writes atomically (nestable; the outermost block commits, an exception
        rolls everything back, and so does a failed statement inside that a caller caught:
        nothing after it is committed as if it had worked). Raises StoreError."""
        with self._lock:
            if self._conn is not None:  # nested: join the outer block
                yield self
                return
            self._failed = None
            with self._guard(), self._engine.begin() as self._conn:
                try:
                    yield self
                    if self._failed is not None:  # a statement inside failed and its caller went on
                        raise StoreError(f"transaction rolled back: {self._failed}")
                finally:
                    self._conn = None

    @property
    def in_transaction(self) -> bool:
        """Whether a :meth:`transaction` block is open (a caller must not commit and
        acknowledge inside someone else's)."""
        return self._conn is not None

    # kv
    def put_json(self, key: str, value: Any) -> None:
        """Insert or replace JSON document ``key``. Raises TypeError (not JSON-serialisable) or StoreError."""
        self._upsert(_KV, key, json.dumps(value))

    def get_json(self, key: str, default: Any = None) -> Any:
        """The decoded JSON document ``key``, or ``default`` when absent. Raises StoreError."""
        rows = self._exec(select(_KV.c.value).where(_KV.c.key == key))
        return json.loads(rows[0][0]) if rows else default

    def delete(self, key: str) -> None:
        """Remove a JSON document or blob ``key`` (missing keys are fine). Raises StoreError."""
        self._exec(*(delete(t).where(t.c.key == key) for t in (_KV, _BLOBS)))

    def delete_prefix(self, prefix: str) -> None:
        """Remove every JSON document and blob whose key starts with ``prefix`` (literally). Raises StoreError."""
        self._exec(*(delete(t).where(_starts(t, prefix)) for t in (_KV, _BLOBS)))

    def move_prefix(self, prefix: str, to: str) -> None:
        """Rename every JSON document and blob key starting with ``prefix`` to start with
        ``to`` instead (e.g. quarantine a failed round's in-flight messages), replacing
        keys already under ``to``; one transaction. Raises StoreError."""
        with self.transaction():
            for t in (_KV, _BLOBS):
                self._exec(delete(t).where(_starts(t, to)), update(t).where(_starts(t, prefix)).values(
                    key=literal(to, Text) + func.substr(t.c.key, len(prefix) + 1)))

    def json_items(self, prefix: str) -> dict[str, Any]:
        """key -> decoded JSON document, for the keys starting with ``prefix`` (literally). Raises StoreError."""
        return {k: json.loads(v) for k, v in self._exec(select(_KV.c.key, _KV.c.value).where(_starts(_KV, prefix)))}

    def json_keys(self, prefix: str) -> list[str]:
        """Keys of the JSON documents starting with ``prefix`` (literally), unsorted. Raises StoreError."""
        return [k for (k,) in self._exec(select(_KV.c.key).where(_starts(_KV, prefix)))]

    def json_many(self, keys: list[str]) -> dict[str, Any]:
        """key -> decoded JSON document for those of ``keys`` that exist. Raises StoreError."""
        out: dict[str, Any] = {}
        for i in range(0, len(keys), 500):
            rows = self._exec(select(_KV.c.key, _KV.c.value).where(_KV.c.key.in_(keys[i:i + 500])))
            out.update({k: json.loads(v) for k, v in rows})
        return out

    def clock(self) -> float:
        """Unix seconds by the database's clock (PostgreSQL's ``now()``: the same for every
        process sharing the store), or this host's for SQLite. Raises StoreError."""
        if self.kind != "postgresql":
            return time.time()
        from sqlalchemy import text

        return float(self._exec(text("SELECT extract(epoch FROM clock_timestamp())"))[0][0])

    def lock(self, name: str, shared: bool = False) -> None:
        """Take the lock ``name`` until the open :meth:`transaction` ends (call inside one):
        on PostgreSQL a transaction-level advisory lock (``shared``: many holders, none
        exclusive), so processes sharing the store serialise on it; SQLite serialises writers
        by itself and holds no such lock (one process per file). Raises StoreError."""
        if self.kind != "postgresql":
            return
        from sqlalchemy import text

        fn = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
        self._exec(text(f"SELECT {fn}(hashtextextended(current_database() || '.' || current_schema() || '.' "
                        f"|| :name, 0))").bindparams(name=name))

    # blobs
    def put_blob(self, key: str, value: bytes) -> None:
        """Insert or replace blob ``key`` (bytes). Raises StoreError."""
        self._upsert(_BLOBS, key, bytes(value))

    def get_blob(self, key: str) -> bytes | None:
        """The bytes of blob ``key``, or None when absent. Raises StoreError."""
        rows = self._exec(select(_BLOBS.c.value).where(_BLOBS.c.key == key))
        return bytes(rows[0][0]) if rows else None

    def blob_items(self, prefix: str) -> list[tuple[str, bytes]]:
        """(key, bytes) of the blobs starting with ``prefix`` (literally), by key; one query. Raises StoreError."""
        return [(k, bytes(v)) for k, v in self._exec(select(_BLOBS.c.key, _BLOBS.c.value).where(
            _starts(_BLOBS, prefix)).order_by(_BLOBS.c.key))]

    def blob_keys(self, prefix: str) -> list[str]:
        """Keys of the blobs starting with ``prefix`` (literally; ``%``/``_`` escaped), sorted."""
        return [k for (k,) in self._exec(select(_BLOBS.c.key).where(_starts(_BLOBS, prefix)).order_by(_BLOBS.c.key))]

    # devices
    def save_device(self, device_id: str, info: dict[str, Any]) -> None:
        """Insert or replace a device's JSON-serialisable ``info``. Raises TypeError or StoreError."""
        self._upsert(_DEVICES, device_id, json.dumps(info))

    def devices(self) -> dict[str, dict[str, Any]]:
        """device id -> the ``info`` last saved for it."""
        return {d: json.loads(i) for d, i in self._exec(select(_DEVICES))}

    # rounds
    def save_round(self, record: dict[str, Any]) -> None:
        """Insert or replace the record of round ``record["round"]``. Raises KeyError (no ``round``),
        TypeError (not JSON-serialisable) or StoreError."""
        self._upsert(_ROUNDS, int(record["round"]), json.dumps(record))

    def rounds(self) -> list[dict[str, Any]]:
        """Every round record, by ascending round."""
        return [json.loads(r) for (r,) in self._exec(select(_ROUNDS.c.record).order_by(_ROUNDS.c.round))]

    def is_empty(self) -> bool:
        """True if nothing was ever written (a fresh federation)."""
        return not any(self._exec(select(t.c[0]).limit(1)) for t in (_KV, _BLOBS, _ROUNDS))

    def drop_all(self) -> None:
        """Delete every row (tests, ``--fresh``)."""
        self._exec(*(delete(t) for t in _META.sorted_tables))

    def ping(self) -> None:
        """One round trip to the database (readiness checks).

        Raises:
            StoreError: the database does not answer.
        """
        from sqlalchemy import text

        self._exec(text("SELECT 1"))

    def acquire_leader(self, wait: bool = False, poll_s: float = 1.0,
                       on_wait: Callable[[], None] | None = None) -> bool:
        """Make this process the one aggregator of this store, until :meth:`close` or the
        process ends (a SIGKILL included: the lock dies with it).

        PostgreSQL: a session advisory lock keyed by the database and schema, on a
        connection of its own. SQLite file: a POSIX record lock (``lockf``) on
        ``{file}.leader``; it excludes other processes only. In-memory: nothing to share.

        Args:
            wait: poll every ``poll_s`` seconds until the lock is free (a standby);
                else return at once.
            on_wait: called once when the lock is held by another process and ``wait``.

        Returns:
            True when held; False (only without ``wait``) when another process holds it.

        Raises:
            StoreError: the database cannot be reached for the lock.
        """
        if self._leader is not None:
            return True
        told = False
        while True:
            if self._try_leader():
                return True
            if not wait:
                return False
            if not told and on_wait is not None:
                on_wait()
            told = True
            time.sleep(poll_s)

    def _try_leader(self) -> bool:
        if self.kind == "postgresql":
            with self._guard("cannot take the leader lock of store"):
                conn = self._engine.connect()
                got = conn.exec_driver_sql(
                    "SELECT pg_try_advisory_lock(hashtextextended("
                    "current_database() || '.' || current_schema() || '.fedmoe-leader', 0))").scalar()
                conn.commit()
            if got:
                self._leader = conn
            else:
                conn.close()
            return bool(got)
        if self._path is None:
            return True
        import fcntl

        f = open(self._path + ".leader", "a+")  # noqa: SIM115  (held open while leading)
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            return False
        self._leader = f
        return True

    def leader_alive(self) -> bool:
        """Whether this process still holds the leader lock it took: on PostgreSQL the lock's
        session must still be there and hold it (a dropped connection frees the lock for a
        standby); a file lock lives as long as the process. True without a lock to hold."""
        if self.kind != "postgresql" or self._leader is None:
            return True
        try:
            with self._lock:
                n = self._leader.exec_driver_sql(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                    "AND pid = pg_backend_pid()").scalar()
                self._leader.commit()
        except SQLAlchemyError as e:
            log.error("leader lock of store %s: its connection failed: %s", self._name, e)
            return False
        return bool(n)

    def close(self) -> None:
        """Close the database connections and give up the leader lock (an in-memory store
        is gone; driver errors while closing are ignored)."""
        with self._lock:
            if self._leader is not None:
                try:
                    self._leader.close()
                except (SQLAlchemyError, OSError):
                    pass
                self._leader = None
            try:
                self._engine.dispose()
            except SQLAlchemyError:
                pass


def _sqlite_pragmas(dbapi: Any, _record: Any) -> None:
    """Write-ahead log, and 64 KiB pages for a new database file: blobs (update chunks,
    updates, adapter states) are 0.25-1.1 MiB, which with the default 4 KiB pages is a chain
    of up to 280 overflow pages to write, checkpoint and free. Measured with SQLite alone
    (300 updates of 1.1 MiB as 4 chunks + the update, then the round's delete): 10.9 -> 6.9
    ms of CPU per update written, 6.5 -> 2.3 ms deleted. An existing file keeps its page
    size (``VACUUM`` after ``PRAGMA page_size=65536`` converts one)."""
    dbapi.execute("PRAGMA page_size=65536")
    dbapi.execute("PRAGMA journal_mode=WAL")


def _starts(table: Table, prefix: str) -> Any:
    """``key LIKE prefix || '%'`` with ``%``/``_`` in ``prefix`` escaped (matched literally)."""
    return table.c.key.startswith(prefix, autoescape=True)


def redact_url(url: str) -> str:
    """``url`` with its password (if any) shown as ``***``."""
    u = urlparse(url)
    if u.password:
        return url.replace(f":{u.password}@", ":***@")
    return url
