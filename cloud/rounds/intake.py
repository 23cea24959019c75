"""Intake: what devices send for the open round. Acks (a refusal whose memory plan
exceeds the budget is answered with a smaller assignment), updates (decoded against the
device's assignment, through the incoming filters) and statistics (their claims bounded),
each accepted once and stored in flight; anything else is refused with a reply. With
aggregator workers (``role: coordinator``) the updates they took come in by :meth:`Intake.sync`."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from moe_model.ranks import at_rank, expected_at_rank, pad_rank
from moe_model.train import num_steps
from protocol.chunking import Blob
from protocol.codec import CodecError, decode_tensors, sha256_hex
from protocol.messages import Ack, Stats, TrainConfig

from ..filters import InboundFilter
from ..strategy import Experts, Plan
from .state import EngineState, OpenRound

log = logging.getLogger(__name__)


class Intake(EngineState):
    """The round engine's receiving side (a part of :class:`cloud.rounds.RoundEngine`; it
    uses :meth:`_view` of eligibility, :meth:`_invalid_entries` and :meth:`_train_for` of
    the plan checks, :meth:`_send_assignment` and :meth:`_sent_state` of dispatch, and
    :meth:`fold_reported` of streaming)."""

    filters: list[InboundFilter]

    def check_current(self, device_id: str, round_: int, what: str,
                      upload_id: str | None = None) -> OpenRound | None:
        """The open round if ``what`` (a message kind) of ``device_id`` for ``round_`` belongs
        to it; else None, and the device is told why (stale or early round, not selected)."""
        rnd = self.current
        if rnd is None or round_ != rnd.number:
            cur = rnd.number if rnd else self.completed
            self.reject(device_id, round_,
                        f"{what} for round {round_} rejected: current round is {cur} (stale or early)",
                        kind=what, upload_id=upload_id)
            return None
        if device_id not in rnd.selected:
            self.reject(device_id, round_, f"{what} rejected: {device_id} was not selected in round {round_}",
                        kind=what, upload_id=upload_id)
            return None
        return rnd

    def on_ack(self, device_id: str, ack: Ack) -> None:
        """A device accepted or refused its assignment (``ack.attempt`` must be the current
        one; repeats are ignored). A refusal that reports a budget and the memory needed
        asks the strategy for a smaller assignment (:meth:`_reassign`). A refusal after an
        acceptance is a device that failed during the round (its training raised): it
        counts as finished, so the round need not wait for its deadline. Never raises for
        bad input: a stale round or an unselected device gets a reject reply."""
        rnd = self.check_current(device_id, ack.round, "ack")
        if rnd is None or ack.attempt != rnd.attempts.get(device_id, 0):
            return
        prev = rnd.acks.get(device_id)
        if prev is not None and not (prev.accepted and not ack.accepted and device_id not in rnd.updates):
            return
        rnd.acks[device_id] = ack
        self.store.put_json(f"inflight/{rnd.number}/ack/{device_id}", ack.model_dump(mode="json"))
        if not ack.accepted:
            log.warning("round %d: %s refused its assignment: %s", rnd.number, device_id, ack.reason)
            if ack.needed_bytes is not None and ack.budget_bytes is not None and device_id not in rnd.updates:
                self._reassign(rnd, device_id, ack)

    MAX_ATTEMPTS = 3

    def _reassign(self, rnd: OpenRound, device_id: str, ack: Ack) -> None:
        """Shrink a device's assignment to what its (updated) budget holds and send it
        again as the next attempt (module docstring, step 4)."""
        self.registry.update_memory(device_id, ack.budget_bytes, ack.runtime_bytes)
        dev = self.registry.get(device_id)
        attempt = rnd.attempts.get(device_id, 0) + 1
        before = rnd.selected[device_id]
        view = self._view(dev)
        need = view.memory
        try:
            experts = self.strategy.on_refusal(rnd.number, view, {k: list(v) for k, v in before.items()}, ack)
        except Exception:  # a strategy bug: the device sits this round out, the round goes on
            log.exception("round %d: the strategy failed to answer %s's refusal", rnd.number, device_id)
            experts = None
        if experts is not None:
            experts = {k: sorted(v) for k, v in experts.items()}
            if self._invalid_entries(Plan({device_id: experts}), [view]):
                experts = None
        fits = experts is not None and need(experts) <= dev.budget_bytes
        experts = Experts(experts) if fits else before
        info = {"attempt": attempt, "reason": ack.reason, "budget_bytes": dev.budget_bytes,
                "needed_bytes": ack.needed_bytes, "from": before.to_json(), "to": experts.to_json() if fits else None}
        rnd.reassigned[device_id] = info
        if not fits or attempt > self.MAX_ATTEMPTS or experts == before:
            log.warning("round %d: %s cannot be reassigned within %.0f MiB; it sits this round out", rnd.number,
                        device_id, dev.budget_bytes / 2**20)
            info["to"] = None
            return
        rnd.acks.pop(device_id, None)
        self.store.delete(f"inflight/{rnd.number}/ack/{device_id}")
        rnd.attempts[device_id] = attempt
        rnd.selected[device_id] = experts
        cur = self.store.get_json("current_round")
        if cur is not None and cur.get("number") == rnd.number:
            cur["selected"][device_id] = experts.to_json()
            cur.setdefault("attempts", {})[device_id] = attempt
            self.store.put_json("current_round", cur)
        log.info("round %d: %s reassigned within its budget (%s -> %s experts per layer, attempt %d)", rnd.number,
                 device_id, [len(v) for v in before.values()], [len(v) for v in experts.values()], attempt)
        self._send_assignment(rnd, device_id, experts)

    def on_update(self, device_id: str, blob: Blob) -> None:
        """A reassembled update blob (safetensors bytes, checksum verified by the transport
        layer): decoded against exactly the names, shapes and dtypes of ``device_id``'s
        assignment (finite values, at most ``max_update_bytes``), stored in flight (in a
        streaming round at the end of its batch, and only if not folded by then:
        :mod:`cloud.rounds.streaming`), and accepted once; a second, different update for
        the round is refused with a reply, an exact repeat ignored. Never raises for bad
        input."""
        refers = {"kind": "update", "upload_id": blob.header.id}
        rnd = self.check_current(device_id, blob.header.round, "update", blob.header.id)
        if rnd is None:
            return
        if device_id in rnd.updates:
            if rnd.updates[device_id][0] != blob.header.sha:
                self.reject(device_id, rnd.number, "a second, different update for this round was ignored", **refers)
            return
        try:
            tensors = self.decode_update(device_id, rnd.selected[device_id], blob.data, rnd.ranks.get(device_id))
        except Exception as e:  # CodecError, or the strategy's sent state failing its layout check
            rnd.rejected[device_id] = str(e)
            self.reject(device_id, rnd.number, f"update rejected: {e}", **refers)
            return
        rnd.updates[device_id] = (blob.header.sha, tensors)
        if rnd.stream is not None:  # stored at the batch's end unless folded by then
            rnd.stream.unsaved[device_id] = blob.data
        else:
            self.store.put_blob(f"inflight/{rnd.number}/update/{device_id}", blob.data)
        self._maybe_report(rnd, device_id)

    def decode_update(self, device_id: str, experts: Experts, data: bytes, rank: int | None = None
                      ) -> dict[str, torch.Tensor]:
        """An update payload as fp32 tensors of exactly the layout ``device_id`` holding
        ``experts`` must send, through the incoming filters (precision, delta). A device of
        LoRA rank ``rank`` (below the model's; ``OpenRound.ranks``) sends each ``B`` with
        ``rank`` columns; it comes back padded to the model's rank with the columns it was
        sent (``moe_model.ranks.pad_rank``).

        Raises:
            CodecError: malformed, oversized, non-finite or not that layout.
        """
        task = self.registry.get(device_id).task
        meta: dict[str, str] = {}
        expected = self.model.expected_for(experts, task)
        tensors = decode_tensors(data, self.settings.max_update_bytes,
                                 expected if rank is None else expected_at_rank(expected, rank),
                                 as_float=torch.float32, metadata_out=meta)
        full = functools.cache(lambda: self._sent_state(device_id, experts))  # built once, if needed at all
        sent = full if rank is None else (lambda: at_rank(full(), rank))
        for f in self.filters:
            tensors = f.on_update(device_id, tensors, meta, sent)
        return tensors if rank is None else pad_rank(tensors, full(), rank)

    def on_stats(self, device_id: str, stats: Stats) -> None:
        """A device's round statistics (schema-valid): bounded by :meth:`_stats_problem`
        (claimed samples, token and usage counts) and the strategy's
        :meth:`Strategy.stats_problem`, stored in flight and accepted once; refused with a
        reply otherwise. Never raises for bad input."""
        rnd = self.check_current(device_id, stats.round, "stats", stats.update.transfer_id if stats.update else None)
        if rnd is None:
            return
        if device_id in rnd.stats:
            return
        dev = self.registry.get(device_id)
        problem = self.stats_problem(rnd, device_id, stats)
        if problem:
            rnd.rejected[device_id] = problem
            self.reject(device_id, rnd.number, f"stats rejected: {problem}", kind="stats",
                        upload_id=stats.update.transfer_id if stats.update else None)
            return
        rnd.stats[device_id] = stats
        if stats.baseline_rss_bytes and stats.baseline_rss_bytes != dev.runtime_bytes:
            self.registry.update_memory(device_id, None, stats.baseline_rss_bytes)  # later plans use it
        self.store.put_json(f"inflight/{rnd.number}/stats/{device_id}", stats.model_dump(mode="json"))
        self._maybe_report(rnd, device_id)

    def stats_problem(self, rnd: OpenRound, device_id: str, stats: Stats) -> str | None:
        """Why ``device_id``'s statistics for ``rnd`` cannot be accepted (:meth:`_stats_problem`
        against its hello and assignment, then the strategy's
        :meth:`Strategy.stats_problem`), or None."""
        dev = self.registry.get(device_id)
        if dev is None:
            return f"unknown device {device_id!r}"
        return self._stats_problem(stats, rnd.selected[device_id], dev.task, dev.num_samples,
                                   self._train_for(rnd, device_id)) or self.strategy.stats_problem(device_id, stats)

    def _stats_problem(self, stats: Stats, experts: Experts, task: str, declared: int | None = None,
                       train: TrainConfig | None = None) -> str | None:
        """Why ``stats`` cannot be accepted, or None.

        A signing device may still lie, so what it claims is bounded: ``num_samples`` (its
        aggregation weight) by ``declared`` (the device's hello) and by
        ``max_samples_per_device``; each layer's ``tokens`` by what that many samples can
        produce in the round's training (``train``: steps x batch size x ``max_seq_len``),
        its usage counts by ``tokens x top_k`` and its per-expert sample counts by the
        samples trained on.
        """
        n, cap = stats.num_samples, self.settings.max_samples_per_device
        if declared is not None and n > declared:
            return f"num_samples {n} exceeds the {declared} samples its hello declared"
        if n > cap:
            return f"num_samples {n} exceeds the aggregator's max_samples_per_device {cap}"
        if stats.task != task:
            return f"task {stats.task!r} differs from the registered {task!r}"
        E = self.model.spec.num_experts
        if sorted(ls.layer for ls in stats.layers) != sorted(self.model.layers):
            return f"layers {[ls.layer for ls in stats.layers]} differ from the model's {self.model.layers}"
        for ls in stats.layers:
            if len(ls.usage) != E:
                return f"layer {ls.layer}: {len(ls.usage)} experts reported, model has {E}"
            held = set(experts[ls.layer])
            if any(u > 0 and e not in held for e, u in enumerate(ls.usage)):
                return f"layer {ls.layer}: usage reported for experts it does not hold"
        train = train or self.settings.train
        seen = num_steps(train, n) * train.batch_size  # samples local training can visit
        max_tokens, top_k = seen * self.model.spec.max_seq_len, self.model.spec.top_k
        for ls in stats.layers:
            if ls.tokens > max_tokens:
                return (f"layer {ls.layer}: {ls.tokens} tokens exceed the {max_tokens} that {n} samples can give "
                        f"({seen} sample visits x max_seq_len {self.model.spec.max_seq_len})")
            if sum(ls.usage) > ls.tokens * top_k:
                return f"layer {ls.layer}: usage {sum(ls.usage)} exceeds tokens x top_k = {ls.tokens} x {top_k}"
            if sum(ls.expert_samples) > seen:
                return f"layer {ls.layer}: expert_samples {sum(ls.expert_samples)} exceed the {seen} sample visits"
        return None

    def _maybe_report(self, rnd: OpenRound, device_id: str) -> None:
        if rnd.reported(device_id):
            if rnd.stream is not None:
                self.fold_reported(rnd, device_id)
            st = rnd.stats[device_id]
            reported = rnd.note_reported(device_id)
            log.info("round %d: update from %s accepted (%d/%d)", rnd.number, device_id, reported, len(rnd.selected))
            self.progress("report", rnd.number, {"device": device_id, "val_accuracy": st.val_accuracy,
                                                 "reported": reported, "selected": len(rnd.selected)})
        elif device_id in rnd.stats and device_id in rnd.updates:
            st = rnd.stats[device_id]
            self.reject(device_id, rnd.number, "stats reference an update other than the one received", kind="stats",
                        upload_id=st.update.transfer_id if st.update else None)

    def sync(self, markers: dict[str, dict[str, Any]] | None = None) -> int:
        """Coordinator: take in the updates the aggregator workers took in the open round since
        the last call (their markers, :mod:`cloud.workers`; ``markers`` if already read), and
        why they refused others. An update stored for the coordinator (a method that does not
        decompose into sums) is decoded now; a folded one is not held. Returns how many were new.
        Raises StoreError."""
        rnd = self.current
        if rnd is None or self.coordinator is None:
            return 0
        markers = self.coordinator.markers(rnd.number, rnd.updates) if markers is None else markers
        new = 0
        for d, m in markers.items():
            if d in rnd.updates or d not in rnd.selected:
                continue
            tensors: dict[str, torch.Tensor] = {}
            if m.get("status") == "stored":
                try:
                    data = self.store.get_blob(f"inflight/{rnd.number}/update/{d}") or b""
                    if sha256_hex(data) != m["sha"]:  # replaced by a later, different upload
                        raise CodecError("the stored update is not the one the worker took")
                    tensors = self.decode_update(d, rnd.selected[d], data, rnd.ranks.get(d))
                except Exception as e:  # a worker accepted it; it must not stop the coordinator now
                    rnd.rejected[d] = f"stored update does not decode: {type(e).__name__}: {e}"[:500]
                    continue
            rnd.stats[d] = Stats.model_validate(m["stats"])
            rnd.updates[d] = (m["sha"], tensors)
            rnd.takers[d] = m.get("worker", "?")
            new += 1
        for d, why in self.coordinator.refusals(rnd.number).items():
            if d in rnd.selected and d not in rnd.updates:
                rnd.rejected[d] = why
        return new
