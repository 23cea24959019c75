"""The native (phone-class) device, ``native/`` built into ``fedmoe-device``: its protocol pieces
equal the Python reference's (payloads in every weight format, chunks, Python's shuffle,
signatures), it joins a signed federation over a real Mosquitto beside Python devices, its
update equals a Python device's on the same data, seed and experts, and bad input from the
cloud gets the refusals a Python device gives, without a crash."""

from __future__ import annotations

import base64
import json
import random
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("executorch")

from safetensors.torch import load_file  # noqa: E402

from cloud.config import StrategyConfig  # noqa: E402
from fedmoe.native_data import write_token_file  # noqa: E402
from protocol.chunking import Reassembler, split_blob  # noqa: E402
from protocol.codec import decode_tensors, encode_tensors  # noqa: E402
from protocol.messages import Ack, Assignment, parse_message  # noqa: E402
from protocol.signing import generate_key, private_key_b64  # noqa: E402
from protocol.topics import Topics  # noqa: E402
from protocol.transport import Transport  # noqa: E402
from tests.conftest import TINY_CONFIG, native_binary  # noqa: E402
from tests.federation import Federation  # noqa: E402
from tests.test_http_shards import ShardServer, server  # noqa: E402,F401  (server: the web-server fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tools():
    return native_binary("fedmoe-native-check"), native_binary("fedmoe-device")


def _check(tool, *args, ok=True):
    r = subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True, timeout=60)
    assert (r.returncode == 0) == ok, r.stderr
    return r


def test_payloads_in_every_format_decode_as_the_reference_decodes_them(tools, tmp_path):
    check = tools[0]
    g = torch.Generator().manual_seed(0)
    state = {"expert.1.3.fc1.lora_B": torch.randn(96, 8, generator=g), "router.1.3": torch.randn(64, generator=g),
             "backbone.q.lora_B": torch.randn(8, 96, generator=g), "head.bbc.weight": torch.randn(5, 33, generator=g),
             "w": torch.randn(3, 4, 5, generator=g)}
    for fmt in ("fp32", "fp16", "bf16", "int8", "nf4"):
        for compress in (False, True):
            blob = encode_tensors(state, fmt, compress=compress, vectors=fmt == "nf4")
            (tmp_path / "in").write_bytes(blob)
            _check(check, "decode", tmp_path / "in", tmp_path / "out")
            got, ref = load_file(str(tmp_path / "out")), decode_tensors(blob, 2**30, as_float=torch.float32)
            assert got.keys() == ref.keys()
            for k in ref:
                assert torch.equal(got[k], ref[k].float()), (fmt, compress, k)
    _check(check, "encode", tmp_path / "in", tmp_path / "enc", "compress")  # the device's own update encoding
    back = decode_tensors((tmp_path / "enc").read_bytes(), 2**30)
    assert all(torch.equal(back[k], load_file(str(tmp_path / "out"))[k]) for k in back)


def test_bad_payloads_are_refused_with_a_reason(tools, tmp_path):
    check = tools[0]
    good = encode_tensors({"a": torch.ones(4, 4)}, "int8")
    z = encode_tensors({"a": torch.ones(64, 4)}, "fp32", compress=True)
    header = int.from_bytes(good[:8], "little")
    cases = {
        "truncated": good[:-3],
        "trailing bytes after the zlib stream": z + b"x",
        "truncated zlib stream": z[:-5],
        "unknown format": good.replace(b'"int8"', b'"int9"'),
        "int8 without its scale": good.replace(b"a::scale", b"b::scale"),
        "header beyond the data": (header + 10**6).to_bytes(8, "little") + good[8:],
    }
    header = json.dumps({"x": {"dtype": "F32", "shape": [2**32 + 1, 2**32 - 1, 2**32 + 1, 2**32 - 1],
                               "data_offsets": [0, 4]}}).encode()
    cases["a shape whose element count wraps around 2^64"] = len(header).to_bytes(8, "little") + header + b"\0" * 4
    f32 = bytearray(encode_tensors({"a": torch.ones(2)}, "fp32"))
    f32[-4:] = bytes.fromhex("0000c07f")  # NaN in the data
    cases["a NaN"] = bytes(f32)
    for why, blob in cases.items():
        (tmp_path / "bad").write_bytes(blob)
        r = _check(check, "decode", tmp_path / "bad", tmp_path / "o", ok=False)
        assert r.returncode == 2 and r.stderr.strip(), why


def test_chunks_shuffles_and_signatures_equal_the_reference(tools, tmp_path):
    check = tools[0]
    blob = bytes(random.Random(1).randbytes(5000))
    (tmp_path / "blob").write_bytes(blob)
    sha = _check(check, "split", tmp_path / "blob", 2048, "abc123", "update", 7, tmp_path / "mine").stdout.strip()
    rx, done = Reassembler(2**20), None
    for f in sorted((tmp_path / "mine").iterdir()):
        done = rx.add("dev", f.read_bytes()) or done
    assert done is not None and done.data == blob and done.header.sha == sha
    (tmp_path / "ref").mkdir()
    chunks, _ = split_blob(blob, 2048, "abc123", "update", 7)
    for i, c in enumerate(chunks):
        (tmp_path / "ref" / f"{i:06d}.chunk").write_bytes(c)
    _check(check, "join", tmp_path / "ref", tmp_path / "joined")
    assert (tmp_path / "joined").read_bytes() == blob
    bad = bytearray(chunks[1])
    bad[-1] ^= 1  # its data no longer matches its csha
    (tmp_path / "ref" / "000001.chunk").write_bytes(bytes(bad))
    assert "sha256" in _check(check, "join", tmp_path / "ref", tmp_path / "j2", ok=False).stderr
    for seed in (0, 7, 100_003 * 3 + 2, 2**40 + 5):
        ref = list(range(57))
        random.Random(seed).shuffle(ref)
        assert json.loads(_check(check, "shuffle", seed, 57).stdout) == ref
    key = generate_key()
    sig = _check(check, "sign", private_key_b64(key), "fedmoe/v1|update|d|3|ab|cd").stdout.strip()
    key.public_key().verify(base64.b64decode(sig), b"fedmoe/v1|update|d|3|ab|cd")


# --------------------------------------------------------------------------- federations


NO_DROPOUT = {**TINY_CONFIG, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


class Natives:
    """``fedmoe-device`` processes of a test federation, each with its token file and log."""

    def __init__(self, binary_path: Path, federation: str, spec, tmp: Path, url: str, tls_ca: str | None = None):
        self.binary, self.federation, self.spec, self.tmp, self.url = binary_path, federation, spec, tmp, url
        self.tls_ca = tls_ca
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, device_id: str, items, budget: str = "1GiB", credentials: Path | None = None, **flags):
        data = write_token_file(items, self.spec, self.tmp / f"{device_id}.tokens.safetensors")
        args = [str(self.binary), "--broker", self.url, "--federation", self.federation, "--task", "bbc",
                "--budget", budget, "--data", str(data), "--cache", str(self.tmp / f"cache-{device_id}")]
        args += ["--credentials", str(credentials)] if credentials else ["--device-id", device_id]
        if self.tls_ca:
            args += ["--tls-ca", self.tls_ca]
        for k, v in flags.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        self.procs[device_id] = subprocess.Popen(args, stderr=open(self.tmp / f"{device_id}.log", "w"))

    def log(self, device_id: str) -> str:
        return (self.tmp / f"{device_id}.log").read_text()

    def wait(self, timeout: float = 60) -> dict[str, int]:
        out = {}
        for d, p in self.procs.items():
            try:
                out[d] = p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out[d] = -9
        return out


def _served(server) -> dict:
    return {"shard_url": server.url, "shard_dir": str(server.directory)}


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """A provisioned deployment (TLS, passwords, ACL, signing keys) and its Mosquitto."""
    from fedmoe.broker import MosquittoBroker
    from fedmoe.provision import mosquitto_conf, provision

    d = tmp_path_factory.mktemp("native-secure")
    p = provision(d / "secrets", ["dev0", "dev1", "nat0", "nat1"], tls_hosts=["localhost", "127.0.0.1"])
    broker = MosquittoBroker(str(d / "broker"), mosquitto_conf(p.out)).start()
    yield p, broker
    broker.stop()


def test_a_signed_federation_of_python_and_native_devices_completes_three_rounds(tools, secure, tmp_path,
                                                                                   server):
    """TLS, per-device accounts under the ACL, Ed25519-signed updates and stats: 2 Python and 2
    native devices take part in every round, every update is accepted."""
    p, broker = secure
    fed = Federation(broker.url(tls=True), str(tmp_path), rounds=3, experts=(2, 4), min_devices=4,
                     round_timeout_s=150, secure=p, config_kw=_served(server))
    natives = Natives(tools[1], fed.federation, fed.aggregator.cfg.model, tmp_path, broker.url(tls=True), str(p.ca_file))
    records = fed.run(extra=lambda f: [natives.start(d, f.train_items[200 + 40 * i:240 + 40 * i],
                                                     credentials=p.device_file(d)) for i, d in enumerate(("nat0", "nat1"))],
                      timeout=600)
    codes = natives.wait()
    assert len(records) == 3, records
    for r in records:
        assert r["status"] == "ok" and set(r["devices"]) == {"dev0", "dev1", "nat0", "nat1"}, r
        for d in ("nat0", "nat1"):
            rep = r["devices"][d]
            assert rep["samples"] == 32 and 0 < rep["peak_footprint_bytes"] <= rep["predicted_peak_bytes"], rep
    assert codes == {"nat0": 0, "nat1": 0}, {d: natives.log(d)[-2000:] for d in codes}
    assert "reject" not in natives.log("nat0") + natives.log("nat1")
    assert fed.aggregator.engine.programs.cache.built >= 1


def _watch(url: str, federation: str, got: dict, stop: threading.Event) -> None:
    """Every blob and stats message of the federation's devices: ``got[(device, kind)]``, kind
    ``update`` and ``state`` (blobs, reassembled) or ``stats`` (the JSON)."""
    tr = Transport(url, f"watch-{federation}").connect()
    rx = Reassembler(2**28)
    for kind in ("up/update", "up/stats", "down/state"):
        tr.subscribe(f"fl/v1/{federation}/dev/+/{kind}")
    while not stop.is_set():
        m = tr.get(0.2)
        if m is None:
            continue
        device, kind = m.topic.split("/")[4], m.topic.rsplit("/", 1)[1]
        if kind == "stats":
            got[(device, kind)] = json.loads(m.payload)
        else:
            blob = rx.add(m.topic, m.payload)
            if blob is not None:
                got[(device, kind)] = blob.data
    tr.close()


def test_the_native_update_equals_the_python_devices_on_the_same_data_seed_and_experts(tools, mosquitto_url, tmp_path,
                                                                                        server):
    """A Python device and a native device with the same data and seed, holding the same experts
    (``fixed``), train the same batches from the same state: their updates (trained minus
    received) agree within a relative L2 error of 1e-3 (fp32, no dropout), and so do their
    losses, accuracies and expert statistics."""
    fed = Federation(mosquitto_url, str(tmp_path), rounds=1, experts=(4,), min_devices=2, round_timeout_s=150,
                     spec_kw={"config": NO_DROPOUT},
                     config_kw={**_served(server),
                                "assignment": StrategyConfig(name="fixed", params={"experts": [1, 3]})})
    natives = Natives(tools[1], fed.federation, fed.aggregator.cfg.model, tmp_path, mosquitto_url)
    got, stop = {}, threading.Event()
    watcher = threading.Thread(target=_watch, args=(mosquitto_url, fed.federation, got, stop), daemon=True)
    watcher.start()
    time.sleep(0.5)
    (rec,) = fed.run(extra=lambda f: natives.start("nat0", f.train_items[0:40]), timeout=400)
    natives.wait()
    stop.set()
    watcher.join(10)
    assert rec["status"] == "ok" and set(rec["devices"]) == {"dev0", "nat0"}, rec
    assert rec["devices"]["nat0"]["experts"] == rec["devices"]["dev0"]["experts"] == {"1": [1, 3]}
    sent = {d: decode_tensors(got[(d, "state")], 2**28) for d in ("dev0", "nat0")}
    assert all(torch.equal(sent["dev0"][k], sent["nat0"][k]) for k in sent["dev0"])
    py, nat = (decode_tensors(got[(d, "update")], 2**28) for d in ("dev0", "nat0"))
    assert py.keys() == nat.keys() == sent["dev0"].keys()
    delta = lambda u: torch.cat([(u[k] - sent["dev0"][k]).flatten() for k in sorted(u)])  # noqa: E731
    ref = delta(py)
    assert ref.norm() > 0
    assert ((delta(nat) - ref).norm() / ref.norm()).item() < 1e-3
    a, b = got[("dev0", "stats")], got[("nat0", "stats")]
    assert b["num_samples"] == a["num_samples"] == 32
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-4) and b["val_accuracy"] == a["val_accuracy"]
    for la, lb in zip(a["layers"], b["layers"]):
        assert (la["layer"], la["tokens"], la["usage"], la["expert_samples"]) == (
            lb["layer"], lb["tokens"], lb["usage"], lb["expert_samples"])
        for key in ("activation_prob", "routing_dist", "margin"):
            assert lb[key] == pytest.approx(la[key], abs=1e-5), key


class RogueCloud:
    """The cloud's side played by hand against native devices: the tiny model's int8 shards and
    its training programs served over HTTP, assignments and state chunks sent as the test says,
    what the devices publish collected."""

    def __init__(self, url: str, server: ShardServer, tmp: Path):
        import uuid

        from cloud.global_model import GlobalModel
        from cloud.programs import ProgramPublisher
        from fedmoe.datasets import bbc_news
        from tests.conftest import tiny_spec

        self.items, self.labels = bbc_news()
        self.gm = GlobalModel(tiny_spec(max_seq_len=32), {"bbc": self.labels}, "int8")
        self.server = server
        for sid, data in self.gm.encoded["int8"].items():
            (server.directory / f"{self.gm.sha['int8'][sid]}.safetensors").write_bytes(data)
        self.programs = ProgramPublisher(self.gm, server.directory, server.url)
        self.federation = f"rogue-{uuid.uuid4().hex[:8]}"
        self.topics = Topics(self.federation)
        self.tr = Transport(url, f"rogue-{self.federation}").connect()
        self.tr.subscribe(f"fl/v1/{self.federation}/dev/+/up/#")
        self.seen: list[tuple[str, str, bytes]] = []  # (device, kind, payload)

    def assignment(self, round_: int, held: dict[int, list[int]], program_for=None, deadline_s: float = 60):
        from protocol.chunking import split_blob as split
        from protocol.messages import BlobRef, TrainConfig

        blob = encode_tensors(self.gm.state_for(held, "bbc"), "fp32")
        tid = f"s{round_:03d}{int(time.time() * 1000) % 10**9}"
        chunks, sha = split(blob, 4096, tid, "state", round_)
        a = Assignment(round=round_, model_version=0, model=self.gm.spec, task="bbc", labels=self.labels, experts=held,
                       shards=self.gm.manifests(held, self.topics, 2**18, url=self.server.url), weight_format="int8",
                       state=BlobRef(transfer_id=tid, bytes=len(blob), sha256=sha, chunks=len(chunks)),
                       train=TrainConfig(max_steps=2, batch_size=8), deadline=time.time() + deadline_s,
                       program=self.programs.ref_for("bbc", program_for or held, 8, 32))
        return a, chunks

    def send(self, device: str, a: Assignment, chunks: list[bytes]) -> None:
        from protocol.messages import encode

        for c in chunks:
            self.tr.publish(self.topics.device_down(device).rstrip("#") + "state", c)
        self.tr.publish(self.topics.device_down(device).rstrip("#") + "assignment", encode(a))

    def wait(self, until, timeout: float) -> None:
        end = time.time() + timeout
        while time.time() < end and not until():
            m = self.tr.get(0.2)
            if m is not None:
                parts = m.topic.split("/")
                self.seen.append((parts[4], parts[6], m.payload))

    def acks(self, device: str) -> list[Ack]:
        return [parse_message(p, Ack) for d, k, p in self.seen if d == device and k == "ack"]


def test_bad_input_from_the_cloud_gets_the_python_devices_refusals_and_nothing_crashes(tools, mosquitto_url,
                                                                                        tmp_path, server):
    cloud = RogueCloud(mosquitto_url, server, tmp_path)
    natives = Natives(tools[1], cloud.federation, cloud.gm.spec, tmp_path, mosquitto_url)
    data = cloud.items[:40]
    natives.start("nat0", data, budget="1GiB")
    natives.start("small", data, budget="11MiB")
    cloud.wait(lambda: sum(k == "hello" for _, k, _ in cloud.seen) >= 2, 30)
    held = {1: [1, 3]}

    def refused(device: str, rnd: int, timeout: float = 60) -> Ack:
        cloud.wait(lambda: any(a.round == rnd for a in cloud.acks(device)), timeout)
        got = [a for a in cloud.acks(device) if a.round == rnd]
        assert got, f"{device} sent no ack for round {rnd}: {natives.log(device)[-3000:]}"
        return got[-1]

    # 1. a truncated state chunk: refused, so the state never completes; at the deadline the round fails
    a, chunks = cloud.assignment(1, held, deadline_s=8)
    cloud.send("nat0", a, [chunks[0][:-10], *chunks[1:]])
    ack = refused("nat0", 1, 30)
    assert not ack.accepted and "adapter state did not arrive before the round deadline" in ack.reason
    # 2. a shard whose bytes fail their sha256: the round fails after its acceptance
    a, chunks = cloud.assignment(2, held)
    server.tamper = True  # every file it serves: the device has fetched none but the manifest yet
    cloud.send("nat0", a, chunks)
    cloud.wait(lambda: any(x.round == 2 and not x.accepted for x in cloud.acks("nat0")), 60)
    server.tamper = False
    acks = [x for x in cloud.acks("nat0") if x.round == 2]
    assert acks[0].accepted and not acks[-1].accepted and "sha256" in acks[-1].reason, acks
    # 3. a program for another shape (one expert per layer for a device assigned two)
    a, chunks = cloud.assignment(3, held, program_for={1: [0]})
    cloud.send("nat0", a, chunks)
    ack = refused("nat0", 3)
    assert not ack.accepted and "for another shape" in ack.reason
    # 4. an assignment over the device's budget: refused with the figures, so the cloud can try a smaller one
    a, chunks = cloud.assignment(1, held)
    cloud.send("small", a, chunks)
    ack = refused("small", 1)
    assert not ack.accepted and ack.reason.startswith("over budget: the memory plan needs")
    assert ack.budget_bytes == 11 * 2**20 and ack.needed_bytes > ack.budget_bytes and ack.runtime_bytes > 0
    # 5. garbage on every downlink topic: dropped and logged, the device goes on
    for kind in ("assignment", "state", "command"):
        cloud.tr.publish(cloud.topics.device_down("nat0").rstrip("#") + kind, b'{"v": 1.0, "type": 7}')
        cloud.tr.publish(cloud.topics.device_down("nat0").rstrip("#") + kind, b"\xff" * 100)
    # 6. then a good round: trained, and its update and signed-off stats arrive
    a, chunks = cloud.assignment(4, held)
    cloud.send("nat0", a, chunks)
    cloud.wait(lambda: any(d == "nat0" and k == "stats" for d, k, _ in cloud.seen), 120)
    stats = [json.loads(p) for d, k, p in cloud.seen if d == "nat0" and k == "stats"]
    assert stats and stats[-1]["round"] == 4 and stats[-1]["num_samples"] == 32, natives.log("nat0")[-3000:]
    assert [x.accepted for x in cloud.acks("nat0") if x.round == 4] == [True]
    for d in ("nat0", "small"):
        assert natives.procs[d].poll() is None, natives.log(d)[-3000:]  # alive
        natives.procs[d].terminate()
    assert natives.wait(30) == {"nat0": 0, "small": 0}  # SIGTERM: offline status, a clean exit
    assert "refused" in natives.log("nat0")
    cloud.tr.close()
