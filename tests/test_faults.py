"""Fault survival against a real Mosquitto (own process, free port, persistence on):
a device SIGKILLed mid-round, the aggregator SIGKILLed and restarted, the broker
restarted mid-round. Duplicates and stragglers: tests/test_security.py."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from cloud.store import Store
from edge_sdk import EdgeClient
from moe_model.budget import estimate
from fedmoe.broker import MosquittoBroker
from fedmoe.datasets import bbc_news
from protocol.messages import Progress, parse_message
from protocol.topics import Topics
from protocol.transport import Transport
from tests.conftest import tiny_spec
from tests.federation import Federation

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not MosquittoBroker.available(), reason="no mosquitto binary")]
ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture
def broker(tmp_path):
    b = MosquittoBroker(str(tmp_path / "broker")).start()
    yield b
    b.stop()


class Observer:
    """Records every message on ``topics`` in a background thread."""

    def __init__(self, url: str, *topics: str):
        self.tr = Transport(url, protocol="5").connect()
        for t in topics:
            self.tr.subscribe(t)
        self.seen: list[tuple[str, bytes]] = []
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop:
            m = self.tr.get(0.1)
            if m is not None:
                self.seen.append((m.topic, m.payload))

    def progress(self) -> list[Progress]:
        return [parse_message(p, Progress) for t, p in list(self.seen) if t.endswith("cloud/progress")]

    def wait(self, pred, timeout: float, what: str) -> None:
        end = time.time() + timeout
        while time.time() < end:
            if pred():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def close(self):
        self._stop = True
        self._t.join(2)
        self.tr.close()


def reported(obs: Observer, device: str, rnd: int) -> bool:
    return any(p.event == "report" and p.round == rnd and p.detail.get("device") == device for p in obs.progress())


def gate_round1(client: EdgeClient, gate: threading.Event) -> None:
    """Hold ``client`` before it starts round 1 until ``gate`` is set."""
    orig = client._train_round

    def gated(a):
        if a.round == 1:
            gate.wait(120)
        orig(a)

    client._train_round = gated


@pytest.mark.parametrize("store_url,takeover,streaming", [("sqlite", "restart", False),
                                                           ("postgresql", "standby", False),
                                                           ("sqlite", "restart", True)],
                         indirect=["store_url"])
def test_aggregator_sigkill_and_restart_loses_nothing(broker, tmp_path, store_url, takeover, streaming):
    """The aggregator is SIGKILLed after accepting one of round 1's two updates; the other
    device publishes meanwhile. ``restart``: the operator starts it again; ``standby``: a
    second aggregator started with ``--standby`` at the beginning takes the store's
    leader lock as the first dies. Both rounds complete with every update applied once.
    Two of the four store x takeover pairs (each store and each takeover once: the store's
    code paths do not depend on how the aggregator comes back; 35 s a pair), and once with
    streaming rounds (no robust rule and no screening: each update folded into the round's
    sums as it is reported, its payload replaced in the store by the sums)."""
    items, labels = bbc_news()
    spec = tiny_spec(upcycle_noise=0.01)
    fed = f"kill-{os.getpid()}-{int(time.time())}"
    cfg = {"federation": fed, "model": spec.model_dump(mode="json"), "tasks": {"bbc": {"labels": labels}},
           "rounds": 2, "min_devices": 2, "round_timeout_s": 90, "train": {"max_steps": 3, "batch_size": 8},
           "store": store_url, "clear_retained_on_exit": True, "threads": 1,
           "resume_drain_s": 2.0}
    if streaming:
        cfg["defences"] = {"robust": {"name": "none"}, "screening": None}
    (tmp_path / "agg.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "fedmoe", "aggregator", "--broker", broker.url(), "--config", str(tmp_path / "agg.yaml")]

    def start(n):
        log = open(tmp_path / f"agg{n}.log", "w")
        return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)

    t = Topics(fed)
    obs = Observer(broker.url(), t.progress(), f"{t.root}/dev/+/up/stats")
    agg = start(1)
    standby = None
    if takeover == "standby":
        obs.wait(lambda: any(p.event in ("waiting", "round_start") for p in obs.progress())
                 or agg.poll() is not None, 120, "the leader to start")
        second = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1 and "another aggregator holds store" in second.stderr, second.stderr[-2000:]
        standby = subprocess.Popen(cmd + ["--standby"], cwd=ROOT, env=ENV, stdout=open(tmp_path / "agg2.log", "w"),
                                   stderr=subprocess.STDOUT)
        obs.wait(lambda: "standby: another aggregator holds store" in (tmp_path / "agg2.log").read_text()
                 or standby.poll() is not None, 60, "the standby to wait")
        assert standby.poll() is None, (tmp_path / "agg2.log").read_text()[-3000:]
    gate = threading.Event()
    clients, threads = [], []
    for i, k in enumerate((2, 4)):
        budget = estimate(spec, k, 8, len(labels), runtime_bytes=0).total + 1
        c = EdgeClient(broker.url(), f"dev{i}", items[i::9][:40], federation=fed, budget_bytes=budget, task="bbc",
                       cache_dir=str(tmp_path / f"cache{i}"), runtime_bytes=0)
        clients.append(c)
    gate_round1(clients[1], gate)
    for c in clients:
        th = threading.Thread(target=lambda c=c: c.run(idle_timeout=240) or None, daemon=True)
        th.start()
        threads.append(th)
    try:
        obs.wait(lambda: reported(obs, "dev0", 1), 120, "dev0's round-1 update to be accepted")
        agg.send_signal(signal.SIGKILL)
        agg.wait(10)
        gate.set()  # dev1 trains and publishes while the aggregator is down (or the standby takes over)
        if standby is None:
            obs.wait(lambda: any("/dev/dev1/up/stats" in tp for tp, _ in obs.seen), 60, "dev1's stats")
            time.sleep(0.5)
            agg = start(2)
        else:
            agg = standby
        assert agg.wait(180) == 0, (tmp_path / "agg2.log").read_text()[-3000:]
    finally:
        gate.set()
        for p in (agg, standby):
            if p is not None and p.poll() is None:
                p.kill()
        obs.close()
        for c in clients:
            c.stop()
    for th in threads:
        th.join(30)
    log2 = (tmp_path / "agg2.log").read_text()
    assert "resumed round 1" in log2 and "1 updates and 1 stats already accepted" in log2
    assert ("round 1: resumed streaming with 1 update folded" in log2) == streaming
    store = Store(cfg["store"])
    rounds = store.rounds()
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["status"] == "ok" and set(r["devices"]) == {"dev0", "dev1"} for r in rounds)
    # each device's update was applied exactly once per round (the counter is written
    # in the same transaction as the round's aggregation)
    assert {d: info["rounds"] for d, info in store.devices().items()} == {"dev0": 2, "dev1": 2}
    assert store.get_json("current_round") is None and store.blob_keys("inflight/") == []
    assert [len(c.history) for c in clients] == [2, 2]


def test_device_sigkill_will_marks_offline_round_closes_with_quorum_and_device_rejoins(broker, tmp_path):
    # round 1 waits out its deadline (dev2 never reports); the restarted dev2 must be online before it
    # closes to be in round 2: it was 8-9 s after round 1's start on 2 cores at load 5, so 16 s
    fed = Federation(broker.url(), str(tmp_path), rounds=2, experts=(2, 4), min_devices=3, round_timeout_s=16)
    data = tmp_path / "dev2.csv"
    with data.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows(fed.train_items[200:240])
    budget = "4GiB"  # the process measures its own runtime memory; the tiny model fits easily
    cmd = [sys.executable, "-m", "fedmoe", "device", "--broker", broker.url(), "--device-id", "dev2", "--budget",
           str(budget), "--data", str(data), "--task", "bbc", "--federation", fed.federation, "--threads", "1",
           "--cache-dir", str(tmp_path / "cache2"), "--idle-timeout", "120"]
    t = Topics(fed.federation)
    obs = Observer(broker.url(), t.down("dev2", "assignment"), t.up("dev2", "status"))
    procs = []
    events = {}

    def extra(f: Federation):
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=open(tmp_path / "dev2a.log", "w"),
                                      stderr=subprocess.STDOUT))
        # killed as its round-1 assignment goes out: before it can fetch, train and upload
        # (after its ack, a fast round could finish first under load)
        obs.wait(lambda: any(tp.endswith("/assignment") for tp, _ in obs.seen), 120, "dev2's round-1 assignment")
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        reg = f.aggregator.registry
        obs.wait(lambda: reg.get("dev2") is not None and not reg.get("dev2").online, 60, "dev2's Last Will")
        events["offline_in_round"] = f.aggregator.engine.current.number if f.aggregator.engine.current else None
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=open(tmp_path / "dev2b.log", "w"),
                                      stderr=subprocess.STDOUT))

    try:
        r1, r2 = fed.run(extra=extra, timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        obs.close()
    statuses = [json.loads(p)["state"] for tp, p in obs.seen if tp.endswith("/status") and p]
    assert "offline" in statuses                                    # the Last Will
    assert events["offline_in_round"] == 1
    assert r1["status"] == "ok" and {"dev0", "dev1"} <= set(r1["devices"])
    sent_r1 = [tp for tp, p in obs.seen if tp.endswith("/assignment") and p and json.loads(p)["round"] == 1]
    if "dev2" in r1["devices"]:
        # killed before it acknowledged: the aggregator re-sent round 1's assignment, and the
        # restarted dev2 reported before the deadline (seen in a loaded full test run); or the
        # first process trained (0.3 s) and uploaded before the kill landed (seen too)
        assert len(sent_r1) >= 2 or "dev2 round 1:" in (tmp_path / "dev2a.log").read_text()
    else:
        assert r1["failures"] == {"dev2": "no update before the deadline"}
    assert r2["status"] == "ok" and set(r2["devices"]) == {"dev0", "dev1", "dev2"}   # rejoined


def test_broker_restart_mid_round(broker, tmp_path):
    gate = threading.Event()
    fed = Federation(broker.url(), str(tmp_path), rounds=2, experts=(2, 4), round_timeout_s=90,
                     client_hook=lambda c: gate_round1(c, gate) if c.device_id == "dev1" else None)

    def extra(f: Federation):
        end = time.time() + 120
        while time.time() < end:
            rnd = f.aggregator.engine.current
            if rnd is not None and rnd.reported("dev0"):
                break
            time.sleep(0.05)
        broker.restart()
        gate.set()

    try:
        r1, r2 = fed.run(extra=extra, timeout=240)
    finally:
        gate.set()
    assert all(r["status"] == "ok" and set(r["devices"]) == {"dev0", "dev1"} for r in (r1, r2))
    assert fed.aggregator.transport.reconnects >= 1
    assert all(c.transport.reconnects >= 1 for c in fed.clients)
