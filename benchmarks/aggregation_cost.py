"""What each aggregation rule costs the aggregator per round, in time and memory, as the
round grows (issue "the aggregator at the hardware's pace", step 3): the fleet's model
(16 experts x 2 MoE layers, a 1.07 MiB fp32 adapter state; ``benchmarks.fleet.MODEL``),
``n`` synthetic updates (the global state plus Gaussian noise, every device holding every
expert), each rule run the way the round engine runs it:

- ``modular (streaming)``: FedAvg over the holders folded update by update into running
  sums (:meth:`cloud.strategies.Strategy.fold`, then ``finish``): what a streaming round
  does; it holds the sums, not the updates;
- ``modular`` (held), ``median``, ``trimmed_mean``, ``multi_krum``: ``Strategy.aggregate``
  over all ``n`` updates at once (the robust rules wrap ``modular``,
  :mod:`cloud.robust.rules`); the round holds every update until its close.

Measured for ``--sizes`` (default 100, 300, 1000) on this machine's CPU (one thread);
10,000 is extrapolated from the two largest sizes by a power law in ``n`` (time; an exponent
below 1 is taken as 1) and linearly (memory), and marked so. Memory: what the round holds (``n`` fp32 updates, or the
float64 sums) plus the rule's own peak on top (the kernel's RSS high-water mark).

    python -m benchmarks.aggregation_cost                 # ~9 min on 2 cores
    python -m benchmarks.aggregation_cost --sizes 50,100  # a quick look

Writes ``results/fleet/aggregation_cost.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from benchmarks.common import ROOT, fmt, heavy_lock, write_result

MIB = 2**20
RULES = ("modular (streaming)", "modular", "median", "trimmed_mean", "multi_krum")


@contextmanager
def peak_above() -> Iterator[list[int]]:
    """The process's peak RSS above its RSS at the start of the block, in bytes, as the one
    item of the yielded list once the block ends (the kernel's high-water mark,
    :class:`moe_model.budget.PeakMeter`)."""
    from moe_model.budget import PeakMeter, current_rss_bytes

    base, meter, out = current_rss_bytes(), PeakMeter().start(), []
    yield out
    out.append(max(0, meter.peaks()[0] - base))


def _strategy(rule: str, model):
    from cloud.robust.defences import Defences
    from cloud.robust.config import DefenceConfig
    from cloud.strategies import get_strategy
    from cloud.strategy import Setup

    setup = Setup(model.layers, model.spec.num_experts, 0, tasks=model.tasks, assignment=("full", {}),
                  aggregation=("modular", {}))
    strategy = get_strategy("composed")(setup)
    name = "none" if rule.startswith("modular") else rule
    strategy.aggregation = Defences(DefenceConfig(robust={"name": name}, screening=None)).wrap(strategy.aggregation)
    return strategy


def measure(rule: str, n: int, seed: int = 0) -> dict:
    """One rule over ``n`` updates: CPU seconds of the aggregation, bytes the round holds
    and the rule's peak RSS above them."""
    import torch

    from benchmarks.fleet import LABELS, MODEL
    from cloud.aggregation.base import RoundSums
    from cloud.global_model import GlobalModel
    from cloud.strategy import ClientResult
    from protocol.messages import ModelSpec

    torch.set_num_threads(1)
    model = GlobalModel(ModelSpec.model_validate(MODEL), {"bbc": LABELS}, "fp32")
    experts = {layer: list(range(model.spec.num_experts)) for layer in model.layers}
    strategy = _strategy(rule, model)
    g = torch.Generator().manual_seed(seed)

    def update(i: int) -> ClientResult:
        state = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in model.state.items()}
        return ClientResult(f"d{i}", "bbc", 100 + i % 7, experts, state, None)

    update_bytes = sum(v.numel() * v.element_size() for v in model.state.values())
    gc.collect()
    if rule == "modular (streaming)":
        sums, cpu = RoundSums(), 0.0
        with peak_above() as above:
            for i in range(n):
                r = update(i)  # made outside the timed part, dropped after the fold
                t0 = time.process_time()
                strategy.fold(sums, r)
                cpu += time.process_time() - t0
                del r
            t0 = time.process_time()
            strategy.finish(1, model, sums)
            cpu += time.process_time() - t0
        held = sum(t.numel() * t.element_size() for t in sums.weighted.values())
        rule_peak = max(0, above[0] - held)
    else:
        results = [update(i) for i in range(n)]
        held = n * update_bytes
        gc.collect()
        with peak_above() as above:
            t0 = time.process_time()
            strategy.aggregate(1, model, results, [])
            cpu = time.process_time() - t0
        rule_peak = above[0]
        del results
    gc.collect()
    return {"rule": rule, "n": n, "cpu_s": cpu, "cpu_ms_per_update": 1000 * cpu / n, "held_bytes": held,
            "rule_peak_bytes": rule_peak, "update_bytes": update_bytes}


def extrapolate(rows: list[dict], rule: str, n: int) -> dict:
    """``rule`` at ``n`` updates from its two largest measured sizes: time by the power law
    through them, memory linearly in ``n`` (held) and as measured at the largest (a rule's
    temporaries scale with ``n`` too: linearly)."""
    pts = sorted((r for r in rows if r["rule"] == rule), key=lambda r: r["n"])[-2:]
    (a, b) = pts
    k = math.log(b["cpu_s"] / a["cpu_s"]) / math.log(b["n"] / a["n"]) if b["cpu_s"] > 0 and a["cpu_s"] > 0 else 1.0
    k = max(k, 1.0)  # every update is touched: no rule grows slower than linearly (a lower fit is noise)
    cpu = b["cpu_s"] * (n / b["n"]) ** k
    held = b["held_bytes"] if rule == "modular (streaming)" else b["held_bytes"] * n / b["n"]
    peak = b["rule_peak_bytes"] if rule == "modular (streaming)" else b["rule_peak_bytes"] * n / b["n"]
    return {"rule": rule, "n": n, "cpu_s": cpu, "cpu_ms_per_update": 1000 * cpu / n, "held_bytes": held,
            "rule_peak_bytes": peak, "exponent": k, "extrapolated": True}


def markdown(r: dict) -> str:
    lines = [f"# Aggregation rules: cost per round as it grows\n",
             f"Measured {r['date']} on {r['machine']}, one torch thread: "
             f"`python -m benchmarks.aggregation_cost {' '.join(r['argv'])}`. {r.get('note', '')} The fleet's model "
             f"({r['update_mib']:.2f} MiB fp32 adapter state per update, 16 experts x 2 MoE layers, every device "
             "holding every expert); synthetic updates. *Held*: what the round keeps until its close (every update, "
             "or a streaming round's float64 sums); *rule peak*: the aggregation's own RSS above that. Rows marked "
             "~ are extrapolated from the two largest measured sizes (time by the power law through them, exponent "
             "given; memory linearly).\n",
             "| rule | updates | CPU s per round | ms per update | held (MiB) | rule peak (MiB) |",
             "|---|---|---|---|---|---|"]
    for row in r["rows"] + r["extrapolated"]:
        mark = f"~ (n^{row['exponent']:.2f})" if row.get("extrapolated") else ""
        lines.append(f"| {row['rule']} | {row['n']:,} {mark} | {fmt(row['cpu_s'], '.2f')} | "
                     f"{fmt(row['cpu_ms_per_update'], '.2f')} | {row['held_bytes'] / MIB:,.0f} | "
                     f"{row['rule_peak_bytes'] / MIB:,.0f} |")
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for rule in RULES:
        pts = sorted((x for x in r["rows"] + r["extrapolated"] if x["rule"] == rule), key=lambda x: x["n"])
        if not pts:
            continue
        xs = [p["n"] for p in pts]
        line, = a1.plot(xs, [p["cpu_s"] for p in pts], marker="o", label=rule)
        a2.plot(xs, [(p["held_bytes"] + p["rule_peak_bytes"]) / MIB for p in pts], marker="o", color=line.get_color(),
                label=rule)
    for ax, title in ((a1, "CPU seconds per round"), (a2, "memory: held + rule peak (MiB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("updates per round (largest point extrapolated)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,300,1000")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--extrapolate-to", type=int, default=10_000)
    ap.add_argument("--out", default=str(ROOT / "results" / "fleet"))
    ap.add_argument("--name", default="aggregation_cost")
    ap.add_argument("--note", default="", help="a sentence for the page (what else ran)")
    ap.add_argument("--lock")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    rules = [r for r in args.rules.split(",") if r]
    rows = []
    with heavy_lock(args.lock):
        for n in sizes:
            for rule in rules:
                row = measure(rule, n)
                rows.append(row)
                print(f"{rule:>20} n={n:>6}: {row['cpu_s']:8.2f} s CPU ({row['cpu_ms_per_update']:.2f} ms per update), "
                      f"held {row['held_bytes'] / MIB:,.0f} MiB, rule peak {row['rule_peak_bytes'] / MIB:,.0f} MiB",
                      flush=True)
    extra = [extrapolate(rows, rule, args.extrapolate_to) for rule in rules] if len(sizes) >= 2 else []
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{os.cpu_count()} CPU cores",
              "argv": sys.argv[1:] if argv is None else argv,
              "note": args.note, "update_mib": rows[0]["update_bytes"] / MIB, "rows": rows, "extrapolated": extra}
    print(write_result(args.out, args.name, result, markdown, plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
