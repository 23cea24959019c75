"""Fleet load test (issue "scale-out"): thousands of protocol-level devices against the real aggregator.

For each setting (broker x fleet size x aggregator workers) this starts its own broker (a
Mosquitto 2.0 process, or the 3-node NATS cluster of ``fedmoe.natscluster``), the real
``fedmoe aggregator`` process (signatures required, SQLite store, the ``full`` assignment
so every update has one known size, ``modular`` aggregation with the default screening and
guard) and ``--procs`` device processes (``benchmarks/fleet_devices.py``: asyncio MQTT
clients speaking the device side of PROTOCOL.md with real signed, chunked safetensors
updates, no model). It measures:

- devices connected (each device's CONNACK; on Mosquitto also the broker's own
  ``$SYS/broker/clients/connected``);
- per round: updates accepted, rounds per hour (3600 / the round's seconds), updates
  accepted per second while ingesting ((n - 1) / the time between the first and the last
  accepted update), and the time from a device's last update chunk being acknowledged by
  the broker to the aggregator folding the update in (its ``report`` progress event;
  p50/p99);
- accounting: every update a device finished uploading is accepted exactly once (no
  ``report`` event twice for a device and round, none missing, no reject);
- aggregator and broker peak RSS, and their CPU seconds per accepted update.

    python -m benchmarks.fleet            # Mosquitto: 1,000 / 10,000 devices, 1,000 updates per round, 1/2/4 workers;
                                          # the NATS cluster: 300 / 1,000 devices, 1/2/4 workers at 1,000, and 300
                                          # devices with a QoS 1 downlink (as before protocol 1.9)
    python -m benchmarks.fleet --quick    # 300 devices, 100 updates of 1 MiB per round: Mosquitto (one process,
                                          # 1-2 workers), the cluster (one process, 1-2 workers)
    python -m benchmarks.fleet --sizes "" --cluster-sizes 100,300    # the NATS cluster only

Writes ``results/fleet/fleet{,_quick}.{json,md,png}``. At the largest Mosquitto size it
also runs a coordinator with 1, 2 and 4 ``--role worker`` processes (``--worker-counts``;
PostgreSQL store, a fresh schema each, ``--pg``) and reports how the ingest rate grows with
workers, measured in the same run (``scaling``); at the largest cluster size, a coordinator
with ``--cluster-worker-counts`` workers. Each device sends its uploads to the worker its
assignment names (``Assignment.uplink``), on the cluster's MQTT 3.1.1 as on Mosquitto.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
from collections import Counter
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import fmt, heavy_lock, module_command, module_env, stop_on_sigterm, write_result

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("fleet")
MIB = 2**20
MODEL = {"family": "bert-upcycled", "base": None, "num_experts": 16, "top_k": 2, "moe_layers": [0, 1],
         "max_seq_len": 32, "config": {"vocab_size": 30522, "hidden_size": 256, "num_hidden_layers": 2,
                                       "num_attention_heads": 4, "intermediate_size": 768}}
"""A random-init upcycled BERT whose full LoRA adapter state (16 experts x 2 MoE layers,
rank 8) is 1.07 MiB in fp32: every device holds all experts, so every update has that size."""
LABELS = ["business", "entertainment", "politics", "sport", "tech"]


def provision(n: int, work: Path) -> tuple[list[tuple[str, str]], Path]:
    """``n`` device ids with fresh Ed25519 keys: ([(id, private key b64)], device_keys.json path)."""
    from protocol.signing import generate_key, private_key_b64, public_key_b64

    devices, public = [], {}
    for i in range(n):
        k = generate_key()
        did = f"fleet-{i:06d}"
        devices.append((did, private_key_b64(k)))
        public[did] = public_key_b64(k)
    path = work / "device_keys.json"
    path.write_text(json.dumps(public))
    return devices, path


def aggregator_config(work: Path, args, n: int, per_round: int, protocol: str, keys: Path, store: str,
                      resend: bool = True) -> Path:
    """The aggregator's YAML for one setting (module docstring); ``resend``: False turns off
    re-sending unacknowledged assignments (the devices' downlink is QoS 1, as before
    protocol 1.9: a slow delivery is not a loss, and re-sending would only add states)."""
    import yaml

    (work / "eval.jsonl").write_text("".join(json.dumps({"text": f"fleet evaluation text {i}", "label": LABELS[i % 5]})
                                             + "\n" for i in range(16)))
    cfg = {"federation": "fleet", "model": MODEL, "tasks": {"bbc": {"labels": LABELS,
                                                                    "eval_data": str(work / "eval.jsonl")}},
           "rounds": args.rounds, "min_devices": n, "start_timeout_s": 1800, "clients_per_round": per_round,
           "quorum": 0.5, "round_timeout_s": args.round_timeout, "assignment": {"name": "full"},
           "aggregation": {"name": "modular"},
           # Multi-Krum (the default rule) holds every update and costs O(n^2) distances per round: the fleet
           # measures the streaming round unless --robust names a rule
           "defences": {"robust": {"name": args.robust}},
           "train": {"max_steps": 1, "batch_size": 8}, "weight_format": "int8",
           "store": store, "device_keys": str(keys), "protocol": protocol,
           "stop_devices_when_done": False, "threads": 1}
    if not resend:
        cfg["assignment_resend_s"] = 0
    path = work / "aggregator.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Monitor:
    """Timestamps the aggregator's progress events and the broker's client count (one paho
    client, MQTT 3.1.1 so it works on either broker) and samples RSS and CPU of the
    aggregator and broker processes every second (psutil)."""

    def __init__(self, host: str, port: int, federation: str):
        import paho.mqtt.client as mqtt

        from protocol.topics import Topics

        self.events: list[tuple[float, dict]] = []
        self.sys_connected = 0
        self.samples: dict[str, dict] = {}
        self._pids: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._progress = Topics(federation).progress()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="fleet-monitor", protocol=mqtt.MQTTv311)
        c.on_connect = lambda cl, *_: (cl.subscribe(self._progress, 1), cl.subscribe("$SYS/broker/clients/connected"))
        c.on_message = self._on_message
        c.connect(host, port, keepalive=600)
        c.loop_start()
        self._client = c
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _on_message(self, _c, _u, msg) -> None:
        if msg.topic == self._progress:
            try:
                event = json.loads(msg.payload)
            except ValueError:
                return
            self.events.append((time.time(), event))
            if event.get("event") in ("round_start", "round_end"):  # CPU spent in rounds, not in start-up
                for name, pids in list(self._pids.items()):
                    self.samples[name].setdefault(event["event"], []).append(self._cpu(_resolve(pids)))
        else:
            try:
                self.sys_connected = max(self.sys_connected, int(msg.payload))
            except ValueError:
                pass

    def watch(self, name: str, pids) -> None:
        """Sample the summed RSS and CPU time of ``pids`` (a list, or a function returning the
        list at each sample: processes that come and go) as ``name``."""
        self._pids[name] = pids
        self.samples.setdefault(name, {"peak_rss": 0})

    @staticmethod
    def _total(pids: list[int], read) -> float:
        """``read(psutil.Process)`` summed over ``pids`` (processes that ended count 0)."""
        import psutil

        total = 0.0
        for p in pids:
            try:
                total += read(psutil.Process(p))
            except psutil.Error:
                pass
        return total

    def _cpu(self, pids: list[int]) -> float:
        return self._total(pids, lambda p: sum(p.cpu_times()[:2]))  # user + system seconds

    def _rss(self, pids: list[int]) -> int:
        return int(self._total(pids, lambda p: p.memory_info().rss))

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            for name, pids in list(self._pids.items()):
                s = self.samples[name]
                s["peak_rss"] = max(s["peak_rss"], self._rss(_resolve(pids)))

    def round_cpu(self, name: str) -> float | None:
        """CPU seconds ``name`` spent from the first round's start to the last round's end."""
        s = self.samples.get(name, {})
        return s["round_end"][-1] - s["round_start"][0] if s.get("round_start") and s.get("round_end") else None

    def stop(self) -> None:
        self._stop.set()
        self._client.loop_stop()
        self._client.disconnect()


def _resolve(pids) -> list[int]:
    return pids() if callable(pids) else pids


def postgres_pids() -> list[int]:
    """The PostgreSQL server's processes now (its connection backends come and go)."""
    import psutil

    return [p.pid for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("postgres")]


def start_broker(kind: str, work: Path, ack_wait: str | None = None):
    """(broker object, device node list [(host, port)], aggregator URL, protocol, broker pids);
    ``ack_wait``: the NATS cluster's redelivery time of an unacknowledged QoS 1 message
    (None: the shipped :data:`fedmoe.natscluster.ACK_WAIT`)."""
    if kind == "mosquitto":
        from fedmoe.broker import MosquittoBroker

        b = MosquittoBroker(str(work / "mosquitto"), persistence=False, config=(
            "allow_anonymous true\nmax_connections -1\nmax_queued_messages 0\nmax_queued_bytes 0\n"
            "max_inflight_messages 0\nsys_interval 2\nmemory_limit 0\n")).start()
        return b, [(b.host, b.port)], b.url(), "5", [b.proc.pid]
    from fedmoe.natscluster import ACK_WAIT, NatsCluster

    c = NatsCluster(work / "nats", ack_wait=ack_wait or ACK_WAIT).start()
    return c, [(c.host, p) for p in c.mqtt_ports], c.url, "3.1.1", [p.pid for p in c.procs if p is not None]


PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
"""The PostgreSQL database the worker settings use (a fresh schema each; ``--pg``)."""


class Workers:
    """The ``fedmoe aggregator --role worker`` processes of one setting (``w0``, ``w1``, ...),
    each restartable under its id (its broker session and sums keep the id)."""

    def __init__(self, args, url: str, cfg: Path, work: Path, count: int):
        self.cmd = lambda i: [args.fedmoe, "aggregator", "--broker", url, "--config", str(cfg), "--role", "worker",
                              "--worker-id", f"w{i}"]
        self.work, self.procs, self.logs = work, [None] * count, []
        for i in range(count):
            self.start(i)

    def start(self, i: int) -> subprocess.Popen:
        """(Re)start worker ``i``; returns its process."""
        self.logs.append(open(self.work / f"worker-{i}.log", "a"))
        self.procs[i] = subprocess.Popen(self.cmd(i), stdout=self.logs[-1], stderr=subprocess.STDOUT, cwd=self.work)
        return self.procs[i]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in self.logs:
            f.close()


def fresh_schema(pg: str) -> str:
    """A new empty schema in ``pg``'s database; returns the store URL that uses it."""
    import uuid

    import psycopg

    schema = f"fleet_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {schema}")
    return f"{pg}?options=-csearch_path%3D{schema}"


def drop_schema(store: str) -> None:
    """Drop the schema :func:`fresh_schema` made."""
    import psycopg

    base, _, opts = store.partition("?options=-csearch_path%3D")
    with psycopg.connect(base, autocommit=True) as c:
        c.execute(f"DROP SCHEMA IF EXISTS {opts} CASCADE")


def run_setting(args, broker_kind: str, n: int, per_round: int, work: Path, workers: int = 0,
                chaos=None, standby: bool = False, down_qos: str | None = None) -> dict:
    """One fleet run; returns its measurements (module docstring).

    Args:
        workers: 0: one ``fedmoe aggregator`` process (SQLite store); k >= 1: a coordinator
            and k workers on a fresh PostgreSQL schema (``args.pg``).
        chaos: called about every second as ``chaos(monitor, workers, coordinators)`` (fault tests).
        standby: start a second coordinator with ``--standby`` (it takes over when the first dies).
        down_qos: "0", "1" or "auto" (the default: ``args.down_qos``): the QoS of the devices'
            ``down/#`` subscription; auto is 0 on the cluster (as the SDK does there), 1 on Mosquitto.
    """
    work.mkdir(parents=True, exist_ok=True)
    for f in work.glob("*"):
        if f.is_file():
            f.unlink()
    t0 = time.time()
    devices, keys = provision(n, work)
    broker, nodes, url, protocol, broker_pids = start_broker(broker_kind, work, getattr(args, "ack_wait", None))
    procs, agg, logs, pool = [], None, [], None
    store = fresh_schema(getattr(args, "pg", PG_URL)) if workers else f"sqlite:///{work / 'aggregator.db'}"
    mon = Monitor(nodes[0][0], nodes[0][1], "fleet")
    down_qos = {"auto": 1 if broker_kind == "mosquitto" else 0, "0": 0, "1": 1}[
        down_qos or getattr(args, "down_qos", "auto")]
    try:
        cfg = aggregator_config(work, args, n, per_round, protocol, keys, store, resend=down_qos == 0)
        coords = []
        for i in range(2 if standby else 1):  # the first leads (it exits if it cannot), the second waits
            if i:
                time.sleep(1.0)
            logs.append(open(work / ("aggregator.log" if i == 0 else f"aggregator-standby-{i}.log"), "w"))
            coords.append(subprocess.Popen([args.fedmoe, "aggregator", "--broker", url, "--config", str(cfg)]
                                           + (["--role", "coordinator"] if workers else [])
                                           + (["--standby"] if i else []),
                                           stdout=logs[-1], stderr=subprocess.STDOUT, cwd=work))
        agg = coords[0]
        if workers:
            pool = Workers(args, url, cfg, work, workers)
        mon.watch("aggregator", [agg.pid] + (pool.pids if pool else []))
        mon.watch("coordinator", [agg.pid])
        if workers:
            mon.watch("store", postgres_pids)
        mon.watch("broker", broker_pids)
        nprocs = min(args.procs, n)
        spec = {"federation": "fleet", "task": "bbc", "protocol": protocol, "nodes": nodes, "train_s": args.train_s,
                "down_qos": down_qos,
                "out": str(work), "connect_rate": args.connect_rate / nprocs,
                "devices": [devices[i::nprocs] for i in range(nprocs)]}
        (work / "spec.json").write_text(json.dumps(spec))
        for i in range(nprocs):
            logs.append(open(work / f"devices-{i}.log", "w"))
            procs.append(subprocess.Popen(module_command("fleet_devices", "--spec", str(work / "spec.json"), "--index", str(i)),
                                          env=module_env(), stderr=logs[-1]))
        mon.watch("devices", [p.pid for p in procs])
        deadline = time.time() + args.timeout
        last = 0.0
        while any(c.poll() is None for c in coords) and time.time() < deadline:
            time.sleep(1.0)
            if chaos is not None:
                chaos(mon, pool, coords)
                if pool is not None:
                    mon.watch("aggregator", [agg.pid] + pool.pids)  # a restarted worker
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"device process {dead[0]} exited with {procs[dead[0]].returncode}: see "
                                   f"{work / f'devices-{dead[0]}.log'}")
            if time.time() - last > 10:
                last = time.time()
                up = sum(int((work / f"progress-{i}.txt").read_text().split()[0])
                         for i in range(nprocs) if (work / f"progress-{i}.txt").exists())
                ends = [e for _, e in mon.events if e.get("event") == "round_end"]
                reps = sum(e.get("event") == "report" for _, e in mon.events)
                log.info("[%s n=%d] %.0f s: %d devices connected, %d rounds closed, %d updates accepted",
                         broker_kind, n, time.time() - t0, up, len(ends), reps)
        timed_out = any(c.poll() is None for c in coords)
        if timed_out:
            log.warning("[%s n=%d] the aggregator did not finish within %d s; stopping it", broker_kind, n,
                        args.timeout)
            for c in coords:
                c.terminate()
                c.wait(30)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        for c in coords if agg is not None else []:
            if c.poll() is None:
                c.kill()
        if pool is not None:
            pool.stop()
        mon.stop()
        broker.stop()
        for f in logs:
            f.close()
    records = {}
    for i in range(len(procs)):
        f = work / f"devices-{i}.json"
        if f.exists():
            records.update(json.loads(f.read_text()))
    try:
        out = summarise(broker_kind, n, per_round, records, mon, work, timed_out, time.time() - t0, store, workers)
        out["down_qos"] = down_qos
        return out
    finally:
        if workers:
            drop_schema(store)


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ``xs`` by nearest rank, or None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * len(s)) - 1))]


def summarise(broker_kind: str, n: int, per_round: int, records: dict, mon: Monitor, work: Path, timed_out: bool,
              wall: float, store_url: str, workers: int) -> dict:
    """The setting's figures from the device records, the progress events and the store."""
    from cloud.store import Store

    store = Store(store_url)
    rounds = store.rounds()
    store.close()
    reports: dict[tuple[int, str], list[float]] = {}
    for t, e in mon.events:
        if e.get("event") == "report":
            reports.setdefault((e["round"], e["detail"]["device"]), []).append(t)
    per_round_out, latencies = [], []
    lost, twice, accepted_total = 0, 0, 0
    for rec in rounds:
        r = rec["round"]
        accepted = set(rec.get("devices", {}))
        uploaded = {d for d, x in records.items() if "stats_sent" in x["rounds"].get(str(r), {})}
        times = sorted(t[0] for (rr, _), t in reports.items() if rr == r)
        lat = [reports[(r, d)][0] - records[d]["rounds"][str(r)]["last_chunk"]
               for d in uploaded if (r, d) in reports]
        latencies += lat
        lost_r = len(uploaded - accepted)
        twice_r = sum(len(v) > 1 for (rr, _), v in reports.items() if rr == r)
        lost, twice, accepted_total = lost + lost_r, twice + twice_r, accepted_total + len(accepted)
        per_round_out.append({
            "round": r, "status": rec["status"], "selected": len(rec["selected"]), "accepted": len(accepted),
            "uploaded": len(uploaded), "not_accepted": lost_r, "reported_twice": twice_r,
            "failures": len(rec.get("failures", {})), "seconds": rec["seconds"],
            "ingest_per_s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0]
            else None,
            "latency_p50_s": percentile(lat, 0.5), "latency_p99_s": percentile(lat, 0.99),
            "aggregator_rss_bytes": rec.get("aggregator_rss_bytes"),
            "by_worker": dict(sorted(Counter(x.get("worker", "-") for x in rec.get("devices", {}).values()).items()))})
    connected = sum(x["connected_at"] is not None for x in records.values())
    sizes = [x["rounds"][r]["update_bytes"] for x in records.values() for r in x["rounds"]
             if "update_bytes" in x["rounds"][r]]
    s = mon.samples

    def per_update(cpu: float | None) -> float | None:
        return cpu / accepted_total if cpu is not None and accepted_total else None

    ok_rounds = [p for p in per_round_out if p["status"] == "ok"]
    ingest = [p["ingest_per_s"] for p in ok_rounds if p["ingest_per_s"]]
    out = {
        "broker": broker_kind, "devices": n, "updates_per_round": per_round, "workers": workers,
        "connected": connected, "broker_connected": mon.sys_connected or None,
        "reconnects": sum(max(0, x["connects"] - 1) for x in records.values()),
        "update_bytes": statistics.mean(sizes) if sizes else None, "rounds": per_round_out,
        "rounds_closed": len(rounds), "timed_out": timed_out, "wall_s": wall,
        "accepted": accepted_total, "not_accepted": lost, "reported_twice": twice,
        "rejects": sum(x["rejects"] for x in records.values()),
        "resent_assignments_taken": sum(x["rounds"][r].get("resent", 0) for x in records.values() for r in x["rounds"]),
        "reject_reasons": sorted({r for x in records.values() for r in x["reject_reasons"]})[:5],
        "device_errors": sorted({x["rounds"][r]["error"] for x in records.values() for r in x["rounds"]
                                 if "error" in x["rounds"][r]})[:5],
        "rounds_per_hour": 3600 / statistics.mean(p["seconds"] for p in ok_rounds) if ok_rounds else None,
        "ingest_per_s": statistics.mean(ingest) if ingest else None,
        "latency_p50_s": percentile(latencies, 0.5), "latency_p99_s": percentile(latencies, 0.99),
        "aggregator_peak_rss_bytes": s["aggregator"]["peak_rss"], "broker_peak_rss_bytes": s["broker"]["peak_rss"],
        "devices_peak_rss_bytes": s["devices"]["peak_rss"],
        "aggregator_cpu_s_per_update": per_update(mon.round_cpu("aggregator")),
        "coordinator_peak_rss_bytes": s["coordinator"]["peak_rss"],
        "store_cpu_s_per_update": per_update(mon.round_cpu("store")),
        "coordinator_cpu_s_per_update": per_update(mon.round_cpu("coordinator")),
        "broker_cpu_s_per_update": per_update(mon.round_cpu("broker")),
        "devices_cpu_s_per_update": per_update(mon.round_cpu("devices")),
    }
    log.info("[%s n=%d] %d connected, %d rounds, %d accepted, %d not accepted, %d twice, %s updates/s, "
             "p50 %s s, p99 %s s", broker_kind, n, connected, len(rounds), accepted_total, lost, twice,
             fmt(out["ingest_per_s"], ".1f"), fmt(out["latency_p50_s"], ".2f"), fmt(out["latency_p99_s"], ".2f"))
    return out


MILLION = {"devices": 1_000_000, "share_per_round": 0.1, "rounds_per_hour": 1.0}
"""The fleet :func:`estimate` sizes: a million devices, a tenth of them per round, a round an hour."""


def estimate(settings: list[dict], fleet: dict = MILLION) -> dict | None:
    """What ``fleet`` needs, scaled linearly from the settings measured on one Mosquitto
    (None without one): aggregator and broker cores from their CPU seconds per accepted
    update (the largest fleet's), broker memory per connected device from the slope of
    the broker's peak RSS over the fleet sizes (the same updates per round in flight at
    each size; with one size, its peak RSS over its devices, an upper bound), network
    from the update size (up, and the same state down), in-flight store writes (one update
    blob per accepted update, kept for a restart). Linear scaling is the assumption to
    check: it holds for sums, not for a robust rule such as Multi-Krum (O(n^2))."""
    single = sorted((s for s in settings if s["broker"] == "mosquitto" and not s["workers"] and s["accepted"]),
                    key=lambda s: s["connected"])
    if not single:
        return None
    s = single[-1]
    xs, ys = [t["connected"] for t in single], [t["broker_peak_rss_bytes"] for t in single]
    if len(set(xs)) > 1:
        mx, my = statistics.mean(xs), statistics.mean(ys)
        rss_per_device = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        basis = "the slope of its peak RSS over the fleet sizes"
    else:
        rss_per_device = ys[0] / max(1, xs[0])
        basis = "its peak RSS over the devices of one size, in-flight updates included: an upper bound"
    per_round = fleet["devices"] * fleet["share_per_round"]
    rate = per_round * fleet["rounds_per_hour"] / 3600  # updates per second, averaged over the hour
    size = s["update_bytes"] or 0
    return {
        **fleet, "updates_per_round": per_round, "updates_per_s": rate,
        "aggregator_cores": rate * (s["aggregator_cpu_s_per_update"] or 0),
        "broker_cores": rate * (s["broker_cpu_s_per_update"] or 0),
        "broker_memory_gib": fleet["devices"] * max(0.0, rss_per_device) / 2**30,
        "broker_rss_per_device_kib": rss_per_device / 1024, "broker_memory_basis": basis,
        "network_mbit_s": rate * 2 * size * 8 / 1e6,
        "store_write_mib_s": rate * size / MIB,
        "round_ingest_minutes_one_aggregator": per_round / s["ingest_per_s"] / 60 if s["ingest_per_s"] else None,
        "aggregator_rss_per_update_mib": s["aggregator_peak_rss_bytes"] / MIB / max(1, s["updates_per_round"]),
        "from": ", ".join(f"n={t['connected']}" for t in single) + " on one Mosquitto",
        **_worker_estimate(settings, rate),
    }


def _worker_estimate(settings: list[dict], rate: float) -> dict:
    """The coordinator + workers part of :func:`estimate`: their CPU per update (all
    processes, the 1-worker setting), the cores that makes at ``rate`` updates/s, the
    coordinator's peak RSS and how many updates per second one worker took."""
    one = [s for s in settings if s["broker"] == "mosquitto" and s["workers"] == 1 and s["accepted"]]
    if not one:
        return {}
    s = one[-1]
    cpu = s["aggregator_cpu_s_per_update"]
    return {"workers_cpu_s_per_update": cpu, "workers_cores": rate * cpu if cpu else None,
            "coordinator_peak_rss_mib": s["coordinator_peak_rss_bytes"] / MIB,
            "one_worker_ingest_per_s": s["ingest_per_s"],
            "workers_for_rate": rate / s["ingest_per_s"] if s["ingest_per_s"] else None}


def scaling(settings: list[dict]) -> list[dict]:
    """Per broker, updates accepted per second with k workers over the same fleet with 1
    worker (and over one ``all``-role process where measured), from the settings of one run."""
    out = []
    for broker in sorted({s["broker"] for s in settings}):
        by_w = {s["workers"]: s for s in settings if s["broker"] == broker and s["workers"]}
        if not by_w:
            continue
        n = next(iter(by_w.values()))["devices"]
        one = by_w.get(1)
        single = [s for s in settings if s["broker"] == broker and not s["workers"] and s["devices"] == n]
        for w, s in sorted(by_w.items()):
            rate = s["ingest_per_s"]
            ratio = rate / one["ingest_per_s"] if one and one["ingest_per_s"] and rate else None
            vs_single = rate / single[0]["ingest_per_s"] if single and single[0]["ingest_per_s"] and rate else None
            out.append({"broker": broker, "workers": w, "devices": s["devices"], "ingest_per_s": rate,
                        "vs_one_worker": ratio, "vs_one_process": vs_single})
    return out


def markdown(result: dict) -> str:
    """The results table and the accounting verdict."""
    lines = [f"# Fleet load test ({result['profile']})", "",
             f"Machine: {result['machine']}. Update {fmt((result['settings'][0].get('update_bytes') or 0) / MIB, '.2f')} "
             f"MiB (fp32 LoRA state of {MODEL['num_experts']} experts x 2 MoE layers, signed, 256 KiB chunks); "
             f"{result['rounds']} rounds per setting; devices upload after a uniform 0-{result['train_s']} s wait. "
             "Workers 0: one `fedmoe aggregator` process (SQLite store); k >= 1: a coordinator and k "
             "`--role worker` processes (PostgreSQL store; each device sends its uploads to the worker its assignment names), "
             "all on these 2 cores "
             "with the broker and the device processes.", "",
             "| broker | down QoS | workers | devices | connected | updates/round | rounds closed | accepted | not accepted | "
             "twice | rejects | re-sent assignments taken | rounds/h | updates/s ingesting | latency p50 / p99 (s) | aggregator peak RSS (MiB): all / "
             "coordinator | broker peak RSS (MiB) | CPU ms/update: aggregator / broker / PostgreSQL |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["settings"]:
        lines.append(
            f"| {s['broker']} | {s.get('down_qos', 1)} | {s['workers']} | {s['devices']} | {s['connected']} | "
            f"{s['updates_per_round']} | {s['rounds_closed']} | "
            f"{s['accepted']} | {s['not_accepted']} | {s['reported_twice']} | {s['rejects']} | "
            f"{s.get('resent_assignments_taken', '-')} | "
            f"{fmt(s['rounds_per_hour'], '.0f')} | {fmt(s['ingest_per_s'], '.1f')} | "
            f"{fmt(s['latency_p50_s'], '.2f')} / {fmt(s['latency_p99_s'], '.2f')} | "
            f"{s['aggregator_peak_rss_bytes'] / MIB:.0f} / {s.get('coordinator_peak_rss_bytes', 0) / MIB:.0f} | "
            f"{s['broker_peak_rss_bytes'] / MIB:.0f} | "
            f"{fmt(s['aggregator_cpu_s_per_update'] and 1000 * s['aggregator_cpu_s_per_update'], '.1f')} / "
            f"{fmt(s['broker_cpu_s_per_update'] and 1000 * s['broker_cpu_s_per_update'], '.1f')} / "
            f"{fmt(s.get('store_cpu_s_per_update') and 1000 * s['store_cpu_s_per_update'], '.1f')} |")
    sc = result.get("scaling") or []
    if sc:
        lines += ["", "Scaling with workers (same fleet, same run): updates accepted per second while ingesting.", "",
                  "| broker | workers | devices | updates/s | vs 1 worker | vs one process |", "|---|---|---|---|---|---|"]
        for x in sc:
            lines.append(f"| {x.get('broker', 'mosquitto')} | {x['workers']} | {x['devices']} | {fmt(x['ingest_per_s'], '.1f')} | "
                         f"{fmt(x['vs_one_worker'], '.2f')}x | {fmt(x['vs_one_process'], '.2f')}x |")
    lines += ["", "Per round:", "", "| broker | workers | devices | round | status | selected | uploaded | accepted | "
              "seconds | updates/s | p50 / p99 (s) | taken by |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["settings"]:
        for p in s["rounds"]:
            lines.append(f"| {s['broker']} | {s['workers']} | {s['devices']} | {p['round']} | {p['status']} | "
                         f"{p['selected']} | {p['uploaded']} | {p['accepted']} | {p['seconds']:.1f} | "
                         f"{fmt(p['ingest_per_s'], '.1f')} | {fmt(p['latency_p50_s'], '.2f')} / "
                         f"{fmt(p['latency_p99_s'], '.2f')} | "
                         f"{', '.join(f'{w}: {c}' for w, c in p.get('by_worker', {}).items())} |")
    bad = [s for s in result["settings"] if s["not_accepted"] or s["reported_twice"] or s["rejects"]]
    lines += ["", "Accounting: " + ("every uploaded update was accepted exactly once in every setting." if not bad else
                                    "NOT exactly once in " + ", ".join(f"{s['broker']} n={s['devices']} workers="
                                                                       f"{s['workers']}" for s in bad)
                                    + " (see not accepted / twice / rejects).")]
    e = result.get("estimate")
    if e:
        lines += ["", f"Estimate for {e['devices']:,} devices, {e['share_per_round']:.0%} per round, "
                      f"{e['rounds_per_hour']:g} round per hour ({e['updates_per_round']:,.0f} updates per round, "
                      f"{e['updates_per_s']:.1f} updates/s averaged), scaled linearly from {e['from']}: "
                      f"aggregator {e['aggregator_cores']:.1f} cores; broker {e['broker_cores']:.1f} cores and "
                      f"{e['broker_memory_gib']:.0f} GiB for the connections ({e['broker_rss_per_device_kib']:.1f} KiB "
                      f"per connected device: {e['broker_memory_basis']}); network {e['network_mbit_s']:.0f} Mbit/s (updates up, states down); "
                      f"in-flight store writes {e['store_write_mib_s']:.0f} MiB/s; one aggregator process ingests a "
                      f"round in {fmt(e['round_ingest_minutes_one_aggregator'], '.0f')} min and holds "
                      f"{e['aggregator_rss_per_update_mib']:.1f} MiB per update of the round (its peak RSS over the "
                      f"updates per round), so a round of {e['updates_per_round']:,.0f} does not fit one process."]
        if e.get("workers_cpu_s_per_update"):
            lines += ["", f"With a coordinator and workers (measured with 1 worker): "
                          f"{1000 * e['workers_cpu_s_per_update']:.0f} ms CPU per update over all aggregator "
                          f"processes, {e['workers_cores']:.1f} cores at {e['updates_per_s']:.1f} updates/s; one worker "
                          f"took {fmt(e['one_worker_ingest_per_s'], '.1f')} updates/s here, so about "
                          f"{fmt(e['workers_for_rate'], '.1f')} workers' worth; the coordinator's peak RSS was "
                          f"{e['coordinator_peak_rss_mib']:.0f} MiB: it holds the workers' sums, not the updates."]
    for s in result["settings"]:
        if s["reject_reasons"] or s["device_errors"]:
            lines.append(f"- {s['broker']} n={s['devices']}: rejects {s['reject_reasons']}, device errors "
                         f"{s['device_errors']}")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Throughput and p99 latency against fleet size, one line per broker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for b, q in sorted({(s["broker"], s.get("down_qos", 1)) for s in result["settings"]}):
        ss = sorted((s for s in result["settings"] if s["broker"] == b and s.get("down_qos", 1) == q
                     and not s["workers"]), key=lambda s: s["devices"])
        xs = [s["devices"] for s in ss]
        for ax, key in ((axes[0], "ingest_per_s"), (axes[1], "latency_p99_s")):
            ax.plot(xs, [s[key] or 0 for s in ss], marker="o", label=f"{b} (downlink QoS {q}), one process")
    ws = sorted((s for s in result["settings"] if s["workers"]), key=lambda s: s["workers"])
    for s in ws:
        for ax, key in ((axes[0], "ingest_per_s"), (axes[1], "latency_p99_s")):
            ax.scatter([s["devices"]], [s[key] or 0], marker="s", zorder=3,
                       label=f"{s['broker']}, coordinator + {s['workers']} worker(s)")
    axes[0].set(xlabel="devices connected", ylabel="updates accepted / s", title="ingest rate vs fleet size")
    axes[1].set(xlabel="devices connected", ylabel="s", title="p99 last chunk -> taken")
    for b in sorted({s["broker"] for s in ws}):
        bs = [s for s in ws if s["broker"] == b]
        line, = axes[2].plot([s["workers"] for s in bs], [s["ingest_per_s"] or 0 for s in bs], marker="s",
                             label=f"{b}: coordinator + workers, n={bs[0]['devices']}")
        one = [s for s in result["settings"] if s["broker"] == b and not s["workers"] and s["devices"] == bs[0]["devices"]]
        if one and one[0]["ingest_per_s"]:
            axes[2].axhline(one[0]["ingest_per_s"], ls="--", color=line.get_color(), label=f"{b}: one process, same fleet")
    if ws:
        axes[2].set_xticks(sorted({s["workers"] for s in ws}))
    axes[2].set(xlabel="aggregator workers", ylabel="updates accepted / s", title="ingest rate vs workers (2 cores)")
    for i, a in enumerate(axes):
        if i < 2:
            a.set_xscale("log")
        a.set_ylim(bottom=0)
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="300 devices, 100 updates per round, 2 rounds: Mosquitto "
                    "(one process, 1 and 2 workers), the NATS cluster (one process, 1 and 2 workers) (< 5 min)")
    ap.add_argument("--sizes", help="fleet sizes, one aggregator process (default 1000,10000; quick 300)")
    ap.add_argument("--cluster-sizes", help="fleet sizes on the NATS cluster, one aggregator process (default "
                    "300,1000; quick 300); the full profile also runs the smallest with the devices' downlink at QoS 1")
    ap.add_argument("--worker-counts", help="aggregator workers to measure at the largest Mosquitto size, each with a "
                    "coordinator on PostgreSQL (default 1,2,4; quick 1,2)")
    ap.add_argument("--cluster-worker-counts", help="aggregator workers to measure at the largest cluster size "
                    "(default 1,2,4; quick 1,2)")
    ap.add_argument("--pg", default=PG_URL, help="PostgreSQL database of the worker settings (a fresh schema each)")
    ap.add_argument("--per-round", type=int, help="updates per round (default 1000; quick 100)")
    ap.add_argument("--rounds", type=int, help="rounds per setting (default 3; quick 2)")
    ap.add_argument("--down-qos", choices=("auto", "0", "1"), default="auto", help="QoS of the devices' down/# "
                    "subscription (auto: 0 on the cluster, as the SDK does, 1 on Mosquitto)")
    ap.add_argument("--procs", type=int, default=4, help="device processes")
    ap.add_argument("--train-s", type=float, default=5.0, help="devices upload after a uniform wait of up to this")
    ap.add_argument("--connect-rate", type=float, default=400.0, help="device connects per second, all processes")
    ap.add_argument("--round-timeout", type=float, help="seconds a round waits for its quorum (default 900; quick 30)")
    ap.add_argument("--timeout", type=float, help="seconds one setting may run (default 3600; quick 240)")
    ap.add_argument("--robust", default="none", help="the aggregator's robust rule (default none: the round streams; "
                    "multi_krum, the aggregator's default, holds every update until the close)")
    ap.add_argument("--fedmoe", default=str(Path(sys.executable).parent / "fedmoe"))
    ap.add_argument("--work", default=str(ROOT / "runs" / "fleet"))
    ap.add_argument("--out", default=str(ROOT / "results" / "fleet"))
    ap.add_argument("--lock")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    stop_on_sigterm()
    profile = "quick" if args.quick else "full"
    sizes = [int(x) for x in (args.sizes if args.sizes is not None else
                              ("300" if args.quick else "1000,10000")).split(",") if x]
    csizes = [int(x) for x in (args.cluster_sizes if args.cluster_sizes is not None else
                               ("300" if args.quick else "300,1000")).split(",") if x]
    wcounts = [int(x) for x in (args.worker_counts if args.worker_counts is not None else
                                ("1,2" if args.quick else "1,2,4")).split(",") if x]
    cwcounts = [int(x) for x in (args.cluster_worker_counts if args.cluster_worker_counts is not None else
                                 ("1,2" if args.quick else "1,2,4")).split(",") if x]
    per_round = args.per_round or (100 if args.quick else 1000)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.round_timeout = args.round_timeout or (30.0 if args.quick else 900.0)
    args.timeout = args.timeout or (240.0 if args.quick else 3600.0)
    settings = []
    with heavy_lock(args.lock):
        for kind, ns, counts in (("mosquitto", sizes, wcounts), ("nats-cluster", csizes, cwcounts)):
            for n in ns:
                settings.append(run_setting(args, kind, n, min(per_round, n), Path(args.work) / f"{kind}-{n}"))
            n = max(ns, default=0)
            for w in counts if n else []:  # the same fleet, one run: how ingest grows with workers
                settings.append(run_setting(args, kind, n, min(per_round, n),
                                            Path(args.work) / f"{kind}-{n}-workers-{w}", workers=w))
        if csizes and not args.quick and args.down_qos == "auto":  # the cluster as it was: a QoS 1 downlink
            n = min(csizes)
            settings.append(run_setting(args, "nats-cluster", n, min(per_round, n),
                                        Path(args.work) / f"nats-cluster-{n}-qos1", down_qos="1"))
    result = {"profile": profile, "rounds": args.rounds, "train_s": args.train_s, "procs": args.procs,
              "machine": f"{os.cpu_count()} CPU cores", "model": MODEL, "settings": settings}
    result["estimate"] = estimate(settings)
    result["scaling"] = scaling(settings)
    print(write_result(args.out, "fleet" if profile == "full" else "fleet_quick", result, markdown, plot))
    bad = any(s["not_accepted"] or s["reported_twice"] for s in settings)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
