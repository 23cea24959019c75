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

Its parts, one module each: the settings and the configs the processes run from
(:mod:`fedmoe.sim_config`, options in :mod:`fedmoe.sim_options`), device memory budgets
(:mod:`fedmoe.sim_budgets`), the data (:mod:`fedmoe.sim_data`), the processes
(:mod:`fedmoe.supervisor`) and the progress shown while it runs (:mod:`fedmoe.sim_progress`).
Their public names are importable from here too.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from edge_sdk.config import DeviceConfig
from protocol.topics import Topics

from .broker import EmbeddedBroker
from .options import schema_options
from .sim_budgets import auto_budget_range, check_budgets, device_baseline_bytes, small_device_budget
from .sim_config import (  # noqa: F401  (_model_dict: re-exported)
    SimulationConfig, SimulationConfigError, _model_dict, aggregator_config, check_names, device_config,
)
from .sim_data import builtin_test_set, prepare_data, split_task
from .sim_options import ALIASES, OPTIONS, error_name
from .sim_progress import Narrator, watch
from .supervisor import Processes, stop_on_signals

# torch (moe_model, edge_sdk.client) and protocol.transport are imported where used, so
# that a SimulationConfig is checked within a second.

log = logging.getLogger(__name__)

_prepare_data = prepare_data
"""The former name of :func:`fedmoe.sim_data.prepare_data`."""

__all__ = [  # what the modules of a simulation export, importable from here as before they were split
    "ALIASES", "OPTIONS", "SimulationConfig", "SimulationConfigError", "aggregator_config", "auto_budget_range",
    "builtin_test_set", "check_budgets", "device_baseline_bytes", "device_config", "simulate",
    "small_device_budget", "split_task",
]


def simulate(cfg: SimulationConfig) -> dict[str, Any]:
    """Run the simulation described by ``cfg`` and return the report (also written to
    ``{out}/report.json``). SIGINT, SIGTERM and SIGHUP stop every process it started
    (:mod:`fedmoe.supervisor`) and raise KeyboardInterrupt or SystemExit.

    Raises:
        SimulationConfigError: a setting that cannot work (:meth:`SimulationConfig.validate`,
            unknown strategies, :func:`check_budgets`), found before any process starts.
        RuntimeError: the aggregator process failed (its log tail is in the message).
    """
    with stop_on_signals():
        return _simulate(cfg)


def _simulate(cfg: SimulationConfig) -> dict[str, Any]:
    """:func:`simulate`'s work (its signal handlers set)."""
    from protocol.transport import Transport

    from . import report as R

    t_start = time.time()
    cfg.validate()
    check_names(cfg, error_name(("model", "base")))
    if cfg.device_memory_limit:
        from .cgroups import unavailable

        why = unavailable()
        if why:
            raise SimulationConfigError(f"--device-memory-limit: {why} (needs root or a delegated cgroup)")
    out = Path(cfg.out)
    given = bool(cfg.budgets) or cfg.budget_range is not None  # auto budgets (set by prepare_data) fit by design
    devices, tasks = prepare_data(cfg, out / "data")
    if given:
        check_budgets(cfg, devices)  # before any process starts
    (out / "logs").mkdir(parents=True, exist_ok=True)
    federation = f"sim-{uuid.uuid4().hex[:8]}"
    store = out / "aggregator.db"
    store.unlink(missing_ok=True)
    shutil.rmtree(out / "cache", ignore_errors=True)  # fresh devices: round 1 fetches their base shards
    agg_cfg = aggregator_config(cfg, tasks, federation, f"sqlite:///{store}")
    native = _native_devices(cfg, devices, out)  # before any process starts: the build takes minutes once
    if native is not None:
        agg_cfg.update(shard_url=native.server.url, shard_dir=str(native.server.directory))
    (out / "aggregator.yaml").write_text(yaml.safe_dump(agg_cfg, sort_keys=False))
    log.info("simulating %d devices x %d rounds of %s (%s, %s assignment, %s aggregation, %d experts per MoE "
             "layer) -> %s", cfg.devices, cfg.rounds, cfg.strategy.name, cfg.partition, cfg.assignment.name,
             cfg.aggregation.name, cfg.model.num_experts, out)
    broker = None if cfg.broker else EmbeddedBroker(log_file=out / "logs" / "broker.log").start()
    url = cfg.broker or broker.url
    protocol = ["--protocol", "3.1.1"] if broker else []
    procs = Processes(out / "logs")
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
            lim = limits.get(d["device_id"])
            if native is not None and d["device_id"] in native.tokens:
                procs.start(d["device_id"], native_args(cfg, d, url, federation, native.tokens[d["device_id"]],
                                                        bool(broker)),
                            cfg.device.threads or 1, preexec=lim.preexec() if lim else None, program=native.binary)
                continue
            dev = device_config(cfg, d, url, federation, protocol="3.1.1" if broker else "auto")
            path = out / "devices" / f"{d['device_id']}.yaml"
            fields = dev.model_dump(mode="json", exclude_none=True)
            fields = {k: fields[k] for k in schema_options(DeviceConfig) if k in fields}  # the --help order
            path.write_text(yaml.safe_dump(fields, sort_keys=False))
            procs.start(d["device_id"], ["device", "--config", str(path)], cfg.device.threads or 1,
                        preexec=lim.preexec() if lim else None)
        watch(watcher, procs, narrator)
        rc = procs.procs["aggregator"].wait()
        if rc != 0:
            raise RuntimeError(f"aggregator exited with {rc}:\n{procs.tail('aggregator')}")
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C or a signal: end every process now, not after a grace period
        procs.stop(timeout=0.0)
        raise
    finally:
        procs.stop()
        watcher.close()
        if broker is not None:
            broker.stop()
        if native is not None:
            native.server.close()
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


NATIVE_FORMATS = ("fp32", "int8", "nf4")
"""The base-shard formats the native device holds (its training programs take them as stored)."""


class NativeDevices(NamedTuple):
    """What the native devices of a simulation run from (:func:`_native_devices`)."""

    binary: Path
    """``fedmoe-device``, built."""
    tokens: dict[str, Path]
    """Device id -> its data as token ids (:mod:`fedmoe.native_data`)."""
    server: Any
    """The :class:`fedmoe.file_server.FileServer` the aggregator serves shards and programs from."""


def _native_devices(cfg: SimulationConfig, devices: list[dict[str, Any]], out: Path) -> NativeDevices | None:
    """For ``cfg.native_devices``: the native device built, the first devices' data written as
    token ids (each such device marked ``"runtime": "native"``), and a local web server
    started; None without native devices.

    Raises:
        SimulationConfigError: the native device cannot be built (the reason names what to install).
    """
    if not cfg.native_devices:
        return None
    from edge_sdk.data import load_text_file

    from .file_server import FileServer
    from .native import NativeBuildError, binary
    from .native_data import write_token_file

    try:
        program = binary("fedmoe-device")
    except NativeBuildError as e:
        raise SimulationConfigError(f"--native-devices: {e}") from None
    tokens = {}
    for d in devices[: cfg.native_devices]:
        path = Path(d["data"]).with_suffix(".tokens.safetensors")
        tokens[d["device_id"]] = write_token_file(load_text_file(d["data"]).items, cfg.model, path)
        d["runtime"] = "native"
    (out / "served").mkdir(exist_ok=True)
    return NativeDevices(program, tokens, FileServer(out / "served"))


def native_args(cfg: SimulationConfig, device: dict[str, Any], broker: str, federation: str, tokens: Path,
                mqtt311: bool) -> list[str]:
    """The ``fedmoe-device`` command line of a simulated native device: the Python device's
    settings where both have them (budget, formats, seed, validation share, hello timeout, one
    thread unless ``device.threads`` says more)."""
    from .sim_config import SIM_START_TIMEOUT_S

    args = ["--broker", broker, "--device-id", device["device_id"], "--federation", federation, "--task",
            device["task"], "--budget", str(int(device["budget_bytes"])), "--data", str(tokens), "--cache",
            str(Path(cfg.out) / "cache" / device["device_id"]), "--formats",
            ",".join(f for f in cfg.device.formats if f in NATIVE_FORMATS) or "int8", "--seed", str(cfg.device.seed),
            "--val-fraction", str(cfg.device.val_fraction), "--hello-timeout",
            str(cfg.device.hello_timeout_s if "hello_timeout_s" in cfg.device.model_fields_set else SIM_START_TIMEOUT_S)]
    if (cfg.device.threads or 1) == 1:  # as the Python devices here (one torch thread each)
        args += ["--threads", "1"]
    return args + (["--protocol", "3.1.1"] if mqtt311 else [])
