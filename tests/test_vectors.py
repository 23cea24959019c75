"""The committed golden vectors (protocol/vectors, PROTOCOL.md) are what this
implementation produces and accepts: another implementation can check itself against them."""

import json

import jsonschema
import torch

from protocol.chunking import Reassembler, parse_chunk
from protocol.codec import decode_tensors
from protocol.messages import MessageError, VersionError, parse_message
from protocol.schema import SCHEMA_DIR
from protocol.signing import ReplayGuard, Verifier
from protocol.vectors import VECTOR_DIR, main


def _load(name: str) -> dict:
    return json.loads((VECTOR_DIR / name).read_text())


def test_committed_vectors_are_current():
    assert main(["--check"]) == 0, "protocol/vectors is stale: run python -m protocol.vectors"


def test_valid_messages_parse_and_match_their_schema_invalid_ones_are_refused():
    vec = _load("messages.json")
    kinds = set()
    for case in vec["valid"]:
        msg = parse_message(json.dumps(case["message"]).encode())
        kinds.add(msg.type)
        schema = json.loads((SCHEMA_DIR / f"{type(msg).__name__}.json").read_text())
        jsonschema.validate(case["message"], schema, cls=jsonschema.Draft202012Validator)
    assert kinds == {"hello", "status", "ack", "stats", "assignment", "command", "progress"}
    assert len(vec["invalid"]) >= 10
    for case in vec["invalid"]:
        try:
            parse_message(case["raw"].encode())
        except (MessageError, VersionError) as e:
            assert case["error"] == f"{type(e).__name__}: {e}", case["why"]
        else:
            raise AssertionError(f"accepted: {case['why']}")


def test_chunk_vectors_reassemble_to_the_blob():
    vec = _load("chunks.json")
    blob = bytes.fromhex(vec["blob_hex"])
    chunks = [bytes.fromhex(c) for c in vec["chunks_hex"]]
    assert all(len(c) <= vec["max_payload"] for c in chunks) and len(chunks) > 1
    headers = [parse_chunk(c, 10**6)[0] for c in chunks]
    assert {(h.id, h.kind, h.round, h.sha, h.n) for h in headers} == {
        (vec["transfer_id"], vec["kind"], vec["round"], vec["blob_sha256"], len(chunks))}
    r = Reassembler(10**6)
    done = [r.add("dev-7", c) for c in reversed(chunks)]  # any order
    assert done[-1] is not None and done[-1].data == blob and done[:-1] == [None] * (len(chunks) - 1)


def test_signature_vectors_verify():
    vec = _load("signatures.json")
    v = Verifier({vec["device_id"]: vec["public_key_b64"]})
    for kind in ("update", "stats"):
        signed = v.verify(kind, vec["device_id"], vec[kind]["properties"])
        assert vec[kind]["signed_bytes"] == f"fedmoe/v1|{kind}|{vec['device_id']}|{signed.round}|" \
                                           f"{signed.upload_id}|{signed.sha256}"
        assert ReplayGuard().check(vec["device_id"], kind, signed)


def test_tensor_vectors_decode_to_their_values():
    vec = _load("tensors.json")
    state = {k: torch.tensor(v) for k, v in vec["state"].items()}
    expected = {k: (tuple(t.shape), torch.float32) for k, t in state.items()}
    for fmt, enc in vec["encodings"].items():
        got = decode_tensors(bytes.fromhex(enc["payload_hex"]), 2**20, expected, as_float=torch.float32)
        for k, t in got.items():
            assert torch.equal(t, torch.tensor(enc["decoded"][k])), (fmt, k)
            if fmt == "fp32":
                assert torch.equal(t, state[k])
            else:  # lossy, and close
                assert (t - state[k]).abs().max() <= state[k].abs().max() * 0.2, (fmt, k)
