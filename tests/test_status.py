"""The open round in ``fedmoe status`` (text and ``--json``): read from a store holding a
round in progress, its accepted messages, the device registry and :mod:`cloud.activity`."""

from __future__ import annotations

import json
import time

from cloud.activity import Activity
from cloud.store import Store

MiB = 2**20
TIMEOUT_S = 240.0


def open_round_store(url: str, now: float | None = None) -> dict:
    """A store as an aggregator leaves it 90 s into round 2 (``round_timeout_s`` 240): round 1
    closed; dev-a and dev-b selected, dev-a reported (stats and update), dev-b acknowledged
    and trains; dev-c excluded; one refused message of dev-c. Returns what the checks compare."""
    now = time.time() if now is None else now
    store = Store(url)
    for d, online in (("dev-a", True), ("dev-b", True), ("dev-c", False)):
        store.save_device(d, {"device_id": d, "task": "bbc", "budget_bytes": 512 * MiB, "num_samples": 9,
                              "weight_formats": ["int8"], "runtime_bytes": 300 * MiB, "online": online,
                              "last_seen": now - 600})
    store.save_round({"round": 1, "status": "ok", "started": now - 400, "accuracy": 0.5, "loss": 1.25,
                      "selected": ["dev-a", "dev-b"], "excluded": {}, "bytes_up": 2 * MiB, "bytes_down": 300 * MiB,
                      "seconds": 230.0, "expert_load": {"1": [10, 0, 5, 40]},
                      "devices": {d: {"experts": {"1": [0, 3]}, "peak_bytes": 384 * MiB, "budget_bytes": 512 * MiB}
                                  for d in ("dev-a", "dev-b")}})
    store.put_json("last_round", 1)
    store.put_json("initial_evaluation", {"accuracy": 0.193, "loss": 1.61, "per_task": {}})
    store.put_json("current_round", {
        "number": 2, "started": now - 90, "deadline": now - 90 + TIMEOUT_S, "plan_info": {}, "train": {},
        "assignment_seconds": 0.1, "selected": {"dev-a": {"1": [0, 3]}, "dev-b": {"1": [1, 2]}},
        "excluded": {"dev-c": "over budget: the plan needs 600 MiB"}, "objectives": {}, "sample_cap": None})
    for d in ("dev-a", "dev-b"):
        store.put_json(f"inflight/2/ack/{d}", {"type": "ack", "device_id": d, "round": 2, "accepted": True})
    store.put_json("inflight/2/stats/dev-a", {"device_id": "dev-a", "round": 2})
    store.put_blob("inflight/2/update/dev-a", b"update bytes")
    activity = Activity(store)
    activity.seen("dev-a", now - 5)
    activity.seen("dev-b", now - 30)
    activity.event("exclude", "dev-c", 2, "over budget: the plan needs 600 MiB", now - 90)
    activity.event("reject", "dev-c", 2, "stats rejected: dev-c was not selected in round 2", now - 60)
    activity.flush(force=True)
    store.close()
    return {"now": now}


def test_status_shows_the_open_round_last_seen_and_recent_events(tmp_path, capsys):
    from fedmoe.cli import main

    url = f"sqlite:///{tmp_path}/agg.db"
    open_round_store(url)
    assert main(["status", "--store", url]) == 0
    out = capsys.readouterr().out
    assert "3 devices registered, 2 online; 1 rounds completed; before round 1: accuracy 0.193" in out
    head = next(line for line in out.splitlines() if line.startswith("Open round 2:"))
    assert " s of 240 s " in head and "passed" not in head
    assert int(head.split("started ")[1].split(", ")[1].split(" s of")[0]) >= 90
    assert "  reported 1/2: dev-a" in out and "  waiting for: dev-b" in out
    assert "  excluded: dev-c: over budget: the plan needs 600 MiB" in out
    dev_a = next(line for line in out.splitlines() if line.startswith("dev-a"))
    assert "s ago)" in dev_a and dev_a.split()[3:5] != ["-", "-"]
    events = out.split("Rejected messages and exclusions (last 2)")[1].strip().splitlines()
    assert events[2].split()[2:5] == ["reject", "dev-c", "2"]  # newest first
    assert events[3].split()[2:5] == ["exclude", "dev-c", "2"]

    assert main(["status", "--store", url, "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    o = view["open_round"]
    assert (o["round"], o["selected"], o["reported"], o["accepted"]) == (2, ["dev-a", "dev-b"], ["dev-a"],
                                                                        ["dev-a", "dev-b"])
    assert o["timeout_s"] == TIMEOUT_S and o["refused"] == {} and o["failed"] == {}
    seen = {d["device_id"]: view["now"] - d["last_seen"] for d in view["devices"]}
    assert 5 <= seen["dev-a"] < 60 and 30 <= seen["dev-b"] < 90 and seen["dev-c"] >= 600
    assert [e["kind"] for e in view["events"]] == ["reject", "exclude"]
    assert view["rounds"][0]["started"] is not None


def test_activity_keeps_a_bounded_history_and_writes_the_store_throttled(tmp_path):
    from cloud.activity import MAX_EVENTS, read

    store = Store(f"sqlite:///{tmp_path}/agg.db")
    a = Activity(store)
    for i in range(MAX_EVENTS + 20):
        a.event("reject", "dev-a", i, f"reason {i}")
    _, events = read(store)
    assert len(events) == 1  # the first event was written; the rest wait for the throttle
    a.flush(force=True)
    _, events = read(store)
    assert len(events) == MAX_EVENTS and events[0]["round"] == 20 and events[-1]["round"] == MAX_EVENTS + 19
    assert len(Activity(store).events) == MAX_EVENTS  # carried on by the next run
    Activity(store, enabled=False).seen("dev-b")
    assert "dev-b" not in read(store)[0]
    store.close()


def test_failed_and_refused_devices_of_the_open_round(tmp_path):
    """A refused assignment and a refused message are told apart from a device still training."""
    from cloud.dashboard import open_round

    url = f"sqlite:///{tmp_path}/agg.db"
    open_round_store(url)
    store = Store(url)
    store.put_json("inflight/2/ack/dev-b", {"type": "ack", "device_id": "dev-b", "round": 2, "accepted": False,
                                            "reason": "out of memory"})
    assert open_round(store)["refused"] == {"dev-b": "out of memory"}
    store.put_json("inflight/2/ack/dev-b", {"type": "ack", "device_id": "dev-b", "round": 2, "accepted": True})
    events = [{"kind": "reject", "device": "dev-b", "round": 2, "reason": "update rejected: bad layout"},
              {"kind": "reject", "device": "dev-b", "round": 1, "reason": "an old round"}]
    assert open_round(store, events=events)["failed"] == {"dev-b": "update rejected: bad layout"}
    store.delete("current_round")
    assert open_round(store) is None
    store.close()
