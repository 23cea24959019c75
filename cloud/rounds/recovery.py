"""Recovery: what the round engine stores so that a restarted aggregator resumes where it
stopped (module docstring of :mod:`cloud.rounds`, "Crash safety"): the open round when it
starts (:meth:`Recovery._save_open_round`), everything a closed round changed
(:meth:`Recovery._persist`), and both read back (:meth:`Recovery.restore`)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from pydantic import ValidationError

from protocol.codec import decode_tensors, encode_tensors, sha256_hex
from protocol.experts import experts_by_device_from_json, experts_by_device_to_json
from protocol.messages import Ack, Objective, Stats

from ..metrics import LoadWindow
from ..strategy import Experts
from .state import EngineState, OpenRound

log = logging.getLogger(__name__)

MAX_CLOSE_ATTEMPTS = 2
"""A round whose closing was interrupted this many times (the process died in it) is
failed on the next restart, its messages quarantined, instead of being closed again."""


class Recovery(EngineState):
    """The round engine's persistence (a part of :class:`cloud.rounds.RoundEngine`; a
    restored round's messages are checked again by :meth:`stats_problem` and
    :meth:`decode_update` of intake, a streaming round's sums are read back by
    :meth:`restore_stream` of streaming, and a round that keeps killing the aggregator is
    failed by :meth:`_fail` of closing)."""

    window: LoadWindow
    assigned_window: LoadWindow
    previous: dict[str, Experts]
    persist_seconds: float | None

    def _save_open_round(self, rnd: OpenRound) -> None:
        """Store round ``rnd`` as it opens, before any assignment goes out: its plan's extra
        tensors (a restart re-sends the same assignment), the strategy state configuring it
        changed, and the round itself (``current_round``, read by :meth:`round_from_json`)."""
        for d, tensors in rnd.tensors.items():
            self.store.put_blob(f"inflight/{rnd.number}/tensors/{d}", encode_tensors(tensors, "fp32"))
        self.store.put_json("strategy_state", self.strategy.state_dict())
        self.store.put_json("current_round", {
            "number": rnd.number, "started": rnd.started, "deadline": rnd.deadline,
            "plan_info": jsonable(rnd.plan_info), "assignment_seconds": rnd.assignment_seconds, "train": rnd.train,
            "excluded": rnd.excluded, "offline": rnd.offline, "selected": experts_by_device_to_json(rnd.selected),
            "objectives": {d: [o.model_dump(mode="json") for o in x] for d, x in rnd.objectives.items()},
            "sample_cap": rnd.sample_cap, "ranks": rnd.ranks, "streams": rnd.stream is not None,
        })

    def _persist(self, record: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self._persist_state(record)
        self.persist_seconds = time.perf_counter() - t0

    def _persist_state(self, record: dict[str, Any]) -> None:
        self.store.put_blob("global_state", encode_tensors(self.model.state, "fp32"))
        self.store.put_blob("strategy_tensors", encode_tensors(self.model.owned, "fp32"))
        self.store.put_json("strategy_state", self.strategy.state_dict())
        self.store.put_json("defences_state", self.defences.state_dict())
        self.store.put_json("load_window", self.window.state_dict())
        self.store.put_json("assigned_window", self.assigned_window.state_dict())
        self.store.put_json("previous_assignment", experts_by_device_to_json(self.previous))
        self.store.save_round(record)
        self.store.put_json("last_round", record["round"])
        self.store.delete("current_round")
        self.store.delete("closing_round")
        if record["status"] == "failed":  # kept for a post-mortem, never replayed
            self.store.move_prefix(f"inflight/{record['round']}/", f"quarantine/{record['round']}/")
        else:
            self.store.delete_prefix(f"inflight/{record['round']}/")

    def restore(self, open_round: bool = True) -> None:
        """Load the persisted global state and strategy states (after a restart), and with
        ``open_round`` the round that was open with what it had accepted."""
        blob = self.store.get_blob("global_state")
        if blob is not None:
            self.model.set_state(decode_tensors(blob, 2**34, {k: (tuple(v.shape), v.dtype)
                                                               for k, v in self.model.state.items()}))
            log.info("resumed global state after round %d", self.completed)
        owned = self.store.get_blob("strategy_tensors")
        if owned is not None:
            self.model.set_owned(decode_tensors(owned, 2**34))
        state = self.store.get_json("strategy_state")
        if state is None:  # a store written before strategies were one object
            state = {"assignment": self.store.get_json("assignment_state", {}),
                     "aggregation": self.store.get_json("aggregation_state", {})}
        self.strategy.load_state_dict(state)
        self.defences.load_state_dict(self.store.get_json("defences_state", {}))
        if open_round:
            self._restore_round()

    def _restore_round(self) -> None:
        """Rebuild the round that was open when the aggregator stopped, with the acks,
        updates and statistics it had accepted (each validated again)."""
        cur = self.store.get_json("current_round")
        if cur is None:
            return
        if cur["number"] != self.completed + 1:
            log.warning("discarding stored in-flight round %s (last closed round is %d)", cur["number"],
                        self.completed)
            self.store.delete("current_round")
            self.store.delete_prefix(f"inflight/{cur['number']}/")
            return
        rnd = self.round_from_json(cur)
        if self.coordinator is not None:  # a coordinator that died after fencing it applied nothing
            self.coordinator.unfence(rnd.number)
        prefix = f"inflight/{rnd.number}/"
        for d in rnd.selected:
            blob = self.store.get_blob(f"{prefix}tensors/{d}")
            if blob is not None:
                rnd.tensors[d] = decode_tensors(blob, 2**34)
        for d in rnd.selected:
            ack = self.store.get_json(f"{prefix}ack/{d}")
            if ack is not None:
                rnd.acks[d] = Ack.model_validate(ack)
            st = self.store.get_json(f"{prefix}stats/{d}")
            dev = self.registry.get(d)
            if st is not None:
                # Accepted before a restart, possibly by an older version with looser bounds: checked again, so
                # statistics that could not be accepted now are dropped rather than crash every restart.
                try:
                    stats = Stats.model_validate(st)
                    problem = None if dev is None else self.stats_problem(rnd, d, stats)
                except ValidationError as e:
                    problem = f"invalid: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}"
                if problem:
                    log.warning("round %d: dropped the stored stats of %s: %s", rnd.number, d, problem)
                    rnd.rejected[d] = problem
                    self.store.delete(f"{prefix}stats/{d}")
                else:
                    rnd.stats[d] = stats
            data = None if self.coordinator is not None else self.store.get_blob(f"{prefix}update/{d}")
            if data is not None and dev is not None:  # a coordinator learns the workers' updates by sync()
                try:
                    rnd.updates[d] = (sha256_hex(data), self.decode_update(d, rnd.selected[d], data, rnd.ranks.get(d)))
                except Exception as e:  # decodable once, not now (a strategy's sent state changed): drop, not crash
                    log.warning("round %d: dropped the stored update of %s: %s", rnd.number, d, e)
                    rnd.rejected[d] = f"stored update no longer decodes: {type(e).__name__}: {e}"[:500]
                    self.store.delete(f"{prefix}update/{d}")
        self.current = rnd
        if cur.get("streams"):
            try:
                self.restore_stream(rnd)
            except (RuntimeError, ValueError) as e:
                log.error("round %d: its stored running sums cannot be used (%s); failing it", rnd.number, e)
                self._fail(rnd, f"stored running sums unusable: {e}"[:500])
                return
        closing = self.store.get_json("closing_round", {})
        if closing.get("round") == rnd.number and closing.get("attempts", 0) >= MAX_CLOSE_ATTEMPTS:
            # The process died while closing this round, more than once: something in it (a message that
            # exhausts memory, a native crash) kills the aggregator. Fail it instead of dying again.
            log.error("round %d: the aggregator stopped %d times while closing it; failing it and quarantining "
                      "its messages", rnd.number, closing["attempts"])
            self._fail(rnd, f"the aggregator stopped {closing['attempts']} times while closing this round")
            return
        log.info("resumed round %d: %d selected, %d updates and %d stats already accepted", rnd.number,
                 len(rnd.selected), len(rnd.updates), len(rnd.stats))

    @staticmethod
    def round_from_json(cur: dict[str, Any]) -> OpenRound:
        """The open round as stored under ``current_round`` (selection, deadline, plan), without
        the messages accepted in it. Raises KeyError or pydantic.ValidationError when ill-formed."""
        return OpenRound(cur["number"], cur["started"], cur["deadline"], experts_by_device_from_json(cur["selected"]),
                      cur.get("plan_info", {}), cur.get("assignment_seconds", 0.0), train=cur.get("train", {}),
                      attempts={d: int(a) for d, a in cur.get("attempts", {}).items()},
                      excluded=cur.get("excluded", {}), offline=list(cur.get("offline", [])),
                      objectives={d: [Objective.model_validate(o) for o in x]
                                  for d, x in cur.get("objectives", {}).items()},
                      sample_cap=cur.get("sample_cap"),
                      ranks={d: int(r) for d, r in cur.get("ranks", {}).items()})


def jsonable(value: Any) -> Any:
    """``value`` if JSON can hold it, else its ``str`` (plan info is free-form)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return json.loads(json.dumps(value, default=str))
