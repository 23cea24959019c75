"""The strategy lifecycle: one object per federated method.

The round engine calls, per round (docs/architecture.md data flow):

0. :meth:`Strategy.sample_devices` -> which of the eligible devices take part;
1. :meth:`Strategy.configure_round` with the selected devices -> a :class:`Plan`: each
   device's experts, training overrides, objective terms and extra tensors;
2. :meth:`Strategy.on_refusal` when a device refuses its assignment (its memory plan
   exceeds its budget) -> a smaller expert set or None;
3. :meth:`Strategy.stats_problem` for each statistics message (after the engine's own
   bounds) -> a reason to refuse it or None;
   :meth:`Strategy.state_for` -> the adapter state each device is sent;
4. :meth:`Strategy.aggregate` with the screened, accepted updates -> the next global
   state, the strategy's own tensors and metrics (:class:`Aggregated`);
5. :meth:`Strategy.observe` with every result and failure (also without a quorum);
6. :meth:`Strategy.evaluate` -> the round's evaluation figures on the cloud's test data;
   :meth:`Strategy.evaluate_federated` -> the figures the devices chosen by
   :meth:`Strategy.configure_evaluate` measured on their own validation data.

What a strategy learns in one round and needs in the next (a routing distribution, a
trust score) it keeps: small JSON in :meth:`state_dict`, tensors in the global model's
``owned`` tensors (:class:`Aggregated`); both are persisted with the round.
"""

from __future__ import annotations

import math
import random
from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from moe_model.objectives import perplexity
from protocol.messages import MAX_SAMPLES, Ack, Objective, Stats
from protocol.plugins import Registry

from ..aggregation.base import AggregationStrategy, RoundSums
from ..strategy import Aggregated, ClientResult, DeviceView, Experts, Failure, Plan, Registered, Setup

if TYPE_CHECKING:
    from ..global_model import GlobalModel


def parse_objectives(raw: list[dict] | None) -> list[Objective]:
    """``Strategy(objectives=...)`` validated: a list of ``{name, params}`` of terms this
    installation knows (None: none).

    Raises:
        ValueError: not such a list, a malformed entry, an unknown term name
            (:class:`protocol.plugins.UnknownNameError`, with "did you mean") or a term
            named twice.
    """
    from pydantic import ValidationError

    from edge_sdk.objectives import check_objectives

    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError(f"objectives must be a list of {{name, params}}, got {type(raw).__name__}")
    try:
        out = [Objective.model_validate(o) for o in raw]
    except ValidationError as e:
        raise ValueError(f"objectives: {e}") from None
    check_objectives(out)
    return out


class Strategy(Registered):
    """One federated method (FedMoE, FLEX-MoE, FedAlign-MoE, ...).

    Args:
        setup: layers, experts, seed, training configuration, tasks and the configured
            assignment/aggregation parts.
        evaluate_fraction: share of each round's devices asked to evaluate the global
            model they receive on their validation split (:meth:`configure_evaluate`);
            default 0 (none).
        objectives: terms every assigned device adds to its local objective, whatever
            the method plans (``[{name: load_balance, params: {alpha: 0.01}}]``;
            :mod:`edge_sdk.objectives`); default none. A term the plan already names for
            a device is not added twice.
        **params: the method's parameters from the config (``strategy.params``).

    Raises:
        TypeError: unknown parameters.
        ValueError: ``evaluate_fraction`` outside [0, 1]; ``objectives`` not a list of
            valid terms (an unknown name lists the known ones).

    Attributes:
        aggregation: the aggregation part, if the method has one; the aggregator wraps it in
            the configured robust rule or DP-FedAvg (:mod:`cloud.robust`; ``cloud.service.build_strategy``), so robust
            aggregation composes with every method that aggregates through a part.
    """

    registry: ClassVar[Registry] = Registry("strategy", "fedmoe.strategies", "cloud.strategies")
    aggregation: AggregationStrategy | None = None

    EVALUATION_TERM: ClassVar[str] = "evaluate_received"
    """The device objective term that evaluates the received model (its statistics:
    ``evaluate_received.accuracy``, ``.loss``, ``.samples``)."""

    def __init__(self, setup: Setup, evaluate_fraction: float = 0.0, objectives: list[dict] | None = None,
                 **params: Any):
        if params:
            raise TypeError(f"{type(self).__name__} got unknown parameters {sorted(params)}")
        if not 0.0 <= float(evaluate_fraction) <= 1.0:
            raise ValueError(f"evaluate_fraction must be in [0, 1], got {evaluate_fraction!r}")
        self.setup, self.evaluate_fraction = setup, float(evaluate_fraction)
        self.objectives = parse_objectives(objectives)

    @classmethod
    def reserve_fraction_of(cls, params: dict[str, Any]) -> float:
        """The share of each task's training split a simulator keeps on the cloud as
        ``Setup.reserved`` for this method with ``params`` (default 0: none; Fed-MoE
        fusion's D^r, :mod:`cloud.strategies.fusion`)."""
        return 0.0

    @classmethod
    def smallest_batch_of(cls, params: dict[str, Any], batch_size: int) -> int:
        """The smallest training batch size this method with ``params`` may give a
        device whose budget does not hold one expert per layer at ``batch_size`` (default
        ``batch_size``: such a device is left out; Fed-MoE fusion shrinks the batch)."""
        return batch_size

    @property
    def label(self) -> str:
        """The name round records and logs show for this method."""
        return self.name

    def sample_devices(self, round: int, candidates: list[str], count: int, rng: random.Random) -> list[str]:
        """The devices that take part in ``round``.

        Args:
            candidates: the eligible devices (online, known task, a weight format the
                cloud serves), sorted ids.
            count: how many ``clients_per_round`` asks for (< ``len(candidates)``; with
                at least as many, every candidate takes part and this is not called).
            rng: the engine's seeded generator (restarts reproduce the choice).

        Returns:
            ids among ``candidates`` (default: a uniform sample of ``count``).
        """
        return rng.sample(candidates, count)

    def state_for(self, device_id: str, task: str, experts: Experts, model: "GlobalModel") -> dict:
        """The adapter state device ``device_id`` (of ``task``) holding ``experts`` is sent
        this round (name -> tensor; exactly the names and shapes of
        ``model.state_for(experts, task)``, which is the default). Called for every
        assignment sent and every delta update decoded, so it gets ids, not a
        :class:`DeviceView` (whose capacity costs a memory plan per expert count). Must
        not change during a round: a restarted aggregator sends it again and decodes delta
        updates against it."""
        return model.state_for(experts, task)

    @abstractmethod
    def configure_round(self, round: int, devices: list[DeviceView], model: "GlobalModel") -> Plan:
        """Each selected device's instructions for ``round``.

        Args:
            round: the round number (1-based).
            devices: the selected devices (budget, capacity, memory model, last stats).
            model: the global model (``state``, ``owned``, layers, tasks); read only.

        Returns:
            The plan. Experts must cover every MoE layer with 1..capacity experts (or
            fit the device's memory model); a device with an invalid entry is excluded
            from the round with the reason, the others go ahead.
        """

    def aggregate(self, round: int, model: "GlobalModel", results: list[ClientResult],
                  failures: list[Failure]) -> Aggregated:
        """The next global state from the accepted (screened) updates.

        Default: the aggregation part on ``model.state`` (each result as
        :meth:`for_aggregation` gives it); the strategy's tensors stay.

        Raises:
            NotImplementedError: no aggregation part and no override.
        """
        if self.aggregation is None:
            raise NotImplementedError(f"strategy {self.name!r} has no aggregation part and does not aggregate")
        results = [self.for_aggregation(r) for r in results]
        state = self.aggregation.aggregate(round, model.state, results, failures)
        return Aggregated(state, metrics=self.aggregation.metrics())

    def for_aggregation(self, result: ClientResult) -> ClientResult:
        """``result`` as the aggregation part sees it (default: unchanged)."""
        return result

    @property
    def decomposes(self) -> bool:
        """Whether this method's aggregation runs as running sums (:meth:`fold` per update,
        :meth:`finish` at the close), so aggregator workers can fold updates as they arrive:
        the default :meth:`aggregate` through an aggregation part whose rule decomposes
        (``modular``, ``usage_weighted``; not a robust rule or DP-FedAvg)."""
        return self.aggregation is not None and self.aggregation.decomposes and \
            type(self).aggregate is Strategy.aggregate

    def fold(self, sums: RoundSums, result: ClientResult) -> None:
        """Add one accepted update to the round's ``sums`` (only where :attr:`decomposes`).

        Raises:
            NotImplementedError: the method does not decompose into sums.
        """
        if not self.decomposes:
            raise NotImplementedError(f"strategy {self.name!r} does not aggregate by running sums")
        self.aggregation.fold(sums, self.for_aggregation(result))

    def finish(self, round: int, model: "GlobalModel", sums: RoundSums) -> Aggregated:
        """The next global state from the round's ``sums`` (what :meth:`aggregate` gives for
        the updates folded into them).

        Raises:
            NotImplementedError: the method does not decompose into sums.
        """
        if not self.decomposes:
            raise NotImplementedError(f"strategy {self.name!r} does not aggregate by running sums")
        state = self.aggregation.finish(model.state, sums)
        return Aggregated(state, metrics=self.aggregation.metrics())

    def observe(self, round: int, results: list[ClientResult], failures: list[Failure]) -> None:
        """Feedback after every round, with or without a quorum (default: ignored)."""

    def on_refusal(self, round: int, device: DeviceView, experts: Experts, ack: Ack) -> Experts | None:
        """A smaller expert set for a device that refused ``experts`` as over its budget.

        ``device`` already carries the budget and baseline the refusal reported. Default:
        drop the highest expert id of the layer holding the most (the lowest layer
        first on ties) until ``device.memory`` fits ``device.budget_bytes``, keeping one
        expert per layer. The engine sends the result as the next attempt if it fits and
        differs from ``experts``.

        Returns:
            layer -> expert ids, or None to leave the device out of this round.
        """
        out = {k: list(v) for k, v in experts.items()}
        if device.memory is None:
            return None
        while device.memory(out) > device.budget_bytes:
            layer = max(out, key=lambda k: (len(out[k]), -k))
            if len(out[layer]) <= 1:
                return None
            out[layer] = out[layer][:-1]
        return out

    def stats_problem(self, device_id: str, stats: Stats) -> str | None:
        """Why this method cannot accept ``stats`` (e.g. its ``extras`` lack what the
        method asked for or are out of range), or None. Called after the engine's bounds."""
        return None

    def configure_evaluate(self, round: int, devices: list[DeviceView]) -> list[str]:
        """The devices of this round's plan that first evaluate the global sub-MoE they
        receive on their local validation split (federated evaluation, Flower's
        ``configure_evaluate``, done in the training round: the model is loaded anyway,
        and only accuracy, loss and a sample count leave the device). The engine turns
        it on with the :attr:`EVALUATION_TERM` objective for devices of protocol minor
        >= 3. Default: a seeded ``evaluate_fraction`` of ``devices`` (at least one when
        the fraction is positive).

        Returns:
            device ids.
        """
        if self.evaluate_fraction <= 0 or not devices:
            return []
        ids = sorted(d.device_id for d in devices)
        k = max(1, math.ceil(self.evaluate_fraction * len(ids)))
        return sorted(random.Random(self.setup.seed * 7919 + round).sample(ids, min(k, len(ids))))

    def evaluate_federated(self, round: int, reports: dict[str, dict[str, float]]) -> dict[str, Any] | None:
        """Combine the devices' own evaluations of the model they received.

        Args:
            reports: device id -> ``{"accuracy", "loss", "samples"}`` as the device sent
                them (unchecked: a device may lie).

        Returns:
            ``{"accuracy", "loss", "samples", "devices", "refused"}``: sample-weighted
            means over the reports within bounds (accuracy in [0, 1], finite loss >= 0,
            1..MAX_SAMPLES whole samples); ``refused``: device -> why. None without reports.
        """
        if not reports:
            return None
        good, refused = {}, {}
        for d, r in sorted(reports.items()):
            acc, loss, n = r.get("accuracy"), r.get("loss"), r.get("samples")
            if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (acc, loss, n)):
                refused[d] = "missing or non-finite accuracy, loss or samples"
            elif not (0.0 <= acc <= 1.0 and loss >= 0.0 and 1 <= n <= MAX_SAMPLES and n == int(n)):
                refused[d] = f"out of bounds (accuracy {acc}, loss {loss}, samples {n})"
            else:
                good[d] = (acc, loss, int(n))
        total = sum(n for _, _, n in good.values())
        return {"accuracy": sum(a * n for a, _, n in good.values()) / total if total else None,
                "loss": sum(lo * n for _, lo, n in good.values()) / total if total else None,
                "samples": total, "devices": sorted(good), "refused": refused}

    def evaluated_experts(self, model: "GlobalModel") -> dict[int, list[int]] | None:
        """The sub-MoE :meth:`evaluate` scores (layer -> expert ids); None (default): the
        whole global MoE."""
        return None

    def evaluate(self, round: int, model: "GlobalModel", eval_data: dict[str, Sequence[tuple[Any, int]]],
                 batch_size: int = 32) -> dict[str, Any]:
        """Evaluation of the global model after ``round`` (0: before training), the sub-MoE
        of :meth:`evaluated_experts` where that names one.

        Returns:
            ``{"accuracy", "loss", "per_task": {task: {"accuracy", "loss", "samples"}}}``;
            the top-level figures are sample-weighted means over tasks (None without data).
            For a ``causal-lm`` model, accuracy is next-token accuracy and each level also
            has ``perplexity`` (``exp`` of its loss, nats per token); a task whose items carry
            more than one label (e.g. the ``domains`` of a BTX checkpoint) also has
            ``per_label`` (label id -> the same figures and ``tokens``; the task's figures
            are their token-weighted means, as one evaluation of all items gives).
        """
        lm = model.spec.objective == "causal-lm"
        per_task, n_total, acc, loss = {}, 0, 0.0, 0.0
        for task, items in eval_data.items():
            if not items:
                continue
            if lm:
                r = _lm_by_label(model, task, items, batch_size, self.evaluated_experts(model))
            else:
                e = model.evaluate(task, items, batch_size, experts=self.evaluated_experts(model))
                r = {"accuracy": e.accuracy, "loss": e.loss, "samples": e.samples}
            per_task[task] = r
            n_total += r["samples"]
            acc += r["accuracy"] * r["samples"]
            loss += r["loss"] * r["samples"]
        if not n_total:
            return {"accuracy": None, "loss": None, "per_task": {}}
        out = {"accuracy": acc / n_total, "loss": loss / n_total, "per_task": per_task}
        if lm:
            out["perplexity"] = perplexity(out["loss"])
        return out


def _lm_by_label(model: "GlobalModel", task: str, items: Sequence[tuple[Any, int]], batch_size: int,
                 experts: dict[int, list[int]] | None) -> dict[str, Any]:
    """A causal-LM task's figures (:meth:`Strategy.evaluate`), with ``per_label`` where its
    items carry more than one label: each label's items evaluated apart, the task's loss and
    accuracy their means weighted by target tokens."""
    def figures(r) -> dict[str, Any]:
        return {"accuracy": r.accuracy, "loss": r.loss, "samples": r.samples, "perplexity": r.perplexity,
                "tokens": r.tokens}

    groups: dict[str, list] = {}  # label id (as the report's JSON keys it) -> its items
    for item in items:
        groups.setdefault(str(item[1]), []).append(item)
    parts = {y: model.evaluate(task, g, batch_size, experts=experts) for y, g in groups.items()}
    if len(parts) == 1:
        return figures(next(iter(parts.values())))
    tokens = sum(r.tokens for r in parts.values())
    loss = sum(r.loss * r.tokens for r in parts.values()) / max(tokens, 1)
    return {"accuracy": sum(r.accuracy * r.tokens for r in parts.values()) / max(tokens, 1), "loss": loss,
            "samples": sum(r.samples for r in parts.values()), "perplexity": perplexity(loss), "tokens": tokens,
            "per_label": {y: figures(r) for y, r in parts.items()}}


def get_strategy(name: str) -> type[Strategy]:
    """The strategy class registered as ``name``.

    Raises:
        protocol.plugins.UnknownNameError: unknown name (a KeyError and a ValueError;
            suggests near misses, lists the known ones).
    """
    return Strategy.lookup(name)
