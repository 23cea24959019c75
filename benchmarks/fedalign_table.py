"""FedAlign-MoE's Table I and ablations (Fang et al. 2026, "Aggregation Alignment for Federated Learning with Mixture-of-Experts under Data Heterogeneity" (FedAlign-MoE), arXiv:2603.21276, Table I, Fig. 9, 13, 14)
in shape, on our data, with several seeds and paired significance tests.

Model: the upcycled MiniLM MoE the other tables use (``bert-upcycled``, all-MiniLM-L6-v2
from a package; 3 MoE layers of E = 8 experts, top-2, LoRA rank 8, int8 base shards).
Data: BBC News (5 topics) and tweet sentiment (3 classes), each task its own federation
(the paper's Table I is per data set); settings IID, Dirichlet(0.5), Dirichlet(0.1) label
skew over the devices. Every device trains every round.

Methods (same devices, budgets, data split, seeds and training budget for all):

- FedAvg: ``full`` assignment (every device holds all experts), ``modular`` aggregation
  (FedAvg over holders).
- FedProx: the same plus the proximal term μ = 0.01 in the device objective.
- FedMoE: ``fedmoe`` assignment (probe, sub-model search, expert recommendation) +
  ``modular`` aggregation, as in ``benchmarks/fedmoe_table.py``.
- FedAlign-MoE: strategy ``fedalign`` on the ``full`` assignment, i.e. exactly FedAvg's
  devices and experts, so the difference to FedAvg/FedProx is FedAlign's routing
  regulariser, global routing reference and semantic expert aggregation alone.
- FedAlign-MoE on FedMoE: strategy ``fedalign`` on the ``fedmoe`` assignment (the same
  experts as FedMoE), its fair comparison with FedMoE.

Ablations (one setting, :data:`ABLATION_SETTING`, against FedAlign-MoE on ``full``): the
strategy's switches ``router_alignment``, ``consistency_weighting``, ``adaptive_lambda``,
``semantic_aggregation``, ``direction_consensus`` off, and a fixed threshold s*.

Every cell is a real federation through the production code: the aggregator
(``cloud.service.Aggregator``, strategy, round engine, store) and one
``edge_sdk.EdgeClient`` per device talk MQTT through the embedded broker, but as threads
of this process (``fedmoe.inprocess.run_inprocess``, ``benchmarks.cells.federate``)
rather than ``fedmoe simulate``'s separate processes: on this 2-core machine that saves
each cell the start-up of 7 Python processes (torch, the model). Devices plan memory for the model alone
(``runtime_bytes=0``: the process is shared); every budget holds the full MoE, with a
spread of up to one full-MoE-minus-2-experts on top, so FedMoE's search (α = 0.8 of the
part above the fixed memory) picks sub-models of different sizes.

Per cell: the global model's accuracy on the task's held-out test split after every round
(cloud evaluation), the mean over devices of their latest local validation accuracy (own
sub-model after local training: the paper's "average local accuracy"), the per-round
sanity report (devices trained, experts held, devices excluded or failed, FedAlign's
regulariser values, r_g's movement and the semantic gate's statistics). Over seeds: mean ±
std, the 95% Student-t CI of the mean, rounds to reach the setting's target accuracy (90%
of the best method's mean final global accuracy in that setting), and paired t-tests of
the differences (pairs = seeds; "better" only where the 95% CI of the paired difference
excludes 0).

The table is the harness's (:mod:`benchmarks.harness`) on ``benchmarks/configs/fedalign_table.yaml``
(methods, ablations, pairs, profiles); this module is its cells (``table: fedalign_table``).
Cells are resumable: each writes ``runs/fedalign_table/<profile>/s<seed>/<setting>--<method>/report.json``
and is skipped when that exists (``--force`` reruns); ``--lock FILE`` holds an exclusive
flock only while a cell runs. Writes ``results/fedalign_table{,_quick}.{json,md,png}``.

    python -m benchmarks.fedalign_table --quick --lock /tmp/fedmoe-heavy.lock   # < 10 min
    python -m benchmarks.fedalign_table --lock /tmp/fedmoe-heavy.lock           # ~1 h
    python -m benchmarks.fedalign_table --collect    # tables from the cells finished so far
    # the same: python -m benchmarks.harness benchmarks/configs/fedalign_table.yaml [options]
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path
from typing import Any

from benchmarks import cells, tables
from benchmarks.common import ROOT, ci_text, diff_text, fmt, marks, verdict

CONFIG = ROOT / "benchmarks" / "configs" / "fedalign_table.yaml"
REQUIRED = ("name", "tasks", "partitions", "partition_schemes", "seeds", "devices", "rounds", "max_steps", "batch",
            "lr", "max_samples_per_task", "eval_samples", "methods")
DEFAULTS: dict[str, Any] = {"max_seq_len": 24, "probe_steps": 2, "patience": 1, "weight_format": "int8",
                            "eval_threads": 2}
PROFILE_KEYS = ("tasks", "partitions", "seeds", "devices", "rounds", "max_steps", "batch", "lr", "max_seq_len",
                "max_samples_per_task", "eval_samples", "probe_steps", "patience", "weight_format", "eval_threads")
METRICS = (("global", "accuracy"), ("local", "local_accuracy"))
EXTRA = ("experts_held_mean",)
DEFENCES = {"robust": {"name": "none"}, "screening": None}
"""The aggregator's poisoning defences, off for every method: the production default wraps
the aggregation in Multi-Krum (f = 1) and clips outlying updates, which under label skew
drops or shrinks the most different device's update each round; the paper's methods
average plainly. The pre-commit guard stays on (it never refused a round here)."""
BUDGET_SPREAD = 0.25
"""Budgets: the full MoE's plan plus up to this fraction of (plan(E) − plan(2))."""
NUM_EXPERTS = 8


def check(cfg: dict[str, Any]) -> list[str]:
    """A config's problems: an unknown task or partition."""
    return ([f"tasks: unknown {t!r} (bbc, tweets)" for t in cfg["tasks"] if t not in ("bbc", "tweets")]
            + [f"partitions: {p!r} is not in partition_schemes" for p in cfg["partitions"]
               if p not in cfg["partition_schemes"]])


def settings_of(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``"<task> <partition>"`` -> ``{"task", "partition"}`` (the partition's scheme)."""
    return {f"{t} {p}": {"task": t, "partition": cfg["partition_schemes"][p]} for t in cfg["tasks"]
            for p in cfg["partitions"]}


# --------------------------------------------------------------------------- one federation


class GateProbe:
    """Records what FedAlign's semantic aggregation computes (diagnostics only): wraps
    ``cloud.strategies.fedalign.client_weights`` and ``FedAlign.aggregate`` while a cell
    runs and keeps, per round, the mean pairwise hidden-state cosine s, the threshold s*,
    the mean gate sigmoid((s − s*)/T_s), the mean clamped update cosine d, and how unequal
    the ω are (max/min). Nothing it does changes what the strategy returns."""

    def __init__(self) -> None:
        self.rounds: dict[int, list[dict[str, float]]] = {}
        self._round = 0
        self._saved: tuple | None = None

    def __enter__(self) -> "GateProbe":
        import torch

        import cloud.strategies.fedalign as F

        orig_weights, orig_aggregate = F.client_weights, F.FedAlign.aggregate
        probe = self

        def client_weights(deltas, hidden, zeta=1.0, t_s=0.05, threshold=None, consensus=True):
            omega = orig_weights(deltas, hidden, zeta, t_s, threshold, consensus)
            n = deltas.shape[0]
            if n > 1:
                off = ~torch.eye(n, dtype=torch.bool)
                s = F.cosines(hidden)
                pairs = s[torch.triu(torch.ones(n, n, dtype=torch.bool), 1)]
                s_star = (pairs.mean() - zeta * pairs.std(unbiased=False)) if threshold is None else \
                    torch.tensor(float(threshold), dtype=torch.float64)
                gate = torch.sigmoid((s - s_star) / t_s)[off]
                d = F.cosines(deltas).clamp_min(0)[off]
                probe.rounds.setdefault(probe._round, []).append({
                    "n": n, "s": float(pairs.mean()), "s_min": float(pairs.min()), "s_star": float(s_star),
                    "gate": float(gate.mean()), "gate_closed": float((gate < 0.5).double().mean()),
                    "d": float(d.mean()),
                    "omega_ratio": float(omega.max() / omega.min()) if float(omega.min()) > 0 else float("inf"),
                    "omega_zero": float(float(omega.sum()) <= 0)})
            return omega

        def aggregate(strategy, round, *a, **kw):
            probe._round = round
            return orig_aggregate(strategy, round, *a, **kw)

        self._saved = (F, orig_weights, orig_aggregate)
        F.client_weights, F.FedAlign.aggregate = client_weights, aggregate
        return self

    def __exit__(self, *exc) -> None:
        F, w, a = self._saved
        F.client_weights, F.FedAlign.aggregate = w, a

    def summary(self) -> dict[str, dict[str, float]]:
        """Per round: the means over experts of each recorded figure."""
        out = {}
        for rnd, rows in sorted(self.rounds.items()):
            keys = [k for k in rows[0] if k != "n"]
            finite = lambda xs: [x for x in xs if math.isfinite(x)]  # noqa: E731
            out[str(rnd)] = {k: (sum(v) / len(v) if (v := finite([r[k] for r in rows])) else None) for k in keys}
            out[str(rnd)]["experts"] = len(rows)
            out[str(rnd)]["omega_zero"] = sum(r["omega_zero"] for r in rows)  # experts left unchanged by ω = 0
            out[str(rnd)]["participants"] = sum(r["n"] for r in rows) / len(rows)
        return out


def device_budgets(spec, batch: int, num_labels: int, devices: int, seed: int, task: str,
                   fmt_: str = "int8") -> list[int]:
    """Budgets (bytes, model only) that all hold the full MoE: the full MoE's plan plus a
    seeded draw from [0, BUDGET_SPREAD·(plan(E) − plan(2))] (the same for every method of a
    seed), so FedMoE's search (limit F + 0.8·(M − F)) keeps 6-7 of 8 experts per layer."""
    from moe_model.budget import estimate

    plan = lambda k: estimate(spec, k, batch, num_labels, runtime_bytes=0, weight_format=fmt_).total  # noqa: E731
    full, lo = plan(NUM_EXPERTS), plan(2)
    rng = random.Random(f"fedalign_table/{seed}/{task}")
    return [full + rng.randint(0, int(BUDGET_SPREAD * (full - lo))) for _ in range(devices)]


def run_cell(cfg: dict[str, Any], setting: dict[str, Any], method: dict[str, Any], seed: int, out: Path,
             url: str) -> dict[str, Any]:
    """One federation (:func:`cells.federate`, with :class:`GateProbe`); returns its report."""
    from fedmoe.partition import partition
    from fedmoe.simulate import split_task
    from protocol.messages import ModelSpec

    task, scheme = setting["task"], setting["partition"]
    items, labels, train_idx, test_idx = split_task(task, seed, 0.2, cfg["max_samples_per_task"])
    parts = partition([labels.index(items[i][1]) for i in train_idx], cfg["devices"], scheme, seed)
    spec = ModelSpec(num_experts=NUM_EXPERTS, top_k=2, max_seq_len=cfg["max_seq_len"], seed=seed)
    if method["assignment"] == "fedmoe":
        method = {**method, "assignment_params": {"probe_steps": cfg["probe_steps"], "patience": cfg["patience"]}}
    return cells.federate(
        out, url, spec=spec, task=task, labels=labels, test=[items[i] for i in test_idx],
        device_data=[[items[train_idx[j]] for j in part] for part in parts],
        budgets=device_budgets(spec, cfg["batch"], len(labels), cfg["devices"], seed, task, cfg["weight_format"]),
        method=method, train={"max_steps": cfg["max_steps"], "batch_size": cfg["batch"], "lr": cfg["lr"]},
        rounds=cfg["rounds"], weight_format=cfg["weight_format"], eval_samples=cfg["eval_samples"], seed=seed,
        defences=DEFENCES, eval_threads_n=cfg["eval_threads"], probe=GateProbe(), config={"partition": scheme})


# --------------------------------------------------------------------------- per-cell summary and sanity


def sanity(report: dict[str, Any]) -> dict[str, Any]:
    """The per-round report condensed: devices trained, experts held (per device, all
    layers), excluded/failed devices, FedAlign's regulariser and r_g movement, the gate."""
    rows, prev_rg, problems = [], None, []
    for r in report["rounds"]:
        held = [sum(len(v) for v in d["experts"].values()) for d in r["devices"].values()]
        sm = r.get("strategy_metrics") or {}
        reg = list((sm.get("regulariser") or {}).values())
        rg = sm.get("r_g")
        move = None
        if rg is not None:
            flat = [x for layer in sorted(rg, key=int) for x in rg[layer]]
            if prev_rg is not None:
                move = sum(abs(a - b) for a, b in zip(flat, prev_rg))
            dev_uniform = max(abs(x - 1 / NUM_EXPERTS) for x in flat)
            prev_rg = flat
        row = {"round": r["round"], "status": r["status"], "trained": len(r["devices"]),
               "held_min": min(held) if held else None, "held_max": max(held) if held else None,
               "excluded": r.get("excluded") or {}, "failures": r.get("failures") or {},
               "accuracy": r.get("accuracy"), "local": r.get("mean_local_accuracy"),
               "unused_experts": sum(1 for v in (r.get("expert_load") or {}).values() for x in v if x == 0),
               "cv": r.get("cv")}
        if sm:
            row.update({"reg_min": min(reg) if reg else None, "reg_max": max(reg) if reg else None,
                        "reg_finite": all(math.isfinite(x) for x in reg), "reg_reported": len(reg),
                        "r_g_l1_move": move, "r_g_max_dev_uniform": dev_uniform if rg is not None else None,
                        "experts_aggregated": (sm.get("experts") or {}).get("aggregated"),
                        "experts_unchanged": (sm.get("experts") or {}).get("unchanged")})
            if reg and not row["reg_finite"]:
                problems.append(f"round {r['round']}: regulariser not finite")
        if r["status"] != "ok":
            problems.append(f"round {r['round']}: status {r['status']} {r.get('error', '')}")
        if row["excluded"] or row["failures"]:
            problems.append(f"round {r['round']}: excluded {sorted(row['excluded'])} failed {sorted(row['failures'])}")
        rows.append(row)
    strat = report["config"]["method"]["strategy"]
    params = report["config"]["method"].get("params", {})
    if strat == "fedalign":
        moves = [x["r_g_l1_move"] for x in rows if x.get("r_g_l1_move") is not None]
        if params.get("router_alignment", True) and not any(x.get("reg_reported") for x in rows):
            problems.append("no regulariser value reported")
        if moves and max(moves) == 0:
            problems.append("r_g never changed")
    return {"rounds": rows, "problems": problems, "gate": report.get("probe", report.get("gate", {}))}


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """The table row of one run."""
    rounds, task = report["rounds"], report["config"]["task"]
    latest: dict[str, float] = {}
    for r in rounds:
        for d, v in r["devices"].items():
            if v.get("val_accuracy") is not None:
                latest[d] = v["val_accuracy"]
    acc = lambda r: ((r.get("per_task") or {}).get(task) or {}).get("accuracy", r.get("accuracy"))  # noqa: E731
    held = [sum(len(v) for v in d["experts"].values()) for r in rounds for d in r["devices"].values()]
    return {
        "accuracy": acc(rounds[-1]) if rounds else None,
        "local_accuracy": sum(latest.values()) / len(latest) if latest else None,
        "initial_accuracy": report.get("initial_accuracy"),
        "accuracy_per_round": [acc(r) for r in rounds],
        "local_per_round": [r.get("mean_local_accuracy") for r in rounds],
        "experts_held_mean": sum(held) / len(held) if held else None,
        "devices_trained": len({d for r in rounds for d in r["devices"]}),
        "devices_total": len(report["config"]["devices"]),
        "rounds_ok": sum(r["status"] == "ok" for r in rounds), "rounds": len(rounds),
        "wall_seconds": report.get("wall_seconds"),
        "sanity": sanity(report),
    }


# --------------------------------------------------------------------------- output


def _head(result: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    p = result["profile_config"]
    return [*tables.profile_head("FedAlign-MoE table", result, "each seed: its own data split, budgets"
                                                       " and model/device seeds, the same for every method"),
            "Columns: *global* = the global MoE on the task's held-out test split after the last round; *local* = "
            "mean over devices of their latest validation accuracy (own sub-model after local training). Each: mean ± "
            "std over seeds [95% Student-t CI of the mean]. *Rounds to target* = first round whose global accuracy "
            f"reaches the setting's target ({cfg['target_fraction']:.0%} of the best method's mean final global "
            f"accuracy; a seed that never reaches it counts as {p['rounds'] + 1}); *reached* = seeds that reached it. "
            "▲X / ▼X: global accuracy significantly above / below method X (paired t-test over seeds, 95% CI of the "
            "paired difference excludes 0; uncorrected: each setting's Holm-Bonferroni line corrects for the number "
            "of its tests).", ""]


def _summary(result: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """FedAlign-MoE against each baseline (the first four pairs of ``compare``), every setting."""
    pairs = [tuple(p) for p in cfg["compare"][:4]]
    lines = ["## Summary: FedAlign-MoE against the baselines (global accuracy)", "",
             "| Setting | " + " | ".join(f"{a} − {b}" for a, b in pairs) + " |", "|---|" + "---|" * len(pairs)]
    for setting, st in result["stats"].items():
        diffs = []
        for a, b in pairs:
            t = next((t for t in st["tests"] if t["a"] == a and t["b"] == b), None)
            diffs.append("–" if t is None else f"{fmt(t['global']['diff'], '+.3f')} ({verdict(t['global'])})")
        lines.append(f"| {setting} | " + " | ".join(diffs) + " |")
    return lines + [""]


def _sanity(result: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """FedAlign's regulariser, r_g and semantic gate over its cells; FedMoE's experts held."""
    lines = []
    fa = [c for c in result["cells"] if c["method"] == "FedAlign-MoE"]
    if fa:
        regs = [x for c in fa for r in c["sanity"]["rounds"] for x in (r.get("reg_min"), r.get("reg_max"))
                if x is not None]
        moves = [r["r_g_l1_move"] for c in fa for r in c["sanity"]["rounds"] if r.get("r_g_l1_move") is not None]
        devs = [r["r_g_max_dev_uniform"] for c in fa for r in c["sanity"]["rounds"]
                if r.get("r_g_max_dev_uniform") is not None]
        gates = [g for c in fa for g in c["sanity"]["gate"].values()]
        agg_un = [(r.get("experts_aggregated"), r.get("experts_unchanged")) for c in fa for r in c["sanity"]["rounds"]]
        lines.append(f"- FedAlign-MoE (full), all settings and seeds: regulariser L_reg per device-round "
                     f"{fmt(min(regs), '.4f') if regs else '–'} … {fmt(max(regs), '.4f') if regs else '–'} (finite); "
                     f"r_g L1 change per round {fmt(min(moves), '.4f') if moves else '–'} … "
                     f"{fmt(max(moves), '.4f') if moves else '–'}; largest |r_g − 1/E| "
                     f"{fmt(max(devs), '.3f') if devs else '–'}; experts aggregated / left unchanged per round "
                     f"{sorted(set(agg_un))}.")
        if gates:
            g = lambda k: [x[k] for x in gates if x.get(k) is not None]  # noqa: E731
            lines.append(f"- Semantic gate (per round, mean over experts): hidden-state cosine s "
                         f"{fmt(min(g('s')))} … {fmt(max(g('s')))} (pair minimum down to {fmt(min(g('s_min')))}), "
                         f"adaptive s* {fmt(min(g('s_star')))} … {fmt(max(g('s_star')))}, mean gate "
                         f"{fmt(min(g('gate')))} … {fmt(max(g('gate')))}, share of pairs with gate < 0.5 "
                         f"{fmt(min(g('gate_closed')))} … {fmt(max(g('gate_closed')))}, update cosine d "
                         f"{fmt(min(g('d')))} … {fmt(max(g('d')))}, ω max/min "
                         f"{fmt(min(g('omega_ratio')), '.2f')} … {fmt(max(g('omega_ratio')), '.2f')}.")
    fm = [c for c in result["cells"] if c["method"] == "FedMoE"]
    if fm:
        lines.append(f"- FedMoE experts held per device (of 24, mean over device-rounds): "
                     f"{fmt(min(c['experts_held_mean'] for c in fm), '.1f')} … "
                     f"{fmt(max(c['experts_held_mean'] for c in fm), '.1f')}.")
    return lines


def _routing(result: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """Routing health per method over its cells (last round), and the per-round tables' place."""
    lines = ["", "Routing health per method (over all its cells; last round): experts that no device routed a "
                 "token to (of 24; 3 layers × 8), the expert-load CV (eq. 8 of FLEX-MoE, cumulative), and for "
                 "fedalign the experts per round left unchanged because every ω was 0 (all their update pairs "
                 "pointed apart) or because nobody used them.", "",
             "| Method | cells | unused experts, last round (mean, max) | load CV, last round | "
             "fedalign: experts unchanged per round (mean) | of which all ω = 0 |", "|---|---|---|---|---|---|"]
    for m in dict.fromkeys(c["method"] for c in result["cells"]):
        cs = [c for c in result["cells"] if c["method"] == m]
        last = [c["sanity"]["rounds"][-1] for c in cs if c["sanity"]["rounds"]]
        un = [r["unused_experts"] for r in last]
        cv = [r["cv"] for r in last if r.get("cv") is not None]
        unch = [r["experts_unchanged"] for c in cs for r in c["sanity"]["rounds"]
                if r.get("experts_unchanged") is not None]
        zero = [g.get("omega_zero", 0) for c in cs for g in c["sanity"]["gate"].values()]
        nrounds = sum(len(c["sanity"]["rounds"]) for c in cs)
        lines.append(f"| {m} | {len(cs)} | {fmt(sum(un) / len(un), '.1f') if un else '–'}, {max(un) if un else '–'} | "
                     f"{fmt(sum(cv) / len(cv), '.2f') if cv else '–'} | "
                     f"{fmt(sum(unch) / len(unch), '.1f') if unch else '–'} | "
                     f"{fmt(sum(zero) / nrounds, '.1f') if unch and nrounds else '–'} |")
    return lines + ["", "Per-round tables of every cell: `runs/fedalign_table/<profile>/s<seed>/<cell>/rounds.md` "
                        "(not committed).", ""]


LAYOUT = tables.Layout(
    head=_head,
    columns=[("Method", lambda m, s, st: m), ("global acc", lambda m, s, st: f"{ci_text(s['global'])}{marks(st, m)}"),
             ("local acc", lambda m, s, st: ci_text(s["local"])),
             ("rounds to target", lambda m, s, st: ci_text(s["rounds_to_target"], ".1f")),
             ("reached", lambda m, s, st: f"{s['reached']}/{len(s['seeds'])}"),
             ("experts held (of 24)", lambda m, s, st: fmt(s["experts_held_mean"], ".1f"))],
    test_header="| Paired difference (a − b) | Δ global [95% CI], p | | Δ local [95% CI], p | "
                "| Δ rounds to target [95% CI], p | |",
    test_columns=[lambda t, st: f"{diff_text(t['global'])} | {verdict(t['global'])}",
                  lambda t, st: f"{diff_text(t['local'])} | {verdict(t['local'])}",
                  lambda t, st: f"{diff_text(t['rounds'], '+.1f')} | {verdict(t['rounds'], higher_is_better=False)}"],
    all_ok="- Every round of every cell closed `ok`; no device was excluded or failed; every FedAlign run reported a "
           "finite regulariser and moved r_g.",
    sections=_summary, sanity=_sanity, tail=_routing)


def plot(result: dict[str, Any], path: Path, cfg: dict[str, Any]) -> None:
    """:func:`tables.plot_with_ablations`: the methods, and the ablations against FedAlign-MoE."""
    tables.plot_with_ablations(result, path, list(cfg["methods"]), [cfg["ablations_against"], *cfg["ablations"]],
                               cfg["ablation_setting"])


def main(argv: list[str] | None = None) -> int:
    """The harness on :data:`CONFIG` with ``argv`` (harness options)."""
    from benchmarks import harness

    return harness.main([*(sys.argv[1:] if argv is None else argv), str(CONFIG)])


if __name__ == "__main__":
    sys.exit(main())
