"""Streaming rounds: one process folding each reported update into running sums as it
arrives, so the aggregator's memory does not grow with the round.

A round streams when the method aggregates by running sums (:func:`cloud.workers.sums_mode`:
a weighted mean such as FedAvg, no robust rule, no DP, no damping of experts with few
holders). Each reported update (update and statistics both accepted) is screened and folded
into :attr:`cloud.rounds.state.Stream.sums`, and its tensors are dropped. With screening on,
the round's first :data:`STREAM_WARMUP` reporters are held and screened together, as a
whole round is (their median change norms become the round's references and their median
claim its sample cap); every later one is screened alone against those references
(:meth:`cloud.robust.defences.Defences.screen_update`, the cap from the selected devices'
declared samples: an aggregator worker's screening). A round with at most
:data:`STREAM_WARMUP` reporters therefore closes exactly as a held round does.

What is stored, and when (``inflight/{n}/...``; :meth:`Streaming.end_batch`, called by the
service at the end of each batch of messages, inside the batch's transaction, before the
broker is acknowledged): each accepted update either as its payload (``update/{device}``)
or, once folded, as its marker (``folded/{device}``) together with the round's sums that
include it (``sums``, and the reference norms of its warm-up, ``references``). A batch
*settles* (writes the sums and the markers of everything folded since the last time, and
deletes those payloads) when the payloads it would otherwise write are at least the sums'
size (float64: twice an update), or :data:`SETTLE_AFTER` folded updates wait; else it
writes the payloads. Under load a batch holds many updates and settles: one sums write
instead of every payload; a trickle of updates costs what a held round costs. Killed at
any instant, the aggregator has each accepted update as a payload or in the stored sums,
never both or neither; a restart (:meth:`Streaming.restore_stream`) reads the sums and
markers and folds the stored payloads again.
"""

from __future__ import annotations

import logging
from typing import Any

from ..aggregation.base import RoundSums
from ..strategy import ClientResult
from ..workers import screened_marker, sums_mode
from .state import EngineState, OpenRound, Stream

log = logging.getLogger(__name__)

SETTLE_AFTER = 64
"""Folded updates whose payloads a streaming round keeps in the store before it writes its
sums anyway (:meth:`Streaming.end_batch`)."""
STREAM_WARMUP = 32
"""A streaming round's first reporters screened together (module docstring; at least
screening's ``min_reference``): their median change norms are the round's references for
the rest. Held whole meanwhile (32 MiB at 1 MiB updates)."""


class Streaming(EngineState):
    """The round engine's streaming rounds (a part of :class:`cloud.rounds.RoundEngine`;
    module docstring)."""

    def streams(self) -> bool:
        """Whether a round opened now in one process streams (:func:`cloud.workers.sums_mode`)."""
        return sums_mode(self)

    def open_stream(self, rnd: OpenRound) -> None:
        """Make ``rnd`` a streaming round: empty sums, and a warm-up where screening is on."""
        rnd.stream = Stream(warmup=[] if self.defences.screen is not None else None)

    def fold_reported(self, rnd: OpenRound, device_id: str) -> None:
        """Fold ``device_id``'s reported update into the round's sums unless screening
        rejects it, record its marker and drop its tensors (module docstring: the warm-up
        holds the first reporters instead)."""
        stream = rnd.stream
        if stream.warmup is not None:
            stream.warmup.append(device_id)
            if len(stream.warmup) >= max(STREAM_WARMUP, self.defences.screen.config.min_reference):
                self.end_warmup(rnd)
            return
        screened = self.defences.screen_update(rnd.number, self.model.state, self._result(rnd, device_id),
                                               rnd.sample_cap)
        self._fold_screened(rnd, [device_id], screened)

    def end_warmup(self, rnd: OpenRound) -> None:
        """Screen the round's held first reporters together and fold them in; a no-op once done."""
        held, rnd.stream.warmup = rnd.stream.warmup or [], None
        if held:
            screened = self.defences.screen_round(rnd.number, self.model.state, [self._result(rnd, d) for d in held])
            rnd.stream.references = dict(self.defences.screen.references)  # what screen_round set
            self._fold_screened(rnd, held, screened)

    def _result(self, rnd: OpenRound, device_id: str) -> ClientResult:
        st = rnd.stats[device_id]
        return ClientResult(device_id, self.registry.get(device_id).task, st.num_samples, rnd.selected[device_id],
                            rnd.updates[device_id][1], st, rnd.ranks.get(device_id))

    def _fold_screened(self, rnd: OpenRound, devices: list[str], screened: Any) -> None:
        stream = rnd.stream
        for d in devices:
            stream.markers[d], result = screened_marker(screened, d, rnd.updates[d][0])
            stream.fresh.append(d)
            if result is not None:
                self.strategy.fold(stream.sums, result)
            data = stream.unsaved.pop(d, None)
            if data is not None:  # folded within its batch: stored only if the batch does not settle
                stream.loose[d] = data
            rnd.updates[d] = (rnd.updates[d][0], {})

    def end_batch(self) -> None:
        """Store what the open streaming round accepted since the last call (module
        docstring), in one transaction; a no-op for other rounds. Raises StoreError."""
        rnd = self.current
        stream = rnd.stream if rnd is not None else None
        if stream is None:
            return
        prefix = f"inflight/{rnd.number}/"
        new = stream.fresh
        if not stream.unsaved and not new:
            return
        sums_bytes = sum(t.numel() * t.element_size() for t in stream.sums.weighted.values())
        avoided = sum(len(stream.loose[d]) for d in new if d in stream.loose)
        settle = bool(new) and (avoided >= sums_bytes or len(new) >= SETTLE_AFTER)
        with self.store.transaction():
            for d, data in {**stream.unsaved, **({} if settle else stream.loose)}.items():
                self.store.put_blob(f"{prefix}update/{d}", data)
                stream.stored.add(d)
            if settle:
                self.store.put_blob(f"{prefix}sums", stream.sums.to_bytes())
                self.store.put_json(f"{prefix}references", stream.references)
                for d in new:
                    self.store.put_json(f"{prefix}folded/{d}", stream.markers[d])
                    if d in stream.stored:
                        self.store.delete(f"{prefix}update/{d}")
        stream.unsaved.clear()
        stream.loose.clear()
        if settle:
            stream.saved.update(new)
            stream.stored.difference_update(new)
            stream.fresh = []

    def restore_stream(self, rnd: OpenRound) -> None:
        """After a restart: the streaming round's stored sums and markers; the updates stored
        whole (``rnd.updates``, decoded by recovery) are folded again where reported.

        Raises:
            RuntimeError, ValueError: the stored sums are unreadable or disagree with the
                markers (a damaged store: the round must fail, not be applied).
        """
        prefix = f"inflight/{rnd.number}/"
        self.open_stream(rnd)
        stream = rnd.stream
        blob = self.store.get_blob(f"{prefix}sums")
        if blob is not None:
            stream.sums = RoundSums.from_bytes(blob)
        stream.markers = {k[len(prefix) + len("folded/"):]: m for k, m in self.store.json_items(f"{prefix}folded/").items()}
        stream.saved = set(stream.markers)
        if stream.markers:
            stream.warmup = None  # written when the warm-up ended, with the references it set
            stream.references = self.store.get_json(f"{prefix}references", {})
            if self.defences.screen is not None:
                self.defences.screen.references.update(stream.references)
        folded = sum(m.get("status") == "folded" for m in stream.markers.values())
        if stream.sums.devices != folded:  # written in one transaction: only a damaged store disagrees
            raise RuntimeError(f"round {rnd.number}: the stored sums hold {stream.sums.devices} updates but "
                               f"{folded} are marked folded")
        for d, m in stream.markers.items():
            rnd.updates[d] = (m["sha"], {})
        stream.stored = {d for d in rnd.updates if d not in stream.markers}
        for d in sorted(stream.stored):
            if rnd.reported(d):
                self.fold_reported(rnd, d)
        log.info("round %d: resumed streaming with %d update%s folded (%d stored whole)", rnd.number,
                 stream.sums.devices, "" if stream.sums.devices == 1 else "s", len(stream.stored))
