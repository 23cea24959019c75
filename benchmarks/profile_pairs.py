"""Paired comparison of ``benchmarks.aggregator_profile`` runs: the aggregator's CPU per
update before and after a change, in total and by category, over repeated pairs of runs
(run i of each side one after the other on the same machine).

    python -m benchmarks.aggregator_profile --fedmoe OLD/fedmoe --name base1 --out /tmp/p   # then
    python -m benchmarks.aggregator_profile --name cur1 --out /tmp/p                          # ... x3
    python -m benchmarks.profile_pairs --before /tmp/p/base1.json ... --after /tmp/p/cur1.json ...

Writes ``results/fleet/<name>.{json,md,png}``: per category and in all, the mean ± 95% CI of
each side, the paired difference (after − before) with its 95% CI and t-test p-value, and
Holm-Bonferroni over the table's family (the categories and the total).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import fmt, holm, mean_ci, paired_test, write_result

ROOT = Path(__file__).resolve().parents[1]
TOTAL = "in all (psutil, over the rounds)"


def per_category(run: dict) -> dict[str, float]:
    """One profile result -> category -> ms of CPU per update (``TOTAL``: the measured figure)."""
    s = run["summary"]
    out = {c["name"]: c["ms_per_update"] for c in s["categories"] if c["ms_per_update"] is not None}
    out[TOTAL] = s["measured_ms_per_update"]
    return out


def compare(before: list[dict], after: list[dict]) -> list[dict]:
    """Rows of the table, largest mean "before" first, the total last. Raises ValueError
    for sides of different lengths."""
    if len(before) != len(after):
        raise ValueError(f"{len(before)} runs before and {len(after)} after: pairs need as many of each")
    b, a = [per_category(r) for r in before], [per_category(r) for r in after]
    names = sorted({k for r in b + a for k in r} - {TOTAL}, key=lambda k: -mean_ci([r.get(k, 0.0) for r in b])["mean"])
    rows = []
    for name in names + [TOTAL]:
        xb, xa = [r.get(name, 0.0) for r in b], [r.get(name, 0.0) for r in a]
        rows.append({"name": name, "before": mean_ci(xb), "after": mean_ci(xa), "runs_before": xb,
                     "runs_after": xa, "test": paired_test(xa, xb)})
    adjusted = holm([r["test"]["p"] for r in rows])
    for r, p in zip(rows, adjusted):
        r["p_holm"] = p
    return rows


def _ci(m: dict) -> str:
    if m["ci_lo"] is None:
        return fmt(m["mean"], ".1f")
    return f"{m['mean']:.1f} ± {(m['ci_hi'] - m['ci_lo']) / 2:.1f}"


def markdown(r: dict) -> str:
    """The result page."""
    lines = [f"# Aggregator CPU per update, before and after: {r['name']}", "",
             f"Made {r['date']}: `python -m benchmarks.profile_pairs {' '.join(r['argv'])}`. {r['note']}", "",
             f"{len(r['before'])} pairs of `benchmarks.aggregator_profile` runs (Mosquitto, 1,000 devices, 1,000 "
             "signed updates of 1.08 MiB a round, 2 rounds; run i before, then run i after). Mean ± 95% CI (Student "
             "t) in ms of aggregator CPU per update; difference = after − before, paired by run, with its 95% CI, "
             "the paired t-test p and Holm-Bonferroni over the table's rows. A category's figure is its share of "
             "the samples outside start-up and waiting times the run's measured total, so the categories of one "
             "run sum to its total.", "",
             "| ms of CPU per update | before | after | after − before | p | p (Holm) |", "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        t = row["test"]
        diff = fmt(t["diff"], "+.1f") + ("" if t["ci_lo"] is None else f" [{t['ci_lo']:+.1f}, {t['ci_hi']:+.1f}]")
        lines.append(f"| {row['name']} | {_ci(row['before'])} | {_ci(row['after'])} | {diff} | {fmt(t['p'], '.3f')} "
                     f"| {fmt(row['p_holm'], '.3f')} |")
    lines += ["", "Runs: " + "; ".join(f"{Path(b).stem} / {Path(a).stem}" for b, a in zip(r["before"], r["after"])),
              ""]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    """Bars of each row's mean before and after, with the 95% CI."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = r["rows"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = range(len(rows))
    for off, side, colour in ((-0.2, "before", "tab:grey"), (0.2, "after", "tab:blue")):
        means = [row[side]["mean"] for row in rows]
        errs = [0 if row[side]["ci_lo"] is None else (row[side]["ci_hi"] - row[side]["ci_lo"]) / 2 for row in rows]
        ax.bar([x + off for x in xs], means, 0.4, yerr=errs, capsize=3, color=colour, label=side)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([row["name"].split(" (")[0] for row in rows], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("ms of aggregator CPU per 1.08 MiB update")
    ax.set_title(f"{r['name']}: mean ± 95% CI over {len(r['before'])} pairs of runs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, nargs="+", help="profile JSONs of the code before")
    ap.add_argument("--after", required=True, nargs="+", help="profile JSONs of the code after, in pair order")
    ap.add_argument("--name", default="profile_pairs")
    ap.add_argument("--note", default="", help="a sentence for the page (the builds, what else ran)")
    ap.add_argument("--out", default=str(ROOT / "results" / "fleet"))
    args = ap.parse_args(argv)
    before, after = args.before, args.after
    try:
        rows = compare([json.loads(Path(p).read_text()) for p in before], [json.loads(Path(p).read_text())
                                                                           for p in after])
    except (OSError, ValueError, KeyError) as e:
        ap.error(str(e))
    result = {"name": args.name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "argv": [f"'{a}'" if " " in a else a for a in (sys.argv[1:] if argv is None else argv)],
              "note": args.note, "before": before, "after": after, "rows": rows}
    print(write_result(args.out, args.name, result, markdown, plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
