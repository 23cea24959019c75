"""FedMoE's Table 1 and Table 2 on our data (Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of Experts", arXiv:2408.11304, "End-to-End
Performance" and "Ablation Study").

Settings (two tasks on one upcycled MiniLM MoE: BBC News topics, 5 classes, and tweet
sentiment, 3 classes; each task with its own head, aggregated only among its devices):

- Standard-Hetero-T: devices split evenly between the tasks, i.i.d. within a task;
  a random subset selected per round.
- Standard-Hetero-TD: the same plus Dirichlet(0.5) label skew within a task.

Methods: FedMoE (``fedmoe`` assignment + aggregation), randomMoE (``randommoe``: random
experts, FedMoE's sizes), FedProx on the full MoE (``full`` + proximal term μ = 0.01 in
the device's local objective), FedAvg on the full MoE (``full``). Ablations on
Standard-Hetero-T: FedMoE w/o stage 1 (no probe, uniform p), w/o stage 2 (no expert
recommendation).

Every cell is a real ``fedmoe simulate`` run (separate device processes over the embedded
MQTT broker). Columns: per-task accuracy of the global model on the task's test split
after the last round, the per-task mean of each device's latest local validation accuracy
(its personalised sub-model), communication (GB counted on the wire by the devices, up +
down, all rounds), peak device memory (GB, the largest per-process peak RSS over devices
and rounds; also the mean of per-device peaks), expert counts of the client-expert map.

Devices' memory budgets are heterogeneous (:func:`device_budgets`): within each task,
half the devices hold the full MoE with a margin for their baselines' growth, half cannot.
The full-MoE baselines cannot use the latter (``full`` leaves them out); FedMoE probes
the former and estimates p for the latter.

Cells are resumable: each writes ``runs/fedmoe_table/<profile>/<cell>/report.json`` and is
skipped when that exists (``--force`` reruns). ``--lock FILE`` holds an exclusive flock
only while a cell runs (the machine is shared). Writes ``results/fedmoe_table.json``,
``results/fedmoe_table.md`` and ``results/fedmoe_table_<setting>.png``.

    python -m benchmarks.fedmoe_table --quick      # < 10 min: 6 devices, 3 rounds
    python -m benchmarks.fedmoe_table              # 12 devices, 4 per round, 10 rounds
    python -m benchmarks.fedmoe_table --collect    # tables from the cells finished so far
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import fmt as _fmt, heavy_lock, slug
from moe_model.budget import estimate
from fedmoe.simulate import SimulationConfig, simulate
from protocol.messages import ModelSpec

ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("fedmoe_table")

SETTINGS = {"Standard-Hetero-T": "iid", "Standard-Hetero-TD": "dirichlet:0.5"}
METHODS: dict[str, dict[str, Any]] = {
    "FedMoE": {"assignment": "fedmoe", "aggregation": "fedmoe"},
    "randomMoE": {"assignment": "randommoe", "aggregation": "modular"},
    "FedProx (full MoE)": {"assignment": "full", "aggregation": "modular", "prox_mu": 0.01},
    "FedAvg (full MoE)": {"assignment": "full", "aggregation": "modular"},
}
ABLATIONS: dict[str, dict[str, Any]] = {
    "FedMoE w/o stage 1": {"assignment": "fedmoe", "aggregation": "fedmoe", "params": {"stage1": False}},
    "FedMoE w/o stage 2": {"assignment": "fedmoe", "aggregation": "fedmoe", "params": {"stage2": False}},
}
PROFILES = {
    "quick": dict(devices=6, clients_per_round=2, rounds=3, max_steps=4, max_seq_len=32, max_samples_per_task=600,
                  probe_steps=3, patience=1),
    "full": dict(devices=12, clients_per_round=4, rounds=10, max_steps=8, max_seq_len=64, max_samples_per_task=1500,
                 probe_steps=4, patience=1),
}
TASKS = ["bbc", "tweets"]
@functools.lru_cache(maxsize=1)
def runtime_baseline() -> int:
    """Device process memory before the model, measured here, plus the devices' default
    headroom (``fedmoe.simulate.device_baseline_bytes``; the measured part was 432-440 MiB
    on 2026-11-23, 467 MiB on a fresh install on 2026-11-24), so the budgets keep the same
    meaning whatever the installed packages weigh."""
    from fedmoe.simulate import device_baseline_bytes

    return device_baseline_bytes()


GROWTH_MARGIN_BYTES = 32 * 2**20
"""How far above the full MoE's plan the budgets of the devices that hold it start:
when the committed table was measured, devices folded their per-round heap growth into
their baseline (up to ~25 MiB over 10 rounds, oneDNN's primitive cache, since bounded),
and a device whose budget held the full MoE only at start-up dropped out of the full-MoE
baselines after a few rounds. Kept so reruns stay comparable with that table."""


def device_budgets(profile: str, seed: int, batch: int = 8) -> list[int]:
    """Per-device budgets (bytes), over :func:`runtime_baseline` (which includes the
    devices' headroom). Within each task, devices alternate between one that cannot hold
    the full MoE (drawn between the memory plans of 2 and E-1 experts per layer) and one
    that holds it with :data:`GROWTH_MARGIN_BYTES` to spare (drawn from full +
    margin to full + margin + (full - plan(2))), so half the devices of each task can
    train the full MoE (the full-MoE baselines and FedMoE's stage-one probes use them)."""
    p = PROFILES[profile]
    spec = ModelSpec(max_seq_len=p["max_seq_len"], num_experts=8)
    plan = lambda k: estimate(spec, k, batch, 5, runtime_baseline()).total  # noqa: E731
    lo, below_full, full = plan(2), plan(spec.num_experts - 1), plan(spec.num_experts)
    rng = random.Random(seed)
    return [rng.randint(lo, below_full) if i % 2 == 0 else
            rng.randint(full + GROWTH_MARGIN_BYTES, full + GROWTH_MARGIN_BYTES + full - lo)
            for i in range(p["devices"])]


def cell_config(profile: str, setting: str, method: dict[str, Any], out: Path, seed: int) -> SimulationConfig:
    p = PROFILES[profile]
    params = dict(method.get("params", {}))
    if method["assignment"] in ("fedmoe", "randommoe"):
        params = {"probe_steps": p["probe_steps"], "patience": p["patience"], **params}
        if method["assignment"] == "randommoe":
            params.pop("patience")
    return SimulationConfig(
        out=str(out), devices=p["devices"], rounds=p["rounds"], tasks=TASKS, partition=SETTINGS[setting],
        assignment=method["assignment"], assignment_params=params, aggregation=method["aggregation"],
        budgets=[str(b) for b in device_budgets(profile, seed)], seed=seed, max_seq_len=p["max_seq_len"],
        max_steps=p["max_steps"],
        prox_mu=method.get("prox_mu", 0.0), clients_per_round=p["clients_per_round"],
        max_samples_per_task=p["max_samples_per_task"], quorum=0.5,
    )


def _expert_counts(out: Path) -> dict[str, Any] | None:
    """Mean expert count of the client-expert map at initialisation and at the end, and
    the final min/max (FedMoE strategies only), read from the aggregator's store."""
    from cloud.store import Store

    db = out / "aggregator.db"
    if not db.exists():
        return None
    st = Store(f"sqlite:///{db}")
    state = (st.get_json("strategy_state") or {}).get("assignment") or st.get_json("assignment_state", {}) or {}
    st.close()
    if "map" not in state:
        return None
    count = lambda m: [sum(len(v) for v in e.values()) for e in m.values()]  # noqa: E731
    init, final = count(state.get("initial", {})), count(state["map"])
    if not final:
        return None
    events = [e["event"] for h in state.get("history", []) for e in h["events"]]
    return {"initial_mean": sum(init) / len(init) if init else None, "final_mean": sum(final) / len(final),
            "final_min": min(final), "final_max": max(final), "devices": len(final),
            "recommended": events.count("recommended"), "reverted": events.count("reverted"),
            "kept": events.count("kept"), "probed": len(state.get("probes", {}))}


def summarise(report: dict[str, Any], out: Path) -> dict[str, Any]:
    """The table row of one run."""
    rounds = report["rounds"]
    last = rounds[-1] if rounds else {}
    devices = {d["device_id"]: d for d in report["config"]["devices"]}
    latest: dict[str, float] = {}
    peaks: dict[str, int] = {}
    peaks2: dict[str, int] = {}  # rounds where the device was not running a full-MoE probe
    comm, device_rounds = 0, 0
    for r in rounds:
        probing = set(r.get("assignment", {}).get("probing", []))
        for d, v in r["devices"].items():
            comm += v["bytes_up"] + v["bytes_down"]
            device_rounds += 1
            peaks[d] = max(peaks.get(d, 0), v["peak_rss_bytes"])
            if d not in probing:
                peaks2[d] = max(peaks2.get(d, 0), v["peak_rss_bytes"])
            if v.get("val_accuracy") is not None:
                latest[d] = v["val_accuracy"]
    per_task_local = {}
    for task in TASKS:
        accs = [a for d, a in latest.items() if devices[d]["task"] == task]
        per_task_local[task] = sum(accs) / len(accs) if accs else None
    trained = sorted({d for r in rounds for d in r["devices"]})
    return {
        "accuracy": {t: (last.get("per_task", {}).get(t) or {}).get("accuracy") for t in TASKS},
        "initial_accuracy": {t: (report.get("initial_per_task") or {}).get(t, {}).get("accuracy") for t in TASKS},
        "local_accuracy": per_task_local,
        "accuracy_per_round": {t: [(r.get("per_task", {}).get(t) or {}).get("accuracy") for r in rounds]
                               for t in TASKS},
        "comm_gb": comm / 1e9,
        "comm_mb_per_device_round": comm / 1e6 / device_rounds if device_rounds else None,
        "peak_memory_gb": max(peaks.values()) / 2**30 if peaks else None,
        "mean_device_peak_gb": sum(peaks.values()) / len(peaks) / 2**30 if peaks else None,
        "peak_memory_no_probe_gb": max(peaks2.values()) / 2**30 if peaks2 else None,
        "devices_trained": len(trained), "devices_total": len(devices),
        "rounds_ok": sum(r["status"] == "ok" for r in rounds), "rounds": len(rounds),
        "experts": _expert_counts(out),
        "wall_seconds": report.get("wall_seconds"),
    }


def cell_dir(base: Path, setting: str, name: str) -> Path:
    """Where one cell's simulation writes its report."""
    return base / slug(f"{setting}--{name}")


def run_cell(profile: str, setting: str, name: str, method: dict[str, Any], base: Path, seed: int, force: bool,
             lock: str | None, collect: bool = False) -> dict[str, Any] | None:
    out = cell_dir(base, setting, name)
    if (out / "report.json").exists() and not force:
        log.info("%s / %s: reusing %s", setting, name, out / "report.json")
        report = json.loads((out / "report.json").read_text())
    elif collect:
        return None
    else:
        cfg = cell_config(profile, setting, method, out, seed)
        log.info("%s / %s: running (%s)", setting, name, out)
        with heavy_lock(lock):
            t0 = time.time()
            try:
                report = simulate(cfg)
            except Exception as e:  # one failed cell must not lose the others
                log.error("%s / %s failed: %s", setting, name, e)
                return None
            log.info("%s / %s: %.0f s", setting, name, time.time() - t0)
    measured = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime((out / "report.json").stat().st_mtime))
    return {"setting": setting, "method": name, "dir": str(out), "measured": measured, **summarise(report, out)}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# FedMoE table ({result['profile']} profile)", "",
             f"Measured {result['date']} on {result['machine']}. {result['note']}",
             f"Profile: {json.dumps(result['profile_config'])}; budgets (MiB, per device, tasks in turn): "
             f"{', '.join(f'{b / 2**20:.0f}' for b in result['budgets_bytes'])}.", ""]
    dates = sorted({c["measured"] for c in result["cells"] if c.get("measured")})
    if len(dates) > 1:
        lines += ["Cells measured at: "
                  + "; ".join(f"{c['setting']} / {c['method']}: {c['measured']}" for c in result["cells"]) + ".", ""]
    if result.get("cells_missing"):
        lines += [f"Not run (no finished report): {', '.join(result['cells_missing'])}.", ""]
    for setting in SETTINGS:
        rows = [c for c in result["cells"] if c["setting"] == setting and c["method"] in METHODS]
        if not rows:
            continue
        lines += [f"## {setting}", "",
                  "| Method | bbc acc (global) | tweets acc (global) | bbc acc (local) | tweets acc (local) "
                  "| Comm. (GB) | MB per device-round | Peak mem (GiB) | Peak w/o probe rounds (GiB) | Mean device peak (GiB) | Devices trained |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in rows:
            lines.append(f"| {c['method']} | {_fmt(c['accuracy']['bbc'])} | {_fmt(c['accuracy']['tweets'])} | "
                         f"{_fmt(c['local_accuracy']['bbc'])} | {_fmt(c['local_accuracy']['tweets'])} | "
                         f"{_fmt(c['comm_gb'])} | {_fmt(c['comm_mb_per_device_round'], '.1f')} | {_fmt(c['peak_memory_gb'])} | {_fmt(c['peak_memory_no_probe_gb'])} | "
                         f"{_fmt(c['mean_device_peak_gb'])} | "
                         f"{c['devices_trained']}/{c['devices_total']} |")
        lines.append("")
    abl = [c for c in result["cells"] if c["setting"] == "Standard-Hetero-T" and (c["method"] in ABLATIONS
                                                                                 or c["method"] == "FedMoE")]
    if abl:
        lines += ["## Ablation (Standard-Hetero-T)", "",
                  "| Method | bbc acc (global) | tweets acc (global) | bbc acc (local) | tweets acc (local) "
                  "| Experts avg (init → end) | Min/Max (end) | Recommended / reverted |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in abl:
            e = c.get("experts") or {}
            lines.append(f"| {c['method']} | {_fmt(c['accuracy']['bbc'])} | {_fmt(c['accuracy']['tweets'])} | "
                         f"{_fmt(c['local_accuracy']['bbc'])} | {_fmt(c['local_accuracy']['tweets'])} | "
                         f"{_fmt(e.get('initial_mean'), '.1f')} → {_fmt(e.get('final_mean'), '.1f')} | "
                         f"{e.get('final_min', '–')}/{e.get('final_max', '–')} | "
                         f"{e.get('recommended', '–')} / {e.get('reverted', '–')} |")
        lines.append("")
    lines += ["Columns: *global* = the global MoE on the task's test split after the last round; *local* = mean "
              "over the task's devices of their latest validation accuracy (own sub-model, after local training). "
              "Comm. = bytes on the wire counted by the devices (MQTT packets up + down, all rounds, base shards "
              "included). Peak mem = largest per-device-process peak RSS (GiB) over all rounds (FedMoE's and "
              "randomMoE's include their stage-one full-MoE probe rounds; the next column leaves those out). "
              "Devices trained = devices that took part in at least one round (the full-MoE baselines cannot "
              "use devices whose budget does not hold the full MoE). Expert counts are totals over the 3 MoE layers (24 = full MoE).", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], out_dir: Path, suffix: str = "") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for setting in SETTINGS:
        cells = [c for c in result["cells"] if c["setting"] == setting]
        if not cells:
            continue
        fig, axes = plt.subplots(1, len(TASKS), figsize=(11, 4), sharey=True)
        for ax, task in zip(axes, TASKS):
            for c in cells:
                ys = [c["initial_accuracy"][task]] + c["accuracy_per_round"][task]
                ax.plot(range(len(ys)), [float("nan") if y is None else y for y in ys], "o-", label=c["method"])
            ax.set_title(f"{setting}: {task}")
            ax.set_xlabel("round")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("global test accuracy")
        axes[-1].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"fedmoe_table_{setting}{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="6 devices, 3 rounds (< 10 min)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated settings")
    ap.add_argument("--methods", help="comma-separated methods/ablations (default: all)")
    ap.add_argument("--no-ablations", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="", help="a line for the table's header (e.g. what else ran on the machine)")
    ap.add_argument("--force", action="store_true", help="rerun cells that already have a report")
    ap.add_argument("--lock", help="flock this file while a cell runs")
    ap.add_argument("--collect", action="store_true", help="only tabulate cells that already finished")
    ap.add_argument("--keep-previous", action="store_true",
                    help="cells with no report under --runs are taken from the committed results JSON of the same "
                         "profile (marked with their measurement date) instead of being run")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "fedmoe_table"))
    ap.add_argument("--results", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for name in ("amqtt", "transitions", "fedmoe.simulate"):
        logging.getLogger(name).setLevel(logging.WARNING)
    profile = "quick" if args.quick else "full"
    base = Path(args.runs) / profile
    wanted = set(args.methods.split(",")) if args.methods else None
    suffix = "" if profile == "full" else "_quick"
    previous: dict[tuple[str, str], dict[str, Any]] = {}
    if args.keep_previous and (Path(args.results) / f"fedmoe_table{suffix}.json").exists():
        old = json.loads((Path(args.results) / f"fedmoe_table{suffix}.json").read_text())
        for c in old["cells"]:
            previous[(c["setting"], c["method"])] = {**c, "measured": c.get("measured", old["date"])}
    t0 = time.time()
    cells, missing = [], []
    for setting in args.settings.split(","):
        todo = dict(METHODS)
        if setting == "Standard-Hetero-T" and not args.no_ablations:
            todo.update(ABLATIONS)
        for name, method in todo.items():
            if wanted and name not in wanted:
                continue
            if (setting, name) in previous and not (cell_dir(base, setting, name) / "report.json").exists():
                cells.append(previous[(setting, name)])
                log.info("%s / %s: kept from the previous results (%s)", setting, name,
                         previous[(setting, name)]["measured"])
                continue
            c = run_cell(profile, setting, name, method, base, args.seed, args.force, args.lock, args.collect)
            if c is None:
                missing.append(f"{setting} / {name}")
            else:
                cells.append(c)
                print(f"{setting:20s} {name:22s} bbc {_fmt(c['accuracy']['bbc'])} tweets "
                      f"{_fmt(c['accuracy']['tweets'])} local {_fmt(c['local_accuracy']['bbc'])}/"
                      f"{_fmt(c['local_accuracy']['tweets'])} comm {c['comm_gb']:.3f} GB "
                      f"peak {_fmt(c['peak_memory_gb'])} GB", flush=True)
    import platform
    import os

    result = {
        "profile": profile, "profile_config": PROFILES[profile], "settings": SETTINGS, "tasks": TASKS,
        "budgets_bytes": device_budgets(profile, args.seed),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "note": args.note,
        "cells": cells, "cells_missing": missing, "wall_seconds_this_invocation": time.time() - t0,
    }
    res = Path(args.results)
    res.mkdir(parents=True, exist_ok=True)
    (res / f"fedmoe_table{suffix}.json").write_text(json.dumps(result, indent=1))
    (res / f"fedmoe_table{suffix}.md").write_text(markdown(result))
    plot(result, res, suffix)  # the quick profile must not overwrite the full profile's plots
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
