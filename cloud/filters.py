"""The aggregator's incoming filter chain (NVFlare-style, the counterpart of
:mod:`edge_sdk.filters`): what stands between the transport and the round engine.

The service asks every filter whether to accept an update chunk or a stats message
(:meth:`InboundFilter.accept_chunk`, :meth:`InboundFilter.accept_stats`: signature
verification); the round engine passes every decoded update through
:meth:`InboundFilter.on_update` (precision and delta decoding), so the engine and the
strategies see model-layout fp32 tensors only. Filters shipped here:

- :class:`UpdateDecoding`: undoes the device's ``UpdateEncoding`` (fp16/bf16/int8 updates
  are dequantized by the codec and checked against the model in fp32; a delta gets the
  state the cloud sent added back). Always in the engine's chain.
- :class:`Verification`: Ed25519 signatures of update chunks and statistics and replay
  protection (:mod:`protocol.signing`); in the service's chain when ``device_keys`` is set.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from protocol.chunking import parse_chunk
from protocol.codec import ENCODING_KEY, UPDATE_ENCODINGS, CodecError, sha256_hex
from protocol.logsafe import LogLimiter
from protocol.messages import Stats
from protocol.signing import SIGNED_KINDS, ReplayGuard, SignatureError, Verifier, unsigned_reason

log = logging.getLogger(__name__)


class InboundFilter:
    """One link of the incoming chain; every hook accepts / returns its input by default."""

    def accept_chunk(self, device_id: str, payload: bytes, props: dict[str, str]) -> bool:
        """Whether to accept one chunk of an update (False: ignore it silently, a duplicate).

        Raises:
            SignatureError, protocol.chunking.ChunkError: refuse it (the device is told why).
        """
        return True

    def accept_stats(self, device_id: str, payload: bytes, msg: Stats, props: dict[str, str]) -> bool:
        """Whether to accept a schema-valid stats message (False: ignore it, a duplicate).

        Raises:
            SignatureError: refuse it (the device is told why).
        """
        return True

    def on_update(self, device_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                  sent: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The update the engine aggregates instead of ``tensors``.

        Args:
            device_id: the sender.
            tensors: the decoded update, name -> fp32 tensor of the model's shape.
            metadata: the payload's safetensors metadata.
            sent: returns the adapter state the cloud sent the device this round (same names).

        Raises:
            protocol.codec.CodecError: refuse the update (the device is told why).
        """
        return tensors


class UpdateDecoding(InboundFilter):
    """Undo the device's update encoding (``edge_sdk.filters.UpdateEncoding``): a payload
    whose metadata says ``fedmoe.encoding: delta`` holds ``trained - sent`` and gets the
    round's sent state added back; the sum is checked finite again (fp32 overflow)."""

    def on_update(self, device_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                  sent: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        encoding = metadata.get(ENCODING_KEY, "state")
        if encoding not in UPDATE_ENCODINGS:
            raise CodecError(f"unknown update encoding {encoding[:40]!r} (known: {', '.join(UPDATE_ENCODINGS)})")
        if encoding == "state":
            return tensors
        base = sent()
        out = {k: t + base[k].to(t.dtype) if t.is_floating_point() else t for k, t in tensors.items()}
        for k, t in out.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise CodecError(f"tensor {k!r} is not finite once the delta is added to the sent state")
        return out


class Verification(InboundFilter):
    """Signed updates and statistics (``device_keys`` set; :mod:`protocol.signing`).

    Args:
        verifier: the provisioned devices' public keys.
        max_update_bytes: the largest update blob, bytes (bounds the chunk header parse).

    Attributes:
        duplicates: exact repeats of signed stats ignored (QoS 1 redeliveries, replays).
    """

    def __init__(self, verifier: Verifier, max_update_bytes: int):
        self.verifier, self.replays, self.max_update_bytes = verifier, ReplayGuard(), max_update_bytes
        self.duplicates = 0
        self._log = LogLimiter(log, "repeated stats", per_key=3, total=20, interval_s=60.0)

    def knows(self, device_id: str) -> bool:
        """Whether ``device_id`` is provisioned (others are dropped without a reply)."""
        return self.verifier.knows(device_id)

    def unsigned(self, kind: str, props: dict[str, str] | None) -> str | None:
        """Why a ``kind`` message with user properties ``props`` lacks a signature, or None."""
        return unsigned_reason(kind, props) if kind in SIGNED_KINDS else None

    def prune(self, next_round: int) -> None:
        """Forget replay records of rounds before ``next_round``."""
        self.replays.prune(next_round)

    def accept_chunk(self, device_id: str, payload: bytes, props: dict[str, str]) -> bool:
        signed = self.verifier.verify("update", device_id, props)
        header, _ = parse_chunk(payload, self.max_update_bytes, verify=False)
        if (header.round, header.id, header.sha) != (signed.round, signed.upload_id, signed.sha256):
            raise SignatureError("update chunk does not match its signature (round, upload id or sha256)")
        if header.seq == 0:
            self.replays.check(device_id, "update", signed)
        return True

    def accept_stats(self, device_id: str, payload: bytes, msg: Stats, props: dict[str, str]) -> bool:
        signed = self.verifier.verify("stats", device_id, props)
        if signed.sha256 != sha256_hex(payload) or signed.round != msg.round or \
                signed.upload_id != msg.update.transfer_id:
            raise SignatureError("stats message does not match its signature (payload, round or upload id)")
        if not self.replays.check(device_id, "stats", signed):
            self.duplicates += 1
            self._log.log("repeated stats", logging.INFO, "ignored a repeated stats message from %s (round %d)",
                          device_id, msg.round)
            return False
        return True
