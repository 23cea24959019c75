"""Native and Python devices at the same memory budgets, in one federation: how many experts
each holds, its peak footprint against its budget, its runtime before any model, and its
round time.

``fedmoe simulate`` with ``--devices 2N --native-devices N --budgets B1,...,BN``: devices
``0..N-1`` run the native device (``fedmoe-device``), devices ``N..2N-1`` the Python SDK, and
device ``i`` gets budget ``B[i mod N]``, so each budget has one device of each kind, on the
same model, data split (iid) and rounds. The cloud assigns experts by the memory plan with
each device's own baseline (``Hello.runtime_bytes``); ``random_kept`` fills what a budget
holds. A device whose budget is below its baseline plus one expert per layer is excluded.

    python -m benchmarks.native_budgets                      # the demo model, budgets 448, 460, 472, 484 MiB
    python -m benchmarks.native_budgets --budgets 400MiB,800MiB --rounds 2

Writes ``results/native/native_budgets.{json,md,png}`` (``--name`` changes the stem) and keeps
the run in ``runs/native_budgets`` (report.json, logs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, write_result

WORK = ROOT / "runs" / "native_budgets"


def run(budgets: list[str], rounds: int, experts: int, steps: int, work: Path) -> dict[str, Any]:
    """One simulation (module docstring); returns the per-device figures."""
    n = len(budgets)
    cmd = [sys.executable, "-m", "fedmoe", "simulate", "--out", str(work), "--devices", str(2 * n),
           "--native-devices", str(n), "--budgets", ",".join(budgets), "--rounds", str(rounds), "--num-experts",
           str(experts), "--max-steps", str(steps), "--partition", "iid", "--eval-max-samples", "80"]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if r.returncode != 0:
        raise SystemExit(f"native_budgets: fedmoe simulate failed:\n{r.stderr[-3000:]}")
    report = json.loads((work / "report.json").read_text())
    devices = []
    for d in report["config"]["devices"]:
        recs = [rnd["devices"][d["device_id"]] for rnd in report["rounds"] if d["device_id"] in rnd["devices"]]
        excluded = [rnd["round"] for rnd in report["rounds"] if d["device_id"] not in rnd["devices"]]
        last = recs[-1] if recs else None
        devices.append({
            "device": d["device_id"], "kind": d.get("runtime", "python"), "budget_bytes": d["budget_bytes"],
            "rounds_reported": len(recs), "rounds_not_reported": excluded,
            "experts_per_layer": sorted({len(v) for v in last["experts"].values()}) if last else [],
            "experts_held": sum(len(v) for v in last["experts"].values()) if last else 0,
            "runtime_bytes": last["baseline_rss_bytes"] if last else None,
            "peak_footprint_bytes": max((x["peak_footprint_bytes"] for x in recs), default=None),
            "predicted_peak_bytes": last["predicted_peak_bytes"] if last else None,
            "train_seconds": [round(x["train_seconds"], 2) for x in recs],
        })
    return {"devices": devices, "rounds": len(report["rounds"]), "wall_s": time.time() - t0,
            "accuracy": [rnd.get("accuracy") for rnd in report["rounds"]], "command": " ".join(cmd[1:])}


def markdown(r: dict[str, Any]) -> str:
    mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
    lines = [f"# Native and Python devices at the same budgets: {r['name']}", "",
             f"Measured {r['date']} on {r['machine']}: `python -m {r['command']}`, {r['wall_s'] / 60:.1f} min, "
             f"nothing else running. The demo model (all-MiniLM-L6-v2 upcycled to {r['experts']} experts in each of "
             f"its 3 MoE layers, int8 base shards), BBC News iid, {r['rounds']} rounds of {r['steps']} steps, "
             "`random_kept` assignment (each device holds what its budget holds by the cloud's memory plan on top "
             "of the baseline it reported). One device of each kind per budget.", "",
             "| budget MiB | device | kind | rounds reported | experts held (per layer) | runtime before any model MiB "
             "| peak footprint MiB | peak / budget | train s per round |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d in sorted(r["devices"], key=lambda d: (d["budget_bytes"], d["kind"])):
        held = f"{d['experts_held']} ({'/'.join(map(str, d['experts_per_layer']))})" if d["experts_held"] else \
            "none: excluded"
        share = f"{d['peak_footprint_bytes'] / d['budget_bytes']:.2f}" if d["peak_footprint_bytes"] else "-"
        secs = ", ".join(f"{s:.1f}" for s in d["train_seconds"]) or "-"
        lines.append(f"| {mib(d['budget_bytes'])} | {d['device']} | {d['kind']} | {d['rounds_reported']} of "
                     f"{r['rounds']} | {held} | {mib(d['runtime_bytes'])} | {mib(d['peak_footprint_bytes'])} | "
                     f"{share} | {secs} |")
    lines += ["", "Global accuracy after each round: " + ", ".join(f"{a:.3f}" for a in r["accuracy"] if a is not None)
              + ".", ""]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    for kind, style in (("native", "o-"), ("python", "s--")):
        ds = sorted((d for d in r["devices"] if d["kind"] == kind), key=lambda d: d["budget_bytes"])
        b = [d["budget_bytes"] / 2**20 for d in ds]
        ax[0].plot(b, [d["experts_held"] for d in ds], style, label=f"{kind} device")
        ax[1].plot(b, [(d["peak_footprint_bytes"] or 0) / 2**20 for d in ds], style, label=f"{kind} device")
    top = max(d["budget_bytes"] for d in r["devices"]) / 2**20
    ax[1].plot([0, top], [0, top], ":", color="grey", label="budget")
    ax[0].set(xlabel="memory budget (MiB)", ylabel="experts held (all MoE layers)", title="experts held")
    ax[1].set(xlabel="memory budget (MiB)", ylabel="peak footprint (MiB)", title="peak footprint")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="448MiB,460MiB,472MiB,484MiB", help="comma-separated budgets")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8, help="experts per MoE layer of the demo model (default 8)")
    ap.add_argument("--steps", type=int, default=10, help="training steps per round (default 10)")
    ap.add_argument("--out", default=str(ROOT / "results" / "native"))
    ap.add_argument("--name", default="native_budgets")
    args = ap.parse_args(argv)
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    res = run(budgets, args.rounds, args.experts, args.steps, WORK)
    res.update(name=args.name, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               machine=f"{platform.machine()}, {os.cpu_count()} CPU cores", experts=args.experts, steps=args.steps,
               command="benchmarks.native_budgets " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(write_result(args.out, args.name, res, markdown, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
