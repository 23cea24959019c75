"""The committed JSON Schemas (protocol/schemas, PROTOCOL.md) match the pydantic models,
accept what the peers send and refuse what the peers refuse."""

import json

import jsonschema
import pytest

from protocol.chunking import ChunkError, parse_chunk, split_blob
from protocol.messages import Ack, BlobRef, Hello, LayerStats, MessageError, Stats, encode, parse_message
from protocol.schema import SCHEMA_DIR, main, schemas


def _validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMA_DIR / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_committed_schemas_are_the_generated_ones(tmp_path):
    assert main(["--check"]) == 0, "protocol/schemas is stale: run python -m protocol.schema"
    (tmp_path / "Ack.json").write_text("{}")
    (tmp_path / "Old.json").write_text("{}")
    assert main(["--check", "--dir", str(tmp_path)]) == 1  # a changed or stray file is caught
    assert main(["--dir", str(tmp_path)]) == 0 and not (tmp_path / "Old.json").exists()
    assert sorted(p.name for p in tmp_path.glob("*.json")) == sorted(schemas())


def test_real_messages_validate_and_coercions_are_refused_by_both():
    hello = Hello(device_id="dev-1", sdk_version="1.0", budget_bytes=2**30, weight_formats=["int8"],
                  num_samples=10, task="bbc", runtime_bytes=400 * 2**20)
    ack = Ack(device_id="dev-1", round=3, accepted=False, reason="over budget", needed_bytes=5)
    layer = LayerStats(layer=0, tokens=8, usage=[16, 0], activation_prob=[0.5, 0.5], routing_dist=[0.5, 0.5],
                       margin=[0.1, 0.1], expert_loss=[0.7, 0.0], expert_acc=[0.5, 0.0], expert_samples=[8, 0])
    stats = Stats(device_id="dev-1", round=3, task="bbc", num_samples=10, train_loss=0.5, layers=[layer],
                  update=BlobRef(transfer_id="u1", bytes=10, sha256="0" * 64, chunks=1), train_seconds=1.0,
                  bytes_up=100, bytes_down=100, peak_rss_bytes=2**29, baseline_rss_bytes=2**28,
                  shards_fetched=["L0.E0"])
    for msg, name in ((hello, "Hello.json"), (ack, "Ack.json"), (stats, "Stats.json")):
        obj = json.loads(encode(msg))
        _validator(name).validate(obj)
        obj["future_field"] = {"x": 1}  # a newer minor's field: both the schema and the peer accept it
        _validator(name).validate(obj)
        parse_message(json.dumps(obj).encode())
    bad = json.loads(encode(ack))
    for field, value in (("round", "3"), ("accepted", 1), ("round", -1), ("device_id", "a b")):
        wrong = {**bad, field: value}
        assert list(_validator("Ack.json").iter_errors(wrong)), (field, value)
        with pytest.raises(MessageError):
            parse_message(json.dumps(wrong).encode())


def test_chunk_header_schema_matches_the_parser():
    chunks, _ = split_blob(b"x" * 5000, 2048, "up-1", "update", 2)
    header = json.loads(chunks[0][8 : 8 + int.from_bytes(chunks[0][4:8], "big")])
    v = _validator("ChunkHeader.json")
    v.validate(header)
    for field, value in (("round", "2"), ("extra", 1), ("sha", "ABC")):
        wrong = {**header, field: value}
        assert list(v.iter_errors(wrong)), field
        hb = json.dumps(wrong).encode()
        with pytest.raises(ChunkError, match="malformed chunk header"):
            parse_chunk(chunks[0][:4] + len(hb).to_bytes(4, "big") + hb + chunks[0][8 + len(json.dumps(header)):],
                        10**6)


def test_v_and_type_are_required_on_the_wire():
    obj = json.loads(encode(Ack(device_id="dev-1", round=1, accepted=True)))
    for field in ("v", "type"):
        wrong = {k: x for k, x in obj.items() if k != field}
        assert list(_validator("Ack.json").iter_errors(wrong)), field
        with pytest.raises(MessageError):
            parse_message(json.dumps(wrong).encode())
