"""Soak benchmark: does a device (and the aggregator) hold steady over many rounds?

Two federations, each run by ``fedmoe simulate`` (the production aggregator and device
programs, separate OS processes, embedded MQTT broker):

1. **Devices**: the real all-MiniLM-L6-v2 upcycled to 8 experts (3 MoE layers, int8,
   random_moe assignment kept while a device's capacity is the same), 2 devices whose
   budgets hold 4 and 8 experts per layer (the memory plan over this machine's
   measured device baseline), 20 rounds of 12 local steps. Per device and round: the
   peak RSS of the round (``VmHWM``) and the experts it held.
2. **Aggregator**: a tiny random-init model, 2 devices, 200 rounds of 2 local steps.
   Per round: the aggregator process's RSS when the round closed
   (``aggregator_rss_bytes`` of the round record).

Goals (issue "steady device"): each device's peak RSS grows by at most 2 MiB from
round 2 to the last round, its expert count never falls while its budget is unchanged;
the aggregator's RSS grows by at most 0.05 MiB per round (least-squares slope after a
10-round warm-up).

    python -m benchmarks.soak            # 20 device rounds + 200 aggregator rounds
    python -m benchmarks.soak --quick    # 6 + 40 rounds (< 5 min)

Writes ``results/soak/soak{,_quick}.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from benchmarks.common import heavy_lock

ROOT = Path(__file__).resolve().parents[1]

MIB = 2**20
DEVICE_GOAL_MIB = 2.0
AGGREGATOR_GOAL_MIB_PER_ROUND = 0.05
WARMUP_ROUNDS = 10
TINY = {"vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 128}


def device_run(rounds: int, work: Path) -> dict:
    """Federation 1 (module docstring): per device, peak RSS and experts held per round."""
    from moe_model.budget import estimate
    from fedmoe.datasets import load_task
    from fedmoe.simulate import SimulationConfig, device_baseline_bytes, simulate

    cfg = SimulationConfig(out=str(work / "devices"), devices=2, rounds=rounds, max_steps=12,
                           eval_max_samples=200, max_samples_per_task=1200)
    base = device_baseline_bytes()
    labels = len(load_task("bbc")[1])
    slack = 8 * MIB  # the device's data and tokenizer state, measured after the probe
    cfg.budgets = [estimate(cfg.model, k, cfg.train.batch_size, labels, base, cfg.weight_format).total + slack
                   for k in (4, 8)]
    return simulate(cfg)


def aggregator_run(rounds: int, work: Path) -> dict:
    """Federation 2 (module docstring): the aggregator's RSS per round."""
    from fedmoe.simulate import SimulationConfig, simulate

    cfg = SimulationConfig(out=str(work / "aggregator"), devices=2, rounds=rounds, max_steps=2, base=None,
                           model_config=TINY, budget_range=("700MiB", "700MiB"), eval_max_samples=64,
                           max_samples_per_task=400)
    return simulate(cfg)


def per_device(report: dict) -> dict[str, dict[str, list]]:
    """``{device: {peak_rss_bytes: [...], experts: [...], budget_bytes: [...]}}`` per round
    (None where the device did not report that round)."""
    rounds = report["rounds"]
    ids = sorted({d for r in rounds for d in r["devices"]} | {d for r in rounds for d in r.get("excluded") or {}})
    out = {}
    for d in ids:
        rows = [r["devices"].get(d) for r in rounds]
        out[d] = {"peak_rss_bytes": [x["peak_rss_bytes"] if x else None for x in rows],
                  "experts": [sum(len(v) for v in x["experts"].values()) if x else None for x in rows],
                  "budget_bytes": [x["budget_bytes"] if x else None for x in rows],
                  "excluded": {r["round"]: r["excluded"][d] for r in rounds if d in (r.get("excluded") or {})}}
    return out


def slope(ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against 0, 1, 2, ... (units of ``ys`` per step)."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))


def summarise(devices: dict, agg_rss: list[int]) -> dict:
    """The goals' figures (module docstring)."""
    dev = {}
    for d, v in devices.items():
        peaks = [p for p in v["peak_rss_bytes"][1:] if p is not None]  # from round 2
        held = [e for e in v["experts"] if e is not None]
        dev[d] = {"growth_after_round2_mib": (peaks[-1] - peaks[0]) / MIB if peaks else None,
                  "max_above_round2_mib": (max(peaks) - peaks[0]) / MIB if peaks else None,
                  "experts_first_last": [held[0], held[-1]] if held else None,
                  "experts_never_fell": all(b >= a for a, b in zip(held, held[1:])),
                  "rounds_reported": len(held), "rounds_excluded": len(v["excluded"])}
    tail = [x / MIB for x in agg_rss[WARMUP_ROUNDS:]]
    agg = {"rounds": len(agg_rss), "first_mib": agg_rss[0] / MIB if agg_rss else None,
           "last_mib": agg_rss[-1] / MIB if agg_rss else None,
           "slope_mib_per_round_after_warmup": slope(tail) if len(tail) > 1 else None,
           "growth_after_warmup_mib": (tail[-1] - tail[0]) if len(tail) > 1 else None}
    ok_dev = all(x["growth_after_round2_mib"] is not None and x["growth_after_round2_mib"] <= DEVICE_GOAL_MIB
                 and x["experts_never_fell"] and x["rounds_excluded"] == 0 for x in dev.values())
    ok_agg = agg["slope_mib_per_round_after_warmup"] is not None and \
        agg["slope_mib_per_round_after_warmup"] <= AGGREGATOR_GOAL_MIB_PER_ROUND
    return {"devices": dev, "aggregator": agg, "device_goal_met": ok_dev, "aggregator_goal_met": ok_agg,
            "goals": {"device_growth_after_round2_mib": DEVICE_GOAL_MIB,
                      "aggregator_mib_per_round": AGGREGATOR_GOAL_MIB_PER_ROUND, "warmup_rounds": WARMUP_ROUNDS}}


def _f(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``, or ``n/a`` for None (a device that never reported)."""
    return "n/a" if value is None else format(value, spec)


def write(result: dict, out: Path, name: str) -> None:
    """``{name}.json``, ``{name}.md`` and ``{name}.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    s = result["summary"]
    lines = [f"Soak ({result['setup']['device_rounds']} device rounds, real MiniLM-MoE; "
             f"{result['setup']['aggregator_rounds']} aggregator rounds, tiny model), {result['date']}", "",
             "| device | budget MiB | experts held, first / last | peak RSS round 2 MiB | growth after round 2 MiB "
             "(goal <= 2) | max above round 2 MiB | rounds excluded |", "|---|---|---|---|---|---|---|"]
    for d, x in s["devices"].items():
        v = result["devices"][d]
        p2 = next((p for p in v["peak_rss_bytes"][1:] if p is not None), None)
        budget = next((b for b in v["budget_bytes"] if b is not None), None)
        lines.append(f"| {d} | {_f(budget and budget / MIB, '.0f')} | {x['experts_first_last']} | "
                     f"{_f(p2 and p2 / MIB, '.1f')} | {_f(x['growth_after_round2_mib'], '+.2f')} | "
                     f"{_f(x['max_above_round2_mib'], '+.2f')} | {x['rounds_excluded']} |")
    a = s["aggregator"]
    lines += ["", "| aggregator | rounds | RSS first / last MiB | slope after warm-up MiB/round (goal <= 0.05) | "
              "growth after warm-up MiB |", "|---|---|---|---|---|",
              f"| tiny model | {a['rounds']} | {_f(a['first_mib'], '.1f')} / {_f(a['last_mib'], '.1f')} | "
              f"{_f(a['slope_mib_per_round_after_warmup'], '+.4f')} | {_f(a['growth_after_warmup_mib'], '+.2f')} |",
              "",
              f"Device goal met: {s['device_goal_met']}; aggregator goal met: {s['aggregator_goal_met']}."]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    for d, v in result["devices"].items():
        xs = [i + 1 for i, p in enumerate(v["peak_rss_bytes"]) if p is not None]
        ax1.plot(xs, [p / MIB for p in v["peak_rss_bytes"] if p is not None], "o-", label=d)
        ax2.plot(xs, [e for e in v["experts"] if e is not None], "o-", label=d)
    ax1.set(xlabel="round", ylabel="MiB", title="device peak RSS per round")
    ax2.set(xlabel="round", ylabel="experts held (all layers)", title="device assignment size")
    ax2.set_ylim(bottom=0)
    agg = result["aggregator_rss_bytes"]
    ax3.plot(range(1, len(agg) + 1), [x / MIB for x in agg], "-")
    ax3.set(xlabel="round", ylabel="MiB", title="aggregator RSS after each round (tiny model)")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="6 device rounds and 40 aggregator rounds")
    ap.add_argument("--device-rounds", type=int)
    ap.add_argument("--aggregator-rounds", type=int)
    ap.add_argument("--out", default="results/soak")
    ap.add_argument("--work", default="runs/soak")
    ap.add_argument("--lock", default="/tmp/fedmoe-bench.lock", help="heavy-run lock file ('' for none)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("amqtt").setLevel(logging.WARNING)
    dev_rounds = args.device_rounds or (6 if args.quick else 20)
    agg_rounds = args.aggregator_rounds or (40 if args.quick else 200)
    work = Path(args.work) / ("quick" if args.quick else "full")
    t0 = time.time()
    with heavy_lock(args.lock):
        dev_report = device_run(dev_rounds, work)
        agg_report = aggregator_run(agg_rounds, work)
    devices = per_device(dev_report)
    agg_rss = [r["aggregator_rss_bytes"] for r in agg_report["rounds"]]
    result = {"date": time.strftime("%Y-%m-%d"), "seconds": time.time() - t0,
              "setup": {"device_rounds": dev_rounds, "aggregator_rounds": agg_rounds,
                        "device_model": "all-MiniLM-L6-v2 upcycled, 8 experts x 3 MoE layers, int8, top-2",
                        "device_budgets": "plan of 4 and 8 experts per layer over the measured baseline + 8 MiB",
                        "local_steps": 12, "aggregator_model": "tiny BERT-MoE (random init)"},
            "devices": devices, "aggregator_rss_bytes": agg_rss,
            "device_run_aggregator_rss_bytes": [r.get("aggregator_rss_bytes") for r in dev_report["rounds"]]}
    result["summary"] = summarise(devices, agg_rss)
    write(result, Path(args.out), "soak_quick" if args.quick else "soak")
    print(f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
