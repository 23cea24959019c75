"""Floods of junk (issue "steady device", Floods): a stranger publishing hundreds of
malformed messages per second on the devices' uplink must not stall the federation,
fill the log, or flood the real devices with reject replies."""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time

import pytest

from fedmoe.provision import provision
from protocol.messages import Command, Hello, TrainConfig, encode, parse_message
from protocol.topics import UP_KINDS, Topics
from protocol.transport import Transport
from tests.federation import Federation

RATE = 330
"""Junk messages per second."""
ROUNDS = 5
CLEAN_ROUNDS = 2
"""The clean baseline's rounds: its per-round figures are extrapolated to ROUNDS (its set-up
once, its mean round ROUNDS times), so it need not run them all."""
TRAIN = TrainConfig(local_epochs=10, max_steps=50, batch_size=8)
"""Rounds of about a second, so that thousands of junk messages arrive during the run."""
REPLY_BURST, REPLY_RATE = 10, 0.5
"""The aggregator's reject-reply budget per registered device (cloud.service)."""


def junk(rng: random.Random, topics: Topics, ids: list[str]) -> tuple[str, bytes]:
    """One malformed message on the uplink: random bytes, bad JSON, JSON of a wrong schema
    or a fake chunk, on a real or made-up device id, some on 5,000-character topic levels."""
    r = rng.random()
    device = "x" * 5000 if r < 0.1 else rng.choice(ids + [f"fake{rng.randrange(10**6)}"])
    kind = rng.choice(UP_KINDS)
    topic = f"{topics.root}/dev/{device}/up/{kind}"
    if 0.1 <= r < 0.2:
        topic += "/" + "y" * 5000
    elif 0.2 <= r < 0.25:
        topic = f"{topics.root}/dev/{rng.choice(ids)}/up/{'z' * 5000}"
    how = rng.randrange(5)
    if how == 0:
        payload = rng.randbytes(rng.randrange(1, 2000))
    elif how == 1:
        payload = b'{"v": 1, "type": "' + kind.encode() + b'", "device_id": ' + rng.randbytes(30)
    elif how == 2:
        payload = json.dumps({"v": 1, "type": kind, "device_id": device[:64], "junk": "x" * rng.randrange(500)}).encode()
    elif how == 3:
        payload = b"FMC1" + rng.randbytes(4) + rng.randbytes(rng.randrange(8, 3000))
    else:
        payload = json.dumps([rng.random() for _ in range(50)]).encode()
    return topic, payload


class Flooder(threading.Thread):
    """Publishes :func:`junk` at ``rate`` messages per second (QoS 0 and 1, never waiting
    for PUBACKs) until :meth:`stop`."""

    def __init__(self, url: str, federation: str, ids: list[str], rate: float = RATE, protocol: str = "auto"):
        super().__init__(name="flooder", daemon=True)
        self.tr = Transport(url, f"flooder-{federation}", protocol=protocol).connect()
        self.topics, self.ids, self.rate = Topics(federation), ids, rate
        self.sent = 0
        self.seconds = 0.0
        self._halt = threading.Event()

    def run(self) -> None:
        rng = random.Random(7)
        t0 = time.monotonic()
        while not self._halt.is_set():
            topic, payload = junk(rng, self.topics, self.ids)
            self.tr.publish_nowait(topic, payload, qos=rng.choice((0, 1)))
            self.sent += 1
            ahead = t0 + self.sent / self.rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        self.seconds = time.monotonic() - t0

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
        self.tr.close()


class Records(logging.Handler):
    """Counts log records of the cloud and protocol layers (what the aggregator process writes)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(("cloud", "protocol")) and record.levelno >= logging.INFO:
            self.records.append(record)


def _run(fed: Federation, extra=None) -> tuple[list[dict], float, list[logging.LogRecord]]:
    handler = Records()
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        t0 = time.monotonic()
        records = fed.run(extra=extra, timeout=120)
        return records, time.monotonic() - t0, handler.records
    finally:
        root.removeHandler(handler)
        root.setLevel(old)


@pytest.mark.slow
def test_flood_keeps_rounds_moving_logs_bounded_and_replies_capped(mosquitto_url, tmp_path):
    kw = dict(experts=(2, 4), round_timeout_s=30, config_kw={"train": TRAIN})
    clean = Federation(mosquitto_url, str(tmp_path / "clean"), rounds=CLEAN_ROUNDS, **kw)
    clean_records, clean_run, clean_logs = _run(clean)
    assert [r["status"] for r in clean_records] == ["ok"] * CLEAN_ROUNDS
    # the clean run of ROUNDS rounds: its set-up (all but the rounds) once, then ROUNDS mean rounds;
    # its log: the lines of no round once, each round's lines (those naming "round N") ROUNDS / CLEAN_ROUNDS times
    clean_round_s = sum(r["seconds"] for r in clean_records) / CLEAN_ROUNDS
    clean_total = clean_run - CLEAN_ROUNDS * clean_round_s + ROUNDS * clean_round_s
    per_round = sum(bool(re.search(r"\bround \d", r.getMessage())) for r in clean_logs)
    clean_lines = len(clean_logs) - per_round + per_round * ROUNDS / CLEAN_ROUNDS

    fed = Federation(mosquitto_url, str(tmp_path / "flood"), rounds=ROUNDS, **kw)
    ids = ["dev0", "dev1"]
    replies = {d: 0 for d in ids}
    monitor = Transport(mosquitto_url, f"monitor-{fed.federation}").connect()
    monitor.subscribe(f"{Topics(fed.federation).root}/dev/+/down/command", timeout=10)
    flooder = Flooder(mosquitto_url, fed.federation, ids, protocol=fed.protocol)

    try:
        records, total, logs = _run(fed, lambda _: flooder.start())  # from the aggregator's subscription on
    finally:
        flooder.stop()
    while (m := monitor.get(0.5)) is not None:
        cmd = parse_message(m.payload, Command)
        device = m.topic.split("/")[-3]
        if cmd.command == "reject" and device in replies:
            replies[device] += 1
    monitor.close()

    agg = fed.aggregator
    assert flooder.sent >= 0.9 * RATE * flooder.seconds and flooder.sent > 1000, (flooder.sent, flooder.seconds)
    # every round closed with both honest updates
    assert [r["status"] for r in records] == ["ok"] * ROUNDS
    assert all(set(r["devices"]) == set(ids) for r in records)
    # the rounds keep moving: before the fix the flood stalled a 1.2 s run for 50 s (40x); the
    # bound here is loose on purpose (a shared CI core is no stopwatch; on an idle machine the
    # flooded run took about 1.11x the clean one)
    mean = sum(r["seconds"] for r in records) / len(records)
    logging.getLogger(__name__).info("flood: mean round %.2f s vs %.2f s clean; run %.1f s vs %.1f s clean "
                                     "(%d rounds from %d)", mean, clean_round_s, total, clean_total, ROUNDS,
                                     CLEAN_ROUNDS)
    assert mean <= 3 * clean_round_s + 10.0, (mean, clean_round_s)
    assert total <= 3 * clean_total + 10.0, (total, clean_total)
    # the junk was handled (not queued up) and refused; the log stayed small
    assert agg.transport.dropped == 0
    assert agg.rejected >= 0.5 * flooder.sent and agg.dropped > 0 and agg.internal_errors == 0
    assert len(logs) < clean_lines + 60, [r.getMessage()[:120] for r in logs[-20:]]
    assert max(len(r.getMessage()) for r in logs) < 1000
    # the real devices got at most their reply budget
    budget = REPLY_BURST + REPLY_RATE * flooder.seconds + 1
    assert all(n <= budget for n in replies.values()), (replies, budget)


def test_signed_aggregator_drops_unsigned_junk_unparsed(tmp_path, monkeypatch, caplog):
    """With signatures, unsigned update/stats junk and anything from devices that are not
    provisioned is refused before any parsing or signature check: counted, no
    per-message log line, no reply to strangers and at most the reply budget to a device."""
    import cloud.service as S
    from protocol.signing import Verifier

    p = provision(tmp_path / "secrets", ["dev0", "dev1"])
    fed = Federation("mqtt://127.0.0.1:1", str(tmp_path), secure=p)  # never connects
    agg = fed.aggregator
    t = Topics(fed.federation)
    sent: list[str] = []
    monkeypatch.setattr(agg.transport, "publish_nowait", lambda topic, payload, qos=1: sent.append(topic) or True)
    hello = Hello(device_id="dev0", sdk_version="x", budget_bytes=2**40, weight_formats=["int8"], num_samples=10,
                  task="bbc", runtime_bytes=0)
    agg._handle(t.up("dev0", "hello"), encode(hello))
    assert agg.registry.get("dev0") is not None

    def forbidden(*a, **k):
        raise AssertionError("junk reached a parser or the signature check")

    for name in ("parse_message", "parse_chunk"):
        monkeypatch.setattr(S, name, forbidden)
    monkeypatch.setattr(agg.updates, "add", forbidden)
    monkeypatch.setattr(Verifier, "verify", forbidden)
    rng = random.Random(3)
    n = 3000
    messages = []
    for i in range(n):
        if i % 3 == 0:   # unsigned junk on a registered, provisioned device
            messages.append((t.up("dev0", rng.choice(("update", "stats"))), rng.randbytes(200), {}))
        elif i % 3 == 1:  # a device that is not provisioned, any kind, even with "signature" properties
            messages.append((t.up(f"ghost{i}", rng.choice(UP_KINDS)), rng.randbytes(200), {"fm-sig": "x"}))
        else:             # unsigned on a provisioned device that never said hello
            messages.append((t.up("dev1", "update"), b"FMC1" + rng.randbytes(100), {"fm-round": "1"}))
    r0, d0 = agg.rejected, agg.dropped
    caplog.set_level(logging.INFO, logger="cloud.service")
    caplog.clear()
    t0 = time.perf_counter()
    for topic, payload, props in messages:
        agg._handle(topic, payload, props)
    seconds = time.perf_counter() - t0
    assert agg.rejected - r0 == n and agg.dropped - d0 == n
    assert not any("ghost" in s for s in sent)                              # no reply to strangers
    to_dev0 = sum("/dev/dev0/" in s for s in sent)
    assert 1 <= to_dev0 <= REPLY_BURST + REPLY_RATE * seconds + 1            # the budget, not one per message
    assert len(sent) <= 2 * REPLY_BURST + 2 * REPLY_RATE * seconds + 2
    assert len(caplog.records) <= 25, [r.getMessage()[:100] for r in caplog.records]
    assert seconds / n < 1e-3, f"{1e6 * seconds / n:.0f} us per unsigned junk message"
    agg.store.close()


def test_log_limiter_logs_a_few_then_summarises(caplog):
    from protocol.logsafe import LogLimiter, clip

    now = [0.0]
    lim = LogLimiter(logging.getLogger("t.flood"), "rejections", per_key=2, total=3, interval_s=60,
                     clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="t.flood")
    logged = [lim.log("bad JSON", logging.WARNING, "line %d", i) for i in range(1000)]
    logged += [lim.log("bad magic", logging.WARNING, "magic %d", i) for i in range(10)]
    assert sum(logged) == 3 and [r.getMessage() for r in caplog.records] == ["line 0", "line 1", "magic 0"]
    now[0] = 61.0
    lim.flush()
    summary = caplog.records[-1].getMessage()
    assert "suppressed 1007 similar rejections in the last 61 s" in summary
    assert "998x bad JSON" in summary and "9x bad magic" in summary
    assert lim.log("bad JSON", logging.WARNING, "again")   # a new interval logs again
    lim.flush()
    assert len(caplog.records) == 5                        # nothing suppressed: no summary
    assert clip("a" * 5000) == "a" * 80 + "...(5000 chars)" and clip("short") == "short"


def test_rate_limiter_buckets_are_per_key_and_bounded():
    from protocol.logsafe import RateLimiter

    now = [0.0]
    lim = RateLimiter(rate=0.5, burst=5, max_keys=3, clock=lambda: now[0])
    assert [lim.allow("a") for _ in range(7)] == [True] * 5 + [False] * 2
    assert lim.allow("b")
    now[0] = 2.0                                           # one token back after 2 s
    assert lim.allow("a") and not lim.allow("a")
    for k in ("c", "d", "e"):
        lim.allow(k)
    assert len(lim._buckets) == 3 and lim.denied == 3


def test_device_logs_junk_on_its_downlink_rate_limited(tmp_path, caplog):
    from edge_sdk import EdgeClient
    from protocol.transport import Incoming

    c = EdgeClient("mqtt://127.0.0.1:1", "dev0", [("text", "a")] * 10, federation="fz", task="bbc",
                   cache_dir=str(tmp_path / "cache"))
    t = Topics("fz")
    rng = random.Random(5)
    topics = [t.down("dev0", "command"), t.down("dev0", "assignment"), t.down("dev0", "state"),
              f"{t.root}/dev/dev0/down/{'q' * 5000}", f"{t.root}/shards/0/int8/0/0/0"]
    for i in range(2000):
        c.transport.inbox.put(Incoming(topics[i % len(topics)], rng.randbytes(rng.randrange(1, 500)), False, {}))
    caplog.set_level(logging.INFO, logger="edge_sdk.client")
    while c._pump(0):
        pass
    lines = [r.getMessage() for r in caplog.records if r.name == "edge_sdk.client"]
    assert 1 <= len(lines) <= 10 and max(map(len, lines)) < 1000, lines
    assert c._reject_log.suppressed_total >= 1900
