"""Reliability benchmark: a secured federation under random faults and a malformed stream.

Runs the production configuration (``fedmoe provision``: TLS, per-device passwords,
the ACL, Ed25519-signed updates; a Mosquitto broker with persistence on a free port;
the aggregator as a separate ``fedmoe aggregator`` process with its SQLite store) with a
tiny upcycled model, ``--devices`` device clients (threads of this process) and
``--rounds`` rounds, while injecting at random rounds:

- ``device_kill``: a selected device's connection dies without DISCONNECT mid-round
  (what a SIGKILL looks like to the broker: its Last Will fires); it restarts a few
  seconds later with the same id and cache, and must rejoin a later round;
- ``straggler``: a selected device holds its update until after the round deadline;
  it must be rejected with a reply and never mixed into another round;
- ``duplicate``: a device publishes its update chunks and its stats twice;
- ``aggregator_kill``: SIGKILL of the aggregator process mid-round, restarted 2 s later
  (it resumes the round from its store and its persistent MQTT session);
- ``broker_restart``: Mosquitto restarted mid-round.

A provisioned but malicious device ("rogue") meanwhile sends a stream of malformed
messages (garbage, bad JSON, schema violations, unsigned / forged / stale signed
updates, NaN and wrong-shape tensors, updates for unassigned experts, another device's
id, publishes into another device's topics, oversized declared sizes).

Accounting: an update is *published* when its stats message was acknowledged by the
broker; it is *accepted* if its device is in the round's record, *rejected* if the
aggregator replied with a reject for that device and round, and *lost* otherwise (must
be 0). Bad inputs are *accepted* if the rogue ever appears among a round's accepted
devices (must be 0). The aggregator's resident memory (VmRSS) is sampled at every
round end; growth is measured over its last incarnation (after the last restart).

    python -m benchmarks.reliability                  # 50 devices, 20 rounds
    python -m benchmarks.reliability --quick          # 8 devices, 6 rounds

Writes ``results/reliability/reliability.json``, ``reliability.md`` and
``reliability.png`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import psutil  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from edge_sdk import EdgeClient  # noqa: E402
from edge_sdk.filters import Filter  # noqa: E402
from moe_model.budget import estimate  # noqa: E402
from fedmoe.broker import MosquittoBroker  # noqa: E402
from fedmoe.datasets import bbc_news  # noqa: E402
from fedmoe.provision import mosquitto_conf, provision  # noqa: E402
from protocol.chunking import Reassembler, split_blob  # noqa: E402
from protocol.codec import decode_tensors, encode_tensors  # noqa: E402
from protocol.messages import (  # noqa: E402
    Ack, Assignment, Command, Hello, ModelSpec, Progress, encode, parse_message,
)
from protocol.signing import Signer, generate_key, load_private_key  # noqa: E402
from protocol.topics import Topics  # noqa: E402
from protocol.transport import PublishError, TlsConfig, Transport  # noqa: E402
from benchmarks.common import rel  # noqa: E402

log = logging.getLogger("reliability")
TINY = {"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64}
FAULTS = ("device_kill", "straggler", "duplicate", "aggregator_kill", "broker_restart")


def rss_bytes(pid: int) -> int | None:
    """Resident set size of process ``pid`` in bytes (``psutil``); None if it is gone or unreadable."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.Error, OSError):
        return None


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.work = Path(args.workdir) / uuid.uuid4().hex[:8]
        self.work.mkdir(parents=True, exist_ok=True)
        self.ids = [f"dev{i}" for i in range(args.devices)]
        self.sec = provision(self.work / "secrets", self.ids + ["rogue"], tls_hosts=["127.0.0.1", "localhost"])
        self.broker = MosquittoBroker(str(self.work / "broker"), mosquitto_conf(self.sec.out)).start()
        self.url = self.broker.url(tls=True)
        self.tls = TlsConfig(str(self.sec.ca_file))
        self.federation = f"rel-{uuid.uuid4().hex[:6]}"
        self.topics = Topics(self.federation)
        items, self.labels = bbc_news()
        self.items = items
        self.spec = ModelSpec(base=None, config=TINY, num_experts=4, top_k=2, max_seq_len=32, upcycle_noise=0.01)
        eval_file = self.work / "eval.jsonl"
        eval_file.write_text("".join(json.dumps({"text": t, "label": l}) + "\n" for t, l in items[::45][:48]))
        self.cfg = {
            "federation": self.federation, "model": self.spec.model_dump(mode="json"),
            "tasks": {"bbc": {"labels": self.labels, "eval_data": str(eval_file)}},
            "rounds": args.rounds, "min_devices": args.devices, "start_timeout_s": 600,
            "clients_per_round": args.clients_per_round, "quorum": 0.5, "round_timeout_s": args.round_timeout,
            "train": {"max_steps": 2, "batch_size": 8}, "store": f"sqlite:///{self.work}/agg.db",
            "credentials": str(self.sec.aggregator_file), "device_keys": str(self.sec.device_keys_file),
            "threads": 1, "resume_drain_s": 2.0,
        }
        (self.work / "agg.yaml").write_text(yaml.safe_dump(self.cfg))
        self.agg: subprocess.Popen | None = None
        self.agg_runs = 0
        self.lock = threading.Lock()
        # observations
        self.round_start: dict[int, dict] = {}
        self.round_end: dict[int, float] = {}
        self.rejects: dict[tuple[str, int], list[str]] = defaultdict(list)
        self.published: list[tuple[str, int, float]] = []
        self.rss: list[tuple[int, int, int]] = []  # (incarnation, round, bytes)
        self.faults: list[dict] = []
        self.clients: dict[str, EdgeClient] = {}
        self.client_threads: list[threading.Thread] = []
        self.armed: dict[str, dict] = defaultdict(dict)  # device -> {"straggle": round, "duplicate": round}
        self.crashed: dict[str, int] = {}
        self.bad = Counter()
        self.bad_blocked = 0
        self.rogue_replies = 0
        self.acl_leaks = 0
        self.done = threading.Event()
        self._restart_lock = threading.Lock()
        """Serialises aggregator kill/restarts and broker restarts: two fault threads that
        overlap (a late one under CPU load) must not leave two aggregators running."""

    # ------------------------------------------------------------------ processes
    def start_aggregator(self) -> None:
        self.agg_runs += 1
        out = open(self.work / f"aggregator-{self.agg_runs}.log", "w")
        cmd = [sys.executable, "-m", "fedmoe", "aggregator", "--broker", self.url, "--config",
               str(self.work / "agg.yaml")]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.agg = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def kill_aggregator(self) -> None:
        self.agg.send_signal(signal.SIGKILL)
        self.agg.wait(10)

    # ------------------------------------------------------------------ devices
    def spawn(self, device_id: str) -> None:
        i = int(device_id[3:])
        experts = 1 + i % 4
        budget = estimate(self.spec, experts, 8, len(self.labels), runtime_bytes=0).total + 1
        c = EdgeClient.from_credentials(
            self.url, self.sec.device_file(device_id), self.items[i::self.args.devices][:30],
            federation=self.federation, budget_bytes=budget, task="bbc", cache_dir=str(self.work / f"cache-{i}"),
            runtime_bytes=0, tls=self.tls, low_memory=False, filters=[self._faults(device_id)])
        self.clients[device_id] = c
        th = threading.Thread(target=self._run_client, args=(c,), name=device_id, daemon=True)
        th.start()
        self.client_threads.append(th)

    def _run_client(self, c: EdgeClient) -> None:
        try:
            c.run(idle_timeout=900)
        except Exception as e:  # a crashed (killed) client ends here
            log.debug("%s ended: %s", c.device_id, e)

    def _faults(self, device_id: str) -> Filter:
        """The device's fault-injection filter (straggle, duplicate) and stats accounting."""
        bench = self

        class Faults(Filter):
            def on_publish(self, kind, round, send):
                arm = bench.armed[device_id]
                if kind == "update" and arm.get("straggle") == round:
                    bench.straggle(round)
                result = send()
                if kind == "stats":
                    with bench.lock:
                        bench.published.append((device_id, round, time.time()))
                if kind in ("update", "stats") and arm.get("duplicate") == round:
                    send()
                return result

        return Faults()

    def straggle(self, rnd: int) -> None:
        """Hold an update back until round ``rnd`` closed (or its deadline passed)."""
        wait_until = time.time() + 5.0  # the round_start progress message may still be on its way
        while rnd not in self.round_start and time.time() < wait_until:
            time.sleep(0.05)
        deadline = self.round_start.get(rnd, {}).get("deadline", time.time() + self.args.round_timeout)
        while time.time() < deadline + 1.5 and rnd not in self.round_end:
            time.sleep(0.1)
        time.sleep(0.5)

    def crash(self, device_id: str) -> None:
        """Kill a device's connection without DISCONNECT (its Last Will fires) and stop it."""
        c = self.clients[device_id]
        c._stop = True
        client = c.transport._client
        if client is not None:
            client.loop_stop()
            sock = client.socket()
            if sock is not None:
                sock.close()

    # ------------------------------------------------------------------ observer
    def observe(self) -> None:
        tr = Transport(self.url, f"observer-{uuid.uuid4().hex[:6]}", username=self.sec.aggregator["username"],
                       password=self.sec.aggregator["password"], tls=self.tls, protocol="5").connect()
        tr.subscribe(self.topics.progress())
        tr.subscribe(f"{self.topics.root}/dev/+/down/command")
        while not self.done.is_set():
            m = tr.get(0.2)
            if m is None:
                continue
            try:
                if m.topic.endswith("cloud/progress"):
                    p = parse_message(m.payload, Progress)
                    if p.event == "round_start":
                        self.round_start[p.round] = {"t": time.time(), "devices": p.detail.get("devices", []),
                                                     "deadline": time.time() + self.args.round_timeout}
                        threading.Thread(target=self.inject, args=(p.round, p.detail.get("devices", [])),
                                         daemon=True).start()
                    elif p.event == "round_end":
                        self.round_end[p.round] = time.time()
                        r = rss_bytes(self.agg.pid) if self.agg else None
                        if r:
                            self.rss.append((self.agg_runs, p.round, r))
                        self.prearm(p.round + 1)
                else:
                    dev = m.topic.split("/")[-3]
                    cmd = parse_message(m.payload, Command)
                    if cmd.command == "reject" and cmd.round is not None:
                        self.rejects[(dev, cmd.round)].append(cmd.reason or "")
            except Exception as e:
                log.debug("observer: %s", e)
        tr.close()

    # ------------------------------------------------------------------ faults
    def plan(self) -> dict[int, list[str]]:
        """Which faults hit which round: every kind at least twice (if rounds allow), at random."""
        rounds = list(range(2, self.args.rounds))
        plan: dict[int, list[str]] = defaultdict(list)
        kinds = [k for k in FAULTS for _ in range(2)]
        kinds += [self.rng.choice(("device_kill", "straggler", "duplicate")) for _ in range(len(rounds) // 2)]
        for k in kinds:
            pool = rounds[: max(1, len(rounds) // 2)] if k == "aggregator_kill" else rounds
            free = [r for r in pool if k not in plan[r] and not (
                k in ("aggregator_kill", "broker_restart") and {"aggregator_kill", "broker_restart"} & set(plan[r]))]
            if free:
                plan[self.rng.choice(free)].append(k)
        return dict(plan)

    def prearm(self, rnd: int) -> None:
        """Arm straggle/duplicate hooks before round ``rnd`` starts (devices act on arrival)."""
        for k in self.schedule.get(rnd, []):
            if k in ("straggler", "duplicate"):
                alive = [d for d in self.ids if d not in self.crashed and not self.armed[d]]
                if alive:
                    d = self.rng.choice(alive)
                    self.armed[d]["straggle" if k == "straggler" else k] = rnd
                    self.faults.append({"kind": k, "round": rnd, "device": d})

    def inject(self, rnd: int, selected: list[str]) -> None:
        for k in self.schedule.get(rnd, []):
            if k == "device_kill":
                cands = [d for d in selected if d in self.clients and d not in self.crashed and not self.armed[d]]
                if not cands:
                    continue
                d = self.rng.choice(cands)
                time.sleep(self.rng.uniform(0.0, 0.2))
                self.crash(d)
                self.crashed[d] = rnd
                self.faults.append({"kind": k, "round": rnd, "device": d})
                threading.Timer(3.0, self._respawn, args=(d,)).start()
            elif k == "aggregator_kill":
                time.sleep(self.rng.uniform(0.5, 2.0))
                with self._restart_lock:
                    self.kill_aggregator()
                    self.faults.append({"kind": k, "round": rnd})
                    time.sleep(2.0)
                    self.start_aggregator()
            elif k == "broker_restart":
                time.sleep(self.rng.uniform(0.5, 2.0))
                with self._restart_lock:
                    self.broker.restart()
                self.faults.append({"kind": k, "round": rnd})

    def _respawn(self, d: str) -> None:
        self.spawn(d)
        self.crashed.pop(d, None)

    # ------------------------------------------------------------------ malformed stream
    def rogue(self) -> None:
        info = self.sec.devices["rogue"]
        t = self.topics
        tr = Transport(self.url, "rogue", username="rogue", password=info["password"], tls=self.tls,
                       protocol="5").connect()
        tr.subscribe(t.device_down("rogue"))
        signer = Signer("rogue", load_private_key(info["signing_key"]))
        forger = Signer("rogue", generate_key())
        up = lambda kind: t.up("rogue", kind)  # noqa: E731
        hello = Hello(device_id="rogue", sdk_version="x", budget_bytes=2**40, weight_formats=["int8"],
                      num_samples=10, task="bbc", runtime_bytes=0)
        tr.publish(up("hello"), encode(hello))
        states = Reassembler(64 * 2**20)
        shapes: dict[str, tuple] = {}
        current = 0

        def pump():
            nonlocal current, shapes
            while (m := tr.get(0)) is not None:
                if "/dev/rogue/" not in m.topic:
                    self.acl_leaks += 1  # another device's message reached the rogue
                    continue
                kind = m.topic.rsplit("/", 1)[1]
                try:
                    if kind == "assignment":
                        a = parse_message(m.payload, Assignment)
                        current = a.round
                        tr.publish(up("ack"), encode(Ack(device_id="rogue", round=a.round, accepted=False,
                                                         reason="rogue")))
                    elif kind == "state":
                        blob = states.add("cloud", m.payload)
                        if blob is not None:
                            shapes = {k: tuple(v.shape) for k, v in decode_tensors(blob.data, 2**28).items()}
                    elif kind == "command":
                        self.rogue_replies += 1
                except Exception as e:
                    log.debug("rogue: %s", e)

        def update(tensors, rnd, sign=signer, tid=None):
            data = encode_tensors(tensors) if isinstance(tensors, dict) else tensors
            tid = tid or uuid.uuid4().hex[:12]
            chunks, sha = split_blob(data, 8192, tid, "update", rnd)
            props = sign.properties("update", rnd, tid, sha) if sign else None
            tr.publish_many([(up("update"), c, False) for c in chunks], user_properties=props)

        def good():
            return {k: torch.zeros(s) for k, s in shapes.items()} or {"backbone.x": torch.zeros(2)}

        def nan():
            g = good()
            next(iter(g.values())).view(-1)[0] = math.nan
            return g

        def wrong_shape():
            g = good()
            g[next(iter(g))] = torch.zeros(3, 3, 3)
            return g

        def unassigned():
            g = good()
            g["expert.1.99.fc1.lora_B"] = torch.zeros(2, 2)
            return g

        def stats_as(device):
            s = {"v": 1, "type": "stats", "device_id": device, "round": current, "task": "bbc"}
            return json.dumps(s).encode()

        other = lambda: self.rng.choice(self.ids)  # noqa: E731
        attacks = {
            "garbage_update": lambda: tr.publish(up("update"), os.urandom(self.rng.randint(0, 300))),
            "bad_json_stats": lambda: tr.publish(up("stats"), b"{not json"),
            "schema_violation": lambda: tr.publish(up("stats"), stats_as("rogue")),
            "foreign_device_id": lambda: tr.publish(up("hello"), encode(hello.model_copy(
                update={"device_id": other()}))),
            "unsigned_update": lambda: update(good(), current, sign=None),
            "forged_update": lambda: update(good(), current, sign=forger),
            "nan_update": lambda: update(nan(), current),
            "wrong_shape_update": lambda: update(wrong_shape(), current),
            "unassigned_expert_update": lambda: update(unassigned(), current),
            "stale_round_update": lambda: update(good(), max(0, current - 1)),
            "truncated_safetensors": lambda: update(encode_tensors(good())[:-7], current),
            "oversized_declared": lambda: tr.publish(up("update"), split_blob(b"x" * 2048, 2048, "big", "update",
                                                                              current)[0][0].replace(
                b'"size":2048', b'"size":9999999999')),
            "publish_into_other_device": lambda: tr.publish(t.up(other(), "update"), b"x", timeout=10),
            "read_other_assignment": lambda: tr.subscribe(t.device_down(other())),
        }
        names = sorted(attacks)
        while not self.done.is_set():
            pump()
            name = self.rng.choice(names)
            try:
                attacks[name]()
            except PublishError:
                self.bad_blocked += 1  # refused by the broker (ACL)
            except Exception as e:
                log.debug("rogue %s: %s", name, e)
            self.bad[name] += 1
            time.sleep(self.args.bad_interval)
        # anything that arrived on other devices' topics means the ACL leaked
        pump()
        tr.close()

    # ------------------------------------------------------------------ run
    def run(self) -> dict:
        self.schedule = self.plan()
        t0 = time.time()
        self.start_aggregator()
        obs = threading.Thread(target=self.observe, daemon=True)
        obs.start()
        for d in self.ids:
            self.spawn(d)
        rogue = threading.Thread(target=self.rogue, daemon=True)
        rogue.start()
        deadline = t0 + self.args.max_seconds
        while time.time() < deadline:
            if self.agg.poll() is not None and len(self.round_end) >= self.args.rounds:
                break
            if self.agg.poll() is not None and self.agg.returncode != -9:
                log.error("aggregator exited with %s", self.agg.returncode)
                break
            time.sleep(0.5)
        wall = time.time() - t0
        self.done.set()
        rogue.join(15)
        obs.join(5)
        for c in self.clients.values():
            c._stop = True
        for th in self.client_threads:
            th.join(5)
        if self.agg.poll() is None:
            self.agg.terminate()
        self.broker.stop()
        return self.report(wall)

    def report(self, wall: float) -> dict:
        from cloud.store import Store

        store = Store(self.cfg["store"])
        records = store.rounds()
        store.close()
        by_round = {r["round"]: r for r in records}
        accepted = sum(len(r["devices"]) for r in records)
        published = {(d, r) for d, r, _ in self.published}
        lost, rejected_pub, accepted_pub = [], 0, 0
        for d, r in sorted(published):
            rec = by_round.get(r)
            if rec is not None and d in rec["devices"]:
                accepted_pub += 1
            elif self.rejects.get((d, r)):
                rejected_pub += 1
            else:
                lost.append({"device": d, "round": r})
        rogue_in = [r["round"] for r in records if "rogue" in r["devices"]]
        survived, faults, no_effect = [], [], 0
        for f in self.faults:
            r, d = f["round"], f.get("device")
            rec = by_round.get(r)
            if f["kind"] in ("straggler", "duplicate") and (rec is None or d not in rec["selected"]):
                no_effect += 1  # armed on a device the round did not select: nothing was injected
                continue
            ok = rec is not None
            if f["kind"] == "device_kill":
                ok = ok and rec["status"] == "ok"
                f["killed_before_report"] = d not in rec["devices"]
                f["rejoined"] = any(d in x["selected"] for x in records if x["round"] > r)
            elif f["kind"] == "straggler":
                ok = ok and d not in rec["devices"] and bool(self.rejects.get((d, r)))
            elif f["kind"] == "duplicate":
                ok = ok and d in rec["devices"]
            f["survived"] = bool(ok)
            survived.append(ok)
            faults.append(f)
        self.faults = faults
        last = max((inc for inc, _, _ in self.rss), default=0)
        mem = [b for inc, _, b in self.rss if inc == last]
        logs = "".join(p.read_text() for p in sorted(self.work.glob("aggregator-*.log")))
        out = {
            "config": {k: rel(v) if k in ("workdir", "out") else v for k, v in vars(self.args).items()},
            "wall_seconds": round(wall, 1),
            "rounds_completed": len(records),
            "rounds_ok": sum(r["status"] == "ok" for r in records),
            "rounds_requested": self.args.rounds,
            "faults_injected": len(self.faults),
            "faults_survived": sum(survived),
            "faults_by_kind": dict(Counter(f["kind"] for f in self.faults)),
            "faults": self.faults,
            "armed_faults_without_effect": no_effect,
            "killed_before_report": sum(bool(f.get("killed_before_report")) for f in faults),
            "killed_devices_rejoined": sum(bool(f.get("rejoined")) for f in faults if f["kind"] == "device_kill"),
            "aggregator_restarts": self.agg_runs - 1,
            "updates_published": len(published),
            "updates_accepted": accepted,
            "updates_published_and_accepted": accepted_pub,
            "updates_rejected": rejected_pub,
            "updates_lost": len(lost),
            "lost": lost,
            "reject_replies_total": sum(len(v) for v in self.rejects.values()),
            "duplicates_ignored_by_aggregator": logs.count("ignored a repeated stats message"),
            "bad_inputs_tried": sum(self.bad.values()),
            "bad_inputs_by_kind": dict(self.bad),
            "bad_inputs_blocked_by_broker": self.bad_blocked,
            "bad_inputs_accepted": len(rogue_in),
            "rogue_reject_replies": self.rogue_replies,
            "acl_leaks": self.acl_leaks,
            "aggregator_internal_errors": logs.count("internal error handling"),
            "aggregator_rss_bytes": {"start": mem[0] if mem else None, "end": mem[-1] if mem else None,
                                     "samples": [{"incarnation": i, "round": r, "bytes": b} for i, r, b in self.rss]},
            "aggregator_rss_growth": (mem[-1] / mem[0] - 1) if len(mem) > 1 else None,
            "accuracy": [{"round": r["round"], "accuracy": r["accuracy"], "devices": len(r["devices"]),
                          "selected": len(r["selected"]), "seconds": r["seconds"]} for r in records],
            "workdir": rel(self.work),
        }
        return out


def write(out: dict, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "reliability.json").write_text(json.dumps(out, indent=1))
    g = out["aggregator_rss_growth"]
    mem = out["aggregator_rss_bytes"]
    lines = [
        "# Reliability benchmark (`benchmarks/reliability.py`)", "",
        f"{out['config']['devices']} devices (+1 rogue), {out['rounds_requested']} rounds, tiny model, TLS + ACL + "
        f"signed updates, Mosquitto with persistence; {out['wall_seconds']:.0f} s wall on a shared 2-core machine.", "",
        "| metric | value |", "|---|---|",
        f"| rounds completed (ok) | {out['rounds_completed']} ({out['rounds_ok']}) of {out['rounds_requested']} |",
        f"| faults injected / survived | {out['faults_injected']} / {out['faults_survived']} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(out['faults_by_kind'].items()))}) |",
        f"| aggregator restarts | {out['aggregator_restarts']} |",
        f"| updates published / accepted / rejected / lost | {out['updates_published']} / "
        f"{out['updates_published_and_accepted']} / {out['updates_rejected']} / **{out['updates_lost']}** |",
        f"| duplicate stats ignored | {out['duplicates_ignored_by_aggregator']} |",
        f"| bad inputs tried / blocked by broker ACL / accepted | {out['bad_inputs_tried']} / "
        f"{out['bad_inputs_blocked_by_broker']} / **{out['bad_inputs_accepted']}** |",
        f"| aggregator internal errors | {out['aggregator_internal_errors']} |",
        f"| aggregator RSS start → end (last incarnation) | "
        f"{(mem['start'] or 0) / 2**20:.1f} → {(mem['end'] or 0) / 2**20:.1f} MiB "
        f"({'n/a' if g is None else f'{100 * g:+.1f}%'}) |",
    ]
    (dest / "reliability.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        acc = out["accuracy"]
        a1.plot([r["round"] for r in acc], [r["devices"] for r in acc], "o-", label="updates accepted")
        a1.plot([r["round"] for r in acc], [r["selected"] for r in acc], "s--", label="devices selected")
        for f in out["faults"]:
            a1.axvline(f["round"], color={"device_kill": "r", "straggler": "orange", "duplicate": "g",
                                          "aggregator_kill": "k", "broker_restart": "m"}[f["kind"]], alpha=0.3)
        a1.set_xlabel("round")
        a1.set_title("accepted updates per round (lines: injected faults)")
        a1.legend(fontsize=8)
        s = mem["samples"]
        for inc in sorted({x["incarnation"] for x in s}):
            pts = [x for x in s if x["incarnation"] == inc]
            a2.plot([x["round"] for x in pts], [x["bytes"] / 2**20 for x in pts], "o-", label=f"process {inc}")
        a2.set_xlabel("round")
        a2.set_ylabel("aggregator RSS (MiB)")
        a2.set_title("aggregator memory")
        a2.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(dest / "reliability.png", dpi=110)
    except ImportError:
        log.warning("matplotlib missing: no plot")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clients-per-round", type=float, default=0.5)
    ap.add_argument("--round-timeout", type=float, default=15.0)
    ap.add_argument("--bad-interval", type=float, default=0.3, help="seconds between malformed messages")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=1800)
    ap.add_argument("--quick", action="store_true", help="8 devices, 6 rounds")
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "reliability"))
    ap.add_argument("--out", default=str(ROOT / "results" / "reliability"))
    args = ap.parse_args(argv)
    if args.quick:
        args.devices, args.rounds = 8, 6
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for name in ("edge_sdk", "moe_model", "protocol", "fedmoe", "bitsandbytes", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torch.set_num_threads(1)
    out = Bench(args).run()
    write(out, Path(args.out))
    keys = ("rounds_completed", "rounds_ok", "faults_injected", "faults_survived", "faults_by_kind",
            "killed_devices_rejoined", "aggregator_restarts", "updates_published", "updates_published_and_accepted", "updates_rejected",
            "updates_lost", "duplicates_ignored_by_aggregator", "bad_inputs_tried", "bad_inputs_blocked_by_broker",
            "bad_inputs_accepted", "acl_leaks", "aggregator_internal_errors", "aggregator_rss_growth", "wall_seconds")
    for k in keys:
        print(f"{k:36s} {out[k]}")
    print(f"results in {args.out}")
    ok = out["updates_lost"] == 0 and out["bad_inputs_accepted"] == 0 and out["acl_leaks"] == 0 and out["rounds_completed"] == args.rounds
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
