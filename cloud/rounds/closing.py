"""Closing a round: screen the accepted updates, aggregate them given a quorum, let the
pre-commit guard check the step, evaluate, and record the round (module docstring of
:mod:`cloud.rounds`, steps 5 and 6). Anything that raises in closing fails that round only."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from moe_model.budget import current_rss_bytes, release_free_memory
from protocol.experts import layers_to_json
from protocol.messages import Command

from ..metrics import LoadWindow, assigned_load, round_load
from ..robust.guard import l2_norm
from ..strategy import ClientResult, Experts, Failure
from ..workers import Coordinator, sums_mode
from .recovery import jsonable
from .state import EngineState, OpenRound

log = logging.getLogger(__name__)


class _Refused(Exception):
    """The pre-commit guard refused a round's new global state."""


class Closing(EngineState):
    """The round engine's close pipeline (a part of :class:`cloud.rounds.RoundEngine`; it
    uses :meth:`sync` of intake, :meth:`_notify` of dispatch and :meth:`_persist` of
    recovery)."""

    eval_data: dict[str, Any]
    window: LoadWindow
    assigned_window: LoadWindow
    previous: dict[str, Experts]

    def should_close(self, now: float | None = None) -> bool:
        """Whether the open round is due to close: ``now`` (Unix seconds; default: the
        clock) is past its deadline, or every selected device reported or refused."""
        rnd = self.current
        if rnd is None:
            return False
        now = time.time() if now is None else now
        return now >= rnd.deadline or all(rnd.finished(d) for d in rnd.selected)

    def close_round(self) -> dict[str, Any]:
        """Screen, aggregate (given a quorum), guard, evaluate, persist and return the
        round record.

        Nothing a device sent can stop the service here: an exception anywhere in
        closing (a strategy bug, a message that makes aggregation raise) fails this
        round only. Its record says why, the previous global state stays, devices are
        told, and its accepted messages move to ``quarantine/{round}/`` in the store, so
        a restart does not replay them.
        """
        rnd = self.current
        assert rnd is not None
        before, owned_before = dict(self.model.state), dict(self.model.owned)
        attempt = self.store.get_json("closing_round", {})
        attempts = attempt.get("attempts", 0) + 1 if attempt.get("round") == rnd.number else 1
        self.store.put_json("closing_round", {"round": rnd.number, "attempts": attempts})
        try:
            return self._close(rnd, before, owned_before)
        except Exception as e:
            log.exception("round %d: closing failed; the round fails and its messages are quarantined", rnd.number)
            self.model.set_state(before)
            self.model.set_owned(owned_before)
            return self._fail(rnd, f"{type(e).__name__}: {e}"[:500])

    def _fail(self, rnd: OpenRound, error: str) -> dict[str, Any]:
        """Close ``rnd`` as failed without a new global state: devices told, record
        stored, its accepted messages quarantined."""
        self._tell_failed(rnd, error)
        record = {"round": rnd.number, "status": "failed", "error": error, "accuracy": None, "loss": None,
                  "per_task": {}, "started": rnd.started, "seconds": time.time() - rnd.started,
                  "selected": sorted(rnd.selected), "failures": {}, "devices": {}}
        with self.store.transaction():
            self._persist(record)
        self.current = None
        self.completed = rnd.number
        return record

    def _close(self, rnd: OpenRound, before: dict[str, torch.Tensor],
               owned_before: dict[str, torch.Tensor]) -> dict[str, Any]:
        markers, sums = {}, None
        if self.coordinator is not None:  # no worker takes an update after this; their sums are final
            markers, sums = self.coordinator.fence(rnd.number)
            self.sync(markers)
            if not sums_mode(self):
                sums = None
        elif rnd.stream is not None and rnd.stream.warmup is None:  # streamed: screened and folded as they came
            markers, sums = rnd.stream.markers, rnd.stream.sums
        results, failures = [], []
        for d, experts in sorted(rnd.selected.items()):
            dev = self.registry.get(d)
            if rnd.reported(d):
                st = rnd.stats[d]
                results.append(ClientResult(d, dev.task, st.num_samples, experts, rnd.updates[d][1], st,
                                            rnd.ranks.get(d)))
            else:
                ack = rnd.acks.get(d)
                reason = rnd.rejected.get(d) or (ack.reason if ack is not None and not ack.accepted else None)
                failures.append(Failure(d, reason or "no update before the deadline"))
        screened = Coordinator.screened(self.defences.screen, results, markers) if sums is not None else \
            self.defences.screen_round(rnd.number, before, results)
        for d, why in screened.rejected.items():
            failures.append(Failure(d, f"update rejected by screening: {why}"))
            self.reject(d, rnd.number, f"update rejected: {why}", kind="update")
        accepted = screened.results
        need = max(1, math.ceil(self.settings.quorum * len(rnd.selected)))
        status = "ok" if len(accepted) >= need else "no_quorum"
        error, step, metrics = None, 0.0, {}
        try:
            if status == "ok":
                out = self.strategy.finish(rnd.number, self.model, sums) if sums is not None else \
                    self.strategy.aggregate(rnd.number, self.model, accepted, failures)
                new, metrics = out.state, out.metrics
                step = l2_norm(new[k] - before[k] for k in before)
                problem = self.defences.guard.problem(before, new, step)
                if problem:  # pre-commit guard: the previous state stays
                    raise _Refused(problem)
                self.model.set_state(new)
                if out.owned is not None:
                    self.model.set_owned(out.owned)
            else:
                log.warning("round %d: %d/%d updates, quorum %d not met; global model unchanged", rnd.number,
                            len(accepted), len(rnd.selected), need)
            self.strategy.observe(rnd.number, results, failures)
            ev = self.strategy.evaluate(rnd.number, self.model, self.eval_data, self.settings.eval_batch_size)
        except Exception as e:  # a strategy or evaluation bug must not stop the service
            if isinstance(e, _Refused):
                log.warning("round %d: the pre-commit guard refused the new global state: %s", rnd.number, e)
                error = f"guard: {e}"
            else:
                log.exception("round %d: aggregation or evaluation failed; global model unchanged", rnd.number)
                error = f"{type(e).__name__}: {e}"[:500]
            status, step, metrics = "failed", 0.0, {}
            self.model.set_state(before)
            self.model.set_owned(owned_before)
            ev = {"accuracy": None, "loss": None, "per_task": {}}
            self._tell_failed(rnd, error)
        load = round_load(({ls.layer: ls.usage for ls in r.stats.layers} for r in accepted), self.model.layers,
                          self.model.spec.num_experts)
        self.window.add(load)
        self.assigned_window.add(assigned_load(((r.num_samples, r.experts) for r in accepted), self.model.layers,
                                               self.model.spec.num_experts))
        release_free_memory()  # what aggregation and evaluation freed goes back to the OS before RSS is recorded
        record = self._record(rnd, accepted, failures, status, ev, load)
        record["global_state_norm"] = l2_norm(self.model.state.values())
        record["global_step_norm"] = step
        record["screening"] = screened.report
        report = getattr(self.strategy.aggregation, "report", None)
        if status == "ok" and report:
            record["aggregation_report"] = jsonable(report)
        if metrics:
            record["strategy_metrics"] = jsonable(metrics)
        fed_eval = self._federated_evaluation(rnd, accepted)
        if fed_eval is not None:
            record["federated_evaluation"] = fed_eval
        if error is not None:
            record["error"] = error
        if status == "ok":
            self.defences.guard.committed(step)
        for r in accepted:
            self.previous[r.device_id] = r.experts
        with self.store.transaction():
            for r in accepted:
                self.registry.accepted(r.device_id, r.stats)
            self._persist(record)
        self.current = None
        self.completed = rnd.number
        log.info("round %d closed (%s): accuracy %s, %d/%d updates, %.1f s", rnd.number, status,
                 f"{ev['accuracy']:.4f}" if ev["accuracy"] is not None else "n/a", len(accepted), len(rnd.selected),
                 record["seconds"])
        self.progress("round_end", rnd.number, {k: record[k] for k in ("accuracy", "loss", "mean_local_accuracy",
                                                                         "seconds", "status", "cv")})
        return record

    def _federated_evaluation(self, rnd: OpenRound, results: list[ClientResult]) -> dict[str, Any] | None:
        """The strategy's combination of what the devices asked to evaluate reported
        (``Stats.extras`` of :attr:`Strategy.EVALUATION_TERM`), or None. Reports from
        devices that were not asked, or claiming more samples than the device declared
        in its hello, are refused (listed under ``refused``), never combined."""
        term = self.strategy.EVALUATION_TERM
        prefix, number, reports, refused = term + ".", rnd.number, {}, {}
        for r in results:
            if not any(k.startswith(prefix) for k in r.stats.extras):
                continue
            if all(o.name != term for o in rnd.objectives.get(r.device_id, [])):
                refused[r.device_id] = "reported an evaluation it was not asked for"
                continue
            report = {k[len(prefix):]: v[0] for k, v in r.stats.extras.items() if k.startswith(prefix) and len(v) == 1}
            declared = self.registry.get(r.device_id).num_samples
            if not isinstance(report.get("samples"), (int, float)) or report["samples"] > declared:
                refused[r.device_id] = f"claims {report.get('samples')} validation samples of its {declared}"
                continue
            reports[r.device_id] = report
        try:
            out = self.strategy.evaluate_federated(number, reports)
            if out is None and refused:
                out = {"accuracy": None, "loss": None, "samples": 0, "devices": [], "refused": {}}
            if out is not None:
                out["refused"] = {**out.get("refused", {}), **refused}
            return jsonable(out)
        except Exception:
            log.exception("round %d: the strategy's evaluate_federated failed", number)
            return None

    def _tell_failed(self, rnd: OpenRound, error: str) -> None:
        for d in rnd.selected:
            self._notify(d, Command(command="round_failed", round=rnd.number,
                                    reason=f"the cloud could not aggregate or evaluate round {rnd.number} "
                                           f"({error}); the global model is unchanged"))

    def _record(self, rnd: OpenRound, results: list[ClientResult], failures: list[Failure], status: str,
                ev: dict[str, Any], load: dict[int, list[int]]) -> dict[str, Any]:
        devices = {}
        for r in results:
            st, dev = r.stats, self.registry.get(r.device_id)
            devices[r.device_id] = {
                "task": r.task, "bytes_up": st.bytes_up, "bytes_down": st.bytes_down,
                "payload_up": st.payload_up, "payload_down": st.payload_down,
                "peak_rss_bytes": st.peak_rss_bytes, "peak_footprint_bytes": st.peak_footprint_bytes,
                # what the budget is held against: the footprint from minor-5 devices, RSS before
                "peak_bytes": st.peak_footprint_bytes or st.peak_rss_bytes, "baseline_rss_bytes": st.baseline_rss_bytes,
                "budget_bytes": dev.budget_bytes, "experts": Experts(r.experts).to_json(),
                "shards_fetched": st.shards_fetched, "samples": st.num_samples, "val_accuracy": st.val_accuracy,
                "train_loss": st.train_loss, "train_seconds": st.train_seconds,
                "predicted_peak_bytes": st.predicted_peak_bytes, "weight_format": st.weight_format,
                "lora_rank": rnd.ranks.get(r.device_id, self.model.spec.lora.rank),
                **({"extras": st.extras} if st.extras else {}),  # what the objective terms reported
                **({"worker": rnd.takers[r.device_id]} if r.device_id in rnd.takers else {}),
            }
        local = [r.stats.val_accuracy for r in results if r.stats.val_accuracy is not None]
        return {
            "round": rnd.number,
            "status": status,
            "accuracy": ev["accuracy"],
            "loss": ev["loss"],
            **({"perplexity": ev["perplexity"]} if "perplexity" in ev else {}),
            **({"fused": ev["fused"]} if "fused" in ev else {}),  # fusion_hybrid: the fused server MoE's figures
            "per_task": ev["per_task"],
            "mean_local_accuracy": sum(local) / len(local) if local else None,
            "train_loss": sum(r.stats.train_loss for r in results) / len(results) if results else None,
            "started": rnd.started,  # Unix seconds (the views' timestamps)
            "seconds": time.time() - rnd.started,
            "bytes_up": sum(d["bytes_up"] for d in devices.values()),
            "bytes_down": sum(d["bytes_down"] for d in devices.values()),
            "expert_load": layers_to_json(load),
            **self.window.summary(),
            **self.assigned_window.summary("assigned_"),
            "strategy": self.strategy.name,
            "assignment": {"strategy": self.strategy.label, "seconds": rnd.assignment_seconds, **rnd.plan_info},
            "assignment_seconds": rnd.assignment_seconds,
            "assignment_status": rnd.plan_info.get("status", "ok"),
            "selected": sorted(rnd.selected),
            "failures": {f.device_id: f.reason for f in failures},
            "reassigned": rnd.reassigned,
            "excluded": rnd.excluded,
            "offline": rnd.offline,
            "aggregator_rss_bytes": current_rss_bytes(),
            "devices": devices,
        }
