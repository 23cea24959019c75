"""Aggregator workers and the coordinator: how they share one round through the store.

``fedmoe aggregator --role worker`` processes (any number) take the devices' uploads (update
chunks and statistics) off the broker, and ``fedmoe aggregator --role coordinator`` (one
leader, by the store's leader lock; standbys wait) runs everything else: registration,
rounds, assignment, the close. The coordinator hands each device an uplink partition with
its assignment (``Assignment.uplink``, protocol minor 9: a live worker's id, chosen by
rendezvous hashing, :meth:`Coordinator.uplink`), and the device publishes that round's
update and stats to ``dev/{id}/up/{update|stats}/{worker}``, which only that worker
subscribes to. This needs nothing of the broker beyond MQTT 3.1.1 (a NATS cluster has no
shared subscriptions) and keeps one upload's chunks on one worker. On an MQTT 5 broker the
workers also share the plain topics of older devices with a shared subscription
(``$share/fedmoe-workers/...``: the broker hands each message to one worker). They meet in
the store (PostgreSQL; :class:`cloud.store.Store`), under these keys of round ``n``:

- ``chunks/{n}/{device}/{transfer}/{seq}``: an update's chunks that a batch acknowledged
  before its update was taken. On a worker's own partition the worker gets all of an
  upload's chunks and reassembles them in memory; only the chunks of an upload that is
  incomplete (or waiting for its statistics) when a batch ends are stored. With a shared
  subscription one update's chunks are spread over the workers, so each is stored as it
  comes; whoever stores the last one reassembles and decodes it, under the transfer's
  lock, and keeps it decoded;
- ``inflight/{n}/stats/{device}``: the validated statistics; the worker holding the
  decoded update takes it once they are there (:meth:`Ingest.poll`);
- ``inflight/{n}/update/{device}``: the validated update as sent, only for a method that
  does not aggregate by sums (the coordinator decodes it);
- ``inflight/{n}/sums/{worker}``: the worker's running weighted sums
  (:class:`cloud.aggregation.base.RoundSums`) of the updates it folded in;
- ``inflight/{n}/folded/{device}``: the marker that the device's update was taken: folded
  into a worker's sums, rejected by screening, or stored for the coordinator, with its
  statistics and screening norms;
- ``inflight/{n}/rejected/{device}``: why a message of the device was refused;
- ``inflight/{n}/fence``: set by the coordinator when it closes the round;
- ``workers/{worker}``: when the worker last announced itself (the coordinator starts no
  round without a live one, since uploads sent before any worker subscribed would be lost,
  and hands out only live workers' partitions).

Exactly once: a worker commits the updates it took in groups (:meth:`Ingest.flush`, at
the end of each batch of messages, in the batch's transaction: :meth:`Ingest.end_batch`):
holding each device's lock (a transaction-level advisory lock) and the round's lock
shared, it adds those nobody else took to its sums, writes the sums and their markers and
drops their chunks. Every chunk a batch acknowledges is thus in an update taken in that
batch's commit, or stored by it. The coordinator sets the fence holding the round's
lock exclusively, so no commit is half done or starts after it, and then reads the
markers and every worker's sums. A worker acknowledges a message to the broker only once
it is stored; killed at any instant, it leaves its transaction undone; what it had not
acknowledged the broker redelivers to its session when it comes back (a fixed
``--worker-id``); an update whose statistics are stored but that nobody took for two
sweeps is reassembled from its chunks by another worker (:meth:`Ingest.sweep`). A repeat
is recognised by the marker and ignored.

Screening runs on each update as it arrives, against the reference norms of the rounds
before (:meth:`cloud.robust.defences.Defences.screen_update`), with the round's sample cap
from the selected devices' declared samples (set by the coordinator when the round starts,
:meth:`cloud.robust.defences.Defences.round_sample_cap`); the coordinator updates the
references from the norms in the markers. A method whose aggregation does not decompose
into sums (:attr:`cloud.strategies.Strategy.decomposes`: robust rules, DP-FedAvg,
FedAlign-MoE, the fusion methods) or damping of experts with few holders
(``defences.min_holders`` > 1) has its updates stored by the workers and aggregated by the
coordinator as in one process.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Callable

import torch

from protocol.chunking import Blob, ChunkError, Reassembler, parse_chunk
from protocol.codec import sha256_hex
from protocol.messages import Stats

from .aggregation.base import RoundSums
from .robust.screening import Screened, routed_experts
from .strategy import ClientResult

log = logging.getLogger(__name__)

REFRESH_S = 0.5
"""How often (seconds) a worker reads the open round from the store at most."""
MIN_REFRESH_S = 0.1
"""... and at least this long apart when a message names a later round (a flood of made-up
round numbers costs at most 10 reads a second)."""
WORKER_STALE_S = 30.0
"""A worker that has not announced itself (:meth:`Ingest.announce`, every few seconds) for this
long no longer counts as running; a coordinator starts no round without one that does."""
ANNOUNCE_S = 5.0
MAX_TRANSFERS = 4
"""Uploads (transfer ids) of one device a round whose chunks the workers store at once; more
are refused (a device cannot fill the store with chunks of uploads it never finishes)."""
MAX_DECODED = 64
"""Decoded updates a worker keeps while their statistics are on the way."""
FLUSH_S = 0.5
"""A worker commits the updates it took at least this often (one sums write per commit; the
latency it adds to a report, at most)."""
SWEEP_S = 5.0
"""How often (seconds) a worker folds what is complete in the store but not folded (a
crashed worker's leftovers)."""


def _key(n: int, what: str, name: str = "") -> str:
    return f"inflight/{n}/{what}/{name}"


def screened_marker(screened: Screened, device_id: str, sha: str) -> tuple[dict[str, Any], ClientResult | None]:
    """What became of ``device_id``'s update (sha256 ``sha``) in ``screened``, as the marker
    of the module docstring (``status`` folded, or rejected with its ``reason``; the screening
    ``norms`` and ``kinds``; what was ``clipped`` or ``capped_samples``), and its result to
    fold (None when rejected). A worker's and a streaming round's markers alike."""
    marker: dict[str, Any] = {"sha": sha, "norms": screened.norms.get(device_id, {}), "kinds": screened.kinds}
    result = next((r for r in screened.results if r.device_id == device_id), None)
    if result is None:
        marker.update(status="rejected", reason=screened.rejected.get(device_id, "rejected by screening"))
    else:
        marker["status"] = "folded"
        for what in ("clipped", "capped_samples"):
            if device_id in screened.report.get(what, {}):
                marker[what] = screened.report[what][device_id]
    return marker, result


def sums_mode(engine: Any) -> bool:
    """Whether the round engine's method and defences aggregate by running sums."""
    return engine.strategy.decomposes and engine.defences.streamable


class Ingest:
    """A worker's side: validate uploads for the open round and take each device's update
    exactly once (module docstring).

    Args:
        engine: a :class:`cloud.rounds.RoundEngine` over the shared store; only its
            validation (:meth:`RoundEngine.check_current`, ``decode_update``,
            ``stats_problem``) and its model, strategy and defences are used; it never
            starts or closes a round.
        worker_id: this worker's name (``--worker-id``), keys its sums.
        reject: ``(device, round, reason, *, kind, upload_id)`` -> reply to the device.
        progress: ``(event, round, detail)`` -> operator progress (a ``report`` per update taken).
        max_update_bytes: largest update, in bytes.
    """

    def __init__(self, engine: Any, worker_id: str, reject: Callable[..., None],
                 progress: Callable[[str, int, dict], None], max_update_bytes: int):
        self.engine, self.store, self.worker_id = engine, engine.store, worker_id
        self.reject, self.progress = reject, progress
        self.max_update_bytes = max_update_bytes
        self._round_json: Any = None
        self._last: int | None = None
        self._refreshed = 0.0
        self._swept = 0.0
        self._decoded: dict[tuple[int, str], tuple[str, dict[str, torch.Tensor], str | None]] = {}
        """(round, device) -> (sha256, tensors, chunks' prefix) decoded here and not yet taken."""
        self._pending: dict[str, tuple[int, ClientResult | None, dict[str, Any], str | None]] = {}
        """device -> (round, screened result to fold or None, marker, its chunks' prefix): taken, not
        yet committed."""
        self._stats: dict[tuple[int, str], tuple[dict[str, Any], Stats]] = {}
        """(round, device) -> the statistics this worker stored (as stored, and validated), not yet taken."""
        self._taken: dict[tuple[int, str], str] = {}
        """(round, device) -> sha256 of the update whose marker this worker committed or found: a repeat
        costs no store query (:meth:`flush` checks the store, under the device's lock, before it takes one)."""
        self._waiting: set[str] = set()
        """Devices whose stats were stored but whose update nobody took, at the last sweep."""
        self._sums: tuple[int, RoundSums] | None = None
        self._notices: list[tuple[str, int, dict[str, Any]]] = []
        """What :meth:`flush` took, told by :meth:`tell` once its transaction committed: (device, round, marker)."""
        self.assembler = Reassembler(max_update_bytes, verify_chunks=False)
        """Reassembles the uploads of this worker's own partition in memory (:meth:`on_chunk`)."""
        self._held: dict[str, dict[str, bytes]] = {}
        """chunks' prefix -> store key -> chunk: own-partition chunks of this batch not in the store,
        written at its end unless their update was taken in it (:meth:`end_batch`)."""
        self._own: dict[str, bool] = {}
        """Own-partition transfers of the open round (chunks' prefix) -> whether some of their
        chunks are in the store (then read into :attr:`assembler` once, and deleted once taken)."""
        self._announced = 0.0
        self.taken = 0
        """Updates this worker folded (or stored) since it started."""

    # ------------------------------------------------------------------ the open round
    def announce(self) -> None:
        """Tell the coordinator this worker takes uploads (``workers/{id}``: when it last
        said so), at most every few seconds; call it once subscribed. Raises StoreError."""
        now = time.monotonic()
        if now - self._announced >= ANNOUNCE_S:
            self.store.put_json(f"workers/{self.worker_id}", {"seen": self.store.clock(), "taken": self.taken})
            self._announced = now

    def refresh(self, force: bool = False) -> None:
        """Read the open round (and after a close, the new global state) from the store, at
        most every :data:`REFRESH_S` seconds unless ``force``. Raises StoreError."""
        now = time.monotonic()
        if now - self._refreshed < (MIN_REFRESH_S if force else REFRESH_S):
            return
        self._refreshed = now
        last = int(self.store.get_json("last_round", 0))
        if last != self._last:
            self._pending.clear()  # a closed round takes nothing more
            self.engine.completed = last
            self.engine.restore(open_round=False)
            self.engine.registry.reload()
            self._last, self._round_json = last, None
            self._decoded.clear()
            self._stats.clear()
            self._taken.clear()
            self._held.clear()
            self._own.clear()
            self.assembler.drop_round(last)
        cur = self.store.get_json("current_round")
        if cur is None or cur.get("number") != last + 1:
            self.engine.current, self._round_json = None, None
        elif cur != self._round_json:
            if self._round_json is None or cur["number"] != self._round_json.get("number"):
                self.engine.registry.reload()  # devices that registered for this round
            self.engine.current = self.engine.round_from_json(cur)
            self._round_json = cur

    def _current(self, device_id: str, round_: int, what: str, upload_id: str | None = None):
        rnd = self.engine.current
        if rnd is None or rnd.number != round_:
            self.refresh(force=round_ > (rnd.number if rnd else self._last or 0))
        return self.engine.check_current(device_id, round_, what, upload_id)

    # ------------------------------------------------------------------ uploads
    def on_chunk(self, device_id: str, payload: bytes, own: bool = False) -> None:
        """One update chunk (signature already verified). On this worker's own uplink
        partition (``own``: every chunk of the upload comes here) it is reassembled in memory
        and kept until the batch it came in ends (:meth:`end_batch`: stored then, unless its
        update was taken in that batch); from the shared subscription (older devices, whose
        chunks are spread over the workers) it is stored at once, and the worker that
        stores a transfer's last chunk reassembles it. A complete update goes to
        :meth:`on_update`.

        Raises:
            ChunkError: a malformed chunk, or one that disagrees with its transfer.
        """
        header, data = parse_chunk(payload, self.max_update_bytes, verify=False)
        rnd = self._current(device_id, header.round, "update", header.id)
        if rnd is None:
            return
        prefix = f"chunks/{header.round}/{device_id}/{header.id}/"
        if own:
            self._own_chunk(device_id, header.round, header.id, header.seq, payload, prefix)
            return
        shape = {"kind": header.kind, "n": header.n, "size": header.size, "sha": header.sha}
        overflow = False
        with self.store.transaction():
            self.store.lock(prefix)
            keys = self.store.blob_keys(f"chunks/{header.round}/{device_id}/")
            seqs = {k.rsplit("/", 1)[1] for k in keys if k.startswith(prefix)}
            head = self.store.get_json(f"{prefix}head")
            if head is None:
                held = {k.rsplit("/", 1)[0] for k in keys}
                if len(held) >= MAX_TRANSFERS:
                    raise ChunkError(f"{len(held)} uploads of this device are already in progress in round "
                                     f"{header.round}; at most {MAX_TRANSFERS}")
                head = {**shape, "bytes": 0}
            elif {k: head[k] for k in shape} != shape:
                raise ChunkError(f"chunk {header.seq} of {header.id} disagrees with earlier chunks of the transfer")
            overflow = str(header.seq) not in seqs and head["bytes"] + len(data) > header.size
            if str(header.seq) not in seqs and not overflow:  # a repeat (a redelivery) stores nothing
                self.store.put_blob(f"{prefix}{header.seq}", payload)
                self.store.put_json(f"{prefix}head", {**head, "bytes": head["bytes"] + len(data)})
                seqs.add(str(header.seq))
            complete = len(seqs) >= header.n
        if overflow:  # the transfer is dropped (outside the block: a raise inside would undo the drop)
            self.store.delete_prefix(prefix)
            raise ChunkError(f"transfer {header.id} sent more bytes than it declared ({header.size})")
        if complete:
            self._assemble(device_id, prefix)

    def _own_chunk(self, device_id: str, round_: int, transfer: str, seq: int, payload: bytes, prefix: str) -> None:
        """:meth:`on_chunk` on the own partition: into :attr:`assembler`, after the transfer's
        chunks an earlier batch stored (read once per transfer: a worker restarted mid-upload
        gets the rest redelivered). Raises ChunkError."""
        stored: list[tuple[str, bytes]] = []
        if prefix not in self._own:  # the transfer's first chunk here
            mine = f"chunks/{round_}/{device_id}/"
            open_uploads = sum(1 for p in self._own if p.startswith(mine))
            if open_uploads >= MAX_TRANSFERS:
                raise ChunkError(f"{open_uploads} uploads of this device are already in progress in round {round_}; "
                                 f"at most {MAX_TRANSFERS}")
            if not self.assembler.progress(device_id, round_, transfer)[0]:
                stored = self.store.blob_items(prefix)
            self._own[prefix] = bool(stored)
        blob = None
        try:
            for _, chunk in stored:
                blob = self.assembler.add(device_id, chunk) or blob
            blob = self.assembler.add(device_id, payload) or blob
        except ChunkError:
            if not self.assembler.progress(device_id, round_, transfer)[0]:  # the assembler dropped the transfer
                self._drop_chunks(prefix)
            raise
        if blob is None and not self.assembler.progress(device_id, round_, transfer)[0]:
            return  # a repeat of a chunk of a transfer already complete here
        self._held.setdefault(prefix, {})[f"{prefix}{seq}"] = payload
        if blob is not None:
            self.on_update(device_id, blob, prefix)  # a refused update's chunks are dropped there
            if (round_, device_id) in self._taken and device_id not in self._pending:
                self._held.pop(prefix, None)  # a repeat of an update taken: nothing to keep

    def end_batch(self) -> None:
        """The end of a batch of messages, inside its transaction, before the broker is
        acknowledged: commit the updates taken (:meth:`flush`, nested in it), then store the
        own-partition chunks held in memory whose update was not taken (incomplete, or
        waiting for its statistics), so that every acknowledged chunk is folded or stored.
        Raises StoreError."""
        self.flush()
        for prefix, chunks in self._held.items():
            for key, payload in chunks.items():
                self.store.put_blob(key, payload)
            self._own[prefix] = True
        self._held.clear()

    def _drop_chunks(self, prefix: str) -> None:
        """Forget the chunks of a transfer whose update was taken or refused: those held in
        memory, and those in the store (an own-partition transfer's only where some were
        stored). Raises StoreError."""
        self._held.pop(prefix, None)
        if self._own.get(prefix, True):
            self.store.delete_prefix(prefix)
        self._own.pop(prefix, None)

    def _assemble(self, device_id: str, prefix: str) -> None:
        """Reassemble the update whose chunks are stored under ``prefix`` and hand it to
        :meth:`on_update`. The chunks stay until the update is taken (:meth:`flush` drops
        them with its marker): a worker killed before leaves them for :meth:`sweep`.

        Raises:
            ChunkError: the stored chunks, all there, do not make one update (they are dropped).
        """
        assembler, blob = Reassembler(self.max_update_bytes, verify_chunks=False), None
        try:
            for _, data in self.store.blob_items(prefix):
                blob = assembler.add(device_id, data) or blob
            if blob is None:
                raise ChunkError(f"the chunks stored under {prefix} do not make one update")
        except ChunkError:  # complete in number but not one update (they passed their checks once): drop them
            self.store.delete_prefix(prefix)
            raise
        self.on_update(device_id, blob, prefix)

    def on_update(self, device_id: str, blob: Blob, chunks: str) -> None:
        """A reassembled update (its chunks stored under ``chunks``): validated as the
        single-process engine does (:meth:`RoundEngine.on_update`), kept decoded here, and
        taken once its statistics are there; for a method that does not aggregate by sums,
        also stored whole for the coordinator."""
        refers = {"kind": "update", "upload_id": blob.header.id}
        rnd = self._current(device_id, blob.header.round, "update", blob.header.id)
        if rnd is None:
            return
        n = rnd.number
        if (n, device_id) in self._taken:
            if self._taken[(n, device_id)] != blob.header.sha:
                self.reject(device_id, n, "a second, different update for this round was ignored", **refers)
            return
        try:
            tensors = self.engine.decode_update(device_id, rnd.selected[device_id], blob.data,
                                                rnd.ranks.get(device_id))
        except Exception as e:  # CodecError, or the strategy's sent state failing its layout check
            self.store.put_json(_key(n, "rejected", device_id), f"update rejected: {e}"[:2000])
            self._drop_chunks(chunks)  # refused: nothing to sweep up later
            self.reject(device_id, n, f"update rejected: {e}", **refers)
            return
        if not sums_mode(self.engine):
            self.store.put_blob(_key(n, "update", device_id), blob.data)
        self._decoded[(n, device_id)] = (blob.header.sha, tensors, chunks)
        while len(self._decoded) > MAX_DECODED:  # the oldest: the sweep reassembles it from its chunks
            self._decoded.pop(next(iter(self._decoded)))
        self.take(n, device_id)

    def on_stats(self, device_id: str, stats: Stats) -> None:
        """A device's statistics (signature already verified): bounded as the single-process
        engine bounds them, stored, and the update taken once it is there."""
        upload = stats.update.transfer_id if stats.update else None
        rnd = self._current(device_id, stats.round, "stats", upload)
        if rnd is None:
            return
        n = rnd.number
        if (n, device_id) in self._taken:
            return
        problem = self.engine.stats_problem(rnd, device_id, stats)
        if problem:
            self.store.put_json(_key(n, "rejected", device_id), f"stats rejected: {problem}"[:2000])
            self.reject(device_id, n, f"stats rejected: {problem}", kind="stats", upload_id=upload)
            return
        raw = stats.model_dump(mode="json")
        self.store.put_json(_key(n, "stats", device_id), raw)
        self._stats[(n, device_id)] = (raw, stats)
        if (n, device_id) in self._decoded:  # else the worker that holds the update takes it (:meth:`poll`)
            self.take(n, device_id)

    # ------------------------------------------------------------------ folding
    def take(self, n: int, device_id: str) -> bool:
        """Take ``device_id``'s update of round ``n`` if its update and statistics are both
        stored and agree and nobody took it: screen it and queue it to be folded into this
        worker's sums (or stored for the coordinator); :meth:`flush` commits the queue.

        Returns:
            True when this call queued it.

        Raises:
            StoreError: the store failed.
        """
        rnd = self.engine.current
        dev = self.engine.registry.get(device_id)
        if rnd is None or rnd.number != n or device_id not in rnd.selected or dev is None or \
                device_id in self._pending or (n, device_id) in self._taken:
            return False
        raw, stats = self._stats.get((n, device_id)) or (self.store.get_json(_key(n, "stats", device_id)), None)
        if raw is None:
            return False
        if stats is None:
            stats = Stats.model_validate(raw)
        cached = self._decoded.get((n, device_id))
        if cached is not None and (stats.update is None or cached[0] != stats.update.sha256):
            del self._decoded[(n, device_id)]  # the engine's rule: stats name the update they go with
            self.reject(device_id, n, "stats reference an update other than the one received", kind="stats",
                        upload_id=stats.update.transfer_id if stats.update else None)
            return False
        if cached is None:
            # decoded by another worker (it takes it) or replaced; stored whole only for the coordinator
            data = None if sums_mode(self.engine) else self.store.get_blob(_key(n, "update", device_id))
            if data is None:
                return False
            cached = (sha256_hex(data), None, None)
            if stats.update is not None and cached[0] == stats.update.sha256:
                cached = (cached[0], self.engine.decode_update(device_id, rnd.selected[device_id], data,
                                                               rnd.ranks.get(device_id)), None)
        sha, tensors, chunks = cached
        if stats.update is None or stats.update.sha256 != sha:
            self.reject(device_id, n, "stats reference an update other than the one received", kind="stats",
                        upload_id=stats.update.transfer_id if stats.update else None)
            return False
        self._decoded.pop((n, device_id), None)
        marker: dict[str, Any] = {"worker": self.worker_id, "sha": sha, "stats": raw}
        result = None
        if sums_mode(self.engine):
            candidate = ClientResult(device_id, dev.task, stats.num_samples, rnd.selected[device_id], tensors, stats,
                                     rnd.ranks.get(device_id))
            screened = self.engine.defences.screen_update(n, self.engine.model.state, candidate, rnd.sample_cap)
            screen_marker, result = screened_marker(screened, device_id, sha)
            marker.update(screen_marker)
        else:
            marker["status"] = "stored"
        self._pending[device_id] = (n, result, marker, chunks)
        return True

    def flush(self) -> int:
        """Commit the queued updates: in one transaction, holding the round's lock shared and
        each device's lock, fold those nobody else took into this worker's sums, write the
        sums and their markers (module docstring); then tell the operator (``report``) and the
        devices whose update screening rejected. A fenced (closing) round takes nothing more.

        Returns:
            How many were taken.

        Inside an enclosing transaction (a batch's, :meth:`end_batch`) it commits with it, and
        tells what it took only when the caller calls :meth:`tell` after that commit.

        Raises:
            StoreError: the store failed (nothing was taken; outside a batch the queue is kept
                for the next try; inside one the worker stops, unacknowledged).
        """
        if not self._pending:
            return 0
        pending = dict(self._pending)
        n = next(iter(pending.values()))[0]
        with self.store.transaction():
            self.store.lock(f"round/{n}", shared=True)
            if self.store.get_json(_key(n, "fence")) is not None or int(self.store.get_json("last_round", 0)) >= n:
                log.warning("round %d closed before %d updates taken here were committed; they are not applied",
                            n, len(pending))
                self._pending.clear()
                return 0
            for d in sorted(pending):
                self.store.lock(f"take/{n}/{d}")
            taken = {}
            for d, x in pending.items():
                found = self.store.get_json(_key(n, "folded", d)) if x[0] == n else None
                if found is not None:  # another worker took it first (and drops its stored chunks)
                    self._taken[(n, d)] = found["sha"]
                    self._stats.pop((n, d), None)
                    self._held.pop(x[3] or "", None)
                elif x[0] == n:
                    taken[d] = x
            sums = self._round_sums(n).copy()
            for d, (_, result, _, _) in taken.items():
                if result is not None:
                    self.engine.strategy.fold(sums, result)
            if sums.devices != self._round_sums(n).devices:
                key = _key(n, "sums", self.worker_id)
                self.store.lock(key)
                self.store.put_blob(key, sums.to_bytes())
            for d, (_, _, marker, chunks) in taken.items():
                self.store.put_json(_key(n, "folded", d), marker)
                if chunks is not None:
                    self._drop_chunks(chunks)
        self._sums = (n, sums)
        self._pending.clear()
        for d, (_, _, marker, _) in taken.items():
            self._taken[(n, d)] = marker["sha"]
            self._stats.pop((n, d), None)
        self.taken += len(taken)
        self._notices.extend((d, n, marker) for d, (_, _, marker, _) in taken.items())
        if not self.store.in_transaction:  # else the enclosing batch tells them once it commits
            self.tell()
        return len(taken)

    def tell(self) -> None:
        """Tell the operator (``report``) of each update :meth:`flush` took, and the devices
        whose update screening rejected: after the transaction that took them committed
        (a worker whose commit fails stops, and takes them again when it comes back)."""
        notices, self._notices = self._notices, []
        for d, n, marker in notices:
            if marker["status"] == "rejected":
                self.reject(d, n, f"update rejected: {marker['reason']}", kind="update")
            self.progress("report", n, {"device": d, "val_accuracy": marker["stats"].get("val_accuracy"),
                                        "worker": self.worker_id})

    def poll(self) -> int:
        """Take the updates decoded here whose statistics another worker stored, sweep up what
        a stopped worker left (every :data:`SWEEP_S` s) and commit what waits (:meth:`flush`).
        The worker's loop calls it between batches of messages, outside any transaction: a
        commit must be the outermost one. Returns how many were taken. Raises StoreError."""
        now = time.monotonic()
        if now - self._swept >= SWEEP_S and self.engine.current is not None:
            self._swept = now
            self.sweep()
        rnd = self.engine.current
        if rnd is not None and any(k[0] == rnd.number for k in self._decoded):
            have = set(self.store.json_keys(_key(rnd.number, "stats")))
            for n, d in [k for k in self._decoded if k[0] == rnd.number]:
                if _key(n, "stats", d) in have:
                    self.take(n, d)
        return self.flush()

    def _round_sums(self, n: int) -> RoundSums:
        """This worker's committed sums of round ``n`` (read from the store once per round)."""
        if self._sums is None or self._sums[0] != n:
            blob = self.store.get_blob(_key(n, "sums", self.worker_id))
            self._sums = (n, RoundSums.from_bytes(blob) if blob is not None else RoundSums())
        return self._sums[1]

    def sweep(self) -> int:
        """Take what a stopped worker left: updates whose statistics are stored, nobody took,
        and nobody here holds decoded, that were left so at the last sweep too: reassembled
        from their stored chunks (or, for the coordinator's methods, read whole). Returns how
        many were taken. Raises StoreError."""
        rnd = self.engine.current
        if rnd is None:
            return 0
        n = rnd.number
        folded = set(self.store.json_keys(_key(n, "folded")))
        devices = {k.rsplit("/", 1)[1] for k in self.store.json_keys(_key(n, "stats"))
                   if _key(n, "folded", k.rsplit("/", 1)[1]) not in folded} - {d for m, d in self._decoded if m == n}
        left = {d: f"chunks/{n}/{d}/" for d in devices}
        for d in sorted(set(left) & self._waiting):  # left since the last sweep: the worker holding it is gone
            if not sums_mode(self.engine):
                self.take(n, d)
            transfers: dict[str, list[str]] = {}
            for key in self.store.blob_keys(left[d]):
                transfers.setdefault(key.rsplit("/", 1)[0] + "/", []).append(key)
            for prefix, keys in transfers.items():
                try:  # only a complete transfer: the rest of an incomplete one may still come (a redelivery)
                    if len(keys) >= parse_chunk(self.store.get_blob(keys[0]) or b"", self.max_update_bytes)[0].n:
                        self._assemble(d, prefix)
                except ChunkError as e:
                    log.warning("round %d: dropped the stored chunks of %s: %s", n, d, e)
                    self.store.delete_prefix(prefix)
        self._waiting = set(left)
        taken = self.flush()
        if taken:
            log.info("round %d: took %d updates that a stopped worker had left", n, taken)
        return taken


class Coordinator:
    """The coordinator's side: learn which updates the workers took, fence the round at its
    close, and read the workers' sums (module docstring).

    Args:
        store: the shared store.
    """

    def __init__(self, store: Any):
        self.store = store
        self.shared_subscriptions = True
        """Whether the broker has MQTT 5 shared subscriptions (the service sets it once
        connected): without them only devices that follow ``Assignment.uplink`` (protocol
        minor 9) can reach a worker."""
        self._partitions: tuple[float, list[str]] = (-1e9, [])

    def live_workers(self) -> dict[str, dict[str, Any]]:
        """worker id -> its last announcement, for the workers seen in the last
        :data:`WORKER_STALE_S` seconds. Raises StoreError."""
        now = self.store.clock()  # the database's clock: the hosts' clocks may differ
        return {k.split("/", 1)[1]: v for k, v in self.store.json_items("workers/").items()
                if isinstance(v, dict) and now - float(v.get("seen", 0)) < WORKER_STALE_S}

    def uplink(self, device_id: str) -> str | None:
        """The uplink partition (a live worker's id) for ``device_id``'s uploads
        (``Assignment.uplink``), by rendezvous hashing: the live worker with the highest
        ``blake2b(worker/device)``. A device keeps its worker while the set of live workers
        stays the same, each worker gets about 1/k of the devices, and a worker that stopped
        announcing itself gets none from the next assignment on (its devices move, the
        others stay). None when no worker is live. The live set is read at most every
        :data:`ANNOUNCE_S` seconds. Raises StoreError."""
        read, workers = self._partitions
        if time.monotonic() - read >= ANNOUNCE_S:
            workers = sorted(self.live_workers())
            self._partitions = (time.monotonic(), workers)
        if not workers:
            return None
        return max(workers, key=lambda w: hashlib.blake2b(f"{w}/{device_id}".encode(), digest_size=8).digest())

    def markers(self, n: int, known: Any = ()) -> dict[str, dict[str, Any]]:
        """device -> marker of every update taken in round ``n``, but those of the ``known``
        devices (read only the new ones)."""
        prefix = _key(n, "folded")
        keys = [k for k in self.store.json_keys(prefix) if k[len(prefix):] not in known]
        return {k[len(prefix):]: v for k, v in self.store.json_many(keys).items()}

    def refusals(self, n: int) -> dict[str, str]:
        """device -> why a worker refused its update or statistics in round ``n``."""
        prefix = _key(n, "rejected")
        return {k[len(prefix):]: v for k, v in self.store.json_items(prefix).items()}

    def fence(self, n: int) -> tuple[dict[str, dict[str, Any]], RoundSums]:
        """Close round ``n`` to workers and return what they took: the markers and the sum of
        every worker's sums.

        Raises:
            RuntimeError: the sums hold another number of updates than the markers say were
                folded (exactly-once broken: the round must fail, not be applied).
            StoreError: the store failed.
        """
        with self.store.transaction():
            self.store.lock(f"round/{n}")
            self.store.put_json(_key(n, "fence"), time.time())
        markers = self.markers(n)
        total = RoundSums()
        for key in self.store.blob_keys(_key(n, "sums")):
            total.merge(RoundSums.from_bytes(self.store.get_blob(key)))
        folded = sum(m.get("status") == "folded" for m in markers.values())
        if total.devices != folded:
            raise RuntimeError(f"round {n}: the workers' sums hold {total.devices} updates but {folded} are marked "
                               "folded")
        return markers, total

    def unfence(self, n: int) -> None:
        """Open round ``n`` to the workers again (a coordinator that resumes it: one that died
        after fencing it applied nothing). Raises StoreError."""
        with self.store.transaction():
            self.store.lock(f"round/{n}")
            self.store.delete(_key(n, "fence"))

    @staticmethod
    def screened(screen: Any, results: list[ClientResult], markers: dict[str, dict[str, Any]]) -> Screened:
        """The round's screening as the workers did it (their markers), the reference norms
        updated from the norms they recorded (``screen``: the engine's
        :class:`cloud.robust.screening.UpdateScreen`, or None when screening is off)."""
        kept = [r for r in results if markers[r.device_id].get("status") == "folded"]
        rejected = {r.device_id: markers[r.device_id].get("reason", "rejected by screening") for r in results
                    if markers[r.device_id].get("status") == "rejected"}
        report: dict[str, Any] = {"streaming": True, "rejected": rejected, **{
            what: {r.device_id: markers[r.device_id][what] for r in kept if what in markers[r.device_id]}
            for what in ("clipped", "capped_samples")}}
        if screen is not None:
            kinds: dict[str, str] = {}
            for m in markers.values():
                kinds.update(m.get("kinds", {}))
            report["reference"] = {k: float(f"{v:.6g}") for k, v in screen.update_references(
                {r.device_id: markers[r.device_id].get("norms", {}) for r in results}, kinds,
                {r.device_id: routed_experts(r) for r in results}).items()}
        return Screened(kept, rejected, report)
