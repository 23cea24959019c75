"""The device's outgoing filter chain (edge_sdk.filters): fault injection and signing."""

from __future__ import annotations

import hashlib

import pytest
import torch

from edge_sdk import EdgeClient
from edge_sdk.filters import ClaimSamples, Filter, Signing, TransformUpdate, UpdateContext, UpdateEncoding
from protocol.codec import sha256_hex
from protocol.messages import Hello
from protocol.signing import SignatureError, Signer, Verifier, generate_key, public_key_b64


def test_fault_filters_rewrite_what_they_target_and_nothing_else():
    hello = Hello(device_id="d", sdk_version="x", budget_bytes=2**30, weight_formats=["int8"], num_samples=40,
                  task="bbc")
    lie = ClaimSamples(lambda n: n * 1000)
    assert lie.on_hello(hello).num_samples == 40_000 and lie.on_hello(hello).budget_bytes == 2**30
    sent = {"backbone.w": torch.zeros(2)}
    ctx = UpdateContext(assignment=None, model=None, sent=sent, train_items=[])
    flip = TransformUpdate(lambda u, c: {k: c.sent[k] - 10 * (u[k] - c.sent[k]) for k in u})
    assert torch.equal(flip.on_update({"backbone.w": torch.ones(2)}, ctx)["backbone.w"], torch.full((2,), -10.0))
    assert Filter().on_update(sent, ctx) is sent and Filter().properties("stats", 1, "u", b"x") == {}


def test_signing_filter_signs_the_final_bytes_and_the_verifier_checks_them():
    key = generate_key()
    f = Signing(Signer("dev0", key))
    v = Verifier({"dev0": public_key_b64(key)})
    blob = b"safetensors bytes"
    signed = v.verify("update", "dev0", f.properties("update", 3, "u1", blob))
    assert (signed.round, signed.upload_id, signed.sha256) == (3, "u1", sha256_hex(blob))
    stats = b'{"type": "stats"}'
    assert v.verify("stats", "dev0", f.properties("stats", 3, "u1", stats)).sha256 == hashlib.sha256(stats).hexdigest()
    with pytest.raises(SignatureError):
        v.verify("stats", "dev1", f.properties("stats", 3, "u1", stats))


def test_the_client_puts_signing_last_and_merges_properties(tmp_path):
    class Tag(Filter):
        def properties(self, kind, round, upload_id, payload):
            return {"x-tag": kind}

    c = EdgeClient("mqtt://127.0.0.1:1", "dev0", [("a", "x")], filters=[Tag()], signing_key=generate_key(),
                   cache_dir=str(tmp_path), runtime_bytes=0)
    assert isinstance(c.filters[0], Tag) and isinstance(c.filters[-1], Signing)
    props = c._properties("stats", 1, "u1", b"payload")
    assert props["x-tag"] == "stats" and len(props) > 1
    assert EdgeClient("mqtt://127.0.0.1:1", "dev1", [("a", "x")], cache_dir=str(tmp_path),
                      runtime_bytes=0)._properties("stats", 1, "u", b"p") is None


@pytest.mark.slow
def test_a_device_that_does_not_sign_never_loads_the_signing_library():
    import subprocess
    import sys

    code = "import sys, edge_sdk, edge_sdk.filters; print('cryptography' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-500:]   # ~7 MiB of RSS saved


def _sent_and_trained(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    sent = {"lora_A": torch.randn(16, 64, generator=g), "bias": torch.randn(64, generator=g)}
    trained = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in sent.items()}
    return sent, trained


@pytest.mark.parametrize("precision,delta", [("fp16", True), ("bf16", True), ("int8", True), ("nf4", True),
                                             ("fp16", False)])
def test_update_encoding_round_trips_through_the_cloud_decoder(precision, delta):
    from cloud.filters import UpdateDecoding
    from protocol.codec import decode_tensors, encode_tensors

    sent, trained = _sent_and_trained()
    ctx = UpdateContext(assignment=None, model=None, sent=sent, train_items=[])
    update = UpdateEncoding(precision, delta=delta).on_update(dict(trained), ctx)
    payload = encode_tensors(update, ctx.format, ctx.metadata)
    meta: dict = {}
    expected = {k: (tuple(v.shape), torch.float32) for k, v in sent.items()}
    got = decode_tensors(payload, 2**20, expected, as_float=torch.float32, metadata_out=meta)
    got = UpdateDecoding().on_update("d", got, meta, lambda: sent)
    assert set(got) == set(trained) and all(t.dtype == torch.float32 for t in got.values())
    err = max(float((got[k] - trained[k]).abs().max()) for k in trained)
    step = max(float((trained[k] - sent[k]).abs().max()) for k in trained)
    if delta:  # the error is relative to the small step, not to the weights (nf4: 16 levels a block)
        assert err < (0.15 if precision == "nf4" else 0.02) * step, (precision, err, step)
    else:
        assert 1e-5 < err < 2e-3, err   # fp16 of the weights themselves: coarser than the step would need
    assert len(payload) < 0.6 * len(encode_tensors(trained, "fp32"))


def test_cloud_decoding_refuses_unknown_encodings_and_overflowing_deltas():
    from cloud.filters import UpdateDecoding
    from protocol.codec import ENCODING_KEY, CodecError

    sent = {"w": torch.full((2,), 3e38)}
    with pytest.raises(CodecError, match="unknown update encoding"):
        UpdateDecoding().on_update("d", {"w": torch.zeros(2)}, {ENCODING_KEY: "zstd"}, lambda: sent)
    with pytest.raises(CodecError, match="not finite"):
        UpdateDecoding().on_update("d", {"w": torch.full((2,), 3e38)}, {ENCODING_KEY: "delta"}, lambda: sent)
    with pytest.raises(ValueError, match="precision"):
        UpdateEncoding("int4")


def test_on_publish_wraps_the_send_first_filter_outermost(tmp_path):
    calls = []

    class Twice(Filter):
        def on_publish(self, kind, round, send):
            calls.append(("twice", kind, round))
            first = send()
            send()
            return first

    class Count(Filter):
        def on_publish(self, kind, round, send):
            calls.append(("count", kind, round))
            return send()

    c = EdgeClient("mqtt://127.0.0.1:1", "dev0", [("a", "x")], filters=[Twice(), Count()], cache_dir=str(tmp_path),
                   runtime_bytes=0)
    sent = []
    assert c._publish("stats", 4, lambda: sent.append(1) or len(sent)) == 1
    assert sent == [1, 1] and calls == [("twice", "stats", 4), ("count", "stats", 4), ("count", "stats", 4)]


@pytest.mark.slow
def test_encoded_updates_federate_and_the_cloud_sees_the_trained_tensors(tmp_path, embedded_url):
    """fp16 and int8 deltas over the broker: the engine aggregates what the devices trained
    (within the encoding's error of the step), and nothing is rejected."""
    from cloud.filters import InboundFilter
    from tests.federation import Federation

    trained, decoded = {}, {}

    class Keep(Filter):  # before the encoding: the trained state
        def __init__(self, device_id):
            self.device_id = device_id

        def on_update(self, update, ctx):
            trained[self.device_id] = ({k: v.clone() for k, v in update.items()},
                                       {k: v.clone() for k, v in ctx.sent.items()})
            return update

    class Seen(InboundFilter):  # after the cloud's decoding
        def on_update(self, device_id, tensors, metadata, sent):
            decoded[device_id] = (tensors, dict(metadata))
            return tensors

    def hook(c):
        c.filters[:0] = [Keep(c.device_id), UpdateEncoding("fp16" if c.device_id == "dev0" else "int8", delta=True)]

    fed = Federation(embedded_url, str(tmp_path), rounds=1, experts=(2, 3), client_hook=hook)
    fed.aggregator.engine.filters.append(Seen())
    records = fed.run()
    assert records[0]["status"] == "ok" and not records[0].get("excluded")
    assert set(decoded) == {"dev0", "dev1"}
    for d, (tensors, meta) in decoded.items():
        assert meta["fedmoe.encoding"] == "delta" and meta["format"] == ("fp16" if d == "dev0" else "int8")
        mine, sent = trained[d]
        assert set(tensors) == set(mine)
        step = max(float((mine[k] - sent[k]).abs().max()) for k in mine)
        err = max(float((tensors[k] - mine[k]).abs().max()) for k in mine)
        assert step > 0 and err <= 0.02 * step, (d, err, step)


def test_private_router_term_keeps_this_devices_router_rows_across_rounds():
    """FLEX-MoE's client-private gating is a device term now: train.router == private (old
    assignments) turns it on; rows trained in one round replace the cloud's in the next."""
    from edge_sdk.objectives import terms_for
    from protocol.messages import TrainConfig

    class Model:
        def __init__(self):
            self.p = {"router.0.w": torch.zeros(3), "expert.0.w": torch.zeros(3)}

        def trainable(self):
            return self.p

    memory: dict = {}
    m = Model()
    (t,) = terms_for(TrainConfig(router="private"), [], m.p, memory=memory)
    assert t.name == "private_router" and not t.adds_loss
    t.before_training(m)
    m.p["router.0.w"] += 1.0
    m.p["expert.0.w"] += 1.0
    t.after_training(m)
    fresh = Model()   # next round: the cloud's (zero) state
    (t,) = terms_for(TrainConfig(router="private"), [], fresh.p, memory=memory)
    t.before_training(fresh)
    assert torch.equal(fresh.p["router.0.w"], torch.ones(3)) and torch.equal(fresh.p["expert.0.w"], torch.zeros(3))
    assert terms_for(TrainConfig(), [], fresh.p, memory=memory) == []


@pytest.mark.slow
def test_terms_named_by_train_config_load_in_a_fresh_process():
    """prox_mu / router=private name terms whose modules nothing imported yet (the FedProx
    baseline failed every round with KeyError 'fedprox' when the registry was read directly)."""
    import subprocess
    import sys

    code = ("from edge_sdk.objectives import terms_for; from protocol.messages import TrainConfig; "
            "print(','.join(t.name for t in terms_for(TrainConfig(prox_mu=0.1, router='private'), [], {})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "fedprox,private_router", out.stderr[-500:]


@pytest.mark.parametrize("precision", ["int8", "fp16", "nf4"])
def test_error_feedback_keeps_the_summed_update_within_one_step(precision):
    """Ten rounds of the same small delta: without error feedback the rounding error of
    every round adds up; with it, what the cloud summed stays within one round's error."""
    from protocol.codec import decode_tensors, encode_tensors

    g = torch.Generator().manual_seed(1)
    sent = {"w": torch.randn(8, 64, generator=g), "b": torch.zeros(64), "n": torch.tensor([3])}
    step = {"w": 1e-3 * torch.randn(8, 64, generator=g) + 3e-5, "b": torch.full((64,), 1e-4)}
    expected = {k: (tuple(v.shape), torch.float32) for k, v in sent.items() if v.is_floating_point()}
    drift = {}
    for ef in (False, True):
        enc = UpdateEncoding(precision, delta=True, error_feedback=ef)
        total = {k: torch.zeros_like(v) for k, v in step.items()}
        for _ in range(10):
            ctx = UpdateContext(assignment=None, model=None, sent=sent, train_items=[])
            trained = {"w": sent["w"] + step["w"], "b": sent["b"] + step["b"], "n": sent["n"]}
            update = enc.on_update(trained, ctx)
            assert torch.equal(update["n"], sent["n"])  # integer tensors pass untouched
            got = decode_tensors(encode_tensors({k: update[k] for k in expected}, ctx.format, ctx.metadata), 2**20,
                                 expected, as_float=torch.float32)
            for k in total:
                total[k] += got[k]
        drift[ef] = float((total["w"] - 10 * step["w"]).abs().max())
        if ef:
            one_round = float((enc.encoded(step["w"]) - step["w"]).abs().max())
            assert drift[ef] <= 2 * one_round + 1e-9, (drift, one_round)
    assert drift[True] < drift[False] / 3, drift


def test_error_feedback_needs_a_lossy_delta_and_drops_stale_residuals():
    from edge_sdk.config import DeviceSettings

    with pytest.raises(ValueError, match="error_feedback needs delta"):
        UpdateEncoding("int8", delta=False, error_feedback=True)
    with pytest.raises(ValueError, match="error_feedback needs delta"):
        UpdateEncoding("fp32", delta=True, error_feedback=True)
    with pytest.raises(ValueError, match="update_error_feedback needs update_delta"):
        DeviceSettings(update_precision="int8", update_error_feedback=True)
    assert DeviceSettings(update_precision="int8", update_delta=True, update_error_feedback=True)
    enc = UpdateEncoding("int8", delta=True, error_feedback=True)
    sent = {"a": torch.zeros(4, 4), "b": torch.zeros(4, 4)}
    ctx = UpdateContext(assignment=None, model=None, sent=sent, train_items=[])
    enc.on_update({"a": torch.rand(4, 4) * 1e-3, "b": torch.rand(4, 4) * 1e-3}, ctx)
    assert set(enc.residual) == {"a", "b"}
    enc.on_update({"a": torch.rand(4, 4) * 1e-3}, UpdateContext(assignment=None, model=None, sent=sent,
                                                                train_items=[]))
    assert set(enc.residual) == {"a"}  # the expert "b" is no longer held: its residual goes


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16", "int8", "nf4"])
def test_round_trip_is_what_the_codec_decodes(fmt):
    from protocol.codec import decode_tensors, encode_tensors, round_trip

    g = torch.Generator().manual_seed(2)
    ts = {"m": torch.randn(6, 32, generator=g), "tall": torch.randn(40, 4, generator=g),
          "v": torch.randn(32, generator=g)}
    got = decode_tensors(encode_tensors(ts, fmt), 2**20, {k: (tuple(v.shape), torch.float32) for k, v in ts.items()},
                         as_float=torch.float32)
    assert all(torch.equal(round_trip(v, fmt), got[k]) for k, v in ts.items())


@pytest.mark.slow
def test_quantized_state_down_sends_the_rounded_state_in_fewer_bytes(tmp_path, embedded_url):
    """``state_precision: int8`` / ``nf4``: each device receives exactly the state the
    cloud meant to send, rounded (``protocol.codec.round_trip``: int8 scales per row of
    LoRA A, per column of LoRA B; nf4 blocks of 64; 1-D tensors stay fp32), in fewer
    bytes (on this tiny model the safetensors header weighs: int8 0.43, nf4 0.34 of fp32)."""
    from protocol.codec import round_trip
    from tests.federation import Federation

    received, meant, state_bytes = {}, {}, {}

    class Keep(Filter):
        def __init__(self, device_id):
            self.device_id = device_id

        def on_update(self, update, ctx):
            received[self.device_id] = {k: v.clone() for k, v in ctx.sent.items()}
            return update

    def hook(c):
        c.filters[:0] = [Keep(c.device_id), UpdateEncoding("fp32", delta=True)]

    for precision in ("fp32", "int8", "nf4"):
        fed = Federation(embedded_url, str(tmp_path / precision), rounds=1, experts=(2, 3), client_hook=hook,
                         config_kw={"state_precision": precision})
        engine, agg = fed.aggregator.engine, fed.aggregator
        sent_state, publish_blob = engine._sent_state, agg.publish_blob

        def capture(device_id, experts):
            meant[device_id] = {k: v.clone() for k, v in sent_state(device_id, experts).items()}
            return meant[device_id]

        def count(topic, data, kind, *a, **kw):
            if kind == "state":
                state_bytes[precision] = state_bytes.get(precision, 0) + len(data)
            return publish_blob(topic, data, kind, *a, **kw)

        engine._sent_state, agg.publish_blob = capture, count
        records = fed.run()
        assert records[0]["status"] == "ok" and not records[0].get("excluded")
        assert set(received) == {"dev0", "dev1"}
        for d, got in received.items():
            assert set(got) == set(meant[d])
            for k, v in got.items():
                want = meant[d][k]
                if precision != "fp32":
                    want = round_trip(want, precision)
                assert torch.equal(v, want), (precision, k)
        received.clear()
    assert state_bytes["int8"] < 0.45 * state_bytes["fp32"], state_bytes
    assert state_bytes["nf4"] < 0.85 * state_bytes["int8"], state_bytes


@pytest.mark.slow
def test_compressed_nf4_updates_and_state_federate_and_older_devices_get_plain_state(tmp_path, embedded_url,
                                                                                        monkeypatch):
    """Protocol minor 8 over the broker: with ``update_compression`` the devices send zlib-
    compressed nf4 deltas whose router rows are packed too, with ``state_compression`` the
    cloud sends compressed state, except to a device that announced minor 7 (plain state);
    the round aggregates what the devices trained within nf4's error and rejects nothing."""
    import edge_sdk.client as client_mod
    from cloud.filters import InboundFilter
    from protocol.codec import NF4_MAX_ERROR, is_compressed, nf4_shapes
    from tests.federation import Federation

    sent_updates, state_blobs, decoded, trained = {}, {}, {}, {}
    encode = client_mod.encode_tensors

    def recording_encode(tensors, fmt, metadata=None, **kw):
        data = encode(tensors, fmt, metadata, **kw)
        sent_updates[metadata.get("device")] = data
        return data

    monkeypatch.setattr(client_mod, "encode_tensors", recording_encode)

    class Tag(Filter):  # before the encoding: the trained state, and whose update it is
        def __init__(self, device_id):
            self.device_id = device_id

        def on_update(self, update, ctx):
            ctx.metadata["device"] = self.device_id
            trained[self.device_id] = ({k: v.clone() for k, v in update.items()},
                                       {k: v.clone() for k, v in ctx.sent.items()})
            return update

    class Minor7(Filter):
        def on_hello(self, hello):
            return hello.model_copy(update={"protocol_minor": 7})

    class Seen(InboundFilter):
        def on_update(self, device_id, tensors, metadata, sent):
            decoded[device_id] = (tensors, dict(metadata))
            return tensors

    def hook(c):
        c.filters[:0] = [Tag(c.device_id), UpdateEncoding("nf4", delta=True, error_feedback=True, compress=True)]
        if c.device_id == "dev1":
            c.filters.append(Minor7())

    from tests.conftest import TINY_CONFIG

    fed = Federation(embedded_url, str(tmp_path), rounds=1, experts=(2, 3), client_hook=hook,
                     config_kw={"state_compression": True},  # hidden 64: router rows of one nf4 block
                     spec_kw={"upcycle_noise": 0.01, "config": {**TINY_CONFIG, "hidden_size": 64}})
    agg = fed.aggregator
    agg.engine.filters.append(Seen())
    publish_blob = agg.publish_blob

    def count(topic, data, kind, *a, **kw):
        if kind == "state":
            state_blobs[topic.split("/dev/")[1].split("/")[0]] = data
        return publish_blob(topic, data, kind, *a, **kw)

    agg.publish_blob = count
    records = fed.run()
    assert records[0]["status"] == "ok" and not records[0].get("excluded") and not records[0].get("rejected")
    assert is_compressed(state_blobs["dev0"]) and not is_compressed(state_blobs["dev1"])
    assert set(decoded) == {"dev0", "dev1"}
    for d, (tensors, meta) in decoded.items():
        assert is_compressed(sent_updates[d])
        mine, sent = trained[d]
        routers = [k for k, v in mine.items() if v.dim() == 1 and v.numel() >= 64]
        assert routers and set(routers) <= set(nf4_shapes(meta))  # router rows packed in the delta
        step = max(float((mine[k] - sent[k]).abs().max()) for k in mine)
        err = max(float((tensors[k] - mine[k]).abs().max()) for k in mine)
        assert step > 0 and err <= NF4_MAX_ERROR * step * 1.001, (d, err, step)  # one nf4 rounding


def test_error_feedback_residual_on_disk_matches_memory_and_takes_no_memory(tmp_path, caplog):
    """With a work_dir the residual waits on disk between rounds: the same updates as
    keeping it in memory, nothing held in memory, a damaged file costs one residual only,
    and a file left by an earlier process is never read."""
    g = torch.Generator().manual_seed(3)
    sent = {"w": torch.randn(16, 64, generator=g), "b": torch.zeros(64)}
    steps = [{"w": 1e-3 * torch.randn(16, 64, generator=g), "b": torch.full((64,), 1e-4)} for _ in range(4)]
    mem, disk = (UpdateEncoding("nf4", delta=True, error_feedback=True) for _ in range(2))
    for i, step in enumerate(steps):
        trained = {k: sent[k] + step[k] for k in sent}
        a = mem.on_update(dict(trained), UpdateContext(assignment=None, model=None, sent=sent, train_items=[]))
        b = disk.on_update(dict(trained), UpdateContext(assignment=None, model=None, sent=sent, train_items=[],
                                                        work_dir=tmp_path))
        for k in a:
            assert torch.equal(a[k], b[k]), (i, k)
        assert disk.residual == {} and (tmp_path / "error-feedback.safetensors").is_file()
    assert set(mem.residual) == {"w", "b"}

    fresh = UpdateEncoding("nf4", delta=True, error_feedback=True)  # a new process: the old file is not its own
    plain = UpdateEncoding("nf4", delta=True, error_feedback=True)
    trained = {k: sent[k] + steps[0][k] for k in sent}
    ctx = dict(assignment=None, model=None, sent=sent, train_items=[])
    got = fresh.on_update(dict(trained), UpdateContext(**ctx, work_dir=tmp_path))
    want = plain.on_update(dict(trained), UpdateContext(**ctx))
    assert all(torch.equal(got[k], want[k]) for k in want)

    (tmp_path / "error-feedback.safetensors").write_bytes(b"not a safetensors file")
    with caplog.at_level("WARNING", logger="edge_sdk.filters"):
        again = fresh.on_update(dict(trained), UpdateContext(**ctx, work_dir=tmp_path))
    assert "unreadable" in caplog.text
    assert all(torch.equal(again[k], want[k]) for k in want)  # as if there were no residual
    assert (tmp_path / "error-feedback.safetensors").stat().st_size > 100  # rewritten, readable again


def test_error_feedback_residual_that_cannot_be_written_is_dropped_not_reused(tmp_path, monkeypatch):
    """A full disk loses one round's residual: the next update goes without it (never with
    the residual already used once)."""
    import safetensors.torch

    sent = {"w": torch.zeros(16, 64)}
    ctx = dict(assignment=None, model=None, sent=sent, train_items=[])
    step = {"w": 1e-3 * torch.randn(16, 64, generator=torch.Generator().manual_seed(5))}
    disk, plain = (UpdateEncoding("nf4", delta=True, error_feedback=True) for _ in range(2))
    disk.on_update(dict(step), UpdateContext(**ctx, work_dir=tmp_path))  # round 1: residual on disk

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    disk.on_update(dict(step), UpdateContext(**ctx, work_dir=tmp_path))  # round 2: used, new one not kept
    monkeypatch.undo()
    got = disk.on_update(dict(step), UpdateContext(**ctx, work_dir=tmp_path))  # round 3: none
    want = plain.on_update(dict(step), UpdateContext(**ctx))
    assert torch.equal(got["w"], want["w"])
