"""The device's outgoing filter chain (edge_sdk.filters): fault injection and signing."""

from __future__ import annotations

import hashlib

import pytest
import torch

from edge_sdk import EdgeClient
from edge_sdk.filters import ClaimSamples, Filter, Signing, TransformUpdate, UpdateContext
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


def test_a_device_that_does_not_sign_never_loads_the_signing_library():
    import subprocess
    import sys

    code = "import sys, edge_sdk, edge_sdk.filters; print('cryptography' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-500:]   # ~7 MiB of RSS saved
