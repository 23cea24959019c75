"""Training programs served to devices that train with one (protocol minor 12): the cloud
exports the program of a device's shape once, writes it, its manifest and the device's
frozen LoRA A factors as content-addressed files beside the base shards, and names them in
the assignment; what a device fetches from there is enough for the native training core."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch

from protocol.chunking import Reassembler
from protocol.codec import decode_tensors
from protocol.messages import Ack, Assignment, Command, Hello, encode, parse_message
from protocol.topics import Topics
from protocol.transport import Transport
from tests.federation import Federation
from tests.test_http_shards import ShardServer

RUNTIME = "executorch-1.5"


def _hello(device_id: str, minor: int = 12, runtimes=(RUNTIME,)) -> Hello:
    return Hello(device_id=device_id, sdk_version="native-test", protocol_minor=minor, budget_bytes=2**40,
                 weight_formats=["int8"], num_samples=40, task="bbc", runtime_bytes=0, runtimes=list(runtimes))


def test_hello_runtimes_are_bounded():
    assert _hello("p").runtimes == [RUNTIME]
    assert _hello("p", runtimes=()).runtimes == []
    for bad in (["ExecuTorch"], ["executorch 1.5"], ["x" * 40], [RUNTIME] * 9):
        with pytest.raises(ValueError):
            _hello("p", runtimes=bad)


def test_a_device_training_with_a_program_is_excluded_where_none_is_served(tmp_path):
    """No shard_url: nothing to serve a program from, so the device is excluded with the
    reason and what to configure; a device of minor 11 is read as training the model itself."""
    fed = Federation("mqtt://127.0.0.1:1", str(tmp_path), rounds=1, experts=(2,))
    engine = fed.aggregator.engine
    engine.registry.register(_hello("phone"))
    engine.registry.register(_hello("old", minor=11))
    eligible, excluded = engine._eligible()
    assert "configure shard_url and shard_dir" in excluded["phone"][0]
    assert [d.device_id for d in eligible] == ["old"] and engine.registry.get("old").runtimes == []
    fed.aggregator.store.close()


def _phone(fed: Federation, got: dict) -> None:
    """A device that trains with a served program: hello (minor 12, executorch), then the
    assignment and its state blob; it refuses the round (the test trains offline)."""
    t = Topics(fed.federation)
    tr = Transport(fed.url, f"phone-{fed.federation}", protocol=fed.protocol).connect()
    state_rx = Reassembler(2**29)
    try:
        assert tr.subscribe(t.device_down("phone"), timeout=10)
        tr.publish(t.up("phone", "hello"), encode(_hello("phone")), retain=True)
        end = time.time() + 120
        while time.time() < end and not ("assignment" in got and "state" in got):
            m = tr.get(0.2)
            if m is None:
                continue
            kind = m.topic.rsplit("/", 1)[1]
            if kind == "assignment":
                got["assignment"] = parse_message(m.payload, Assignment)
            elif kind == "state":
                blob = state_rx.add("cloud", m.payload)
                if blob is not None:
                    got["state"] = blob
            elif kind == "command":
                got.setdefault("commands", []).append(parse_message(m.payload, Command))
        a = got["assignment"]
        tr.publish(t.up("phone", "ack"), encode(Ack(device_id="phone", round=a.round, accepted=False,
                                                    reason="trains offline in this test", attempt=a.attempt)))
    finally:
        tr.close()


@pytest.mark.slow
def test_a_program_device_fetches_its_program_over_http_and_the_native_core_trains_with_it(mosquitto_url,
                                                                                            tmp_path):
    pytest.importorskip("executorch")
    from tests.conftest import native_binary

    binary = native_binary("fedmoe-train")
    server = ShardServer(tmp_path / "served")
    server.directory.mkdir()
    try:
        _federate_and_train(mosquitto_url, tmp_path, server, binary)
    finally:
        server.close()


def _federate_and_train(mosquitto_url, tmp_path, server, binary):
    from edge_sdk.http_shards import download
    from moe_model.training_program import to_slots
    from safetensors.torch import load_file, save_file

    got: dict = {}
    fed = Federation(mosquitto_url, str(tmp_path), rounds=1, experts=(2,), min_devices=2, round_timeout_s=90,
                     config_kw={"shard_url": server.url, "shard_dir": str(server.directory)})
    (rec,) = fed.run(extra=lambda f: _phone(f, got), timeout=240)
    assert rec["status"] == "ok" and "dev0" in rec["devices"], rec
    a: Assignment = got["assignment"]
    p = a.program
    assert p is not None and p.runtime == RUNTIME and p.lora_a is not None
    assert fed.aggregator.engine.programs.cache.built == 1

    d = tmp_path / "phone"
    (d / "shards").mkdir(parents=True)
    files = {name: download(ref.url, ref.sha256, ref.bytes, d / name)
             for name, ref in (("p.pte", p.program), ("m.json", p.manifest), ("a.safetensors", p.lora_a))}
    for s in a.shards:
        assert s.url is not None
        download(s.url, s.sha256, s.bytes, d / "shards" / f"{s.shard_id}.safetensors")
    manifest = json.loads(files["m.json"].read_text())
    assert manifest["key"] == p.key and manifest["sha256"] == p.program.sha256
    assert manifest["shape"]["experts_per_layer"] == {str(k): len(v) for k, v in a.experts.items()}
    assert manifest["shape"]["batch_size"] == a.train.batch_size
    assert set(load_file(str(files["a.safetensors"]))) == {f["source"]["lora_a"] for f in manifest["frozen"]
                                                          if "lora_a" in f.get("source", {})}

    held = {int(k): list(v) for k, v in a.experts.items()}
    state = decode_tensors(got["state"].data, 2**29)
    save_file({k: v.contiguous() for k, v in to_slots(state, held).items()}, str(d / "state.safetensors"))
    gen = torch.Generator().manual_seed(0)
    steps, vocab = 2, fed.aggregator.model.spec.config.get("vocab_size", 30522)
    batches = {}
    for x in manifest["batch"]:
        shape = [steps, *x["shape"]]
        batches[x["name"]] = (torch.ones(shape, dtype=torch.int64) if x["name"] == "attention_mask" else
                              torch.randint(0, len(a.labels) if x["name"] == "labels" else min(vocab, 1000), shape,
                                            generator=gen))
    save_file(batches, str(d / "batches.safetensors"))
    r = subprocess.run([str(binary), "--program", str(files["p.pte"]), "--manifest", str(files["m.json"]),
                        "--shards", str(d / "shards"), "--held", json.dumps(held), "--lora-a",
                        str(files["a.safetensors"]), "--state", str(d / "state.safetensors"), "--batches",
                        str(d / "batches.safetensors"), "--steps", str(steps), "--lr", "1e-3", "--out",
                        str(d / "out.safetensors")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    losses = json.loads(r.stdout)["losses"]
    assert len(losses) == steps and all(0 < x < 20 for x in losses)
    assert set(load_file(str(d / "out.safetensors"))) == set(manifest["trainable"].values())


def test_the_round_deadline_starts_after_the_program_export_and_a_failed_export_is_not_retried(tmp_path,
                                                                                                monkeypatch):
    """The export runs before the round opens (a slow export must not eat the round's time for
    every device); a shape whose export failed sits out with the reason, without a second
    export attempt on the next assignment."""
    from cloud.programs import ProgramPublisher
    from tests.test_bounds import _offline

    agg, _ = _offline(str(tmp_path), monkeypatch, round_timeout_s=60)
    publisher = ProgramPublisher(agg.model, tmp_path / "served", "http://127.0.0.1:1/shards", capacity_factor=1.5)
    agg.engine.programs = publisher
    exports = []

    def slow_export(task, held, batch_size, seq_len, capacity_factor, ops):
        assert capacity_factor == 1.5  # the configured factor reaches the export
        exports.append(time.time())
        time.sleep(1.5)
        raise ValueError("this model cannot be exported")

    monkeypatch.setattr(publisher.cache, "get", slow_export)
    agg._handle("fl/v1/bd/dev/phone/up/hello", encode(_hello("phone")))
    t0 = time.time()
    assert agg.engine.start_round()
    rnd = agg.engine.current
    assert rnd.started >= t0 + 1.5 and rnd.deadline == rnd.started + 60
    assert "no training program for its shape" in rnd.rejected["phone"] and "phone" in rnd.unsent
    assert len(exports) == 1
    with pytest.raises(RuntimeError, match="an earlier export failed: ValueError"):
        publisher.ref_for("bbc", rnd.selected["phone"], 8, agg.model.spec.max_seq_len, [RUNTIME])
    assert len(exports) == 1
    agg.store.close()
