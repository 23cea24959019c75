"""Dispatch: each selected device's assignment and its slice of the global adapter state
(plus the plan's extra tensors), sent once and again where unacknowledged or after a
restart, and the notices (``Command``) that tell a device it is excluded or its round
failed."""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from typing import Any, Callable, Collection

import torch

from moe_model.ranks import at_rank
from protocol.codec import EXTRA_DTYPES, CodecError, check_expected, encode_tensors
from protocol.logsafe import LogLimiter
from protocol.messages import (
    MIN_MINOR_FOR_COMPRESSION, MIN_MINOR_FOR_SHARD_URL, MIN_MINOR_FOR_STATE_PRECISION, MIN_MINOR_FOR_UPLINK,
    Assignment, Command, ProgramRef, TensorSpec, TrainConfig, encode,
)

from ..strategy import Experts
from .eligibility import Excluded
from .state import EngineState, OpenRound

log = logging.getLogger(__name__)

_DTYPE_NAMES = {t: name for name, t in EXTRA_DTYPES.items()}
"""Torch dtype of an extra tensor -> its ``TensorSpec.dtype``."""


class StateBlobs:
    """:func:`protocol.codec.encode_tensors` with the most recent results kept by content
    (at most :attr:`SIZE` of them and :attr:`MAX_BYTES` in all, the newest always): every
    device holding the same experts is sent the same state, and encoding it (5 ms of 53 per
    update in the fleet profile, ``results/fleet/profile.md``) once is enough. The key is
    the sha256 of the tensors' bytes, names, dtypes and shapes and the encoding arguments
    (about 1 ms per MiB), so a changed tensor is never served stale.

    Within one ``scope`` (the dispatcher's: the round and the model version, during which
    ``Strategy.state_for`` must not change), the same tensor objects at the same
    ``_version`` (torch's counter of in-place changes) are the same state without hashing
    them again: the tensors are referenced by the entry, so their ids cannot be reused."""

    SIZE = 8
    MAX_BYTES = 64 * 2**20

    def __init__(self) -> None:
        self._kept: dict[tuple, bytes] = {}
        self._seen: dict[tuple, tuple[bytes, list[torch.Tensor]]] = {}
        """Identity key -> (blob, the tensors it was made of), the newest :attr:`SIZE`."""

    def encode(self, tensors: dict[str, torch.Tensor], fmt: str, exact: Collection[str] = (),
               compress: bool = False, scope: tuple | None = None) -> bytes:
        """The safetensors bytes of ``tensors`` (as ``encode_tensors``). ``scope``: a hashable
        within which the same tensor objects at the same version are the same state (the
        dispatcher's ``(round, model version)``); None: always known by content. Raises
        CodecError."""
        args = (fmt, tuple(sorted(exact)), bool(compress))
        seen = None
        if scope is not None:
            seen = (scope, args, tuple((name, id(t), t._version) for name, t in sorted(tensors.items())))
            hit = self._seen.pop(seen, None)
            if hit is not None:
                self._seen[seen] = hit  # most recently used last
                return hit[0]
        h = hashlib.sha256()
        for name in sorted(tensors):
            t = tensors[name].detach().cpu().contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
            h.update(t.view(-1).view(torch.uint8).numpy() if t.numel() else b"")
        key = (h.hexdigest(), *args)
        blob = self._kept.pop(key, None)
        if blob is None:
            blob = encode_tensors(tensors, fmt, exact=exact, compress=compress)
        self._kept[key] = blob  # most recently used last
        self._bound(self._kept, len)
        if seen is not None:
            self._seen[seen] = (blob, list(tensors.values()))
            self._bound(self._seen, lambda entry: len(entry[0]))
        return blob

    def _bound(self, kept: dict, size: Callable[[Any], int]) -> None:
        """Drop the oldest entries of ``kept`` beyond :attr:`SIZE` or :attr:`MAX_BYTES` (by
        ``size``), keeping the newest always."""
        while len(kept) > 1 and (len(kept) > self.SIZE or sum(map(size, kept.values())) > self.MAX_BYTES):
            del kept[next(iter(kept))]


class Dispatch(EngineState):
    """The round engine's sending side (a part of :class:`cloud.rounds.RoundEngine`; it
    uses :meth:`format_for` of eligibility and :meth:`_train_for` of the plan checks)."""

    excluded: dict[str, str]
    _told: dict[str, tuple[int, str]]
    _notice_log: LogLimiter
    ensure_shards: Callable[[str, bool], None] | None

    def _tell_excluded(self, number: int, excluded: Excluded) -> None:
        """Send each excluded device a ``Command(excluded)`` once for round ``number``, and
        log once per device and change of reason (nobody is left out in silence)."""
        self.excluded = {d: why for d, (why, _) in excluded.items()}
        for d, (why, figures) in sorted(excluded.items()):
            told = self._told.get(d)
            if told is not None and told[0] == number and told[1] == why:
                continue
            if told is None or told[1] != why:
                log.warning("round %d: %s cannot be used: %s", number, d, why)
            self._told[d] = (number, why)
            self._notify(d, Command(command="excluded", round=number, reason=why[:2000], **figures))
        for d in [d for d in self._told if d not in excluded]:
            del self._told[d]  # usable again: a later exclusion is a change worth logging

    def _notify(self, device_id: str, cmd: Command) -> None:
        """Send ``cmd`` to ``device_id`` best effort: a failed publish is logged, never raised
        (a notice must not stop the round engine)."""
        try:
            self.wire.publish(self.topics.down(device_id, "command"), encode(cmd))
        except Exception as e:
            self._notice_log.log(f"{cmd.command} notice failed", logging.WARNING, "could not send %s to %s: %s",
                                 cmd.command, device_id, str(e)[:200])

    def _send_assignment(self, rnd: OpenRound, device_id: str, experts: Experts) -> None:
        dev = self.registry.get(device_id)
        fmt = self.format_for(dev)
        url = self.settings.shard_url if dev.protocol_minor >= MIN_MINOR_FOR_SHARD_URL else None
        if self.ensure_shards is not None:
            self.ensure_shards(fmt, url is not None)
        tensors = rnd.tensors.get(device_id, {})
        try:
            sent = self._sent_state(device_id, experts)
            if device_id in rnd.ranks:  # a lower LoRA rank: the first columns (rows of A) of each factor
                sent = at_rank(sent, rnd.ranks[device_id])
        except Exception as e:  # a strategy bug: this device sits the round out, the round goes on
            log.exception("round %d: no state to send %s", rnd.number, device_id)
            rnd.rejected[device_id] = f"the strategy gave no valid state to send: {type(e).__name__}: {e}"[:500]
            rnd.unsent.add(device_id)
            return
        train = self._train_for(rnd, device_id)
        program = None
        if dev.runtimes and self.programs is not None:
            try:
                program = self._program_for(dev, experts, train)
            except Exception as e:  # a model the export cannot take, ExecuTorch missing: this device sits out
                log.exception("round %d: no training program for %s", rnd.number, device_id)
                rnd.rejected[device_id] = f"no training program for its shape: {type(e).__name__}: {e}"[:500]
                rnd.unsent.add(device_id)
                return
        precision = self.settings.state_precision if dev.protocol_minor >= MIN_MINOR_FOR_STATE_PRECISION else "fp32"
        state = self._state_blobs.encode({**sent, **tensors}, precision, exact=tensors,
                                         compress=self.settings.state_compression
                                         and dev.protocol_minor >= MIN_MINOR_FOR_COMPRESSION,
                                         scope=(rnd.number, self.model.version))
        ref = self.wire.publish_blob(self.topics.down(device_id, "state"), state, "state", rnd.number,
                                     uuid.uuid4().hex[:16])
        msg = Assignment(
            round=rnd.number, model_version=self.model.version, model=self.model.spec, task=dev.task,
            labels=self.model.tasks[dev.task], experts=experts,
            shards=self.model.manifests(experts, self.topics, self.wire.chunk_payload_bytes, fmt, url),
            weight_format=fmt, state=ref, attempt=rnd.attempts.get(device_id, 0),
            train=train, deadline=rnd.deadline,
            objectives=rnd.objectives.get(device_id, []),
            tensors={k: TensorSpec(shape=list(t.shape), dtype=_DTYPE_NAMES[t.dtype]) for k, t in tensors.items()},
            compressed_updates=True,
            uplink=self.coordinator.uplink(device_id) if self.coordinator is not None
            and dev.protocol_minor >= MIN_MINOR_FOR_UPLINK else None,
            program=program, lora_rank=rnd.ranks.get(device_id),
        )
        self.wire.publish(self.topics.down(device_id, "assignment"), encode(msg))
        rnd.sent[device_id] = time.time()

    def _program_for(self, dev, experts: Experts, train: TrainConfig) -> ProgramRef:
        """The training program of ``dev`` (a device of ``Hello.runtimes``) holding ``experts``
        and training with ``train``: :meth:`cloud.programs.ProgramPublisher.ref_for` at its batch
        size and the model's sequence length (exported the first time; raises as it does)."""
        return self.programs.ref_for(dev.task, experts, train.batch_size, self.model.spec.max_seq_len, dev.runtimes)

    def _sent_state(self, device_id: str, experts: Experts) -> dict[str, torch.Tensor]:
        """The adapter state the strategy sends ``device_id`` holding ``experts``
        (:meth:`Strategy.state_for`), checked against the model's layout for it.

        Raises:
            ValueError: the strategy's state has other names or shapes.
        """
        task = self.registry.get(device_id).task
        state = self.strategy.state_for(device_id, task, experts, self.model)
        try:
            check_expected(state, self.model.expected_for(experts, task))
        except CodecError as e:
            raise ValueError(f"strategy {self.strategy.name!r} sends {device_id} a state that is not the model's "
                             f"layout for its experts: {e}") from None
        return state

    MAX_RESENDS = 3

    def resend_unacked(self, now: float | None = None) -> int:
        """Send the open round's assignment again (same round and attempt, a new state
        transfer) to each selected device that has not acknowledged it nor finished
        ``assignment_resend_s`` after it was last sent, at most :attr:`MAX_RESENDS` times a
        round. On a cluster devices take their downlink at QoS 0 (``EdgeClient.downlink_qos``),
        so an assignment or its state can be lost while a device moves between nodes; a
        device acknowledges only once it has the state (PROTOCOL.md §4.2). ``now``: Unix
        seconds (default: the clock). Returns how many were sent."""
        every, rnd = self.settings.assignment_resend_s, self.current
        if not every or rnd is None:
            return 0
        now = time.time() if now is None else now
        due = [d for d in rnd.selected if d not in rnd.acks and not rnd.finished(d)
               and rnd.resends.get(d, 0) < self.MAX_RESENDS and now - rnd.sent.get(d, now) >= every
               and self.registry.get(d) is not None]
        for d in due:
            rnd.resends[d] = rnd.resends.get(d, 0) + 1
            self._send_assignment(rnd, d, rnd.selected[d])
        if due:
            log.info("round %d: re-sent %d unacknowledged assignments", rnd.number, len(due))
        return len(due)

    def resend_assignments(self) -> int:
        """Send the open round's assignment again to every selected device that has not
        reported (after a restart; devices ignore an assignment they already have).

        Returns:
            How many assignments were sent.
        """
        rnd = self.current
        if rnd is None:
            return 0
        n = 0
        for d, experts in rnd.selected.items():
            if not rnd.finished(d) and self.registry.get(d) is not None:
                self._send_assignment(rnd, d, experts)
                n += 1
        return n
