"""The strategy lifecycle: one object per federated method.

The round engine calls, per round (DESIGN.md data flow):

1. :meth:`Strategy.configure_round` with the selected devices -> a :class:`Plan`: each
   device's experts, training overrides, objective terms and extra tensors;
2. :meth:`Strategy.on_refusal` when a device refuses its assignment (its memory plan
   exceeds its budget) -> a smaller expert set or None;
3. :meth:`Strategy.stats_problem` for each statistics message (after the engine's own
   bounds) -> a reason to refuse it or None;
4. :meth:`Strategy.aggregate` with the screened, accepted updates -> the next global
   state, the strategy's own tensors and metrics (:class:`Aggregated`);
5. :meth:`Strategy.observe` with every result and failure (also without a quorum);
6. :meth:`Strategy.evaluate` -> the round's evaluation figures.

What a strategy learns in one round and needs in the next (a routing distribution, a
trust score) it keeps: small JSON in :meth:`state_dict`, tensors in the global model's
``owned`` tensors (:class:`Aggregated`); both are persisted with the round.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from protocol.messages import Ack, Stats

from ..aggregation.base import AggregationStrategy
from ..strategy import Aggregated, ClientResult, DeviceView, Experts, Failure, Plan, Registered, Setup

if TYPE_CHECKING:
    from ..global_model import GlobalModel


class Strategy(Registered):
    """One federated method (FedMoE, FLEX-MoE, FedAlign-MoE, ...).

    Args:
        setup: layers, experts, seed, training configuration, tasks and the configured
            assignment/aggregation parts.
        **params: the method's parameters from the config (``strategy.params``).

    Raises:
        TypeError: unknown parameters.

    Attributes:
        aggregation: the aggregation part, if the method has one; the engine wraps it in
            the configured robust rule or DP-FedAvg (:mod:`cloud.robust`), so robust
            aggregation composes with every method that aggregates through a part.
    """

    _registry: ClassVar[dict[str, type]] = {}
    _package: ClassVar[str] = "cloud.strategies"
    aggregation: AggregationStrategy | None = None

    def __init__(self, setup: Setup, **params: Any):
        if params:
            raise TypeError(f"{type(self).__name__} got unknown parameters {sorted(params)}")
        self.setup = setup

    @property
    def label(self) -> str:
        """The name round records and logs show for this method."""
        return self.name

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

        Default: the aggregation part on ``model.state``; the strategy's tensors stay.

        Raises:
            NotImplementedError: no aggregation part and no override.
        """
        if self.aggregation is None:
            raise NotImplementedError(f"strategy {self.name!r} has no aggregation part and does not aggregate")
        return Aggregated(self.aggregation.aggregate(round, model.state, results, failures))

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

    def evaluate(self, round: int, model: "GlobalModel", eval_data: dict[str, Sequence[tuple[Any, int]]],
                 batch_size: int = 32) -> dict[str, Any]:
        """Evaluation of the global model after ``round`` (0: before training).

        Returns:
            ``{"accuracy", "loss", "per_task": {task: {"accuracy", "loss", "samples"}}}``;
            the top-level figures are sample-weighted means over tasks (None without data).
        """
        per_task, n_total, acc, loss = {}, 0, 0.0, 0.0
        for task, items in eval_data.items():
            if not items:
                continue
            r = model.evaluate(task, items, batch_size)
            per_task[task] = {"accuracy": r.accuracy, "loss": r.loss, "samples": r.samples}
            n_total += r.samples
            acc += r.accuracy * r.samples
            loss += r.loss * r.samples
        if not n_total:
            return {"accuracy": None, "loss": None, "per_task": {}}
        return {"accuracy": acc / n_total, "loss": loss / n_total, "per_task": per_task}


def get_strategy(name: str) -> type[Strategy]:
    """The strategy class registered as ``name``. Raises KeyError (lists the known ones)."""
    return Strategy.lookup(name)
