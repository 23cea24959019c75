"""Compare ``fedmoe simulate --device-memory-limit`` runs: experts held, peaks and OOM kills per device.

Each run's devices were processes inside a memory cgroup whose hard limit was their budget
(``fedmoe/cgroups.py``). For each run and device this reads, from ``report.json``, the
experts held in every round, the peak footprint and RSS against the budget, the memory plan's
prediction, the cgroup's peak charge and its OOM kills, and writes a side-by-side table.

    python -m benchmarks.limit_compare BEFORE/report.json AFTER/report.json \\
        --names "RSS budgets (68dd129)" "footprint budgets" --out results/memory/cgroup

Writes ``limit.json``, ``limit.md`` and ``limit.png`` (experts held per device and run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MiB = 2**20


def summarise(report: dict) -> dict[str, dict]:
    """Per device: budget, experts held per round, worst peaks (bytes), plan, cgroup figures."""
    out: dict[str, dict] = {}
    cg = report.get("device_cgroups") or {}
    for rd in report["rounds"]:
        for d, v in (rd.get("devices") or {}).items():
            s = out.setdefault(d, {"budget_bytes": v["budget_bytes"], "experts": [], "peak_footprint_bytes": 0,
                                   "peak_rss_bytes": 0, "predicted_peak_bytes": 0, "excluded_rounds": 0})
            s["experts"].append(sum(len(e) for e in v["experts"].values()))
            for k in ("peak_footprint_bytes", "peak_rss_bytes", "predicted_peak_bytes"):
                s[k] = max(s[k], v.get(k) or 0)
        for d in rd.get("excluded") or {}:
            out.setdefault(d, {"budget_bytes": None, "experts": [], "peak_footprint_bytes": 0, "peak_rss_bytes": 0,
                               "predicted_peak_bytes": 0, "excluded_rounds": 0})["excluded_rounds"] += 1
    for d, s in out.items():
        s.update({k: (cg.get(d) or {}).get(k) for k in ("limit_bytes", "peak_bytes", "oom_kills")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reports", nargs="+", help="report.json of each run")
    ap.add_argument("--names", nargs="+", help="a name per run (default: its directory)")
    ap.add_argument("--out", default="results/memory/cgroup")
    args = ap.parse_args()
    names = args.names or [Path(p).parent.name for p in args.reports]
    runs = {n: summarise(json.loads(Path(p).read_text())) for n, p in zip(names, args.reports)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "limit.json").write_text(json.dumps({"runs": runs, "reports": args.reports}, indent=1))
    mib = lambda b: f"{b / MiB:.0f}" if b else "-"  # noqa: E731
    lines = ["| run | device | budget = limit MiB | experts held, per round | peak footprint | peak RSS | plan "
             "| cgroup peak charge | OOM kills | rounds excluded |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n, devs in runs.items():
        for d in sorted(devs):
            s = devs[d]
            lines.append(f"| {n} | {d} | {mib(s['budget_bytes'] or s['limit_bytes'])} | "
                         f"{', '.join(map(str, s['experts'])) or '-'} | {mib(s['peak_footprint_bytes'])} | "
                         f"{mib(s['peak_rss_bytes'])} | {mib(s['predicted_peak_bytes'])} | {mib(s['peak_bytes'])} | "
                         f"{s['oom_kills'] if s['oom_kills'] is not None else '-'} | {s['excluded_rounds']} |")
    lines.append("\nPeaks are the worst round's; the plan includes the device's 32 MiB headroom. A run before "
                 "protocol 1.5 reports no footprint (-).")
    (out / "limit.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    devices = sorted({d for devs in runs.values() for d in devs})
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / max(len(runs), 1)
    for i, (n, devs) in enumerate(runs.items()):
        ax.bar([x + i * width for x in range(len(devices))],
               [min(devs[d]["experts"]) if d in devs and devs[d]["experts"] else 0 for d in devices], width, label=n)
    budgets = [next((devs[d]["budget_bytes"] for devs in runs.values() if d in devs and devs[d]["budget_bytes"]), 0)
               for d in devices]
    ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(devices))],
                  [f"{d}\n{b / MiB:.0f} MiB" for d, b in zip(devices, budgets)])
    ax.set_ylabel("experts held (fewest over rounds)")
    ax.set_title("devices in a memory cgroup at their budget")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "limit.png", dpi=110)


if __name__ == "__main__":
    main()
