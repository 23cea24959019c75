"""Conformance runner: play the cloud's side against a device under test (PROTOCOL.md).

    python -m fedmoe.conformance --broker mqtt://HOST:1883 --device-id dev-7 [--config aggregator.yaml]

Start the device first (any implementation, pointed at the same broker and federation:
``conformance`` unless ``--config`` names another). A device that trains with a served
training program (protocol minor 12, the native ``fedmoe-device``) needs the base shards and
programs over HTTP: ``--serve-files`` serves them from a local web server
(:class:`fedmoe.file_server.FileServer`). The runner starts a reference
aggregator for ``--rounds`` rounds (default 1; the config's model, or the default
upcycled MiniLM with 4 experts, task ``bbc``), watches everything the device publishes
and receives, and checks the rules below; it prints one line per rule (PASS / FAIL and
why) and exits 1 if any failed. It lives in the CLI layer, not in ``protocol/``, because it
runs the cloud.

Rules (numbers as in the report):

1. ``hello`` is retained, valid (schema, strict types), names the device of its topic.
2. ``status`` ``online`` is retained and valid.
3. The device took part: the cloud assigned it a round.
4. Every assignment is answered by a valid ``ack`` of the same round and attempt.
5. An accepted round's update arrives as valid chunks (header schema, checksums) of one
   transfer, for that round, kind ``update``, reassembling to the sha256 they name.
6. Its ``stats`` are valid, of that round, and their ``update`` reference names that
   transfer (id, bytes, sha256, chunks).
7. QoS 1 for everything the device publishes (as delivered live; the QoS a broker
   delivers a stored retained message with is its own choice).
8. The cloud rejected nothing the device sent (each ``reject`` is listed with its reason).
9. The cloud accepted the device's update and statistics into the round.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Check:
    """One rule's outcome."""

    number: int
    rule: str
    passed: bool
    detail: str = ""


@dataclass
class Report:
    """The outcome of :func:`check_device`: one :class:`Check` per rule, in order."""

    device_id: str
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Whether every rule passed."""
        return all(c.passed for c in self.checks)

    def lines(self) -> list[str]:
        """``PASS|FAIL n. rule: detail`` per rule."""
        return [f"{'PASS' if c.passed else 'FAIL'} {c.number}. {c.rule}" + (f": {c.detail}" if c.detail else "")
                for c in self.checks]


def default_config(federation: str = "conformance"):
    """The reference cloud used when none is given: the upcycled MiniLM with 4 experts in
    every layer, task ``bbc`` (labels of the built-in BBC News set), one round."""
    from cloud.config import AggregatorConfig, TaskConfig
    from fedmoe.datasets import bbc_news
    from protocol.messages import ModelSpec, TrainConfig

    _, labels = bbc_news()
    return AggregatorConfig(federation=federation, model=ModelSpec(num_experts=4, top_k=2, max_seq_len=32),
                            tasks={"bbc": TaskConfig(labels=labels)}, rounds=1, min_devices=1,
                            train=TrainConfig(max_steps=2, batch_size=4), eval_max_samples=32)


def _transport(broker: str, cfg: Any):
    """A watcher's connection with the config's broker account and TLS (the aggregator's
    account may read every device's topics)."""
    from protocol.transport import TlsConfig, Transport

    tls = TlsConfig(cfg.tls_ca, cfg.tls_cert, cfg.tls_key) if cfg.tls_ca else None
    return Transport(broker, f"conformance-{uuid.uuid4().hex[:8]}", protocol=cfg.protocol, username=cfg.username,
                     password=cfg.password, tls=tls)


def _retained(broker: str, topic: str, cfg: Any, wait_s: float = 3.0):
    """The retained message on ``topic`` as a fresh subscriber gets it (delivered with the
    retain flag), or None after ``wait_s`` seconds (a new connection every 2 s, so a device
    that publishes only later is found too)."""
    end = time.monotonic() + wait_s
    while True:
        t = _transport(broker, cfg)
        t.connect()
        try:
            t.subscribe(topic)
            attempt = min(end, time.monotonic() + 2.0)
            while time.monotonic() < attempt:
                m = t.get(0.2)
                if m is not None and m.topic == topic and m.retain:
                    return m
        finally:
            t.close()
        if time.monotonic() >= end:
            return None


def _parse(payload: bytes, cls):
    from protocol.messages import parse_message

    try:
        return parse_message(payload, cls), ""
    except Exception as e:  # noqa: BLE001  (reported as the rule's failure)
        return None, f"{type(e).__name__}: {e}"


def check_device(broker: str, device_id: str, cfg: Any = None, timeout_s: float = 600.0,
                 serve_files: bool = False) -> Report:
    """Run the reference cloud against the device ``device_id`` and check its behaviour.

    Args:
        broker: the broker URL both sides use.
        device_id: the device under test (already started, or starting).
        cfg: a ``cloud.config.AggregatorConfig`` (default :func:`default_config`); its
            ``min_devices`` is set to 1 and the run ends after its ``rounds``.
        timeout_s: seconds for the whole run.
        serve_files: serve the base shards and training programs over HTTP from a local web
            server (``shard_url``/``shard_dir``; a device that trains with a program needs it).

    Returns:
        The :class:`Report` (rule 3 fails if the device never joined within the
        config's ``start_timeout_s``).
    """
    from cloud.service import Aggregator
    from protocol.chunking import ChunkHeader
    from protocol.messages import Ack, Assignment, Command, Hello, Stats, Status
    from protocol.topics import Topics

    import tempfile

    tmp = tempfile.mkdtemp(prefix="fedmoe-conformance-")
    cfg = (cfg or default_config()).model_copy(update={"min_devices": 1, "store": f"sqlite:///{tmp}/aggregator.db",
                                                        "clear_retained_on_exit": True})
    files = None
    if serve_files:
        from .file_server import FileServer

        files = FileServer(Path(tmp) / "served")
        files.directory.mkdir()
        cfg = cfg.model_copy(update={"shard_url": files.url, "shard_dir": str(files.directory)})
    topics = Topics(cfg.federation)
    report = Report(device_id)
    add = report.checks.append
    # retained messages as a fresh subscriber gets them, before the run (a device that
    # stops afterwards may replace its status with offline)
    m = _retained(broker, topics.up(device_id, "hello"), cfg, wait_s=min(cfg.start_timeout_s, 120.0))
    hello, why = _parse(m.payload, Hello) if m is not None else (None, "no retained hello on its topic")
    add(Check(1, "hello is retained, valid and names its topic's device",
              hello is not None and hello.device_id == device_id,
              why or ("" if hello.device_id == device_id else f"device_id {hello.device_id!r} on {device_id}'s topic")))
    m = _retained(broker, topics.up(device_id, "status"), cfg)
    status, why = _parse(m.payload, Status) if m is not None else (None, "no retained status on its topic")
    add(Check(2, "status online is retained and valid", status is not None and status.state == "online",
              why or ("" if status.state == "online" else f"state {status.state!r}")))

    watch = _transport(broker, cfg)
    watch.connect()
    seen: list[Any] = []
    stop = threading.Event()

    def record() -> None:
        while not stop.is_set():
            m = watch.get(0.2)
            if m is not None:
                seen.append(m)

    watch.subscribe(f"{topics.root}/dev/{device_id}/up/#")
    watch.subscribe(topics.device_down(device_id))
    reader = threading.Thread(target=record, daemon=True)
    reader.start()
    agg = Aggregator(cfg, broker)
    records: list[dict] = []
    error = ""
    runner = threading.Thread(target=lambda: records.extend(agg.run()), daemon=True)
    try:
        runner.start()
        runner.join(timeout_s)
        if runner.is_alive():
            agg.stop()
            runner.join(30)
            error = f"the run did not end within {timeout_s:.0f} s"
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    finally:
        time.sleep(1.0)  # the last replies reach the watcher
        stop.set()
        reader.join(5)
        watch.close()
        if files is not None:
            files.close()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)

    def kind(m) -> str:
        return m.topic.rsplit("/", 1)[1]

    up = [m for m in seen if f"/dev/{device_id}/up/" in m.topic]
    down = [m for m in seen if f"/dev/{device_id}/down/" in m.topic]

    assignments = [a for a in (_parse(m.payload, Assignment)[0] for m in down if kind(m) == "assignment") if a]
    add(Check(3, "the device took part (the cloud assigned it a round)", bool(assignments),
              "" if assignments else error or "never assigned: did it join federation "
                                              f"{cfg.federation!r} with task in {sorted(cfg.tasks)}?"))
    acks = {}
    bad_acks = []
    for m in (m for m in up if kind(m) == "ack"):
        a, why = _parse(m.payload, Ack)
        if a is None:
            bad_acks.append(why)
        else:
            acks[(a.round, a.attempt)] = a
    missing = [f"round {a.round} attempt {a.attempt}" for a in assignments if (a.round, a.attempt) not in acks]
    add(Check(4, "every assignment is answered by a valid ack", not missing and not bad_acks and bool(assignments),
              "; ".join(bad_acks + [f"no ack for {x}" for x in missing])))

    accepted = [a for a in assignments if acks.get((a.round, a.attempt)) and acks[(a.round, a.attempt)].accepted]
    from protocol.chunking import ChunkError, Reassembler

    rx, problems = Reassembler(cfg.max_update_bytes), []
    blobs: dict[int, tuple[ChunkHeader, bytes]] = {}
    for m in (m for m in up if kind(m) == "update"):
        try:  # header schema, chunk and blob checksums, agreement between a transfer's chunks
            blob = rx.add(device_id, m.payload)
        except ChunkError as e:
            problems.append(f"ChunkError: {e}")
            continue
        if blob is not None and blob.header.kind != "update":
            problems.append(f"transfer {blob.header.id}: kind {blob.header.kind!r} is not 'update'")
        elif blob is not None:
            blobs[blob.header.round] = (blob.header, blob.data)
    missing = [a.round for a in accepted if a.round not in blobs]
    add(Check(5, "an accepted round's update arrives as valid chunks of one transfer", not problems and not missing,
              "; ".join(problems + [f"no complete update for round {r}" for r in missing])))

    stats_problems = []
    got = [_parse(m.payload, Stats) for m in up if kind(m) == "stats"]
    for a in accepted:
        valid = [s for s, _ in got if s is not None and s.round == a.round]
        if not valid:
            stats_problems.append(f"round {a.round}: no valid stats" + "".join(f" ({w})" for _, w in got if w))
            continue
        ref, blob = valid[-1].update, blobs.get(a.round)
        if blob is not None and ref is not None and (ref.transfer_id, ref.bytes, ref.sha256, ref.chunks) != \
                (blob[0].id, blob[0].size, blob[0].sha, blob[0].n):
            stats_problems.append(f"round {a.round}: stats name update {ref.transfer_id} ({ref.bytes} bytes, "
                                  f"{ref.chunks} chunks), sent was {blob[0].id} ({blob[0].size} bytes, {blob[0].n})")
    add(Check(6, "stats are valid, of the round, and reference the update sent", not stats_problems and bool(accepted),
              "; ".join(stats_problems) or ("" if accepted else "no accepted round")))

    low = sorted({f"{kind(m)} QoS {m.qos}" for m in up if m.qos < 1 and not m.retain})  # a broker picks retained QoS
    add(Check(7, "QoS 1 for everything the device publishes", not low, ", ".join(low)))

    rejects = [c for c in (_parse(m.payload, Command)[0] for m in down if kind(m) == "command")
               if c is not None and c.command == "reject"]
    add(Check(8, "the cloud rejected nothing the device sent", not rejects,
              "; ".join(f"{c.kind or '?'} round {c.round}: {c.reason}" for c in rejects[:5])))
    took = [r["round"] for r in records if device_id in (r.get("devices") or {})]
    add(Check(9, "the cloud accepted the device's update and statistics into the round", bool(took),
              f"rounds {took}" if took else error or "no round used its update"))
    return report


def main(argv: list[str] | None = None) -> int:
    """The command line; exit status 0 when every rule passed, 1 otherwise, 2 for bad arguments."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--broker", required=True, help="broker URL, e.g. mqtt://127.0.0.1:1883")
    ap.add_argument("--device-id", required=True)
    ap.add_argument("--config", help="an aggregator config (YAML) whose federation, model and tasks to use")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    ap.add_argument("--serve-files", action="store_true",
                    help="serve base shards and training programs over HTTP (for a device that trains with a "
                         "served program: the native fedmoe-device)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = None
    if args.config:
        from cloud.config import AggregatorConfig

        cfg = AggregatorConfig.load(Path(args.config))
    cfg = (cfg or default_config()).model_copy(update={"rounds": args.rounds})
    report = check_device(args.broker, args.device_id, cfg, args.timeout, serve_files=args.serve_files)
    print("\n".join(report.lines()))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
