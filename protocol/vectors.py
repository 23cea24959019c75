"""Golden test vectors for implementations of the protocol in other languages (PROTOCOL.md).

``protocol/vectors/*.json``, generated from this implementation and committed:

- ``messages.json``: ``valid``: one message of every control type as the reference peers
  encode it (``topic_kind``: the topic level it travels on); ``invalid``: payloads a peer
  MUST refuse (``raw``: the payload as text), each with the rule it breaks (``why``) and
  the reference parser's error (``error``).
- ``chunks.json``: a blob cut into chunk messages for a given maximum payload: the blob and
  every chunk payload in hex, with the blob's sha256.
- ``signatures.json``: an Ed25519 key (raw 32-byte seed, base64), and for an update and a
  stats message the signed bytes, the signature and the MQTT 5 user properties.
- ``tensors.json``: a small adapter state encoded as the update/state payload in fp32,
  fp16, int8 and nf4: the tensors stored (dtype, shape, bytes in hex), the safetensors
  metadata, the values a reader decodes, and one example payload (safetensors orders its
  header's keys freely, so only the stored tensors and metadata must match).

Regenerate with ``python -m protocol.vectors``; ``--check`` exits 1 when the committed files
differ from what this code produces (``tests/test_vectors.py``). A new implementation
checks itself against these files: parse every ``valid`` message, refuse every
``invalid`` one, reproduce the chunks, signatures and tensor bytes byte for byte.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

VECTOR_DIR = Path(__file__).with_name("vectors")
SEED = bytes(range(32))
"""The vectors' Ed25519 private key (raw seed): a published test key, never a real one."""


def _messages() -> dict[str, Any]:
    from .messages import (
        Ack, Assignment, BlobRef, Command, FileRef, Hello, LayerStats, ModelSpec, ProgramRef, Progress, ShardManifest,
        Stats, Status, TrainConfig, encode, parse_message,
    )

    sha = "0" * 63 + "1"
    ref = BlobRef(transfer_id="3f2a9c0d1e7b4a55", bytes=4096, sha256=sha, chunks=1)
    layer = LayerStats(layer=1, tokens=64, usage=[70, 0, 58, 0], activation_prob=[0.6, 0.0, 0.4, 0.0],
                       routing_dist=[0.55, 0.0, 0.45, 0.0], margin=[0.2, 0.0, 0.1, 0.0],
                       expert_loss=[0.9, 0.0, 1.1, 0.0], expert_acc=[0.5, 0.0, 0.4, 0.0],
                       expert_samples=[8, 0, 6, 0])
    valid = [
        ("hello", Hello(device_id="dev-7", sdk_version="1.0", protocol_minor=4, budget_bytes=1610612736,
                        weight_formats=["nf4", "int8"], num_samples=120, task="bbc", runtime_bytes=412090368)),
        ("status", Status(device_id="dev-7", state="online")),
        ("ack", Ack(device_id="dev-7", round=3, accepted=True)),
        ("ack", Ack(device_id="dev-7", round=3, accepted=False, reason="over budget", budget_bytes=1073741824,
                    runtime_bytes=412090368, needed_bytes=1200000000)),
        ("stats", Stats(device_id="dev-7", round=3, task="bbc", num_samples=120, train_loss=0.91, val_loss=0.95,
                        val_accuracy=0.62, layers=[layer], update=ref, train_seconds=12.5, bytes_up=5000,
                        bytes_down=90000, peak_rss_bytes=900000000, baseline_rss_bytes=412090368,
                        shards_fetched=["L1.E0"])),
        ("assignment", Assignment(
            round=3, model_version=0, model=ModelSpec(num_experts=4, top_k=2), task="bbc", labels=["a", "b"],
            experts={1: [0, 2]}, weight_format="int8", train=TrainConfig(lr=0.001), deadline=1795660000.0,
            shards=[ShardManifest(shard_id="L1.E0", topic="fl/v1/demo/shards/0/int8/1/0", bytes=1000, sha256=sha,
                                  format="int8", chunks=1)],
            state=ref)),
        ("hello", Hello(device_id="phone-3", sdk_version="native-0.1", protocol_minor=12, budget_bytes=805306368,
                        weight_formats=["int8"], num_samples=40, task="bbc", runtime_bytes=5242880,
                        runtimes=["executorch-1.5"])),
        ("assignment", Assignment(
            round=3, model_version=0, model=ModelSpec(num_experts=4, top_k=2), task="bbc", labels=["a", "b"],
            experts={1: [0, 2]}, weight_format="int8", train=TrainConfig(lr=0.001), deadline=1795660000.0,
            shards=[ShardManifest(shard_id="L1.E0", topic="fl/v1/demo/shards/0/int8/1/0", bytes=1000, sha256=sha,
                                  format="int8", chunks=1, url=f"https://cdn.example/shards/{sha}.safetensors")],
            state=ref, program=ProgramRef(
                runtime="executorch-1.5", key="0" * 63 + "2",
                program=FileRef(url=f"https://cdn.example/shards/{'0' * 63}3.pte", bytes=163840,
                                sha256="0" * 63 + "3"),
                manifest=FileRef(url=f"https://cdn.example/shards/{'0' * 63}4.json", bytes=24000,
                                 sha256="0" * 63 + "4"),
                lora_a=FileRef(url=f"https://cdn.example/shards/{'0' * 63}5.safetensors", bytes=98304,
                               sha256="0" * 63 + "5")))),
        ("assignment", Assignment(
            round=3, model_version=0, model=ModelSpec(num_experts=4, top_k=2), task="bbc", labels=["a", "b"],
            experts={1: [0, 1, 2]}, weight_format="int8", train=TrainConfig(lr=0.001), deadline=1795660000.0,
            shards=[], state=ref, lora_rank=2)),
        ("command", Command(command="reject", round=3, kind="stats", upload_id="3f2a9c0d1e7b4a55",
                            reason="stats rejected: layer 1: usage 128 exceeds tokens x top_k = 60 x 2")),
        ("command", Command(command="excluded", round=4, reason="budget below one expert per layer",
                            budget_bytes=500000000, needed_bytes=600000000, runtime_bytes=412090368)),
        ("progress", Progress(event="report", round=3, rounds=6, detail={"device": "dev-7", "val_accuracy": 0.62})),
    ]
    ok = json.loads(encode(Ack(device_id="dev-7", round=3, accepted=True)))
    bad = [
        ("round as a string", {**ok, "round": "3"}),
        ("accepted as a number", {**ok, "accepted": 1}),
        ("v missing", {k: x for k, x in ok.items() if k != "v"}),
        ("another major version", {**ok, "v": 2}),
        ("v as a float", {**ok, "v": 1.0}),
        ("type missing", {k: x for k, x in ok.items() if k != "type"}),
        ("unknown type", {**ok, "type": "greeting"}),
        ("negative round", {**ok, "round": -1}),
        ("device id with a space", {**ok, "device_id": "dev 7"}),
        ("integer beyond 2^62", {**ok, "round": 2**62 + 1}),
    ]
    invalid = [{"why": why, "raw": json.dumps(obj)} for why, obj in bad]
    invalid += [{"why": "non-finite number (NaN is not JSON)", "raw": json.dumps(ok)[:-1] + ', "x": NaN}'},
                {"why": "not a JSON object", "raw": "[1, 2]"},
                {"why": "not JSON", "raw": "{\"v\": 1, "}]
    for case in invalid:
        try:
            parse_message(case["raw"].encode())
            raise AssertionError(f"the reference parser accepted an invalid vector: {case['why']}")
        except Exception as e:  # noqa: BLE001  (MessageError or VersionError)
            case["error"] = f"{type(e).__name__}: {e}"
    return {"valid": [{"topic_kind": k, "message": json.loads(encode(m))} for k, m in valid], "invalid": invalid}


def _chunks() -> dict[str, Any]:
    from .chunking import split_blob

    blob = bytes((i * 37 + 11) % 256 for i in range(5000))
    max_payload = 2048
    chunks, sha = split_blob(blob, max_payload, "3f2a9c0d1e7b4a55", "update", 3)
    return {"max_payload": max_payload, "transfer_id": "3f2a9c0d1e7b4a55", "kind": "update", "round": 3,
            "blob_hex": blob.hex(), "blob_sha256": sha, "chunks_hex": [c.hex() for c in chunks]}


def _signatures() -> dict[str, Any]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from .signing import Signer, public_key_b64, signed_bytes

    key = Ed25519PrivateKey.from_private_bytes(SEED)
    signer = Signer("dev-7", key)
    stats_payload = b'{"v":1,"type":"stats","device_id":"dev-7","round":3}'
    upd = ("update", 3, "3f2a9c0d1e7b4a55", "e1630f843370f402870799e14abbf2b06af2d23b0153658e1211dffabc61ad8f")
    props_stats = signer.stats_properties(3, "3f2a9c0d1e7b4a55", stats_payload)
    return {
        "private_key_b64": base64.b64encode(SEED).decode(), "public_key_b64": public_key_b64(key),
        "device_id": "dev-7",
        "update": {"signed_bytes": signed_bytes(upd[0], "dev-7", *upd[1:]).decode(),
                   "properties": signer.properties(*upd)},
        "stats": {"payload": stats_payload.decode(),
                  "signed_bytes": signed_bytes("stats", "dev-7", 3, "3f2a9c0d1e7b4a55",
                                               props_stats["fm-sha"]).decode(),
                  "properties": props_stats},
    }


def _tensors() -> dict[str, Any]:
    import torch

    from .codec import decode_tensors, encode_tensors

    g = torch.Generator().manual_seed(7)
    state = {"expert.1.0.fc1.lora_B": (torch.randn(16, 4, generator=g) * 0.01).round(decimals=6),
             "router.1.0": (torch.randn(64, generator=g) * 0.01).round(decimals=6)}
    out: dict[str, Any] = {"state": {k: v.tolist() for k, v in state.items()}, "encodings": {}}
    encodings = {"fp32": {}, "fp16": {}, "int8": {}, "nf4": {},
                 "nf4+vectors": {"vectors": True},  # an nf4 delta: the 64-value router row packed too (minor 8)
                 "nf4+vectors+zlib": {"vectors": True, "compress": True}}  # compressed payload (minor 8)
    for name, kw in encodings.items():
        fmt = name.split("+")[0]
        data = encode_tensors(state, fmt, **kw)
        meta: dict[str, str] = {}
        stored = decode_tensors(data, 2**20, dequantize=False, metadata_out=meta)
        decoded = decode_tensors(data, 2**20, {k: (tuple(v.shape), torch.float32) for k, v in state.items()},
                                 as_float=torch.float32)
        out["encodings"][name] = {
            "payload_hex": data.hex(), "metadata": meta,
            "stored": {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                           "data_hex": v.contiguous().view(torch.uint8).numpy().tobytes().hex()}
                       for k, v in stored.items()},
            "decoded": {k: v.tolist() for k, v in decoded.items()}}
    return out


def _normative(name: str, text: str) -> Any:
    """A vector file without what is not fixed: safetensors writes its header's keys in no
    fixed order, so a tensor payload is one valid example, its stored tensors and
    metadata are the contract."""
    obj = json.loads(text)
    if name == "tensors.json":
        for enc in obj.get("encodings", {}).values():
            enc.pop("payload_hex", None)
    return obj


def vectors() -> dict[str, dict[str, Any]]:
    """File name -> content of every vector file."""
    return {"messages.json": _messages(), "chunks.json": _chunks(), "signatures.json": _signatures(),
            "tensors.json": _tensors()}


def rendered() -> dict[str, str]:
    """File name -> file text (sorted keys, 2-space indent, final newline)."""
    return {n: json.dumps(v, indent=2, sort_keys=True) + "\n" for n, v in vectors().items()}


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) ``protocol/vectors/*.json``; returns the exit status."""
    from .schema import sync_files

    return sync_files(argv, rendered(), VECTOR_DIR, "golden vector files", "protocol.vectors",
                      same=lambda n, committed, generated: _normative(n, committed) == _normative(n, generated))


if __name__ == "__main__":
    raise SystemExit(main())
