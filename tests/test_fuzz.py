"""Property-based fuzzing (hypothesis) of every parser on the aggregator's input path:
control-message schemas, chunk headers and reassembly, safetensors payloads, signature
properties, and the aggregator's message handler as a whole. Only the documented error
types may come out; nothing reaches the model.

Each test builds its own state inside the test body (no function-scoped fixture is
shared across hypothesis examples)."""

from __future__ import annotations

import json
import math
import struct
import tracemalloc

import pytest
import torch
from safetensors.torch import save as st_save
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.chunking import MAGIC, ChunkError, Reassembler, parse_chunk, split_blob
from protocol.codec import CodecError, decode_tensors, encode_tensors, inspect_header
from protocol.messages import (
    Ack, Assignment, Command, Hello, MessageError, Progress, Stats, Status, encode, parse_message,
)
from protocol.signing import SignatureError, Signer, Verifier, generate_key, public_key_b64

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMIT = 1 << 20

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                         st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                             st.dictionaries(st.text(max_size=10), c, max_size=4)),
                           max_leaves=20)
TYPES = ["hello", "ack", "stats", "status", "assignment", "command", "progress", "nope"]
CLASSES = [Hello, Ack, Stats, Status, Assignment, Command, Progress, None]


@FAST
@given(st.binary(max_size=512))
def test_parse_message_arbitrary_bytes(data):
    try:
        parse_message(data)
    except MessageError:
        pass


@FAST
@given(st.sampled_from(TYPES), st.dictionaries(st.text(max_size=16), json_values, max_size=8),
       st.sampled_from(CLASSES), st.sampled_from([1, 1, 2, "1", None]))
def test_parse_message_arbitrary_objects(kind, body, expected, version):
    obj = {**body, "v": version, "type": kind}
    try:
        msg = parse_message(json.dumps(obj).encode(), expected)
    except MessageError:
        return
    assert expected is None or isinstance(msg, expected)


@FAST
@given(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"]))
def test_non_finite_numbers_are_rejected(token):
    base = Ack(device_id="d", round=1, accepted=True).model_dump()
    raw = json.dumps({**base, "reason": None}).replace('"round": 1', f'"round": {token}').encode()
    try:
        parse_message(raw, Ack)
        raise AssertionError("accepted a non-finite round")
    except MessageError:
        pass


def _chunk(header: dict, data: bytes) -> bytes:
    hb = json.dumps(header).encode()
    return MAGIC + struct.pack(">I", len(hb)) + hb + data


@FAST
@given(st.binary(max_size=300))
def test_parse_chunk_arbitrary_bytes(data):
    for payload in (data, MAGIC + data):
        try:
            parse_chunk(payload, LIMIT)
        except ChunkError:
            pass


@FAST
@given(st.dictionaries(st.sampled_from(["id", "kind", "round", "seq", "n", "size", "sha", "csha", "x"]),
                       json_values, max_size=9),
       st.binary(max_size=64), st.integers(0, 2**40))
def test_chunk_headers_fuzzed(fields, data, size):
    good, _ = split_blob(b"x" * 5000, 2048, "t1", "update", 3)
    hlen = struct.unpack(">I", good[0][4:8])[0]
    header = {**json.loads(good[0][8:8 + hlen]), **fields}
    if "size" not in fields:
        header["size"] = size
    r = Reassembler(LIMIT)
    try:
        out = r.add("d", _chunk(header, data))
    except ChunkError:
        return
    assert out is None or len(out.data) <= LIMIT
    assert r.pending_bytes <= LIMIT


@FAST
@given(st.permutations(range(4)), st.lists(st.integers(0, 3), max_size=6), st.integers(0, 3), st.binary(max_size=8))
def test_reassembly_reordered_duplicated_and_corrupted(order, dups, bad, junk):
    blob = bytes(range(256)) * 24
    chunks, sha = split_blob(blob, 2048, "t", "update", 1)
    chunks = chunks[:4] if len(chunks) >= 4 else chunks
    r = Reassembler(LIMIT)
    outs = []
    corrupted = bytearray(chunks[bad % len(chunks)])
    if junk:
        corrupted[-1] ^= 0xFF
        corrupted += junk
    for i in list(order) + dups:
        c = chunks[i % len(chunks)]
        try:
            got = r.add("d", c)
        except ChunkError:
            got = None
        outs += [got] if got is not None else []
        if junk:
            try:
                r.add("d", bytes(corrupted))
            except ChunkError:
                pass
    complete = [o for o in outs if o is not None]
    assert len(complete) <= 1 and all(o.data == blob[:len(o.data)] and o.header.sha == sha for o in complete)


def _tensors():
    return {"expert.1.0.fc1.lora_B": torch.randn(8, 4), "backbone.q.lora_B": torch.randn(4, 4)}


@FAST
@given(st.integers(0, 400), st.binary(max_size=16))
def test_truncated_or_extended_safetensors(cut, extra):
    data = encode_tensors(_tensors())
    for payload in (data[:cut], data + extra if extra else data[:cut]):
        try:
            out = decode_tensors(payload, LIMIT, {k: (tuple(v.shape), v.dtype) for k, v in _tensors().items()})
        except CodecError:
            continue
        assert payload == data and set(out) == set(_tensors())


@FAST
@given(st.sampled_from(["F32", "F16", "BF16", "I8", "U8", "I32", "I64", "F64", "BOOL", "Q4", "", 7]),
       st.lists(st.integers(0, 2**40), max_size=4), st.lists(st.integers(-5, 2**62), min_size=0, max_size=3),
       st.binary(max_size=64))
def test_safetensors_headers_fuzzed_no_allocation_before_validation(dtype, shape, offsets, body):
    header = json.dumps({"t": {"dtype": dtype, "shape": shape, "data_offsets": offsets}}).encode()
    payload = struct.pack("<Q", len(header)) + header + body
    tracemalloc.start()
    try:
        decode_tensors(payload, LIMIT, {"t": ((8, 4), torch.float32)})
    except CodecError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 4 * LIMIT  # a declared 2**40-element tensor is never allocated


@FAST
@given(st.integers(2**30, 2**45))
def test_declared_size_over_limit_rejected_unparsed(size):
    header = {"id": "t", "kind": "update", "round": 1, "seq": 0, "n": 1, "size": size, "sha": "0" * 64,
              "csha": "0" * 64}
    try:
        Reassembler(LIMIT).add("d", _chunk(header, b"abc"))
        raise AssertionError("oversized declared blob accepted")
    except ChunkError as e:
        assert "exceeds limit" in str(e)
    big = struct.pack("<Q", 50) + b"{}" + b" " * 48
    try:
        inspect_header(big + b"\0" * 16, 32)
        raise AssertionError("oversized payload accepted")
    except CodecError:
        pass


@FAST
@given(st.sampled_from([math.nan, math.inf, -math.inf]), st.integers(0, 31))
def test_nan_inf_tensors_rejected(value, pos):
    t = _tensors()
    t["expert.1.0.fc1.lora_B"].view(-1)[pos] = value
    for fmt in ("fp32", "fp16", "bf16"):
        try:
            decode_tensors(encode_tensors(t, fmt), LIMIT)
            raise AssertionError("non-finite tensor accepted")
        except CodecError as e:
            assert "NaN or Inf" in str(e)


@FAST
@given(st.dictionaries(st.sampled_from(["fm-round", "fm-upload", "fm-sha", "fm-sig", "other"]),
                       st.text(max_size=100), max_size=5))
def test_signature_properties_fuzzed(props):
    key = generate_key()
    v = Verifier({"d": public_key_b64(key)})
    try:
        v.verify("update", "d", props)
        raise AssertionError("accepted fuzzed signature properties")
    except SignatureError:
        pass
    good = Signer("d", key).properties("update", 1, "u", "ab" * 32)
    assert v.verify("update", "d", good).round == 1


# --------------------------------------------------------------------------- the handler


class _Wire:
    """Records what the round engine publishes (no broker needed for handler fuzzing)."""

    chunk_payload_bytes = 64 * 1024

    def __init__(self):
        self.sent = []

    def publish(self, topic, payload):
        self.sent.append(topic)

    def publish_blob(self, topic, data, kind, round, transfer_id=None):
        from protocol.chunking import split_blob as sb
        from protocol.messages import BlobRef

        chunks, sha = sb(data, self.chunk_payload_bytes, transfer_id or "x", kind, round)
        return BlobRef(transfer_id=transfer_id or "x", bytes=len(data), sha256=sha, chunks=len(chunks))


def _aggregator(tmp: str, signed: bool = False):
    from cloud.service import Aggregator, AggregatorConfig, TaskConfig
    from tests.conftest import tiny_spec

    cfg = AggregatorConfig(federation="fz", model=tiny_spec(), tasks={"bbc": TaskConfig(labels=["a", "b"])},
                           store=f"sqlite:///{tmp}/agg.db")
    keys = {}
    if signed:
        key = generate_key()
        path = f"{tmp}/keys.json"
        with open(path, "w") as f:
            json.dump({"d0": public_key_b64(key)}, f)
        cfg = cfg.model_copy(update={"device_keys": path})
        keys["d0"] = key
    agg = Aggregator(cfg, "mqtt://127.0.0.1:1")
    agg.engine.wire = _Wire()
    hello = Hello(device_id="d0", sdk_version="x", budget_bytes=2**40, weight_formats=["int8"], num_samples=10,
                  task="bbc", runtime_bytes=0)
    agg._handle("fl/v1/fz/dev/d0/up/hello", encode(hello))
    assert agg.engine.start_round()
    return agg, keys


def test_aggregator_handler_survives_fuzzed_messages(tmp_path):
    agg, _ = _aggregator(str(tmp_path))
    before = {k: v.clone() for k, v in agg.model.state.items()}
    rnd = agg.engine.current
    expected = agg.model.expected_for(rnd.selected["d0"], "bbc")
    topics = st.sampled_from(["fl/v1/fz/dev/d0/up/update", "fl/v1/fz/dev/d0/up/stats", "fl/v1/fz/dev/d0/up/ack",
                              "fl/v1/fz/dev/d0/up/hello", "fl/v1/fz/dev/d0/up/status", "fl/v1/fz/dev/zz/up/update",
                              "fl/v1/fz/dev/unknown/up/stats", "fl/v1/fz/dev/d0/down/assignment",
                              "fl/v1/other/dev/d0/up/stats", "fl/v1/fz/dev/d+/up/x", "garbage"])

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(topics, st.binary(max_size=300), st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3))
    def raw(topic, payload, props):
        agg._handle(topic, payload, props)  # must never raise

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.sampled_from(sorted(expected)), st.lists(st.integers(0, 64), max_size=3), st.sampled_from(
        [torch.float32, torch.float16, torch.int8, torch.float64]), st.sampled_from(["shape", "dtype", "extra",
                                                                                      "missing", "nan", "foreign"]))
    def bad_update(name, shape, dtype, how):
        t = {k: torch.zeros(s, dtype=d) for k, (s, d) in expected.items()}
        if how == "shape":
            if tuple(shape) == tuple(t[name].shape):
                return
            t[name] = torch.zeros(*shape or [0], dtype=torch.float32)
        elif how == "dtype" and dtype != torch.float32:
            t[name] = t[name].to(dtype)
        elif how == "extra":
            t["expert.1.3.fc1.lora_B" if "expert.1.3.fc1.lora_B" not in t else "expert.9.0.x"] = torch.zeros(2)
        elif how == "missing":
            del t[name]
        elif how == "nan":
            if t[name].numel() == 0:
                return
            t[name].view(-1)[0] = math.nan
        else:
            t = {"head.other.w": torch.zeros(2)}
        if how == "dtype" and dtype == torch.float32:
            return
        data = st_save({k: v.contiguous() for k, v in t.items()}, metadata={"format": "fp32"})  # dtypes kept
        chunks, _ = split_blob(data, 4096, f"f{abs(hash((name, how, tuple(shape), str(dtype)))) % 10**12}",
                               "update", rnd.number)
        for c in chunks:
            agg._handle("fl/v1/fz/dev/d0/up/update", c, {})

    raw()
    bad_update()
    assert "d0" not in rnd.updates and not rnd.reported("d0")
    assert all(torch.equal(before[k], v) for k, v in agg.model.state.items())
    assert agg.rejected > 0 and agg.internal_errors == 0
    agg.store.close()


def test_signed_aggregator_rejects_unsigned_and_unknown_devices(tmp_path):
    agg, keys = _aggregator(str(tmp_path), signed=True)
    rnd = agg.engine.current
    expected = agg.model.expected_for(rnd.selected["d0"], "bbc")
    data = encode_tensors({k: torch.zeros(s) for k, (s, _) in expected.items()})
    chunks, sha = split_blob(data, 4096, "u1", "update", rnd.number)
    n0 = agg.rejected
    for c in chunks:
        agg._handle("fl/v1/fz/dev/d0/up/update", c, {})                      # unsigned
    forged = Signer("d0", generate_key()).properties("update", rnd.number, "u1", sha)
    for c in chunks:
        agg._handle("fl/v1/fz/dev/d0/up/update", c, forged)                  # forged
    hello = Hello(device_id="ghost", sdk_version="x", budget_bytes=2**40, weight_formats=["int8"], num_samples=1,
                  task="bbc")
    agg._handle("fl/v1/fz/dev/ghost/up/hello", encode(hello))                # not provisioned
    assert agg.registry.get("ghost") is None and "d0" not in rnd.updates
    assert agg.rejected - n0 == 2 * len(chunks) + 1
    good = Signer("d0", keys["d0"]).properties("update", rnd.number, "u1", sha)
    for c in chunks:
        agg._handle("fl/v1/fz/dev/d0/up/update", c, good)
    assert "d0" in rnd.updates                                                # positive control
    agg.store.close()


def test_restart_keeps_accepted_updates_and_partial_chunks(tmp_path):
    """Restart between chunks: acknowledged chunks of an incomplete update and accepted
    updates survive in the store; the resumed round completes the update once."""
    from cloud.service import Aggregator

    agg, _ = _aggregator(str(tmp_path))
    rnd = agg.engine.current
    expected = agg.model.expected_for(rnd.selected["d0"], "bbc")
    data = encode_tensors({k: torch.ones(s) for k, (s, _) in expected.items()})
    chunks, _ = split_blob(data, 2048, "u1", "update", rnd.number)
    assert len(chunks) >= 3
    for c in chunks[:2]:
        agg._handle("fl/v1/fz/dev/d0/up/update", c, {})
    assert agg.store.blob_keys("chunks/") == []         # kept in memory until the batch ends
    agg._save_chunks()                                  # its end (Aggregator._pump), before the broker ack
    agg.store.close()                                   # "killed" here
    agg2 = Aggregator(agg.cfg, "mqtt://127.0.0.1:1")
    agg2.engine.wire = _Wire()
    rnd2 = agg2.engine.current
    assert rnd2 is not None and rnd2.number == rnd.number and rnd2.selected == rnd.selected
    assert agg2.updates.progress("d0", rnd.number, "u1") == (2, len(chunks))
    for c in chunks[1:]:                                # a redelivered chunk among them
        agg2._handle("fl/v1/fz/dev/d0/up/update", c, {})
    assert "d0" in rnd2.updates and agg2.store.blob_keys("chunks/") == []
    agg2.store.close()
    agg3 = Aggregator(agg.cfg, "mqtt://127.0.0.1:1")   # the accepted update is in the store
    assert "d0" in agg3.engine.current.updates
    assert all(torch.equal(v, torch.ones_like(v)) for v in agg3.engine.current.updates["d0"][1].values())
    agg3.store.close()


def test_a_batch_is_one_commit_and_chunks_of_an_update_completed_in_it_never_reach_the_store(tmp_path):
    """Group commit (Aggregator._pump): the messages of a batch are stored in one
    transaction; an update whose chunks all came in the batch stores only the update, and
    a batch that does not commit (the process killed) leaves nothing, for the broker to
    redeliver."""
    from cloud.service import Aggregator
    from protocol.transport import Incoming

    agg, _ = _aggregator(str(tmp_path))
    rnd = agg.engine.current
    expected = agg.model.expected_for(rnd.selected["d0"], "bbc")
    data = encode_tensors({k: torch.ones(s) for k, (s, _) in expected.items()})
    chunks, _ = split_blob(data, 2048, "u1", "update", rnd.number)
    topic = "fl/v1/fz/dev/d0/up/update"
    writes = []
    agg.store.put_blob = lambda key, value, put=agg.store.put_blob: (writes.append(key), put(key, value))[1]
    acked = []
    agg.transport = type("T", (), {"get": lambda self, timeout=None: inbox.pop(0) if inbox else None,
                                   "ack": lambda self, m: acked.append(m)})()
    inbox = [Incoming(topic, c, False, {}, i, 1, 0) for i, c in enumerate(chunks)]
    agg._pump(0)
    assert "d0" in rnd.updates and len(acked) == len(chunks)
    assert writes == [f"inflight/{rnd.number}/update/d0"]                     # no chunk written
    agg.store.close()

    agg2, _ = _aggregator(str(tmp_path / "b"))
    rnd2 = agg2.engine.current
    inbox = [Incoming(topic, c, False, {}, i, 1, 0) for i, c in enumerate(chunks[:2])]
    agg2.transport = agg.transport

    def killed(*_):
        raise KeyboardInterrupt  # the process dies before the batch commits
    agg2._save_chunks = killed
    with pytest.raises(KeyboardInterrupt):
        agg2._pump(0)
    agg2.store.close()
    agg3 = Aggregator(agg2.cfg, "mqtt://127.0.0.1:1")
    assert agg3.updates.progress("d0", rnd2.number, "u1")[0] == 0 and agg3.store.blob_keys("chunks/") == []
    agg3.store.close()
