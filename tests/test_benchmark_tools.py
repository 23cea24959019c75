"""The benchmark scripts' own machinery: stopping what they started, the profile's categories."""

import collections
import signal
import subprocess
import sys
import textwrap

from benchmarks.aggregator_profile import STARTUP, WAITING, category, read_stacks, summarise
from benchmarks.common import ROOT


def test_sigterm_runs_a_benchmarks_finally_blocks(tmp_path):
    marker = tmp_path / "stopped"
    code = textwrap.dedent(f"""
        import time
        from benchmarks.common import stop_on_sigterm
        stop_on_sigterm()
        try:
            print("ready", flush=True)
            time.sleep(60)
        finally:
            open({str(marker)!r}, "w").write("children stopped")
    """)
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 128 + signal.SIGTERM
    assert marker.read_text() == "children stopped"


def test_profile_categories_and_per_update_split(tmp_path):
    raw = tmp_path / "stacks.txt"
    raw.write_text("\n".join([
        "thread (1);main (fedmoe/cli.py:1);_find_and_load (<frozen importlib._bootstrap>:1) 50",
        "thread (1);main (fedmoe/cli.py:1);Intake.on_update (cloud/rounds/intake.py:1);"
        "Store.put_blob (cloud/store.py:1);do_commit (sqlalchemy/engine/default.py:1) 30",
        "thread (1);Dispatch._send_assignment (cloud/rounds/dispatch.py:1);Store.put_blob (cloud/store.py:1) 10",
        "thread (2);Client._loop (paho/mqtt/client.py:1) 10",
        "bad line",
    ]))
    stacks = read_stacks(raw)
    assert sum(stacks.values()) == 100
    cats = collections.Counter()
    for st, n in stacks.items():
        cats[category(list(st))] += n
    # a store write while sending a state counts as sending states
    assert cats == {STARTUP: 50, "store (SQLAlchemy, SQLite)": 30, "states sent (encode, publish)": 10,
                    "MQTT client (paho)": 10}
    s = summarise(stacks, rate=100.0, updates=10, measured_ms=20.0)
    ms = {c["name"]: c["ms_per_update"] for c in s["categories"]}
    assert ms[STARTUP] is None and abs(ms["store (SQLAlchemy, SQLite)"] - 12.0) < 1e-9  # 30 of the 50 running
    assert abs(sum(v for v in ms.values() if v) - 20.0) < 1e-9 and s["sampled_s"] == 1.0


def test_profile_counts_blocked_samples_as_waiting_and_pairs_compare_runs():
    import inspect
    import threading

    import pytest

    from benchmarks.profile_pairs import TOTAL, compare

    lines, first = inspect.getsourcelines(threading.Condition.wait)
    acquire = first + next(i for i, text in enumerate(lines) if "waiter.acquire(" in text)
    blocked = ("Transport._finish (protocol/transport.py:1)", f"Condition.wait (threading.py:{acquire})")
    busy = ("Intake.on_update (cloud/rounds/intake.py:1)", "Store.put_blob (cloud/store.py:1)")
    assert category(list(blocked)) == WAITING and category(list(busy)) == "store (SQLAlchemy, SQLite)"
    s = summarise(collections.Counter({blocked: 70, busy: 30}), rate=100.0, updates=10, measured_ms=6.0)
    ms = {c["name"]: c["ms_per_update"] for c in s["categories"]}
    assert ms[WAITING] is None and abs(ms["store (SQLAlchemy, SQLite)"] - 6.0) < 1e-9  # the whole measured CPU

    def run(total, store):
        return {"summary": {"measured_ms_per_update": total, "categories": [
            {"name": "store (SQLAlchemy, SQLite)", "ms_per_update": store},
            {"name": WAITING, "ms_per_update": None}]}}
    rows = compare([run(15.0, 3.0), run(16.0, 3.2), run(15.5, 2.9)], [run(12.0, 2.0), run(12.5, 2.1), run(12.2, 2.0)])
    assert [r["name"] for r in rows] == ["store (SQLAlchemy, SQLite)", TOTAL]
    total = rows[-1]
    assert total["runs_before"] == [15.0, 16.0, 15.5] and abs(total["test"]["diff"] + 3.2667) < 1e-3
    assert total["test"]["significant"] and total["p_holm"] >= total["test"]["p"]
    with pytest.raises(ValueError, match="pairs"):
        compare([run(1.0, 1.0)], [])
