"""Security over a real Mosquitto with TLS, per-device credentials and the ACL from
``fedmoe provision``; signed updates (Ed25519) and what the aggregator rejects."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import time

import pytest
import torch

from edge_sdk.filters import Signing
from fedmoe.broker import MosquittoBroker
from fedmoe.provision import load_credentials, mosquitto_conf, mosquitto_password_line, provision
from protocol.chunking import split_blob
from protocol.codec import encode_tensors, sha256_hex
from protocol.messages import (
    Ack, Assignment, BlobRef, Hello, LayerStats, Stats, encode,
)
from protocol.signing import (
    ReplayGuard, SignatureError, Signer, Verifier, generate_key, load_private_key, public_key_b64,
)
from protocol.topics import Topics
from protocol.transport import PublishError, TlsConfig, Transport, TransportError
from tests.federation import Federation, drain_downlink

pytestmark = pytest.mark.skipif(not MosquittoBroker.available(), reason="no mosquitto binary")


# --------------------------------------------------------------------------- unit


def test_signature_verifies_and_binds_every_field():
    key = generate_key()
    v = Verifier({"a": public_key_b64(key), "b": public_key_b64(generate_key())})
    props = Signer("a", key).properties("update", 3, "up1", "ab" * 32)
    signed = v.verify("update", "a", props)
    assert (signed.round, signed.upload_id, signed.sha256) == (3, "up1", "ab" * 32)
    with pytest.raises(SignatureError, match="forged"):
        v.verify("update", "b", props)  # another device's topic
    with pytest.raises(SignatureError, match="forged"):
        v.verify("stats", "a", props)  # another kind
    for field, value in (("fm-round", "4"), ("fm-upload", "up2"), ("fm-sha", "cd" * 32)):
        with pytest.raises(SignatureError, match="forged"):
            v.verify("update", "a", {**props, field: value})
    with pytest.raises(SignatureError, match="unsigned"):
        v.verify("update", "a", {})
    with pytest.raises(SignatureError, match="malformed"):
        v.verify("update", "a", {**props, "fm-sig": "!!"})
    with pytest.raises(SignatureError, match="no signing key"):
        v.verify("update", "zed", props)
    # each chunk of an upload carries the same signature: verified once, still bound to every field
    assert v.verify("update", "a", props) == signed
    with pytest.raises(SignatureError, match="forged"):
        v.verify("update", "a", {**props, "fm-sha": "cd" * 32})
    v.keys["a"] = v.keys["b"]  # the device's key replaced: its old signatures no longer verify
    with pytest.raises(SignatureError, match="forged"):
        v.verify("update", "a", props)


def test_replay_guard_tells_duplicates_from_replays():
    key = generate_key()
    v = Verifier({"a": public_key_b64(key)})
    s = Signer("a", key)
    g = ReplayGuard()
    first = v.verify("stats", "a", s.properties("stats", 1, "u", "aa" * 32))
    assert g.check("a", "stats", first) is True
    assert g.check("a", "stats", first) is False  # exact repeat (QoS 1 redelivery)
    other = v.verify("stats", "a", s.properties("stats", 1, "u", "bb" * 32))
    with pytest.raises(SignatureError, match="replayed"):
        g.check("a", "stats", other)
    g.prune(2)
    assert len(g) == 0


def test_provision_is_incremental_and_writes_secrets(tmp_path):
    p1 = provision(tmp_path / "s", ["a", "b"])
    p2 = provision(tmp_path / "s", ["b", "c", "c"])
    assert set(p2.devices) == {"a", "b", "c"} and p1.new == ["a", "b"] and p2.new == ["c"]  # "b" kept, not new
    assert p2.devices["a"] == p1.devices["a"] and p2.devices["b"] == p1.devices["b"]
    cred = load_credentials(p2.device_file("c"))
    load_private_key(cred["signing_key"])
    assert (p2.device_file("c").stat().st_mode & 0o777) == 0o600
    lines = (tmp_path / "s" / "passwd").read_text().split()
    assert sorted(x.split(":")[0] for x in lines) == ["a", "b", "c", "fedmoe-aggregator"]
    assert all(x.split(":")[1].startswith("$7$101$") for x in lines)
    acl = (tmp_path / "s" / "acl").read_text()
    assert "pattern write fl/v1/+/dev/%u/up/#" in acl and "pattern read fl/v1/+/dev/%u/down/#" in acl
    for u in ("a", "b", "c"):  # shards readable by name: no pattern without %u (Mosquitto warns about those)
        assert f"user {u}\ntopic read fl/v1/+/shards/#\n" in acl
    assert [x for x in acl.splitlines() if x.startswith("pattern") and "%u" not in x] == []
    nats = (tmp_path / "s" / "nats-users.conf").read_text()
    assert all(f'user: "{u}"' in nats for u in ("a", "b", "c"))
    with pytest.raises(ValueError):
        provision(tmp_path / "s", ["bad/id"])
    with pytest.raises(ValueError):
        mosquitto_password_line("a:b", "x")


# --------------------------------------------------------------------------- broker


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """A provisioned deployment and a Mosquitto with TLS + passwords + ACL on a free port."""
    d = tmp_path_factory.mktemp("secure")
    p = provision(d / "secrets", ["dev0", "dev1", "mallory"], tls_hosts=["localhost", "127.0.0.1"])
    broker = MosquittoBroker(str(d / "broker"), mosquitto_conf(p.out)).start()
    log = (d / "broker" / "mosquitto.log").read_text()
    assert "Config loaded" in log or "running" in log, log  # the log is where a config warning would be
    assert "does not contain '%c' or '%u'" not in log and "Warning" not in log, log
    yield p, broker
    broker.stop()


def _tr(p, broker, user, **kw):
    info = p.aggregator if user == "agg" else p.devices[user]
    return Transport(broker.url(tls=True), f"{user}-{time.monotonic_ns()}", username=info["username"],
                     password=info["password"], tls=TlsConfig(str(p.ca_file)), protocol="5", **kw)


def test_unauthenticated_and_wrong_password_refused(secure):
    p, broker = secure
    tls = TlsConfig(str(p.ca_file))
    with pytest.raises(TransportError, match="refused"):
        Transport(broker.url(tls=True), "anon", tls=tls, protocol="5").connect(10)
    with pytest.raises(TransportError, match="refused"):
        Transport(broker.url(tls=True), "x", username="dev0", password="wrong", tls=tls, protocol="5").connect(10)
    with pytest.raises(TransportError):  # plain TCP to the TLS listener
        Transport(broker.url(), "plain", username="dev0", password=p.devices["dev0"]["password"],
                  protocol="5").connect(2)
    t = _tr(p, broker, "dev0").connect(10)
    t.close()


def test_acl_confines_each_device_to_its_own_topics(secure):
    p, broker = secure
    t = Topics("acl")
    agg = _tr(p, broker, "agg").connect(10)
    agg.subscribe("fl/v1/#")
    a = _tr(p, broker, "dev0").connect(10)
    b = _tr(p, broker, "dev1").connect(10)
    a.subscribe(t.device_down("dev1"))      # A tries to read B's assignment
    a.subscribe(t.device_down("dev0"))
    b.subscribe(t.device_down("dev1"))
    time.sleep(0.5)
    with pytest.raises(PublishError, match="rejected"):
        a.publish(t.up("dev1", "stats"), b"forged by dev0", timeout=10)   # A writes into B's topic
    with pytest.raises(PublishError, match="rejected"):
        a.publish(t.down("dev1", "assignment"), b"fake assignment", timeout=10)
    with pytest.raises(PublishError, match="rejected"):
        a.publish("fl/v1/acl/shards/0/1/0/0", b"poisoned shard", timeout=10)
    a.publish(t.up("dev0", "stats"), b"own", timeout=10)                   # its own subtree works
    agg.publish(t.down("dev1", "assignment"), b"for dev1 only")
    agg.publish(t.down("dev0", "assignment"), b"for dev0")
    time.sleep(1.0)

    def drain(tr):
        out = []
        while (m := tr.get(0.1)) is not None:
            out.append((m.topic, m.payload))
        return out

    got_a, got_b, got_agg = drain(a), drain(b), drain(agg)
    assert got_b == [(t.down("dev1", "assignment"), b"for dev1 only")]        # positive control
    assert got_a == [(t.down("dev0", "assignment"), b"for dev0")]             # never B's
    payloads = [x[1] for x in got_agg]
    assert b"own" in payloads                                                   # positive control
    assert not {b"forged by dev0", b"fake assignment", b"poisoned shard"} & set(payloads)
    for tr in (a, b, agg):
        tr.close()


def mallory(fed: Federation, p, broker, replies: list, foreign: list) -> None:
    """A provisioned but malicious device: unsigned, forged, mismatched, duplicated and
    stale (straggler) messages, then it refuses round 2."""
    t = Topics(fed.federation)
    tr = _tr(p, broker, "mallory").connect(10)
    tr.subscribe(t.device_down("mallory"), timeout=10)
    tr.subscribe(t.device_down("dev0"))                   # denied by the ACL: nothing may arrive
    up = lambda kind: t.up("mallory", kind)  # noqa: E731
    with pytest.raises(PublishError):
        tr.publish(t.up("dev0", "stats"), b"{}", timeout=10)
    hello = Hello(device_id="mallory", sdk_version="x", budget_bytes=2**40, weight_formats=["int8"],
                  num_samples=10, task="bbc", runtime_bytes=0)
    tr.publish(up("hello"), encode(hello))
    signer = Signer("mallory", load_private_key(p.devices["mallory"]["signing_key"]))
    assignments: list[Assignment] = []

    def drain(seconds: float, until=None) -> None:
        drain_downlink(tr, seconds, replies, assignments, until, device="mallory", foreign=foreign)

    drain(60, lambda: assignments)
    a1 = assignments[0]
    expected = fed.aggregator.model.expected_for(a1.experts, "bbc")
    data = encode_tensors({k: torch.zeros(s) for k, (s, _) in expected.items()})
    sha = sha256_hex(data)

    def send(tid: str, props, rnd: int = a1.round):
        chunks, _ = split_blob(data, 4096, tid, "update", rnd)
        tr.publish_many([(up("update"), c, False) for c in chunks], user_properties=props)
        return len(chunks)

    send("u-unsigned", None)
    send("u-forged", Signer("mallory", generate_key()).properties("update", a1.round, "u-forged", sha))
    send("u-mismatch", signer.properties("update", a1.round, "another-upload", sha))
    good = signer.properties("update", a1.round, "u-good", sha)
    n = send("u-good", good)
    send("u-good", good)                                   # a duplicate delivery
    E = fed.aggregator.model.spec.num_experts
    layers = [LayerStats(layer=l, tokens=0, usage=[0] * E, activation_prob=[0.0] * E, routing_dist=[0.0] * E,
                         margin=[0.0] * E, expert_loss=[None] * E, expert_acc=[None] * E, expert_samples=[0] * E)
              for l in fed.aggregator.model.layers]
    stats = Stats(device_id="mallory", round=a1.round, task="bbc", num_samples=10, train_loss=1.0, layers=layers,
                  update=BlobRef(transfer_id="u-good", bytes=len(data), sha256=sha, chunks=n), train_seconds=0.0,
                  bytes_up=0, bytes_down=0, peak_rss_bytes=0, baseline_rss_bytes=0, shards_fetched=[])
    payload = encode(stats)
    as_dev0 = encode(stats.model_copy(update={"device_id": "dev0"}))
    tr.publish(up("stats"), as_dev0, user_properties=signer.stats_properties(a1.round, "u-good", as_dev0))
    tr.publish(up("stats"), payload, user_properties=signer.stats_properties(a1.round, "u-good", payload + b" "))
    sp = signer.stats_properties(a1.round, "u-good", payload)
    tr.publish(up("stats"), payload, user_properties=sp)
    tr.publish(up("stats"), payload, user_properties=sp)  # a duplicate delivery
    drain(90, lambda: len(assignments) > 1)
    a2 = assignments[1]
    send("u-good", good)                                   # straggler: round 1's update, after round 1 closed
    tr.publish(up("stats"), payload, user_properties=sp)
    drain(2.0)
    tr.publish(up("ack"), encode(Ack(device_id="mallory", round=a2.round, accepted=False, reason="leaving")))
    drain(2.0)
    tr.close()


@pytest.mark.slow
def test_signed_federation_rejects_forgeries_duplicates_and_stragglers(secure, tmp_path):
    p, broker = secure
    replies, foreign = [], []
    fed = Federation(broker.url(tls=True), str(tmp_path), rounds=2, experts=(2, 4), min_devices=3,
                     round_timeout_s=60, secure=p)
    r1, r2 = fed.run(extra=lambda f: mallory(f, p, broker, replies, foreign))
    text = "\n".join(replies)
    for expected in ("unsigned update", "forged update", "does not match its signature", "does not match the topic",
                     "current round is 2"):
        assert expected in text, (expected, text)
    assert foreign == []                                    # mallory never saw dev0's traffic
    # its correctly signed update was accepted by the protocol, then screened: an all-zero state is a change far
    # beyond the round's typical one
    assert r1["status"] == "ok" and set(r1["devices"]) == {"dev0", "dev1"} and set(r1["screening"]["rejected"]) == {
        "mallory"}
    assert r2["status"] == "ok" and set(r2["devices"]) == {"dev0", "dev1"} and "mallory" in r2["failures"]
    assert fed.aggregator.duplicates >= 1
    assert all(isinstance(c.filters[-1], Signing) and c.transport.v5 for c in fed.clients)
    assert all(torch.isfinite(v).all() for v in fed.aggregator.model.state.values())


def test_provision_cli_writes_a_deployment(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "dep"
    proc = subprocess.run([sys.executable, "-m", "fedmoe", "provision", "--out", str(out), "--count", "3",
                           "--prefix", "edge-", "--devices", "gw", "--tls-host", "mqtt.example.org",
                           "--tls-host", "10.0.0.5,fd00::5", "--bind", "127.0.0.1", "--port", "18883"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "(4 new, 0 kept)" in proc.stdout and "4 new, 0 kept" in proc.stderr
    keys = json.loads((out / "device_keys.json").read_text())
    assert sorted(keys) == ["edge-0", "edge-1", "edge-2", "gw"]
    for f in ("passwd", "acl", "aggregator.json", "mosquitto.conf", "tls/ca.crt", "tls/server.key"):
        assert (out / f).exists(), f
    conf = (out / "mosquitto.conf").read_text()
    assert "certfile" in conf and "\nlistener 18883 127.0.0.1\n" in conf
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((out / "tls" / "server.crt").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["mqtt.example.org"]  # no localhost unless asked
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5", "fd00::5"]
    proc = subprocess.run([sys.executable, "-m", "fedmoe", "provision", "--out", str(out), "--count", "5",
                           "--prefix", "edge-"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "6 devices" in proc.stdout and "(2 new, 4 kept)" in proc.stdout  # honest counts
    assert "\nlistener 18883 127.0.0.1\n" in (out / "mosquitto.conf").read_text()  # a re-run keeps the listener
    for bad, why in ((["--devices", "a/b"], "invalid device id"), (["--tls-host", "mqtts://x:8883"], "DNS name"),
                     (["--port", "70000"], "not a TCP port")):
        proc = subprocess.run([sys.executable, "-m", "fedmoe", "provision", "--out", str(out), *bad],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and why in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root: the broker drops to its user")
def test_provisioned_config_starts_mosquitto_as_written(tmp_path):
    """The deployment guide's two commands verbatim (docs/deployment.md): ``fedmoe provision`` as root, then ``mosquitto -c
    secrets/mosquitto.conf`` (which drops to the ``mosquitto`` account) accepts a
    provisioned device over TLS and refuses a wrong password."""
    import pwd
    import socket
    import subprocess
    import tempfile

    try:
        account = pwd.getpwnam("mosquitto")
    except KeyError:
        pytest.skip("no mosquitto system account")
    base = Path(tempfile.mkdtemp(prefix="fedmoe-deploy-", dir="/tmp"))  # pytest's tmp_path is 0700 root
    base.chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "fedmoe", "provision", "--out", str(base / "secrets"),
                           "--devices", "dev-7", "--tls-host", "127.0.0.1", "--port", str(port)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (base / "secrets" / "passwd").stat().st_uid == account.pw_uid
    assert (base / "secrets" / "tls" / "server.key").stat().st_mode & 0o077 == 0  # still private
    broker = subprocess.Popen([shutil.which("mosquitto") or "/usr/sbin/mosquitto",
                               "-c", str(base / "secrets" / "mosquitto.conf")], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert broker.poll() is None, broker.stderr.read().decode(errors="replace")[-2000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        info = load_credentials(base / "secrets" / "devices" / "dev-7.json")
        tls = TlsConfig(info["tls_ca"])
        t = Transport(f"mqtts://127.0.0.1:{port}", "dev-7-c", username="dev-7", password=info["password"], tls=tls,
                      protocol="5")
        t.connect(10)
        t.close()
        with pytest.raises(TransportError, match="refused"):
            Transport(f"mqtts://127.0.0.1:{port}", "dev-7-d", username="dev-7", password="wrong", tls=tls,
                      protocol="5").connect(10)
    finally:
        broker.terminate()
        broker.wait(10)
        shutil.rmtree(base, ignore_errors=True)
