"""Aggregator workers (``fedmoe aggregator --role worker``) and their coordinator over a real
Mosquitto and PostgreSQL, driven by the fleet load generator's protocol-level devices
(signed, chunked 1 MiB updates): every update is applied exactly once, also when a worker
is SIGKILLed mid-round and restarted; and the running sums equal FedAvg of the updates."""

from __future__ import annotations

import signal
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from cloud.aggregation.base import RoundSums
from cloud.aggregation.modular import Modular
from cloud.aggregation.usage_weighted import UsageWeighted
from cloud.config import AggregatorConfig
from fedmoe.broker import MosquittoBroker

from conftest import PG_URL, _pg_available


def _result(d: str, n: int, state: dict):
    from cloud.strategy import ClientResult

    return ClientResult(d, "t", n, {0: [0]}, state, None)


def test_running_sums_equal_fedavg_and_survive_the_store_round_trip():
    g = {"backbone.a": torch.zeros(3), "expert.0.1.lora_A": torch.zeros(2, 2)}
    results = [_result("a", 10, {"backbone.a": torch.tensor([1.0, 2.0, 3.0])}),
               _result("b", 30, {"backbone.a": torch.tensor([5.0, 6.0, 7.0]),
                                 "expert.0.1.lora_A": torch.ones(2, 2)})]
    rule = Modular()
    direct = rule.aggregate(1, g, results, [])
    one, two = RoundSums(), RoundSums()  # two workers, one update each, merged by the coordinator
    rule.fold(one, results[0])
    rule.fold(two, results[1])
    merged = RoundSums.from_bytes(one.to_bytes())
    merged.merge(RoundSums.from_bytes(two.to_bytes()))
    out = rule.finish(g, merged)
    assert merged.devices == 2
    assert torch.allclose(out["backbone.a"], torch.tensor([4.0, 5.0, 6.0]))  # (10 x + 30 y) / 40
    assert torch.equal(out["expert.0.1.lora_A"], torch.ones(2, 2))  # one holder: taken as is
    for k in g:
        assert torch.allclose(out[k], direct[k])
    assert Modular.decomposes and UsageWeighted.decomposes
    with pytest.raises(ValueError, match="not running sums"):
        RoundSums.from_bytes(b"junk")
    bad = RoundSums()
    bad.add("backbone.a", torch.zeros(4), 1.0)
    with pytest.raises(ValueError, match="shape"):
        merged.merge(bad)


def test_sums_written_as_one_tensor_read_back_and_so_does_the_earlier_layout():
    from safetensors.torch import save

    sums = RoundSums(devices=3)
    sums.add("expert.0.1.lora_A", torch.arange(6.0).reshape(2, 3), 2.0)
    sums.add("backbone.a", torch.tensor([1.5]), 0.5)
    back = RoundSums.from_bytes(sums.to_bytes())
    assert back.devices == 3 and back.weight == sums.weight
    assert all(torch.equal(back.weighted[k], sums.weighted[k]) for k in sums.weighted)
    earlier = save({"s/backbone.a": torch.tensor([0.75], dtype=torch.float64),
                    "w/backbone.a": torch.tensor([0.5], dtype=torch.float64), "n": torch.tensor([1])})
    old = RoundSums.from_bytes(earlier)  # an in-flight round's sums stored before the upgrade
    assert old.devices == 1 and old.weight == {"backbone.a": 0.5} and old.weighted["backbone.a"].item() == 0.75
    flat = save({"sums": torch.zeros(5, dtype=torch.float64), "weights": torch.ones(1, dtype=torch.float64),
                 "n": torch.tensor([1])}, metadata={"names": '[["backbone.a", [2, 3]]]'})
    with pytest.raises(ValueError, match="not running sums"):  # 6 values named, 5 stored
        RoundSums.from_bytes(flat)


def test_adding_many_tensors_at_once_equals_adding_each_and_refuses_a_wrong_shape_whole():
    torch.manual_seed(0)
    each, at_once = RoundSums(), RoundSums()
    for w in (0.5, 2.0, 2.0):  # a repeated weight: one foreach call for its tensors
        terms = [(f"t{j}", torch.randn(7 + j), w if j % 2 else 3.0) for j in range(4)]
        for name, t, tw in terms:
            each.add(name, t, tw)
        at_once.add_all(terms)
    assert each.weight == at_once.weight
    assert all(torch.equal(each.weighted[k], at_once.weighted[k]) for k in each.weighted)
    before = {k: v.clone() for k, v in at_once.weighted.items()}
    with pytest.raises(ValueError, match="shape"):
        at_once.add_all([("t0", torch.ones(7), 1.0), ("t1", torch.ones(3), 1.0)])
    assert all(torch.equal(before[k], at_once.weighted[k]) for k in before)  # nothing added
    assert each.weight == at_once.weight


def test_robust_rules_and_dp_do_not_decompose():
    from cloud.robust.rules import RobustAggregation

    assert not RobustAggregation(Modular(), "median").decomposes


@pytest.mark.parametrize("role,store,problem", [
    ("worker", "postgresql://x@h/db", "worker_id"),
    ("coordinator", "sqlite:///x.db", "postgresql"),
])
def test_roles_refuse_impossible_configurations(role, store, problem):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=problem):
        AggregatorConfig.model_validate({"model": {"family": "tiny"}, "tasks": {"t": {"labels": ["a", "b"]}},
                                         "role": role, "store": store})


fleet_env = pytest.mark.skipif(not (MosquittoBroker.available() and _pg_available()),
                               reason="needs mosquitto and PostgreSQL")


def _args():
    # ack_wait: the NATS cluster re-sends the chunks a SIGKILLed worker held unacknowledged after 10 s, not 30 s
    # (the restarted worker gets them then; on Mosquitto its session has them at once)
    return Namespace(rounds=2, round_timeout=120.0, procs=1, train_s=1.0, connect_rate=200.0, timeout=300.0,
                     robust="none", fedmoe=str(Path(sys.executable).parent / "fedmoe"), ack_wait="10s")


def _exactly_once(s: dict, per_round: int) -> None:
    assert s["rounds_closed"] == 2 and not s["timed_out"], s
    assert [p["status"] for p in s["rounds"]] == ["ok", "ok"], s["rounds"]
    assert [p["accepted"] for p in s["rounds"]] == [per_round] * 2, s["rounds"]
    assert [p["uploaded"] for p in s["rounds"]] == [per_round] * 2
    assert s["not_accepted"] == 0 and s["reported_twice"] == 0 and s["rejects"] == 0, s


def test_uplink_partition_topics_round_trip():
    from protocol.topics import Topics

    t = Topics("f")
    topic = t.up("d1", "update", "w0")
    assert topic == "fl/v1/f/dev/d1/up/update/w0" and t.parse_device_topic(topic) == ("d1", "up", "update")
    assert t.parse_device_topic(t.up("d1", "stats", "w0")) == ("d1", "up", "stats")
    assert t.partition_filters("w0") == ["fl/v1/f/dev/+/up/update/w0", "fl/v1/f/dev/+/up/stats/w0"]
    for bad in ("fl/v1/f/dev/d1/up/hello/w0", "fl/v1/f/dev/d1/down/state/w0", "fl/v1/f/dev/d1/up/update/w+"):
        with pytest.raises(ValueError):
            t.parse_device_topic(bad)
    with pytest.raises(ValueError, match="partition"):
        t.up("d1", "ack", "w0")
    # a worker batches only its own partition's messages (a shared-subscription one stands alone)
    from types import SimpleNamespace

    from cloud.service import Aggregator
    worker = SimpleNamespace(cfg=SimpleNamespace(worker_id="w0"))
    assert Aggregator._own_partition(worker, topic) and Aggregator._own_partition(worker, t.up("d1", "stats", "w0"))
    assert not Aggregator._own_partition(worker, t.up("d1", "update", "w1"))
    assert not Aggregator._own_partition(worker, t.up("w0", "update"))  # shared topic of a device named w0


def test_uplinks_spread_devices_over_live_workers_and_leave_a_dead_one(tmp_path, monkeypatch):
    """Rendezvous hashing: each live worker gets a share of the devices, a device keeps its
    worker while the set stays, and a worker that stopped announcing itself gets no device
    (only its own devices move)."""
    import cloud.workers as workers
    from cloud.store import Store

    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    for w in ("w0", "w1", "w2"):
        store.put_json(f"workers/{w}", {"seen": store.clock(), "taken": 0})
    coord = workers.Coordinator(store)
    devices = [f"d{i:04d}" for i in range(600)]
    first = {d: coord.uplink(d) for d in devices}
    counts = {w: list(first.values()).count(w) for w in ("w0", "w1", "w2")}
    assert all(150 <= c <= 250 for c in counts.values()), counts
    assert {d: coord.uplink(d) for d in devices} == first
    store.put_json("workers/w2", {"seen": store.clock() - 2 * workers.WORKER_STALE_S, "taken": 0})
    monkeypatch.setattr(workers, "ANNOUNCE_S", 0.0)  # read the live set again now
    after = {d: coord.uplink(d) for d in devices}
    assert "w2" not in after.values()
    assert all(after[d] == w for d, w in first.items() if w != "w2")
    store.put_json("workers/w0", {"seen": 0.0})
    store.put_json("workers/w1", {"seen": 0.0})
    assert coord.uplink("d0000") is None
    store.close()


@pytest.mark.slow
@fleet_env
@pytest.mark.parametrize("broker", ["mosquitto", "nats-cluster"])
def test_worker_sigkill_mid_round_then_restart_applies_each_update_once(tmp_path, broker):
    """Worker w0 is SIGKILLed as soon as the first update of round 1 is taken (others are
    mid-upload, some chunks in w0's hands) and restarted under its id at the next check, a
    second later (the new process is seconds from connecting: its share waits at the broker). On Mosquitto
    (MQTT 5) and on the 3-node NATS cluster (MQTT 3.1.1: no shared subscriptions; each device
    sends to the worker its assignment names, and w0's session keeps its share)."""
    pytest.importorskip("aiomqtt")
    import shutil
    import time

    from benchmarks import fleet

    if broker == "nats-cluster" and not (shutil.which("nats-server") or shutil.which("/usr/sbin/nats-server")):
        pytest.skip("no nats-server binary (Debian package nats-server)")

    state = {"killed": None, "restarted": False}

    def chaos(mon, pool, coordinators):
        reports = [e for _, e in mon.events if e.get("event") == "report"]
        if state["killed"] is None and reports:
            pool.procs[0].send_signal(signal.SIGKILL)
            pool.procs[0].wait(10)
            state["killed"] = time.time()
        elif state["killed"] and not state["restarted"]:
            pool.start(0)
            state["restarted"] = True

    s = fleet.run_setting(_args(), broker, 12, 8, tmp_path, workers=2, chaos=chaos)
    assert state["restarted"]
    _exactly_once(s, 8)
    assert {w for p in s["rounds"] for w in p["by_worker"]} == {"w0", "w1"}, s["rounds"]


@pytest.mark.slow
@fleet_env
def test_coordinator_sigkill_mid_round_standby_takes_over_and_applies_each_update_once(tmp_path):
    """The coordinator is SIGKILLed once the first update of round 1 was taken, while the two
    workers go on folding; the standby coordinator takes the store's leader lock, resumes the
    round from the store and closes it from the workers' sums."""
    pytest.importorskip("aiomqtt")
    from benchmarks import fleet

    state = {"killed": False}

    def chaos(mon, pool, coordinators):
        if not state["killed"] and any(e.get("event") == "report" for _, e in mon.events):
            coordinators[0].send_signal(signal.SIGKILL)
            state["killed"] = True

    s = fleet.run_setting(_args(), "mosquitto", 12, 8, tmp_path, workers=2, chaos=chaos, standby=True)
    assert state["killed"]
    _exactly_once(s, 8)
    takers = [p["by_worker"] for p in s["rounds"]]  # who took each update (the round records say)
    assert {w for t in takers for w in t} == {"w0", "w1"} and sum(sum(t.values()) for t in takers) == 16, takers
    assert all("taking uploads" in (tmp_path / f"worker-{i}.log").read_text() for i in range(2))
    text = (tmp_path / "aggregator-standby-1.log").read_text()
    assert "leader of store" in text and "resum" in text


@pytest.fixture
def pg_store():
    """A throw-away PostgreSQL schema's store URL."""
    if not _pg_available():
        pytest.skip("no PostgreSQL server at 127.0.0.1:5432")
    from benchmarks import fleet

    url = fleet.fresh_schema(PG_URL)
    yield url
    fleet.drop_schema(url)


@pytest.mark.slow
@pytest.mark.parametrize("robust", ["none", "multi_krum"])
def test_real_devices_and_a_rogue_through_two_workers(mosquitto_url, tmp_path, pg_store, robust):
    """Real SDK devices (torch training) and a rogue device that sends a stale, a wrong-shape,
    a NaN and an over-reaching update: the workers refuse each with its reason, the honest
    update is taken once, and the round closes with a finite model. ``none``: the workers
    fold running sums; ``multi_krum`` (the example config's rule, not a sum): they store the
    update and the coordinator aggregates."""
    import threading

    from cloud.robust.config import DefenceConfig
    from cloud.service import Aggregator
    from tests.federation import Federation
    from tests.test_bad_input import rogue

    replies, assignments = [], []
    fed = Federation(mosquitto_url, str(tmp_path), rounds=1, experts=(2,), min_devices=2, round_timeout_s=15,
                     config_kw={"role": "coordinator", "store": pg_store,
                                "defences": DefenceConfig(robust={"name": robust})})
    workers = [Aggregator(fed.aggregator.cfg.model_copy(update={"role": "worker", "worker_id": f"w{i}"}),
                          mosquitto_url, eval_data={"bbc": fed.test_items}) for i in range(2)]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        assert all(w.ready.wait(30) for w in workers)
        (rec,) = fed.run(extra=lambda f: rogue(f, replies, assignments))
    finally:
        for w in workers:
            w.stop()
        for t in threads:
            t.join(30)
    text = "\n".join(replies)
    for expected in ("does not match the topic", "not valid JSON", "bad magic", "current round is", "shape",
                     "NaN or Inf", "unexpected"):
        assert expected in text, (expected, text)
    assert rec["status"] == "ok" and set(rec["devices"]) == {"dev0"}, rec
    assert rec["devices"]["dev0"]["worker"] in ("w0", "w1")
    assert "evil" in rec["failures"]
    assert all(torch.isfinite(v).all() for v in fed.aggregator.model.state.values())
    assert sum(w.ingest.taken for w in workers) == 1  # the honest update, once


def test_worker_bounds_what_a_device_can_store_in_chunks(pg_store):
    """A (signing) device cannot grow the store without bound through a worker: a repeated
    chunk stores nothing, a chunk that disagrees with its transfer's header or carries more
    bytes than the transfer declared is refused, and a device has at most MAX_TRANSFERS
    uploads in progress a round."""
    import os
    import struct
    from types import SimpleNamespace

    from cloud.store import Store
    from cloud.workers import MAX_TRANSFERS, Ingest
    from protocol.chunking import MAGIC, ChunkError, parse_chunk, sha256_hex, split_blob

    store = Store(pg_store)
    rnd = SimpleNamespace(number=1, selected={"d": {}})
    engine = SimpleNamespace(store=store, current=rnd,
                             check_current=lambda d, r, what, upload=None: rnd if r == 1 and d in rnd.selected else None)
    ing = Ingest(engine, "w0", reject=lambda *a, **k: None, progress=lambda *a: None, max_update_bytes=2**20)
    data = os.urandom(10_000)
    chunks, _ = split_blob(data, 4096, "t1", "update", 1)
    ing.on_chunk("d", chunks[0])
    ing.on_chunk("d", chunks[0])  # a redelivery
    assert store.blob_keys("chunks/1/d/") == ["chunks/1/d/t1/0"]
    other, _ = split_blob(os.urandom(20_000), 4096, "t1", "update", 1)  # same upload id, another blob
    with pytest.raises(ChunkError, match="disagrees"):
        ing.on_chunk("d", other[1])
    h, _ = parse_chunk(chunks[1], 2**20)
    big = os.urandom(len(data))  # seq 1 claiming the whole declared size on top of seq 0
    hb = h.model_copy(update={"csha": sha256_hex(big)}).model_dump_json().encode()
    with pytest.raises(ChunkError, match="more bytes than it declared"):
        ing.on_chunk("d", MAGIC + struct.pack(">I", len(hb)) + hb + big)
    assert store.blob_keys("chunks/1/d/t1/") == []  # the transfer is dropped
    for i in range(MAX_TRANSFERS):
        ing.on_chunk("d", split_blob(data, 4096, f"u{i}", "update", 1)[0][0])
    with pytest.raises(ChunkError, match=f"at most {MAX_TRANSFERS}"):
        ing.on_chunk("d", split_blob(data, 4096, "u9", "update", 1)[0][0])
    ing.on_chunk("x", chunks[0])  # not selected: refused by the round, nothing stored
    assert store.blob_keys("chunks/1/x/") == []
    store.close()


def test_worker_reassembles_its_own_partition_in_memory_and_stores_only_what_a_batch_leaves(pg_store):
    """On a worker's own uplink partition an upload's chunks stay in memory: nothing reaches
    the store while the batch lasts; at its end (end_batch) the chunks of an upload that is
    still incomplete are stored, so that a worker killed after acknowledging them and
    started again completes the upload from the store and the redelivered rest."""
    import os
    from types import SimpleNamespace

    from cloud.store import Store
    from cloud.workers import MAX_TRANSFERS, Ingest
    from protocol.chunking import ChunkError, split_blob

    store = Store(pg_store)
    rnd = SimpleNamespace(number=1, selected={"d": {}, "e": {}})
    engine = SimpleNamespace(store=store, current=rnd,
                             check_current=lambda d, r, what, upload=None: rnd if r == 1 and d in rnd.selected else None)

    def worker() -> tuple[Ingest, list]:
        ing = Ingest(engine, "w0", reject=lambda *a, **k: None, progress=lambda *a: None, max_update_bytes=2**20)
        got: list = []

        def on_update(device, blob, chunks):  # decoded, waiting for its statistics
            got.append((device, blob.data, chunks))
            ing._decoded[(1, device)] = (blob.header.sha, {}, chunks)

        ing.on_update, ing.flush = on_update, lambda: 0
        return ing, got

    a, b = os.urandom(10_000), os.urandom(9_000)
    ca, _ = split_blob(a, 4096, "ta", "update", 1)
    cb, _ = split_blob(b, 4096, "tb", "update", 1)
    ing, got = worker()
    for c in ca:  # a whole upload within one batch: it never reaches the store
        ing.on_chunk("d", c, own=True)
    ing.on_chunk("e", cb[0], own=True)
    ing.on_chunk("e", cb[0], own=True)  # a redelivery
    assert got == [("d", a, "chunks/1/d/ta/")] and store.blob_keys("chunks/") == []
    ing._decoded.pop((1, "d"))
    ing._held.pop("chunks/1/d/ta/")  # as if taken in this batch (flush drops what it took)
    ing.end_batch()
    assert store.blob_keys("chunks/") == ["chunks/1/e/tb/0"]  # only the incomplete upload's chunk
    ing2, got2 = worker()  # the worker killed and started again: the rest of e's upload redelivered
    for c in cb[1:]:
        ing2.on_chunk("e", c, own=True)
    assert got2 == [("e", b, "chunks/1/e/tb/")]
    ing2._drop_chunks("chunks/1/e/tb/")  # taken: its stored chunk goes
    assert store.blob_keys("chunks/") == []
    for i in range(MAX_TRANSFERS):  # as on the shared path: at most MAX_TRANSFERS uploads in progress
        ing2.on_chunk("d", split_blob(a, 4096, f"u{i}", "update", 1)[0][0], own=True)
    with pytest.raises(ChunkError, match=f"at most {MAX_TRANSFERS}"):
        ing2.on_chunk("d", split_blob(a, 4096, "u9", "update", 1)[0][0], own=True)
    store.close()
