"""The round engine: select devices, assign experts, collect, aggregate, evaluate, record.

One round (docs/architecture.md data flow):

1. Select online devices whose budget holds at least one expert per layer.
2. The strategy (:class:`cloud.strategies.Strategy`) configures the round (``Plan``):
   per device its per-layer expert set, training overrides, objective terms and extra
   tensors. An invalid entry excludes that device with the reason; a strategy that
   raises leaves the round waiting (logged, and named in the service's timeout).
3. Each device gets its slice of the global adapter state (plus the plan's extra
   tensors) on ``down/state`` and its ``assignment`` (shard manifests, training config,
   objective terms, deadline).
4. Updates (chunked safetensors) and statistics arrive; each is validated (round,
   device, names/shapes/dtypes against *that device's* assignment, finiteness,
   checksum; a statistics message's ``num_samples`` against the device's hello and
   ``max_samples_per_device``, its token and usage counts against what that many samples
   can produce) and accepted once; anything else is rejected with a reply.
   A device that refuses its assignment because its memory plan exceeds its budget
   (the ack carries its budget and baseline now) is reassigned within the same round:
   the strategy shrinks its expert sets (:meth:`Strategy.on_refusal`; by default the
   largest layer first, keeping at least one expert per layer) until the plan fits, and
   it gets the smaller assignment as a new ``attempt`` (recorded under ``reassigned``);
   if not even one expert per layer fits it counts as failed. No device is ever sent an
   assignment its declared budget cannot hold.
5. The round closes when every selected device reported or refused, or at the
   deadline. Updates are screened; with at least ``quorum`` of the selected devices
   accepted the strategy aggregates (the next global state and its own tensors), the
   pre-commit guard checks the step; otherwise the state stays.
6. The strategy evaluates; load metrics and a round record go to the store.

Memory: a method that aggregates by running sums streams its rounds in one process
(:mod:`.streaming`): each reported update is screened and folded into the round's sums
and its tensors dropped. Other methods (robust rules, DP-FedAvg, the fusion methods) hold
every update until the close.

Crash safety: the round in flight (selection, deadline, plan) is stored before any
assignment goes out, and every accepted update and statistics message is stored when
accepted (``inflight/...``; a streaming round's folded updates as its sums), in the same
transaction as the other messages of its batch (the service's group commit, acknowledged
to the broker only after it commits); closing a round writes the new global state, the
round record and ``last_round`` in one transaction and drops the in-flight data. A
restarted aggregator (:meth:`RoundEngine.restore`) therefore resumes the open round with
what it had accepted, and never applies a round twice.

The package holds one module per job of :class:`RoundEngine` (:mod:`.engine`, the
coordinator that wires them): :mod:`.eligibility` (which devices can take part),
:mod:`.plan` (the strategy's plan completed and checked), :mod:`.dispatch` (assignments,
their state slices, re-sending, notices), :mod:`.intake` (acks, updates, statistics),
:mod:`.streaming` (running sums as updates arrive),
:mod:`.closing` (screen, aggregate, guard, evaluate, record) and :mod:`.recovery`
(persist and restore); :mod:`.state` holds the round's state and settings.
"""

from .engine import RoundEngine
from .plan import MAX_EXTRA_TENSOR_BYTES
from .recovery import MAX_CLOSE_ATTEMPTS
from .state import OpenRound, RoundSettings, Wire

__all__ = ["MAX_CLOSE_ATTEMPTS", "MAX_EXTRA_TENSOR_BYTES", "OpenRound", "RoundEngine", "RoundSettings", "Wire"]
