"""Chunking of large blobs over MQTT and idempotent reassembly.

Wire format of one chunk message (the MQTT payload)::

    b"FMC1" | uint32 big-endian header length | header JSON (ChunkHeader) | data

The header carries the transfer id, the chunk's sequence number and count, the whole
blob's size and sha256, and the chunk's own sha256. Chunks may arrive out of order
and more than once (QoS 1); :class:`Reassembler` keys them by
(sender, round, transfer id, seq), ignores exact duplicates, rejects corrupted or
inconsistent chunks, never allocates more than the declared (and bounded) blob size,
and verifies the blob's sha256 before handing it out exactly once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)

MAGIC = b"FMC1"
DEFAULT_CHUNK_BYTES = 256 * 1024
HEADER_RESERVE = 512
"""Bytes reserved per chunk for magic, length and header JSON."""
MAX_HEADER = 2048


def sha256_hex(data: bytes | memoryview) -> str:
    """Hex sha256 of ``data`` (lowercase, 64 characters)."""
    return hashlib.sha256(data).hexdigest()


class ChunkError(ValueError):
    """A chunk or a reassembled blob failed validation."""


class ChunkHeader(BaseModel):
    """Header of one chunk message."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    id: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Transfer (upload) id, unique per sender and round."""
    kind: str = Field(pattern=r"^[a-z0-9_.-]{1,32}$")
    """What the blob is: ``update``, ``state`` (adapter state down) or ``shard``."""
    round: int = Field(ge=0)
    """The round the blob belongs to (a base-weight shard: the model version)."""
    seq: int = Field(ge=0)
    """This chunk's index, ``0 <= seq < n``."""
    n: int = Field(ge=1, le=1_000_000)
    """Number of chunks of the blob (at most one per byte of it)."""
    size: int = Field(ge=0)
    """Bytes of the whole blob."""
    sha: str = Field(pattern=r"^[0-9a-f]{64}$")
    """sha256 (lowercase hex) of the whole blob."""
    csha: str = Field(pattern=r"^[0-9a-f]{64}$")
    """sha256 (lowercase hex) of this chunk's data."""


@dataclass
class Blob:
    """A reassembled, checksum-verified blob."""

    sender: str
    header: ChunkHeader
    data: bytes

    @property
    def transfer_id(self) -> str:
        """The sender's transfer (upload) id, ``header.id``."""
        return self.header.id


def chunk_data_bytes(max_payload: int) -> int:
    """Data bytes per chunk so that a chunk message stays within ``max_payload`` bytes.

    Raises:
        ValueError: ``max_payload`` leaves no room for data after the header reserve.
    """
    n = int(max_payload) - HEADER_RESERVE
    if n < 1024:
        raise ValueError(f"chunk size {max_payload} bytes is too small (need > {HEADER_RESERVE + 1024})")
    return n


_last_split: tuple[bytes, int, str, list[str]] | None = None
"""The last ``bytes`` :func:`split_blob` split (by identity, the reference held), its data
bytes per chunk and its hashes: one state blob sent to many devices is hashed once."""


def split_blob(data: bytes, max_payload: int, transfer_id: str, kind: str, round: int) -> tuple[list[bytes], str]:
    """Split ``data`` into chunk messages of at most ``max_payload`` bytes each.

    Returns:
        ``(payloads, sha256)``: the MQTT payloads in sequence order (at least one, even
        for empty data) and the hex sha256 of the whole blob.
    """
    global _last_split
    step = chunk_data_bytes(max_payload)
    n = max(1, -(-len(data) // step))
    view = memoryview(data)
    last = _last_split
    if last is not None and last[0] is data and last[1] == step:  # the same state sent to another device
        sha, cshas = last[2], last[3]
    else:
        sha = sha256_hex(data)
        cshas = [sha256_hex(view[seq * step : (seq + 1) * step]) for seq in range(n)]
        if type(data) is bytes:
            _last_split = (data, step, sha, cshas)
    out = []
    for seq in range(n):
        part = view[seq * step : (seq + 1) * step]
        header = ChunkHeader(
            id=transfer_id, kind=kind, round=round, seq=seq, n=n, size=len(data), sha=sha, csha=cshas[seq]
        )
        hb = header.model_dump_json().encode()
        msg = MAGIC + struct.pack(">I", len(hb)) + hb + bytes(part)
        assert len(msg) <= max_payload, "chunk header exceeded its reserve"
        out.append(msg)
    return out, sha


_last_parsed: tuple[bytes, int, tuple[ChunkHeader, bytes], bool] | None = None
"""The last valid chunk :func:`parse_chunk` parsed (the payload object, the limit, the
result, whether its data was hashed): the aggregator's signature check, reassembly and chunk store each parse the same
message; the sha256 and header validation ran three times per chunk (fleet profile,
``results/fleet/profile.md``). Only immutable ``bytes`` are remembered, by identity, and the
reference held keeps that identity from being reused."""


def parse_chunk(payload: bytes, max_blob_bytes: int, verify: bool = True) -> tuple[ChunkHeader, bytes]:
    """Validate one chunk message. The same ``bytes`` object parsed again returns the
    same result without hashing it again. ``verify=False`` leaves the data's sha256 to the
    caller (a :class:`Reassembler` of ``verify_chunks=False`` checks the whole blob's instead).

    Raises:
        ChunkError: bad magic, malformed header, blob larger than ``max_blob_bytes``,
            sequence out of range, or (``verify``) data whose sha256 differs from the header's.
    """
    global _last_parsed
    last = _last_parsed
    if last is not None and last[0] is payload and last[1] == max_blob_bytes and (last[3] or not verify):
        return last[2]
    if len(payload) < 8 or payload[:4] != MAGIC:
        raise ChunkError("not a chunk message (bad magic)")
    (hlen,) = struct.unpack(">I", payload[4:8])
    if hlen > MAX_HEADER or 8 + hlen > len(payload):
        raise ChunkError(f"chunk header length {hlen} is invalid")
    try:
        header = ChunkHeader.model_validate(json.loads(payload[8 : 8 + hlen]), strict=True)
    except (ValidationError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ChunkError(f"malformed chunk header: {str(e)[:200]}") from None
    if header.size > max_blob_bytes:
        raise ChunkError(f"blob of {header.size} bytes exceeds limit {max_blob_bytes}")
    if header.seq >= header.n:
        raise ChunkError(f"chunk seq {header.seq} out of range (n={header.n})")
    if header.n > max(1, header.size):
        raise ChunkError(f"{header.n} chunks for {header.size} bytes")
    data = payload[8 + hlen :]
    if verify and sha256_hex(data) != header.csha:
        raise ChunkError(_corrupted(header.seq, header.n, header.id))
    result = (header, data)
    if type(payload) is bytes:
        _last_parsed = (payload, max_blob_bytes, result, verify)
    return result


def _corrupted(seq: int, n: int, transfer_id: str) -> str:
    return f"chunk {seq}/{n} of {transfer_id} is corrupted (sha256 mismatch)"


@dataclass
class _Pending:
    header: ChunkHeader
    parts: dict[int, bytes] = field(default_factory=dict)
    cshas: dict[int, str] = field(default_factory=dict)
    stored: int = 0
    started: float = field(default_factory=time.monotonic)


class Reassembler:
    """Collects chunks into blobs; idempotent under duplicates and reordering.

    Args:
        max_blob_bytes: largest blob accepted (bytes).
        max_pending: most transfers held incomplete at once (oldest evicted first).
        ttl_s: an incomplete transfer older than this (seconds) is dropped.
        remember: how many completed transfer keys are remembered to ignore late
            duplicates.
        verify_chunks: check each chunk's sha256 as it arrives. False: only the completed
            blob's sha256 is checked, and where it fails, the chunks whose own sha256 fails
            are named (the same errors, at the transfer's last chunk instead of the bad
            one's). It halves the hashing of the aggregator's updates (2.2 MiB of sha256 per
            1.1 MiB update, about 0.6 ms per MiB).
    """

    def __init__(self, max_blob_bytes: int, max_pending: int = 256, ttl_s: float = 3600.0, remember: int = 10_000,
                 verify_chunks: bool = True):
        self.verify_chunks = verify_chunks
        self.max_blob_bytes = max_blob_bytes
        self.max_pending = max_pending
        self.ttl_s = ttl_s
        self._pending: OrderedDict[tuple, _Pending] = OrderedDict()
        self._done: OrderedDict[tuple, None] = OrderedDict()
        self._remember = remember

    def add(self, sender: str, payload: bytes) -> Blob | None:
        """Add one chunk message from ``sender``.

        Returns:
            The completed :class:`Blob` the first time its last chunk arrives, else None.

        Raises:
            ChunkError: the chunk is invalid, conflicts with earlier chunks of its
                transfer, or the completed blob fails its sha256 (the transfer is dropped).
        """
        header, data = parse_chunk(payload, self.max_blob_bytes, self.verify_chunks)
        key = (sender, header.round, header.id)
        if key in self._done:
            return None
        self._expire()
        p = self._pending.get(key)
        if p is None:
            p = _Pending(header)
            self._pending[key] = p
            while len(self._pending) > self.max_pending:
                old, _ = self._pending.popitem(last=False)
                log.warning("dropping incomplete transfer %s (too many pending)", old)
        h0 = p.header
        if (h0.kind, h0.n, h0.size, h0.sha) != (header.kind, header.n, header.size, header.sha):
            raise ChunkError(f"chunk {header.seq} of {header.id} disagrees with earlier chunks of the transfer")
        if header.seq in p.parts:
            if p.parts[header.seq] != data:
                raise ChunkError(f"duplicate chunk {header.seq} of {header.id} with different content")
            return None
        if p.stored + len(data) > header.size:
            del self._pending[key]
            raise ChunkError(f"transfer {header.id} sent more bytes than it declared ({header.size})")
        p.parts[header.seq] = data
        p.cshas[header.seq] = header.csha
        p.stored += len(data)
        if len(p.parts) < header.n:
            return None
        del self._pending[key]
        blob = b"".join(p.parts[i] for i in range(header.n))
        if len(blob) != header.size or sha256_hex(blob) != header.sha:
            bad = [] if self.verify_chunks else [i for i in range(header.n) if sha256_hex(p.parts[i]) != p.cshas[i]]
            if bad:
                raise ChunkError(_corrupted(bad[0], header.n, header.id))
            raise ChunkError(f"transfer {header.id}: reassembled blob fails its sha256")
        self._done[key] = None
        while len(self._done) > self._remember:
            self._done.popitem(last=False)
        return Blob(sender, header, blob)

    def progress(self, sender: str, round: int, transfer_id: str) -> tuple[int, int]:
        """(chunks received, chunks expected) of a pending transfer; (0, 0) if unknown."""
        p = self._pending.get((sender, round, transfer_id))
        return (len(p.parts), p.header.n) if p else (0, 0)

    def drop_round(self, round: int) -> None:
        """Forget pending transfers of ``round`` and earlier (the round closed)."""
        for key in [k for k in self._pending if k[1] <= round]:
            del self._pending[key]

    @property
    def pending_bytes(self) -> int:
        """Bytes held in incomplete transfers."""
        return sum(p.stored for p in self._pending.values())

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            key, p = next(iter(self._pending.items()))
            if now - p.started <= self.ttl_s:
                break
            log.warning("dropping incomplete transfer %s after %.0f s", key, now - p.started)
            del self._pending[key]
