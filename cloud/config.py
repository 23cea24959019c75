"""The aggregator's configuration schema (``fedmoe aggregator --config aggregator.yaml``).

:class:`FederationSettings` is how a federation learns (model, method, local training,
round rules, limits); :class:`AggregatorConfig` adds where and as whom this aggregator
runs (federation name, tasks, store, broker account, durability). ``fedmoe simulate``'s
:class:`fedmoe.simulate.SimulationConfig` is built on :class:`FederationSettings` too, so
a simulation and a deployed aggregator read the same fields with the same checks. Byte
sizes accept ``"256MiB"``-style strings as well as ints (:data:`protocol.config.Bytes`).

Imports nothing heavy (no torch): a config is checked before anything is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.config import BrokerSettings, Bytes, PositiveBytes
from protocol.messages import MAX_SAMPLES, ModelSpec, TrainConfig, WeightFormat

from .robust.config import DefenceConfig


def _default_chunk_bytes() -> int:
    from protocol.chunking import DEFAULT_CHUNK_BYTES  # imports torch (the codec): only when needed

    return DEFAULT_CHUNK_BYTES


CLUSTER_RESEND_S = 60.0
"""``assignment_resend_s`` when it is not set and the broker URL names several nodes."""


class StrategyConfig(BaseModel):
    """A strategy by registered name, with its parameters."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    """Registered name (or alias) of the strategy, assignment or aggregation part."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Its parameters (each method's page in docs/methods/ lists them with their defaults)."""


class TaskConfig(BaseModel):
    """A task: its class labels (ids follow this order) and an optional test file."""

    model_config = ConfigDict(extra="forbid")
    labels: list[str] = Field(min_length=2)
    """The task's class labels; label ids follow this order."""
    eval_data: str | None = None
    """CSV/JSONL ``text,label`` file the cloud evaluates the global model on."""
    reserved_data: str | None = None
    """CSV/JSONL ``text,label`` file of labelled items only the cloud holds (Fed-MoE's
    server-reserved set D^r, strategy ``fusion``); never sent to a device."""


RANKED_AGGREGATIONS = ("flexlora", "hlora", "rankwise")
"""The aggregations for heterogeneous ranks of trained ``A`` and ``B``: the two SVD rules
and the rank-wise averaging they are measured against (docs/ranks.md)."""


class FederationSettings(BaseModel):
    """How a federation learns: the model, the method, local training, the round rules and
    the limits the aggregator enforces. The part of :class:`AggregatorConfig` that
    ``fedmoe simulate`` shares (:class:`fedmoe.simulate.SimulationConfig`)."""

    model_config = ConfigDict(extra="forbid")
    model: ModelSpec = Field(default_factory=ModelSpec)
    """The model family, its base checkpoint, the MoE shape and LoRA (sent to every device)."""
    rounds: int = Field(10, ge=1)
    """Rounds to run before the devices are told to stop."""
    clients_per_round: float = Field(1.0, gt=0, allow_inf_nan=False)
    """<= 1: the fraction of eligible devices selected each round; > 1: a count."""
    quorum: float = Field(0.5, gt=0, le=1)
    """Share of the selected devices whose updates must arrive for the round to close."""
    round_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    """Seconds a round waits for its quorum."""
    strategy: StrategyConfig = Field(default_factory=lambda: StrategyConfig(name="composed"))
    """The federated method (:mod:`cloud.strategies`): ``composed`` (the default) is the
    ``assignment`` part plus the ``aggregation`` part; other methods may use those parts
    too."""
    assignment: StrategyConfig = Field(default_factory=lambda: StrategyConfig(name="random_kept"))
    """Who holds which experts each round (:mod:`cloud.assignment`)."""
    aggregation: StrategyConfig = Field(default_factory=lambda: StrategyConfig(name="modular"))
    """How accepted updates become the next global state (:mod:`cloud.aggregation`)."""
    defences: DefenceConfig = Field(default_factory=DefenceConfig)
    """Update screening, a robust rule or DP-FedAvg around ``aggregation``, and the
    pre-commit guard (:mod:`cloud.robust`); screening and the guard are on by default."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Local training hyper-parameters sent with every assignment."""
    weight_format: WeightFormat = "int8"
    """Primary format of the base shards (the cloud evaluates with these weights)."""
    weight_formats: list[WeightFormat] = Field(default_factory=list)
    """Further formats served to devices that prefer them (published on first use)."""
    state_precision: Literal["fp32", "fp16", "bf16", "int8", "nf4"] = "fp32"
    """Precision of the adapter state sent down to each device every round (the down-link
    counterpart of a device's ``update_precision``): fp16/bf16 halve those bytes; int8
    (``protocol.codec.quantize_int8``: a scale per row of LoRA A, per column of LoRA B)
    quarters them; nf4 (blocks of 64) cuts them ~7x at a coarser rounding. The global model stays
    fp32 in the cloud; a device trains from the rounded copy, and a device that uploads
    deltas (``update_delta``) sends what it learned on top of that copy, so the rounding
    never enters the global model. A method's own extra tensors always travel in fp32."""
    state_compression: bool = False
    """zlib-compress the adapter state sent down (``protocol.codec``) to devices of protocol
    minor 8 or later: an nf4 state shrinks by about a seventh, mostly its safetensors header, for ~0.1 s
    of aggregator CPU per 6 MiB state. Updates arrive compressed from devices that set
    ``update_compression`` either way."""
    max_payload: Annotated[Bytes, Field(ge=4096)] = Field(default_factory=_default_chunk_bytes)
    """Largest MQTT payload the aggregator publishes, in bytes (``256KiB`` or an int);
    blobs are chunked to fit (default :data:`protocol.chunking.DEFAULT_CHUNK_BYTES`)."""
    max_update_bytes: PositiveBytes = 256 * 1024**2
    """Largest update a device may send, in bytes (``256MiB`` or an int)."""
    eval_batch_size: int = Field(32, ge=1)
    """Batch size of the cloud's evaluation of the global model."""
    eval_max_samples: int | None = Field(None, ge=1)
    """Evaluate on at most this many test items per task (None: all)."""
    seed: int = 0
    """Seed of device selection and of the strategies' random choices."""
    max_samples_per_device: int = Field(1_000_000, ge=1, le=MAX_SAMPLES)
    """Largest ``num_samples`` a device's statistics may claim, whatever its hello said:
    its weight in |D_c|-weighted aggregation. Statistics claiming more (or more than the
    device's hello declared) are refused."""
    threads: int | None = Field(None, ge=1)
    """torch intra-op threads of the aggregator process (None: torch's default)."""
    min_lora_rank: int | None = Field(None, ge=1, le=256)
    """Heterogeneous LoRA ranks (``moe_model.ranks``): a device of protocol minor 13 or later
    may train a rank below ``model.lora.rank``, halved down to this, so that a small budget
    holds more experts: its experts are chosen at this rank, then its rank is raised as far
    as its budget allows with them. With a frozen, shared ``A`` (``model.lora.train_a``
    false) any aggregation is exact; with trained ``A`` the aggregation must be ``flexlora``,
    ``hlora`` or ``rankwise``. None: every device trains ``model.lora.rank``."""

    @model_validator(mode="after")
    def _check_min_lora_rank(self) -> "FederationSettings":
        r = self.min_lora_rank
        if r is not None:
            if r > self.model.lora.rank:
                raise ValueError(f"min_lora_rank {r} is above the model's LoRA rank {self.model.lora.rank}")
            if self.model.full_finetune:
                raise ValueError("min_lora_rank needs LoRA (no full fine-tuning)")
            if self.model.lora.train_a and self.aggregation.name not in RANKED_AGGREGATIONS:
                raise ValueError("min_lora_rank with trained A factors (model.lora.train_a) needs an aggregation "
                                 f"for factors of different ranks: {', '.join(RANKED_AGGREGATIONS)} "
                                 "(a frozen, shared A aggregates exactly with any rule)")
        return self


class AggregatorConfig(FederationSettings, BrokerSettings):
    """Everything the aggregator needs; loadable from YAML (:meth:`load`). The MQTT
    account and TLS files (``protocol``, ``username``, ``password``, ``tls_ca``,
    ``tls_cert``, ``tls_key``, ``credentials``: the ``aggregator.json`` of ``fedmoe
    provision``) are :class:`protocol.config.BrokerSettings`."""

    model_config = ConfigDict(extra="forbid")
    federation: str = "default"
    """The federation's name: the topic root is ``fl/v1/{federation}``."""
    tasks: dict[str, TaskConfig]
    """Task name -> its labels and data files; a device declares its task in its hello."""
    min_devices: int = Field(1, ge=1)
    """Devices that must have joined before round 1 starts."""
    start_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    """Give up if fewer than ``min_devices`` joined by then."""
    assign_timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Give up (exit non-zero, with the reason) when no online device could be assigned a
    round for this many seconds (every budget below the plan, the strategy failing);
    default: ``start_timeout_s``."""
    store: str = "sqlite:///fedmoe-aggregator.db"
    """Where the durable state lives: ``sqlite:///FILE`` or ``postgresql://...``."""
    stop_devices_when_done: bool = True
    """Send every device ``command: stop`` after the last round."""
    clear_retained_on_exit: bool = False
    """Remove the retained shard messages on exit (simulations, tests)."""
    near_miss_hellos: bool = True
    """Also take the hellos of every federation on the broker (a second MQTT session) and
    tell a device whose federation name is a near miss of this one's, and whose hello no
    one answers, ``did you mean`` (a ``reject`` of its hello, :mod:`cloud.near_miss`), so it
    leaves within about 15 s instead of waiting out its ``hello_timeout_s``. Not a worker's
    job; off where the broker's ACL refuses the wildcard subscription (logged)."""
    shard_url: str | None = Field(None, max_length=1500, pattern=r"^https?://[^\s]+$")
    """Base URL of the shard files (``{shard_url}/{sha256}.safetensors``) a web server or
    CDN serves from ``shard_dir``: devices of protocol minor 6 or later fetch shards there
    by HTTP range requests, and no shard is held in the broker for them (older devices
    still get retained messages). None (default): shards travel as retained MQTT messages."""
    shard_dir: str | None = None
    """Directory the aggregator writes the content-addressed shard files to (required with
    ``shard_url``)."""
    program_capacity_factor: float | None = Field(None, gt=0, le=64)
    """Devices that train with a program (phone-class, ``executorch``): each held expert runs
    on at most ``ceil(c · B·T · k / n)`` tokens per step, those of largest gate, and routed
    tokens beyond that skip it (``moe_model.models.moe.MoELayer.capacity``; GShard's and
    Switch Transformers' capacity factor). Activations and expert compute then scale with ``c·k``
    instead of the ``n`` held experts, at the cost of the dropped tokens. None (the default):
    every routed token: the same function as a Python device's step."""
    program_ops: Literal["fedmoe", "core"] = "fedmoe"
    """The operators of the programs for devices whose runtime has the project's
    (``Hello.runtimes`` names ``executorch-1.5+fedmoe2``; ``moe_model.training_program.OPS``):
    ``fedmoe`` (default), each held expert on exactly its routed tokens (grouped matrix
    products over the expert-sorted (token, expert) pairs, ``moe_model.grouped``) and a causal
    LM's int8 output layer and loss without its logits (``moe_model.lm_head_loss``); ``core``,
    ExecuTorch's own operators only: every held expert on every token (activations and expert
    compute ``n / k`` times the grouped dispatch's) and the whole logits. Devices whose runtime
    lacks them always get ``core``."""
    metrics: str | None = Field(None, max_length=300, pattern=r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]*):\d{1,5}$")
    """``HOST:PORT`` for the Prometheus ``/metrics`` and the ``/healthz``/``/readyz``
    endpoints (``cloud.observability``; port 0: a free one); e.g. ``127.0.0.1:9464``.
    None (default): not served. Bind to loopback unless a scraper elsewhere needs it."""
    dashboard: str | None = Field(None, max_length=300, pattern=r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]*):\d{1,5}$")
    """``HOST:PORT`` of the live, read-only dashboard (``cloud.dashboard``; port 0: a free
    one), e.g. ``127.0.0.1:8080``. None (default): not served. Bind to loopback unless
    ``dashboard_token`` is set."""
    dashboard_token: str | None = Field(None, min_length=16, max_length=256)
    """A secret every dashboard request must carry (``Authorization: Bearer``, or the
    password of HTTP basic auth); at least 16 characters."""

    @model_validator(mode="after")
    def _dashboard_exposed(self) -> "AggregatorConfig":
        if self.dashboard and not self.dashboard_token:
            host = self.dashboard.rpartition(":")[0].strip("[]")
            if host not in ("127.0.0.1", "localhost", "::1"):
                raise ValueError(f"dashboard {self.dashboard!r} listens beyond loopback without a dashboard_token: "
                                 f"set one (or bind to 127.0.0.1)")
        return self

    @model_validator(mode="after")
    def _roles(self) -> "AggregatorConfig":
        if self.role == "all":
            return self
        if not self.store.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"role {self.role!r} needs a postgresql:// store that the coordinator and its workers "
                             f"share, not {self.store.split(':')[0]!r}")
        if self.role == "worker" and not self.worker_id:
            raise ValueError("role 'worker' needs a worker_id (--worker-id), unique among the workers and kept "
                             "across restarts")
        return self

    @model_validator(mode="after")
    def _shards_over_http(self) -> "AggregatorConfig":
        if (self.shard_url is None) != (self.shard_dir is None):
            raise ValueError("shard_url and shard_dir go together: the URL is where a web server serves the "
                             "directory the aggregator writes the shard files to")
        return self
    device_keys: str | None = None
    """JSON file device id -> Ed25519 public key; when set, signatures are required."""
    session_expiry_s: int = Field(7 * 24 * 3600, ge=0)
    """How long the broker keeps the aggregator's session (and queued messages) while it is down."""
    standby: bool = False
    """Wait as a standby while another aggregator holds the store (its leader lock,
    ``cloud.store.Store.acquire_leader``) and take over, resuming its round, when it
    stops or dies; without it an aggregator whose store is held exits at once."""
    role: Literal["all", "coordinator", "worker"] = "all"
    """``all`` (default): one process does everything. ``coordinator``: rounds, assignment,
    registration and the close, while ``worker`` processes take the devices' uploads and
    fold them into running sums in the store (:mod:`cloud.workers`); both need a
    ``postgresql://`` store shared by all of them. Each device's assignment names the
    worker it sends its uploads to (``Assignment.uplink``, protocol minor 9), so any MQTT
    broker serves (an MQTT 3.1.1 cluster too); on MQTT 5 the workers also share the
    uploads of older devices with a shared subscription (Mosquitto 2)."""
    worker_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """A worker's name (``--role worker`` needs one): its broker session and its sums are
    keyed by it, so a worker restarted under the same id gets the uploads the broker kept
    for it."""
    assignment_resend_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    """Re-send an assignment a device has not acknowledged after this many seconds (at
    most 3 times a round; a device acknowledges once it has the adapter state). None
    (default): :data:`CLUSTER_RESEND_S` (60 s) when the broker URL names several nodes (a
    cluster, where devices take their downlink at QoS 0 and can miss a message while moving
    between nodes), else never; 0: never."""
    reconnect_grace_s: float = Field(15.0, ge=0, allow_inf_nan=False)
    """A round does not start while a registered device that went offline less than this
    many seconds ago may still come back (at most this long): a broker node's failover moves
    every client it held, and a round started meanwhile would leave them out of it (the
    default is above the devices' longest reconnect back-off, 10 s). 0: start at once."""
    resume_drain_s: float = Field(3.0, ge=0, allow_inf_nan=False)
    """After a restart the resumed round stays open at least this many seconds, so the
    messages the broker queued for the session are handled before it closes."""

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> "AggregatorConfig":
        """Read YAML and apply top-level overrides (None values are ignored; a dict merges
        into the YAML's section of that name, e.g. ``model={...}``). Raises pydantic
        ValidationError, OSError or yaml.YAMLError."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        for k, v in overrides.items():
            if isinstance(v, dict) and isinstance(data.get(k), dict):
                data[k] = {**data[k], **v}
            elif v is not None:
                data[k] = v
        return cls.model_validate(data)

    def check_paths(self, eval_given: Any = (), reserved_given: Any = ()) -> "AggregatorConfig":
        """Check what the config names outside itself, before anything is built (the
        model takes seconds to set up): each task's ``eval_data`` file exists, unless the
        task is in ``eval_given`` (tasks whose items the caller passes as
        ``Aggregator(eval_data=...)``); ``eval_data: builtin:NAME`` (a built-in data set)
        must be among those, as only the ``fedmoe`` command can load it; each task's
        ``reserved_data`` file exists unless the task is in ``reserved_given``; the
        ``credentials``, ``device_keys``, ``tls_ca``, ``tls_cert`` and ``tls_key`` files
        exist; the store URL has a supported scheme. Relative paths are relative to the
        working directory. Returns ``self``.

        Raises:
            ValueError: every problem found, in one line.
        """
        from .store import url_problem

        bad, given = [], set(eval_given)
        for name, task in self.tasks.items():
            ref = task.eval_data
            if not ref or name in given:
                continue
            if ref.startswith("builtin:"):
                bad.append(f"tasks.{name}.eval_data {ref!r} names a built-in data set, which only the fedmoe "
                           f"command resolves (`fedmoe aggregator --config ...`); elsewhere pass the items as "
                           f"Aggregator(eval_data={{{name!r}: [(text, label), ...]}})")
            elif not Path(ref).is_file():
                bad.append(f"tasks.{name}.eval_data: no such file {ref!r} (in {Path.cwd()})")
        for name, task in self.tasks.items():
            if task.reserved_data and name not in set(reserved_given) and not Path(task.reserved_data).is_file():
                bad.append(f"tasks.{name}.reserved_data: no such file {task.reserved_data!r} (in {Path.cwd()})")
        bad += self.missing_files()
        if self.device_keys and not Path(self.device_keys).is_file():
            bad.append(f"device_keys: no such file {self.device_keys!r}")
        problem = url_problem(self.store)
        if problem:
            bad.append(f"store: {problem}")
        if bad:
            raise ValueError("; ".join(bad))
        return self
