"""The device's outgoing filter chain (in the spirit of NVFlare's filters): what stands
between local training and the transport.

:class:`EdgeClient` passes every outgoing ``hello``, update and ``stats`` through its
filters, in order, then asks each for MQTT user properties for the final bytes (signing).
The client itself sees tensors and messages only. Filters shipped here:

- :class:`UpdateEncoding`: the update's precision (fp32, fp16, bf16, int8, nf4) and whether
  it is sent as a delta from the state the cloud sent (the cloud's
  ``cloud.filters.UpdateDecoding`` undoes both).
- :class:`Signing`: Ed25519 signatures of update chunks and statistics
  (:mod:`protocol.signing`); added by the client when it has a signing key, always last.
- Fault injection for tests and benchmarks (a provisioned device that signs correctly and
  lies): :class:`ClaimSamples` and :class:`TransformUpdate`; ``benchmarks/poisoning.py``
  builds its attacks from them. :meth:`Filter.on_publish` wraps the publish itself
  (``benchmarks/reliability.py`` delays and duplicates messages with it).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import torch

from protocol.codec import ENCODING_KEY, sha256_hex
from protocol.messages import Assignment, Hello, Stats

if TYPE_CHECKING:  # protocol.signing loads cryptography (~7 MiB RSS): only devices that sign pay for it
    from protocol.signing import Signer

log = logging.getLogger(__name__)


@dataclass
class UpdateContext:
    """What a filter may use to rewrite an update.

    Attributes:
        assignment: the round's assignment.
        model: the trained :class:`moe_model.submoe.SubMoE` (its adapter state is the update).
        sent: the adapter state the cloud sent this round (name -> tensor).
        train_items: the local training samples ``(input, label id)``.
        format: the weight format the update is encoded in (``protocol.codec``; a filter
            may change it, default fp32).
        metadata: safetensors metadata written with the update (a filter may add to it).
        work_dir: a directory of this device's own (``filters/<device id>`` under its shard
            cache, which devices may share) where a filter may keep state between rounds on
            disk instead of in memory; None: keep it in memory.
        vectors: nf4 packs 1-D tensors of 64 or more values too (``protocol.codec``).
        compress: send the payload compressed (``protocol.codec``, protocol minor 8).
    """

    assignment: Assignment
    model: Any
    sent: dict[str, torch.Tensor]
    train_items: list
    format: str = "fp32"
    metadata: dict[str, str] = field(default_factory=dict)
    work_dir: Path | None = None
    vectors: bool = False
    compress: bool = False


T = TypeVar("T")


class Filter:
    """One link of the chain; every hook returns its input unchanged by default."""

    def on_hello(self, hello: Hello) -> Hello:
        """The ``hello`` to publish instead of ``hello``."""
        return hello

    def on_update(self, update: dict[str, torch.Tensor], ctx: UpdateContext) -> dict[str, torch.Tensor]:
        """The adapter state to upload instead of ``update`` (the keys and shapes of ``ctx.sent``)."""
        return update

    def on_stats(self, stats: Stats) -> Stats:
        """The statistics to publish instead of ``stats``."""
        return stats

    def properties(self, kind: str, round: int, upload_id: str, payload: bytes) -> dict[str, str]:
        """MQTT user properties to add to the final ``payload`` of an ``update`` (its
        sha256 over the whole blob) or ``stats`` message (default: none)."""
        return {}

    def on_publish(self, kind: str, round: int, send: Callable[[], T]) -> T:
        """Publish a ``hello`` (round 0), ``update`` or ``stats`` message by calling
        ``send`` (the rest of the chain, then the transport) and return its result; a
        filter may delay, repeat or skip the call (fault injection). Default: ``send()``."""
        return send()


class UpdateEncoding(Filter):
    """How the update travels: in ``precision`` and, with ``delta``, as the difference
    from the adapter state the cloud sent (small values: fp16/int8 lose less of them).
    The cloud decodes any of these (``cloud.filters.UpdateDecoding``). Put it after
    every filter that rewrites the update (they expect whole states).

    With ``error_feedback`` (Seide et al., 1-bit SGD, Interspeech 2014; Karimireddy et
    al., EF-SGD, ICML 2019) the device keeps what the encoding lost, ``e = d' − Q(d')``
    per tensor, and adds it to the next round's delta before encoding (``d' = d + e``):
    the rounding errors cancel over rounds instead of adding up, so the sum of what the
    cloud received stays within one quantization step of the sum of the true deltas. The
    residual is one fp32 copy of the update; it is dropped for a tensor the device no
    longer sends (an expert it no longer holds). Where the context gives a ``work_dir``
    (``EdgeClient`` does) it waits there between rounds (``error-feedback.safetensors``)
    and is read back one tensor at a time after training, so it takes no memory while
    the device trains (the memory plan does not count it, ``moe_model.budget``); else it
    stays in memory. A residual left on disk by an earlier process is never read.

    Args:
        precision: ``fp32`` (default), ``fp16``, ``bf16``, ``int8`` (a scale per row, or
            per column of a tall 2-D tensor such as a LoRA B; ``protocol.codec``) or
            ``nf4`` (4-bit NormalFloat in blocks of 64 with an fp32 absmax each; meant for
            deltas with error feedback): 4, 2, 2, ~1 or ~0.56 bytes per value (rank >= 2
            tensors; 1-D ones stay fp32).
        delta: send ``trained - sent`` instead of ``trained``; an nf4 delta packs the
            1-D tensors of 64 or more values too (a sub-MoE's router rows, ``(H,)`` each:
            0.75 of an fp32 update's 6.2 MiB at 512 experts of H = 384).
        error_feedback: carry the encoding error over to the next round (needs ``delta``
            and a precision other than fp32).
        compress: zlib-compress the payload where the assignment says the cloud reads it
            (``Assignment.compressed_updates``, minor 8); about 15% off an nf4 LoRA update.

    Raises:
        ValueError: an unknown precision, or ``error_feedback`` without ``delta`` or with
            fp32.
    """

    PRECISIONS = ("fp32", "fp16", "bf16", "int8", "nf4")

    def __init__(self, precision: str = "fp32", delta: bool = False, error_feedback: bool = False,
                 compress: bool = False):
        if precision not in self.PRECISIONS:
            raise ValueError(f"update precision must be one of {self.PRECISIONS}, got {precision!r}")
        if error_feedback and (not delta or precision == "fp32"):
            raise ValueError("error_feedback needs delta=True and a precision other than fp32 "
                             f"(got delta={delta}, precision={precision!r})")
        self.precision, self.delta, self.error_feedback = precision, delta, error_feedback
        self.compress = compress
        self.residual: dict[str, torch.Tensor] = {}
        """tensor name -> the encoding error of the last update that carried it (fp32), when
        kept in memory."""
        self._residual_file: Path | None = None

    def encoded(self, t: torch.Tensor) -> torch.Tensor:
        """What the cloud decodes of floating tensor ``t`` after this precision's encoding
        (``protocol.codec.round_trip``), as fp32 of ``t``'s shape."""
        from protocol.codec import round_trip

        return round_trip(t, self.precision, vectors=self.delta)

    def on_update(self, update: dict[str, torch.Tensor], ctx: UpdateContext) -> dict[str, torch.Tensor]:
        ctx.format = self.precision
        ctx.vectors = self.delta
        ctx.compress = self.compress and ctx.assignment.compressed_updates
        if not self.delta:
            return update
        ctx.metadata[ENCODING_KEY] = "delta"
        out = {k: v - ctx.sent[k].to(v.dtype) if v.is_floating_point() else v for k, v in update.items()}
        if not self.error_feedback:
            return out
        residual: dict[str, torch.Tensor] = {}
        with self._last_residual() as last:
            for k, v in out.items():
                if not v.is_floating_point():
                    continue
                e = last(k)  # one old tensor at a time: one residual copy in memory, not two
                v = v.float()
                if e is not None and e.shape == v.shape:
                    v.add_(e)  # v is this call's own delta tensor
                residual[k] = v - self.encoded(v)
                out[k] = v
        self._keep(residual, ctx.work_dir)
        return out

    @contextmanager
    def _last_residual(self) -> Iterator[Callable[[str], torch.Tensor | None]]:
        """A lookup of the last round's residual by tensor name (each taken once)."""
        if self._residual_file is None:
            yield lambda k: self.residual.pop(k, None)
            return
        from safetensors import safe_open

        try:
            f = safe_open(str(self._residual_file), framework="pt")
        except Exception as e:  # noqa: BLE001  (a damaged file loses one round's residual, nothing more)
            log.warning("error-feedback residual %s unreadable (%s); going on without it", self._residual_file, e)
            yield lambda k: None
            return
        with f:
            names = set(f.keys())
            yield lambda k: f.get_tensor(k) if k in names else None

    def _keep(self, residual: dict[str, torch.Tensor], work_dir: Path | None) -> None:
        if work_dir is None:
            self.residual, self._residual_file = residual, None
            return
        from safetensors.torch import save_file

        path = work_dir / "error-feedback.safetensors"
        try:
            work_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            save_file(residual, str(tmp))
            os.replace(tmp, path)
        except OSError as e:  # a full disk loses this round's residual; last round's is never used twice
            log.warning("error-feedback residual not kept (%s); the next update goes without it", e)
            self.residual, self._residual_file = {}, None
            return
        self.residual, self._residual_file = {}, path


class Signing(Filter):
    """Signs update blobs and statistics with the device's Ed25519 key (:mod:`protocol.signing`)."""

    def __init__(self, signer: "Signer"):
        self.signer = signer

    def properties(self, kind: str, round: int, upload_id: str, payload: bytes) -> dict[str, str]:
        if kind == "stats":
            return self.signer.stats_properties(round, upload_id, payload)
        return self.signer.properties(kind, round, upload_id, sha256_hex(payload))


class ClaimSamples(Filter):
    """Fault injection: claim ``claim(n)`` samples (hello and stats) for ``n`` real ones."""

    def __init__(self, claim: Callable[[int], int]):
        self.claim = claim

    def on_hello(self, hello: Hello) -> Hello:
        return hello.model_copy(update={"num_samples": self.claim(hello.num_samples)})

    def on_stats(self, stats: Stats) -> Stats:
        return stats.model_copy(update={"num_samples": self.claim(stats.num_samples)})


class TransformUpdate(Filter):
    """Fault injection: upload ``fn(update, ctx)`` instead of the trained update."""

    def __init__(self, fn: Callable[[dict[str, torch.Tensor], UpdateContext], dict[str, torch.Tensor]]):
        self.fn = fn

    def on_update(self, update: dict[str, torch.Tensor], ctx: UpdateContext) -> dict[str, torch.Tensor]:
        return self.fn(update, ctx)
