"""The aggregator's durable store on SQLite and PostgreSQL (skipped without a server)."""

from __future__ import annotations

import json
import sqlite3
import sys

import pytest
from sqlalchemy import text

from cloud.store import Store, StoreError

def test_roundtrip_and_persistence(store_url):
    s = Store(store_url)
    assert s.is_empty()
    s.put_json("a", {"x": [1, 2]})
    s.put_json("a", {"x": [3]})
    s.put_blob("inflight/1/update/d0", b"\x00\x01binary")
    s.put_blob("inflight/1/update/d1", b"b")
    s.put_blob("inflight/10/update/d0", b"c")
    s.save_device("d0", {"task": "t"})
    s.save_round({"round": 2, "status": "ok"})
    s.save_round({"round": 1, "status": "ok"})
    s.close()
    s = Store(store_url)
    assert not s.is_empty()
    assert s.get_json("a") == {"x": [3]} and s.get_json("missing", 7) == 7
    assert s.get_blob("inflight/1/update/d0") == b"\x00\x01binary"
    assert s.blob_keys("inflight/1/") == ["inflight/1/update/d0", "inflight/1/update/d1"]
    s.delete_prefix("inflight/1/")
    assert s.blob_keys("inflight/") == ["inflight/10/update/d0"]  # the prefix is literal
    assert s.devices() == {"d0": {"task": "t"}}
    assert [r["round"] for r in s.rounds()] == [1, 2]
    s.close()


def test_transaction_is_atomic(store_url):
    s = Store(store_url)
    s.put_json("last_round", 1)
    with pytest.raises(RuntimeError):
        with s.transaction():
            s.put_blob("global_state", b"new")
            with s.transaction():  # nested blocks join the outer one
                s.put_json("last_round", 2)
            raise RuntimeError("killed between writes")
    assert s.get_json("last_round") == 1 and s.get_blob("global_state") is None
    with s.transaction():
        s.put_blob("global_state", b"new")
        s.put_json("last_round", 2)
    assert s.get_json("last_round") == 2 and s.get_blob("global_state") == b"new"
    s.close()


def test_a_failed_statement_a_caller_caught_rolls_the_whole_transaction_back(store_url):
    """Group commit handles many messages in one transaction and a handler may catch a
    StoreError: what the transaction wrote must then not be committed as if it had worked
    (PostgreSQL would end an aborted transaction's COMMIT as a ROLLBACK without an error)."""
    s = Store(store_url)
    s.put_json("kept", 1)
    with pytest.raises(StoreError, match="transaction rolled back|transaction is aborted"):  # SQLite | PostgreSQL
        with s.transaction():
            s.put_json("kept", 2)
            s.put_blob("new", b"x")
            with pytest.raises(StoreError):
                s._exec(text("SELECT * FROM no_such_table"))      # caught: the caller goes on
            s.put_json("after", 3)
    assert s.get_json("kept") == 1 and s.get_blob("new") is None and s.get_json("after") is None
    with s.transaction():                                            # the next one commits
        s.put_json("kept", 4)
    assert s.get_json("kept") == 4
    s.close()


def test_move_prefix_renames_json_and_blobs(store_url):
    """A failed round's in-flight messages move to quarantine/ (literal prefix, replacing
    an older quarantine of the same round)."""
    s = Store(store_url)
    s.put_blob("inflight/1/update/d_0", b"u")
    s.put_json("inflight/1/stats/d_0", {"n": 1})
    s.put_blob("inflight/10/update/d0", b"other round")
    s.put_blob("quarantine/1/update/stale", b"old")
    s.move_prefix("inflight/1/", "quarantine/1/")
    assert s.blob_keys("inflight/") == ["inflight/10/update/d0"]
    assert s.blob_keys("quarantine/") == ["quarantine/1/update/d_0"]
    assert s.get_blob("quarantine/1/update/d_0") == b"u" and s.get_json("quarantine/1/stats/d_0") == {"n": 1}
    s.close()


def test_bad_urls_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unsupported store URL"):
        Store("mysql://x/y")
    with pytest.raises(StoreError, match="cannot open store") as e:
        Store("postgresql://nobody:secret@127.0.0.1:1/none")
    assert "nobody:***@127.0.0.1:1" in str(e.value) and "secret" not in str(e.value)
    with pytest.raises(StoreError, match=f"cannot open store {tmp_path}"):
        Store(str(tmp_path))  # a directory


def test_missing_driver_is_a_store_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(StoreError, match=r"cannot open store postgresql://u:\*\*\*@db/x: .*needs psycopg 3"):
        Store("postgresql://u:pw@db/x")


def test_opens_a_database_written_by_the_sqlite3_psycopg_store(store_url):
    """Tables created by the store before SQLAlchemy (raw DDL, ``?``/``%s`` placeholders)
    open and read the same, and take new writes."""
    if store_url.startswith("sqlite:///"):
        db, blob, ph = sqlite3.connect(store_url[len("sqlite:///"):], isolation_level=None), "BLOB", "?"
        db.execute("PRAGMA journal_mode=WAL")
    else:
        import psycopg

        db, blob, ph = psycopg.connect(store_url, autocommit=True), "BYTEA", "%s"
    for table, cols in (("kv", "key TEXT PRIMARY KEY, value TEXT NOT NULL"),
                        ("blobs", f"key TEXT PRIMARY KEY, value {blob} NOT NULL"),
                        ("devices", "device_id TEXT PRIMARY KEY, info TEXT NOT NULL"),
                        ("rounds", "round INTEGER PRIMARY KEY, record TEXT NOT NULL")):
        db.execute(f"CREATE TABLE IF NOT EXISTS {table} ({cols})")
    for table, row in (("kv", ("last_round", "2")), ("blobs", ("global_state", b"\x00\xffst")),
                       ("blobs", ("inflight/3/update/d_0", b"u")), ("devices", ("d0", json.dumps({"task": "t"}))),
                       ("rounds", (2, json.dumps({"round": 2}))), ("rounds", (1, json.dumps({"round": 1})))):
        db.execute(f"INSERT INTO {table} VALUES ({ph}, {ph})", row)
    db.close()
    s = Store(store_url)
    assert not s.is_empty() and s.get_json("last_round") == 2 and s.get_blob("global_state") == b"\x00\xffst"
    assert s.blob_keys("inflight/3/") == ["inflight/3/update/d_0"] and s.devices() == {"d0": {"task": "t"}}
    assert s.rounds() == [{"round": 1}, {"round": 2}]
    s.save_round({"round": 2, "status": "ok"})
    s.put_blob("global_state", b"new")
    assert s.rounds()[1] == {"round": 2, "status": "ok"} and s.get_blob("global_state") == b"new"
    s.close()


def test_one_process_leads_a_store_and_a_standby_takes_over_when_it_goes(store_url):
    """The leader lock (PostgreSQL advisory lock / POSIX lock on the SQLite file) admits one
    process; another gets False at once, or as a standby waits and gets the lock as soon as
    the leader closes (a killed leader's lock dies with it, tests/test_faults.py)."""
    import subprocess
    import time
    from pathlib import Path

    probe = ("import sys; from cloud.store import Store; s = Store(sys.argv[1]); "
             "print(s.acquire_leader(wait=sys.argv[2] == 'wait', poll_s=0.2), flush=True)")
    root = Path(__file__).parents[1]

    def other(mode: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", probe, store_url, mode], cwd=root, stdout=subprocess.PIPE,
                                text=True)

    leader = Store(store_url)
    assert leader.acquire_leader() and leader.acquire_leader()  # again: still held
    assert other("now").communicate(timeout=60)[0].strip() == "False"
    standby = other("wait")
    time.sleep(2)
    assert standby.poll() is None  # still waiting
    leader.close()
    assert standby.communicate(timeout=30)[0].strip() == "True"
    s = Store(store_url)
    assert s.acquire_leader()  # the standby's process ended: free again
    s.close()


def test_a_leader_whose_lock_session_is_gone_knows_it(store_url):
    """A PostgreSQL leader whose lock connection is terminated (the lock is then free for a
    standby) sees it in leader_alive, so the aggregator stops instead of leading twice."""
    s = Store(store_url)
    assert s.acquire_leader() and s.leader_alive()
    if s.kind == "postgresql":
        pid = s._leader.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        s._leader.commit()
        other = Store(store_url)
        other._exec(text(f"SELECT pg_terminate_backend({pid})"))
        assert not s.leader_alive()
        assert other.acquire_leader()  # free for the next
        other.close()
    s.close()
