import json
import os
import random
import struct

import pytest

from protocol.chunking import MAGIC, ChunkError, Reassembler, parse_chunk, split_blob

PAYLOAD = 4096


def chunks_of(data: bytes, tid: str = "t1", rnd: int = 3):
    msgs, _ = split_blob(data, PAYLOAD, tid, "update", rnd)
    return msgs


def test_round_trip_multi_chunk():
    data = os.urandom(50_000)
    msgs = chunks_of(data)
    assert len(msgs) > 10 and all(len(m) <= PAYLOAD for m in msgs)
    r = Reassembler(1 << 20)
    results = [r.add("dev", m) for m in msgs]
    assert all(x is None for x in results[:-1])
    assert results[-1].data == data and results[-1].header.round == 3


def test_empty_blob_is_one_chunk():
    msgs = chunks_of(b"")
    assert len(msgs) == 1
    assert Reassembler(10).add("d", msgs[0]).data == b""


def test_out_of_order_and_duplicates_complete_once():
    data = os.urandom(30_000)
    msgs = chunks_of(data)
    shuffled = msgs + msgs[:5]
    random.Random(1).shuffle(shuffled)
    r = Reassembler(1 << 20)
    done = [b for b in (r.add("dev", m) for m in shuffled) if b is not None]
    assert len(done) == 1 and done[0].data == data
    # late duplicates after completion are ignored
    assert all(r.add("dev", m) is None for m in msgs)


def test_corrupted_chunk_rejected_and_transfer_still_completes_with_good_copy():
    data = os.urandom(20_000)
    msgs = chunks_of(data)
    bad = bytearray(msgs[2])
    bad[-1] ^= 0xFF
    r = Reassembler(1 << 20)
    with pytest.raises(ChunkError, match="corrupted"):
        r.add("dev", bytes(bad))
    out = [r.add("dev", m) for m in msgs]
    assert out[-1] is not None and out[-1].data == data


def test_unverified_chunks_are_checked_as_one_blob_and_a_corrupted_one_is_named():
    data = os.urandom(20_000)
    msgs = chunks_of(data)
    r = Reassembler(1 << 20, verify_chunks=False)
    assert [r.add("dev", m) for m in msgs][-1].data == data  # the good transfer completes
    bad = bytearray(msgs[2])
    bad[-1] ^= 0xFF
    r = Reassembler(1 << 20, verify_chunks=False)
    r.add("dev", bytes(bad))  # taken unchecked for now
    with pytest.raises(ChunkError, match=f"chunk 2/{len(msgs)} of t1 is corrupted"):  # named at the last chunk
        for m in msgs[:2] + msgs[3:]:
            r.add("dev", m)
    assert r.pending_bytes == 0  # the failed transfer is dropped
    first = parse_chunk(msgs[1], 1 << 20, verify=False)
    assert parse_chunk(msgs[1], 1 << 20, verify=False) is first
    forged = bytes(bad)
    parse_chunk(forged, 1 << 20, verify=False)  # remembered unverified ...
    with pytest.raises(ChunkError, match="corrupted"):  # ... so a verifying parse still hashes it
        parse_chunk(forged, 1 << 20)


def test_blob_checksum_mismatch_rejected():
    data = os.urandom(10_000)
    msgs = chunks_of(data)
    # forge a chunk whose own checksum is right but whose data belongs to another blob
    other = chunks_of(os.urandom(10_000))
    hlen = struct.unpack(">I", other[0][4:8])[0]
    hdr = json.loads(other[0][8:8 + hlen])
    h0 = json.loads(msgs[0][8:8 + struct.unpack(">I", msgs[0][4:8])[0]])
    hdr.update({k: h0[k] for k in ("id", "n", "size", "sha", "kind", "round")})
    hb = json.dumps(hdr).encode()
    forged = MAGIC + struct.pack(">I", len(hb)) + hb + other[0][8 + hlen:]
    r = Reassembler(1 << 20)
    r.add("dev", forged)
    with pytest.raises(ChunkError, match="sha256"):
        for m in msgs[1:]:
            r.add("dev", m)


def test_same_transfer_id_from_two_senders_kept_apart():
    a, b = os.urandom(9000), os.urandom(9000)
    r = Reassembler(1 << 20)
    ma, mb = chunks_of(a, "same"), chunks_of(b, "same")
    res = {}
    for x, y in zip(ma, mb):
        res["a"] = r.add("A", x) or res.get("a")
        res["b"] = r.add("B", y) or res.get("b")
    assert res["a"].data == a and res["b"].data == b


def test_limits_and_malformed_headers():
    msgs = chunks_of(os.urandom(10_000))
    with pytest.raises(ChunkError, match="exceeds limit"):
        parse_chunk(msgs[0], 100)
    for bad in (b"", b"XXXX" + b"\0" * 20, MAGIC + struct.pack(">I", 10**6) + b"{}", MAGIC + struct.pack(">I", 2) + b"{}"):
        with pytest.raises(ChunkError):
            parse_chunk(bad, 1 << 20)


def test_conflicting_duplicate_rejected():
    msgs1 = chunks_of(os.urandom(9000), "x")
    r = Reassembler(1 << 20)
    r.add("d", msgs1[0])
    msgs2 = chunks_of(os.urandom(9000), "x")
    with pytest.raises(ChunkError, match="disagrees"):
        r.add("d", msgs2[1])


def test_pending_transfers_bounded():
    r = Reassembler(1 << 20, max_pending=3)
    for i in range(10):
        r.add("d", chunks_of(os.urandom(9000), f"t{i}")[0])
    assert len(r._pending) == 3


def test_a_chunk_parsed_again_is_not_hashed_again_but_a_corrupted_copy_still_fails():
    data = os.urandom(10_000)
    msgs = chunks_of(data)
    first = parse_chunk(msgs[1], 1 << 20)
    assert parse_chunk(msgs[1], 1 << 20) is first  # the same message object: the remembered result
    bad = bytearray(msgs[1])
    bad[-1] ^= 0xFF
    with pytest.raises(ChunkError, match="corrupted"):  # other bytes with the same header are checked
        parse_chunk(bytes(bad), 1 << 20)
    with pytest.raises(ChunkError, match="exceeds limit"):  # the same object under a smaller limit
        parse_chunk(msgs[1], 100)
    mutable = bytearray(msgs[2])
    parse_chunk(mutable, 1 << 20)
    mutable[-1] ^= 0xFF  # a mutable payload is never remembered
    with pytest.raises(ChunkError, match="corrupted"):
        parse_chunk(mutable, 1 << 20)


def test_one_blob_split_for_many_transfers_keeps_each_header_right():
    data = os.urandom(9_000)
    a, sha_a = split_blob(data, PAYLOAD, "ta", "state", 1)
    b, sha_b = split_blob(data, PAYLOAD, "tb", "state", 2)  # hashes reused, headers its own
    assert sha_a == sha_b and len(a) == len(b)
    r = Reassembler(1 << 20)
    assert [r.add("d", m) for m in b][-1].data == data
    assert parse_chunk(b[0], 1 << 20)[0].id == "tb" and parse_chunk(b[0], 1 << 20)[0].round == 2
    other = os.urandom(9_000)
    c, sha_c = split_blob(other, PAYLOAD, "tc", "state", 2)
    r = Reassembler(1 << 20)
    assert sha_c != sha_a and [r.add("d", m) for m in c][-1].data == other
