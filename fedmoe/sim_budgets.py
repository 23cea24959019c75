"""Device memory budgets of a simulation: a device process's baseline measured on this
machine, the budgets each device gets (given, drawn from a range, or by default from the
memory plan of 2 experts per layer to every expert), and the check that every given
budget holds at least one expert per layer (``moe_model.budget.estimate``)."""

from __future__ import annotations

import logging
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import btx_domains
from .datasets import load_task
from .sim_config import SimulationConfig, SimulationConfigError

log = logging.getLogger(__name__)

AUTO_BUDGET_MARGIN_BYTES = 32 * 2**20
"""Automatic budgets are planned on top of the probed baseline plus this margin: a device
process measures its own baseline at start-up, a few MiB above the probe's (its data, its
MQTT client), and must still fit the plan it was drawn for."""


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


def task_labels(cfg: SimulationConfig, task: str) -> int:
    """The label count of ``task`` (a task head's size in the memory plan): a built-in task's
    classes, or the ``domains`` of the BTX checkpoint ``model.base``."""
    if task == btx_domains.TASK:
        return len(btx_domains.read_record(cfg.model.base)["domains"])
    return len(load_task(task)[1])


def label_count(cfg: SimulationConfig) -> int:
    """The largest :func:`task_labels` of ``cfg``'s tasks."""
    return max(task_labels(cfg, t) for t in cfg.tasks)


def auto_budget_range(cfg: SimulationConfig) -> tuple[int, int]:
    """Budgets (bytes) from the plan of 2 experts per layer (fewer if the model has
    fewer) to that of every expert, at ``cfg``'s model, batch size and weight format,
    on top of :func:`device_baseline_bytes` plus :data:`AUTO_BUDGET_MARGIN_BYTES`
    (``moe_model.budget.estimate``)."""
    from moe_model.budget import estimate

    spec, experts, batch = cfg.model, cfg.model.num_experts, cfg.train.batch_size
    labels = label_count(cfg)
    base = device_baseline_bytes() + AUTO_BUDGET_MARGIN_BYTES
    lo = estimate(spec, min(2, experts), batch, labels, base, cfg.weight_format).total
    hi = estimate(spec, experts, batch, labels, base, cfg.weight_format).total
    log.info("device baseline %.0f MiB here (with a %.0f MiB margin): budgets %.0f-%.0f MiB (2-%d experts per "
             "layer)", base / 2**20, AUTO_BUDGET_MARGIN_BYTES / 2**20, lo / 2**20, hi / 2**20, experts)
    return lo, hi


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def device_budgets(cfg: SimulationConfig) -> list[int]:
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
    labels = label_count(cfg)
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
    :func:`device_baseline_bytes` with the largest device data file loaded, unless given; for
    the native devices (the first ``cfg.native_devices``)
    :data:`fedmoe.native.NATIVE_BASELINE_BYTES`.
    Auto budgets (neither set) start at 2 experts per layer and are not checked.

    Args:
        devices: the device specs of :func:`fedmoe.sim_data.prepare_data` (``device_id``, ``task``,
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

    labels = {t: task_labels(cfg, t) for t in cfg.tasks}

    def plan(task: str, experts: int, base: int = baseline) -> int:
        return estimate(spec, experts, batch, labels[task], base, cfg.weight_format).total

    from .native import NATIVE_BASELINE_BYTES

    native = {d["device_id"] for d in devices[: cfg.native_devices]}  # the native device's baseline is its own
    below = [d for d in devices
             if d["budget_bytes"] < plan(d["task"], 1, NATIVE_BASELINE_BYTES if d["device_id"] in native else baseline)]
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
