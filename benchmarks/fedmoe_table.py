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

The table is the harness's (:mod:`benchmarks.harness`) on ``benchmarks/configs/fedmoe_table.yaml``
(settings, methods, ablations, profiles); this module is its cells (``table: fedmoe_table``)
and, as its rows are per task and per process with one seed (no statistics over seeds),
its own markdown and plots. Cells are resumable: each writes
``runs/fedmoe_table/<profile>/s<seed>/<cell>/report.json`` and is skipped when that exists
(``--force`` reruns). ``--lock FILE`` holds an exclusive flock only while a cell runs (the
machine is shared). ``--reuse results/fedmoe_table.json`` takes the committed rows for cells
with no report (what ``--keep-previous`` did). Writes ``results/fedmoe_table.json``,
``results/fedmoe_table.md`` and ``results/fedmoe_table_<setting>.png``.

    python -m benchmarks.fedmoe_table --quick      # < 10 min: 6 devices, 3 rounds
    python -m benchmarks.fedmoe_table              # 12 devices, 4 per round, 10 rounds
    python -m benchmarks.fedmoe_table --collect    # tables from the cells finished so far
    # the same: python -m benchmarks.harness benchmarks/configs/fedmoe_table.yaml [options]
"""

from __future__ import annotations

import functools
import json
import random
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, fmt as _fmt

CONFIG = ROOT / "benchmarks" / "configs" / "fedmoe_table.yaml"
REQUIRED = ("name", "settings", "tasks", "seeds", "devices", "clients_per_round", "rounds", "max_steps",
            "max_seq_len", "max_samples_per_task", "probe_steps", "patience", "methods")
PROFILE_KEYS = ("devices", "clients_per_round", "rounds", "max_steps", "max_seq_len", "max_samples_per_task",
                "probe_steps", "patience")
STATS = False


def check(cfg: dict[str, Any]) -> list[str]:
    """A config's problems: a method without ``assignment`` or ``aggregation``."""
    return [f"method {m!r} needs assignment and aggregation" for m, v in {**cfg["methods"], **cfg["ablations"]}.items()
            if not {"assignment", "aggregation"} <= set(v)]


def settings_of(cfg: dict[str, Any]) -> dict[str, str]:
    """Setting name -> its partition scheme within a task."""
    return dict(cfg["settings"])


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


def device_budgets(cfg: dict[str, Any], seed: int, batch: int = 8) -> list[int]:
    """Per-device budgets (bytes), over :func:`runtime_baseline` (which includes the
    devices' headroom). Within each task, devices alternate between one that cannot hold
    the full MoE (drawn between the memory plans of 2 and E-1 experts per layer) and one
    that holds it with :data:`GROWTH_MARGIN_BYTES` to spare (drawn from full +
    margin to full + margin + (full - plan(2))), so half the devices of each task can
    train the full MoE (the full-MoE baselines and FedMoE's stage-one probes use them)."""
    from moe_model.budget import estimate
    from protocol.messages import ModelSpec

    spec = ModelSpec(max_seq_len=cfg["max_seq_len"], num_experts=8)
    plan = lambda k: estimate(spec, k, batch, 5, runtime_baseline()).total  # noqa: E731
    lo, below_full, full = plan(2), plan(spec.num_experts - 1), plan(spec.num_experts)
    rng = random.Random(seed)
    return [rng.randint(lo, below_full) if i % 2 == 0 else
            rng.randint(full + GROWTH_MARGIN_BYTES, full + GROWTH_MARGIN_BYTES + full - lo)
            for i in range(cfg["devices"])]


def cell_config(cfg: dict[str, Any], partition: str, method: dict[str, Any], out: Path, seed: int, broker: str):
    """The ``fedmoe simulate`` configuration of one cell over the MQTT broker at ``broker``."""
    from fedmoe.simulate import SimulationConfig

    params = dict(method.get("params", {}))
    if method["assignment"] in ("fedmoe", "randommoe"):
        params = {"probe_steps": cfg["probe_steps"], "patience": cfg["patience"], **params}
        if method["assignment"] == "randommoe":
            params.pop("patience")
    return SimulationConfig(
        out=str(out), devices=cfg["devices"], rounds=cfg["rounds"], tasks=cfg["tasks"], partition=partition,
        assignment=method["assignment"], assignment_params=params, aggregation=method["aggregation"],
        budgets=[str(b) for b in device_budgets(cfg, seed)], seed=seed, max_seq_len=cfg["max_seq_len"],
        max_steps=cfg["max_steps"], prox_mu=method.get("prox_mu", 0.0), clients_per_round=cfg["clients_per_round"],
        max_samples_per_task=cfg["max_samples_per_task"], quorum=0.5, broker=broker,
    )


def run_cell(cfg: dict[str, Any], partition: str, method: dict[str, Any], seed: int, out: Path,
             url: str) -> dict[str, Any]:
    """One ``fedmoe simulate`` run (aggregator and device processes) over the broker at
    ``url``; its report, with the client-expert map's counts (:func:`_expert_counts`) added
    (also to ``out/report.json``)."""
    from fedmoe.simulate import simulate

    report = simulate(cell_config(cfg, partition, method, out, seed, url))
    report["experts"] = _expert_counts(out)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


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


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """The table row of one run (per task: ``accuracy``, ``local_accuracy``, ...)."""
    tasks = list(dict.fromkeys(d["task"] for d in report["config"]["devices"]))
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
    for task in tasks:
        accs = [a for d, a in latest.items() if devices[d]["task"] == task]
        per_task_local[task] = sum(accs) / len(accs) if accs else None
    trained = sorted({d for r in rounds for d in r["devices"]})
    return {
        "accuracy": {t: (last.get("per_task", {}).get(t) or {}).get("accuracy") for t in tasks},
        "initial_accuracy": {t: (report.get("initial_per_task") or {}).get(t, {}).get("accuracy") for t in tasks},
        "local_accuracy": per_task_local,
        "accuracy_per_round": {t: [(r.get("per_task", {}).get(t) or {}).get("accuracy") for r in rounds]
                               for t in tasks},
        "comm_gb": comm / 1e9,
        "comm_mb_per_device_round": comm / 1e6 / device_rounds if device_rounds else None,
        "peak_memory_gb": max(peaks.values()) / 2**30 if peaks else None,
        "mean_device_peak_gb": sum(peaks.values()) / len(peaks) / 2**30 if peaks else None,
        "peak_memory_no_probe_gb": max(peaks2.values()) / 2**30 if peaks2 else None,
        "devices_trained": len(trained), "devices_total": len(devices),
        "rounds_ok": sum(r["status"] == "ok" for r in rounds), "rounds": len(rounds),
        "experts": report.get("experts"),
        "wall_seconds": report.get("wall_seconds"),
        "sanity": {"problems": [f"round {r['round']}: status {r['status']}" for r in rounds if r["status"] != "ok"]},
    }


def result_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The settings, tasks and the devices' budgets (bytes) of the first seed."""
    return {"settings": cfg["settings"], "tasks": cfg["tasks"], "budgets_bytes": device_budgets(cfg, cfg["seeds"][0])}


def markdown(result: dict[str, Any], cfg: dict[str, Any]) -> str:
    """The table: per setting one row a method (per-task accuracy, bytes, peak memory), and
    the ablation's expert counts."""
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
    for setting in cfg["settings"]:
        rows = [c for c in result["cells"] if c["setting"] == setting and c["method"] in cfg["methods"]]
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
    abl = [c for c in result["cells"] if c["setting"] == cfg["ablation_setting"]
           and (c["method"] in cfg["ablations"] or c["method"] == cfg["ablations_against"])]
    if abl:
        lines += [f"## Ablation ({cfg['ablation_setting']})", "",
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


def plot(result: dict[str, Any], path: Path, cfg: dict[str, Any]) -> list[str]:
    """Global accuracy per round, one PNG a setting (a panel a task), beside ``path``:
    ``fedmoe_table_<setting>{,_quick}.png``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suffix = "" if result["profile"] == "full" else "_quick"
    tasks = result.get("tasks") or cfg["tasks"]
    paths = []
    for setting in cfg["settings"]:
        cells = [c for c in result["cells"] if c["setting"] == setting]
        if not cells:
            continue
        fig, axes = plt.subplots(1, len(tasks), figsize=(11, 4), sharey=True)
        for ax, task in zip(axes, tasks):
            for c in cells:
                ys = [c["initial_accuracy"][task]] + c["accuracy_per_round"][task]
                ax.plot(range(len(ys)), [float("nan") if y is None else y for y in ys], "o-", label=c["method"])
            ax.set_title(f"{setting}: {task}")
            ax.set_xlabel("round")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("global test accuracy")
        axes[-1].legend(fontsize=7)
        fig.tight_layout()
        out = path.with_name(f"fedmoe_table_{setting}{suffix}.png")
        fig.savefig(out, dpi=110)
        plt.close(fig)
        paths.append(str(out))
    return paths


def main(argv: list[str] | None = None) -> int:
    """The harness on :data:`CONFIG` with ``argv`` (harness options)."""
    from benchmarks import harness

    return harness.main([*(sys.argv[1:] if argv is None else argv), str(CONFIG)])


if __name__ == "__main__":
    sys.exit(main())
