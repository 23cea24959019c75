import json
import struct

import pytest
import torch
from safetensors.torch import load, save

from protocol.codec import CodecError, check_expected, decode_tensors, dequantize_int8, encode_tensors, \
    inspect_header, quantize_int8

LIMIT = 10 * 2**20


def sample():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g), "i": torch.arange(5)}


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16", "int8"])
def test_round_trip_each_format(fmt):
    t = sample()
    out = decode_tensors(encode_tensors(t, fmt), LIMIT)
    assert set(out) == set(t)
    assert torch.equal(out["i"], t["i"])
    tol = {"fp32": 0, "fp16": 2e-3, "bf16": 2e-2, "int8": None}[fmt]
    if fmt == "int8":
        scale = t["w"].abs().amax(0) / 127   # (16, 8) is taller than wide: a scale per column
        assert (out["w"] - t["w"]).abs().max(0).values.le(scale / 2 + 1e-7).all()
        assert torch.equal(out["b"], t["b"])  # 1-D tensors stay fp32
    else:
        assert torch.allclose(out["w"].float(), t["w"], rtol=tol, atol=tol)


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_an_empty_tensor_round_trips_in_the_quantized_formats(fmt):
    # a Qwen2-MoE without a shared expert has 0-wide shared-expert weights (shared_expert_intermediate_size 0)
    t = {"empty": torch.zeros(576, 0), "w": torch.randn(64, 64)}
    out = decode_tensors(encode_tensors(t, fmt), LIMIT)
    assert out["empty"].shape == (576, 0) and out["w"].shape == (64, 64)


def test_int8_error_bound_per_row():
    w = torch.randn(64, 32) * torch.linspace(0.01, 10, 64)[:, None]
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (64,)
    err = (dequantize_int8(q, s) - w).abs()
    assert (err <= s[:, None] / 2 + 1e-6).all()


def test_int8_scales_a_tall_tensor_per_column_and_shards_per_row():
    """A rank-8 LoRA B ``(320, 8)`` gets 8 column scales (1 byte a value, not 1.5); base
    shards keep a scale per output row, which the int8 linear computes with."""
    from moe_model.shards import encode_shard
    from protocol.codec import int8_axis

    g = torch.Generator().manual_seed(4)
    b = torch.randn(320, 8, generator=g) * torch.linspace(0.01, 3, 8)
    data = encode_tensors({"B": b}, "int8")
    raw = load(data)
    assert raw["B::scale"].shape == (1, 8) and int8_axis(b.shape) == "col"
    out = decode_tensors(data, LIMIT)["B"]
    assert (out - b).abs().le(raw["B::scale"] / 2 + 1e-7).all()   # per-column bound
    assert len(data) < 0.27 * len(encode_tensors({"B": b}))         # per-row scales: 0.375
    assert load(encode_shard({"B": b}, "int8"))["B::scale"].shape == (320,)
    assert torch.equal(decode_tensors(encode_shard({"B": b}, "int8"), LIMIT)["B"],
                       dequantize_int8(*quantize_int8(b)))


def test_rejects_an_int8_scale_of_neither_rows_nor_columns():
    for shape in ((8,), (1, 7), (320, 1), (2, 8)):
        data = save({"B": torch.zeros(320, 8, dtype=torch.int8), "B::scale": torch.ones(shape)},
                    metadata={"format": "int8"})
        with pytest.raises(CodecError, match="rows or columns"):
            decode_tensors(data, LIMIT)


def test_int8_payload_is_smaller():
    t = {"w": torch.randn(256, 256)}
    assert len(encode_tensors(t, "int8")) < 0.3 * len(encode_tensors(t, "fp32"))


def test_rejects_nan_and_inf():
    for bad in (float("nan"), float("inf")):
        t = {"w": torch.ones(3, 3)}
        t["w"][1, 1] = bad
        with pytest.raises(CodecError, match="NaN or Inf"):
            decode_tensors(encode_tensors(t), LIMIT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_anywhere_in_a_run_of_tensors_is_found_and_named(dtype, bad):
    """Adjacent tensors of one dtype are checked as one run of bytes: the bad value is found
    in any of them, whatever the float dtype, and the error names its tensor."""
    t = {f"t{i}": torch.linspace(-1e3, 1e3, 50).to(dtype).reshape(5, 10) for i in range(5)}
    decode_tensors(save(t), LIMIT)                                           # finite: accepted
    t["t3"][4, 9] = bad
    with pytest.raises(CodecError, match="tensor 't3' holds NaN or Inf"):
        decode_tensors(save(t), LIMIT)


def test_a_finite_int8_scale_that_overflows_when_dequantized_is_rejected():
    data = encode_tensors({"w": torch.ones(4, 4)}, "int8")
    raw = load(data)
    raw["w::scale"] = torch.full_like(raw["w::scale"], 3e38)                # finite, but 127 x 3e38 is Inf
    with pytest.raises(CodecError, match="tensor 'w' holds NaN or Inf"):
        decode_tensors(save(raw, metadata={"format": "int8"}), LIMIT)


def test_rejects_oversized_before_parsing():
    data = encode_tensors({"w": torch.zeros(100, 100)})
    with pytest.raises(CodecError, match="exceeds limit"):
        decode_tensors(data, len(data) - 1)


def _raw(header: dict, body: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body


def test_rejects_declared_sizes_larger_than_payload():
    data = _raw({"w": {"dtype": "F32", "shape": [1000000, 1000], "data_offsets": [0, 4_000_000_000]}}, b"\0" * 16)
    with pytest.raises(CodecError, match="do not match"):
        inspect_header(data, LIMIT)


def test_rejects_truncated_and_garbage():
    good = encode_tensors(sample())
    for bad in (b"", b"\x01\x02", good[: len(good) // 2], b"\xff" * 64, struct.pack("<Q", 10**12) + b"{}"):
        with pytest.raises(CodecError):
            decode_tensors(bad, LIMIT)


def test_rejects_unknown_dtype_and_gaps():
    with pytest.raises(CodecError, match="unsupported dtype"):
        inspect_header(_raw({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8), LIMIT)
    with pytest.raises(CodecError, match="overlap or leave gaps"):
        inspect_header(_raw({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8), LIMIT)


def test_rejects_int8_without_scale():
    data = save({"w": torch.zeros(2, 2, dtype=torch.int8)}, metadata={"format": "int8"})
    with pytest.raises(CodecError, match="no scale"):
        decode_tensors(data, LIMIT)


def test_expected_names_shapes_dtypes():
    t = sample()
    exp = {k: (tuple(v.shape), v.dtype) for k, v in t.items()}
    check_expected(t, exp)
    with pytest.raises(CodecError, match="missing"):
        check_expected({k: v for k, v in t.items() if k != "b"}, exp)
    with pytest.raises(CodecError, match="shape"):
        check_expected({**t, "w": torch.zeros(8, 16)}, exp)
    with pytest.raises(CodecError, match="dtype"):
        check_expected({**t, "w": t["w"].half()}, exp)
    data = encode_tensors({**t, "extra": torch.zeros(1)})
    with pytest.raises(CodecError, match="unexpected"):
        decode_tensors(data, LIMIT, exp)


def test_a_compressed_payload_decodes_to_what_the_plain_one_does_in_fewer_bytes():
    from protocol.codec import COMPRESSED_MAGIC, is_compressed

    t = {f"layers.{i}.experts.{e}.down_proj.lora_B": torch.randn(48, 4) for i in range(4) for e in range(8)}
    plain = encode_tensors(t, "nf4")
    packed = encode_tensors(t, "nf4", compress=True)
    assert packed.startswith(COMPRESSED_MAGIC) and is_compressed(packed) and not is_compressed(plain)
    assert len(packed) < 0.95 * len(plain)  # the header's repeated names deflate
    meta: dict[str, str] = {}
    a, b = decode_tensors(plain, LIMIT), decode_tensors(packed, LIMIT, metadata_out=meta)
    assert meta["format"] == "nf4" and all(torch.equal(a[k], b[k]) for k in t)
    with pytest.raises(CodecError, match="compressed payload"):  # its offsets would not be these bytes
        inspect_header(packed, LIMIT)
    # a plain safetensors payload can never start with the magic: read as the header length
    # it declares far more than any header may hold
    assert struct.unpack("<Q", COMPRESSED_MAGIC)[0] > 2**40


def test_bad_compressed_payloads_are_refused_without_inflating_past_the_limit():
    import zlib

    from protocol.codec import COMPRESSED_MAGIC

    bomb = COMPRESSED_MAGIC + zlib.compress(b"\0" * (64 * 2**20), 9)  # 64 KiB that inflate to 64 MiB
    with pytest.raises(CodecError, match="more than the limit"):
        decode_tensors(bomb, LIMIT)
    good = encode_tensors(sample(), "fp32", compress=True)
    for bad, why in [(good[:-5], "truncated"), (good + b"x", "stray"), (COMPRESSED_MAGIC + b"not zlib", "malformed"),
                     (COMPRESSED_MAGIC + zlib.compress(b"garbage"), "header")]:
        with pytest.raises(CodecError, match=why):
            decode_tensors(bad, LIMIT)


def test_nf4_packs_router_rows_only_when_asked():
    from protocol.codec import NF4_BLOCK, nf4_shapes, round_trip

    g = torch.Generator().manual_seed(3)
    t = {"B": torch.randn(32, 4, generator=g), "row": torch.randn(NF4_BLOCK * 3, generator=g),
         "short": torch.randn(NF4_BLOCK - 1, generator=g)}
    for vectors, packed in ((False, {"B"}), (True, {"B", "row"})):
        data = encode_tensors(t, "nf4", vectors=vectors)
        meta: dict[str, str] = {}
        out = decode_tensors(data, LIMIT, metadata_out=meta)
        assert set(nf4_shapes(meta)) == packed
        assert all(torch.equal(round_trip(v, "nf4", vectors=vectors), out[k]) for k, v in t.items())
        assert torch.equal(out["short"], t["short"])  # less than a block stays fp32
    # the row's 768 fp32 bytes become 96 packed + 12 absmax + its header entries
    assert len(encode_tensors(t, "nf4", vectors=True)) < len(encode_tensors(t, "nf4")) - 4 * 3 * NF4_BLOCK // 2


def test_state_blobs_encode_one_state_once_and_never_serve_a_stale_one():
    from cloud.rounds.dispatch import StateBlobs
    from protocol.codec import decode_tensors, encode_tensors

    cache = StateBlobs()
    state = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}
    first = cache.encode(state, "fp32")
    assert first == encode_tensors(state, "fp32")
    copy = {k: v.clone() for k, v in state.items()}  # other tensors, same content: the same bytes object
    assert cache.encode(copy, "fp32") is first
    assert cache.encode(state, "int8") is not first  # another format
    copy["b"][0] = 2.0  # changed content: encoded again
    changed = cache.encode(copy, "fp32")
    assert changed is not first and decode_tensors(changed, 1 << 20)["b"][0].item() == 2.0
    for i in range(StateBlobs.SIZE + 2):  # bounded in number
        cache.encode({"x": torch.full((2,), float(i))}, "fp32")
    assert len(cache._kept) == StateBlobs.SIZE
    cache.MAX_BYTES = 3000  # and in bytes, the newest kept
    big = cache.encode({"y": torch.zeros(1000)}, "fp32")
    assert list(cache._kept.values()) == [big]


def test_state_blobs_know_the_same_tensors_in_a_scope_without_hashing_and_see_in_place_changes(monkeypatch):
    from cloud.rounds import dispatch
    from protocol.codec import decode_tensors

    cache = dispatch.StateBlobs()
    state = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(4)}
    first = cache.encode(state, "fp32", scope=(1, "v1"))
    hashed, real = [], dispatch.hashlib.sha256
    monkeypatch.setattr(dispatch.hashlib, "sha256", lambda *a: hashed.append(1) or real(*a))
    assert cache.encode(dict(state), "fp32", scope=(1, "v1")) is first  # the same tensors: no hash
    assert hashed == []
    assert cache.encode(state, "fp32", scope=(2, "v1")) is first  # another round: hashed, same content
    assert hashed == [1]
    state["b"].add_(1.0)  # an in-place change bumps the tensor's version: encoded again
    changed = cache.encode(state, "fp32", scope=(2, "v1"))
    assert changed is not first and decode_tensors(changed, 1 << 20)["b"][0].item() == 2.0
    for i in range(dispatch.StateBlobs.SIZE + 2):  # bounded in number, like the content cache
        cache.encode({"x": torch.full((2,), float(i))}, "fp32", scope=(3, "v1"))
    assert len(cache._seen) == dispatch.StateBlobs.SIZE


def test_a_repeated_header_is_parsed_once_and_its_parse_is_the_callers_own():
    a = encode_tensors({"w": torch.ones(2, 3), "b": torch.zeros(3)})
    b = encode_tensors({"w": torch.full((2, 3), 2.0), "b": torch.ones(3)})  # the same header, other values
    infos, meta = inspect_header(a, LIMIT)
    infos.pop("w")
    meta["format"] = "nf4"
    assert set(inspect_header(b, LIMIT)[0]) == {"w", "b"} and inspect_header(b, LIMIT)[1].get("format") != "nf4"
    assert torch.equal(decode_tensors(b, LIMIT)["w"], torch.full((2, 3), 2.0))
    # the same header on a payload of another length is checked again, not taken from the cache
    with pytest.raises(CodecError, match="trailing bytes"):
        inspect_header(a + b"\0" * 4, LIMIT)
    with pytest.raises(CodecError, match="do not match"):
        inspect_header(a[:-4], LIMIT)
