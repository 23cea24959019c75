"""The shape of FLEX-MoE's Tables 2-4 (000_5c6cd7a163e9f8d7.txt) on Fashion-MNIST, through
the production aggregator and EdgeClient code over MQTT.

C = 20 clients, E = 8 experts (``conv-moe``: conv extractor, one MoE layer of MLP experts,
client-private gating, classifier; every parameter trained), k_c drawn uniformly in
[2, 6] and turned into a memory budget with the memory plan (so the cloud derives k_c
from the budget), partitions IID, Dirichlet 0.8, 4-class, 2-class, Dirichlet 0.1;
algorithms Random, Greedy (acc), FLEX (acc), Greedy (loss), FLEX (loss), all with
usage-weighted aggregation (eq. 3-4) and private routers; the same seed, partitions,
budgets, rounds and local epochs for all. The devices run as threads of this process
(one EdgeClient each, its own MQTT connection), the aggregator likewise; the broker is
the embedded amqtt one unless ``--broker`` is given.

Per cell: the global model's accuracy on the test set (cloud evaluation; with private
routers the global router rows stay at their initial values), the mean over clients of
the accuracy on their local validation split with their own private gate (the paper's
"average test accuracy across clients" in spirit), CV and Max-Min gap of the expert
load over all rounds (eq. 8-9, window = all rounds, as in the paper).

Each finished cell is stored under ``--work`` and skipped when the script is run again
(resumable); each cell takes ``--lock`` (the machine's heavy-run lock) while it runs.

    python benchmarks/flex_table.py --quick          # < 10 min
    python benchmarks/flex_table.py                  # the full table
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
from common import heavy_lock, install_fashion_mnist

PARTITIONS = [("IID", "iid"), ("Dir(0.8)", "dirichlet:0.8"), ("4-class", "classes:4"), ("2-class", "classes:2"),
              ("Dir(0.1)", "dirichlet:0.1")]
ALGOS = [("Random", "random", {}), ("Greedy (acc)", "greedy", {"indicator": "acc"}),
         ("FLEX (acc)", "flex", {"indicator": "acc"}), ("Greedy (loss)", "greedy", {"indicator": "loss"}),
         ("FLEX (loss)", "flex", {"indicator": "loss"})]
log = logging.getLogger("flex_table")


def client_data(train, scheme: str, clients: int, per_client: int | None, seed: int):
    from fedmoe.partition import partition

    labels = [y for _, y in train]
    parts = partition(labels, clients, scheme, seed)
    rng = random.Random(seed)
    out = []
    for p in parts:
        p = list(p)
        if per_client is not None and len(p) > per_client:
            p = sorted(rng.sample(p, per_client))
        out.append([train[i] for i in p])
    return out


def run_cell(args, spec, data, test, labels, ks, algo: str, params: dict, url: str, protocol: str, tmp: Path) -> dict:
    """One federation; returns its round records and the cell summary."""
    from cloud.service import Aggregator, AggregatorConfig, StrategyConfig, TaskConfig
    from edge_sdk import EdgeClient
    from moe_model.budget import estimate
    from fedmoe.inprocess import run_inprocess
    from protocol.messages import TrainConfig

    fed = f"flex-{uuid.uuid4().hex[:8]}"
    train = TrainConfig(local_epochs=args.local_epochs, batch_size=args.batch_size, lr=args.lr, router="private")
    cfg = AggregatorConfig(
        federation=fed, model=spec, tasks={"fmnist": TaskConfig(labels=labels)}, rounds=args.rounds,
        min_devices=len(data), start_timeout_s=300, round_timeout_s=args.round_timeout, train=train,
        weight_format="fp32", store=f"sqlite:///{tmp}/agg.db", clear_retained_on_exit=True, protocol=protocol,
        assignment=StrategyConfig(name=algo, params=params), aggregation=StrategyConfig(name="usage_weighted"),
        eval_max_samples=args.eval_samples, seed=args.seed, eval_batch_size=256,
    )
    agg = Aggregator(cfg, url, eval_data={"fmnist": test})
    clients = []
    for i, (items, k) in enumerate(zip(data, ks)):
        budget = estimate(spec, int(k), args.batch_size, len(labels), runtime_bytes=0, weight_format="fp32").total + 1
        clients.append(EdgeClient(url, f"c{i:02d}", items, federation=fed, budget_bytes=budget, task="fmnist",
                                  cache_dir=str(tmp / f"cache{i}"), protocol=protocol, runtime_bytes=0,
                                  seed=args.seed + i, low_memory=False))
    records, errors = run_inprocess(agg, clients, args.round_timeout * (args.rounds + 1))
    if errors:
        raise RuntimeError(f"cell failed: {errors!r}")
    last = records[-1]
    return {
        "accuracy": last["accuracy"], "mean_local_accuracy": last["mean_local_accuracy"], "cv": last["cv"],
        "max_min_gap": last["max_min_gap"],
        "accuracy_curve": [r["accuracy"] for r in records],
        "local_accuracy_curve": [r["mean_local_accuracy"] for r in records],
        "expert_load": [r["expert_load"]["0"] for r in records],
        "assignment_seconds": [r["assignment_seconds"] for r in records],
        "assignment_status": [r["assignment_status"] for r in records],
        "round_seconds": [r["seconds"] for r in records],
        "capacities": [int(k) for k in ks],
    }


def plot_loads(cells: dict, path: Path, partitions) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p for p, _ in partitions if f"{p}|Greedy (acc)" in cells or f"{p}|FLEX (acc)" in cells]
    if not names:
        return
    fig, axes = plt.subplots(len(names), 2, figsize=(10, 2.6 * len(names)), squeeze=False, sharex=True)
    for row, p in zip(axes, names):
        for ax, algo in zip(row, ("Greedy (acc)", "FLEX (acc)")):
            c = cells.get(f"{p}|{algo}")
            if c is None:
                ax.set_visible(False)
                continue
            m = np.array(c["expert_load"], dtype=float)  # rounds x E
            for e in range(m.shape[1]):
                ax.plot(range(1, m.shape[0] + 1), m[:, e], label=f"e{e}")
            ax.set_title(f"{p}: {algo} (CV {c['cv']:.3f})", fontsize=9)
            ax.set_ylabel("samples routed")
            ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("round")
    axes[-1][1].set_xlabel("round")
    axes[0][1].legend(fontsize=6, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(args, cells: dict, meta: dict, out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
    f = lambda v, s: "n/a" if v is None else format(v, s)  # noqa: E731
    lines = [f"Fashion-MNIST, C={args.clients}, E=8, k_c in [2,6], {args.rounds} rounds, "
             f"{args.local_epochs} local epoch(s), <= {args.per_client or 'all'} samples/client, seed {args.seed}.",
             "acc = global model on the test set; local = mean client accuracy on its own validation split "
             "with its private gate; CV / Max-Min over all rounds (eq. 8-9).", ""]
    for p, _ in PARTITIONS:
        rows = [(a, cells.get(f"{p}|{a}")) for a, _, _ in ALGOS]
        if not any(c for _, c in rows):
            continue
        lines += [f"### {p}", "", "| Algorithm | acc (%) | local (%) | CV | Max-Min |", "|---|---|---|---|---|"]
        for a, c in rows:
            if c is None:
                lines.append(f"| {a} | not run | | | |")
                continue
            lines.append(f"| {a} | {f(c['accuracy'] and 100 * c['accuracy'], '.2f')} | "
                         f"{f(c['mean_local_accuracy'] and 100 * c['mean_local_accuracy'], '.2f')} | "
                         f"{c['cv']:.4f} | {c['max_min_gap']:.0f} |")
        lines.append("")
    (out / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    plot_loads(cells, out / f"{stem}_load.png", PARTITIONS)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds, 150 samples per client (< 10 min)")
    ap.add_argument("--data", default=None, help="directory with the Fashion-MNIST IDX files")
    ap.add_argument("--broker", default=None, help="MQTT broker URL (default: start the embedded one)")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--per-client", type=int, default=None, help="cap on training samples per client")
    ap.add_argument("--local-epochs", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-samples", type=int, default=None)
    ap.add_argument("--round-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--partitions", default=None, help="comma list of partition names to run (default all)")
    ap.add_argument("--out", default="results")
    ap.add_argument("--work", default=None, help="per-cell results (resume); default runs/flex_table[_quick]")
    ap.add_argument("--lock", default="/tmp/fedmoe-heavy.lock", help="file lock taken per cell ('' = none)")
    ap.add_argument("--fresh", action="store_true", help="ignore stored cells")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 10
    if args.per_client is None:
        args.per_client = 150 if args.quick else 600
    if args.eval_samples is None:
        args.eval_samples = 1000 if args.quick else 2000
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("cloud", "edge_sdk", "moe_model", "protocol", "amqtt", "transitions", "fedmoe.broker"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import torch

    torch.set_num_threads(1)
    from fedmoe.broker import EmbeddedBroker
    from fedmoe.datasets import FASHION_MNIST_DIR, fashion_mnist
    from protocol.messages import ModelSpec

    data_dir = args.data or FASHION_MNIST_DIR
    if not Path(data_dir).exists():
        install_fashion_mnist()
    train, test, labels = fashion_mnist(data_dir)
    spec = ModelSpec(family="conv-moe", base=None, tokenizer=None, num_experts=8, top_k=2, seed=args.seed)
    ks = np.random.default_rng(args.seed).integers(2, 7, args.clients)
    stem = "flex_table_quick" if args.quick else "flex_table"
    work = Path(args.work or f"runs/{stem}")
    (work / "cells").mkdir(parents=True, exist_ok=True)
    wanted = set(args.partitions.split(",")) if args.partitions else None
    meta = {"clients": args.clients, "experts": 8, "rounds": args.rounds, "local_epochs": args.local_epochs,
            "per_client": args.per_client, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
            "eval_samples": args.eval_samples, "capacities": ks.tolist(), "aggregation": "usage_weighted",
            "router": "private", "flex_solver": "cbc", "model": spec.model_dump(),
            "note": "2 CPU cores shared with other jobs; devices are threads of one process over real MQTT"}
    cells: dict[str, dict] = {}
    broker = None
    try:
        for pname, scheme in PARTITIONS:
            if wanted is not None and pname not in wanted:
                continue
            data = client_data(train, scheme, args.clients, args.per_client, args.seed)
            for aname, algo, params in ALGOS:
                key = f"{pname}|{aname}"
                path = work / "cells" / (key.replace("|", "__").replace(" ", "_").replace("(", "").replace(")", "")
                                         + ".json")
                if path.exists() and not args.fresh:
                    cells[key] = json.loads(path.read_text())
                    log.info("%s: stored (%s)", key, path)
                    continue
                with heavy_lock(args.lock):
                    if broker is None and args.broker is None:
                        broker = EmbeddedBroker().start()
                    url = args.broker or broker.url
                    protocol = "3.1.1" if args.broker is None else "auto"
                    tmp = work / "tmp"
                    shutil.rmtree(tmp, ignore_errors=True)
                    tmp.mkdir(parents=True)
                    t0 = time.time()
                    cell = run_cell(args, spec, data, test, labels, ks, algo, params, url, protocol, tmp)
                    cell["seconds"] = time.time() - t0
                    cell["partition"], cell["algorithm"] = scheme, aname
                path.write_text(json.dumps(cell))
                cells[key] = cell
                log.info("%s: acc %.4f local %.4f CV %.4f gap %.0f (%.0f s)", key, cell["accuracy"],
                         cell["mean_local_accuracy"], cell["cv"], cell["max_min_gap"], cell["seconds"])
                write_outputs(args, cells, meta, Path(args.out), stem)
    finally:
        if broker is not None:
            broker.stop()
    write_outputs(args, cells, meta, Path(args.out), stem)


if __name__ == "__main__":
    main()
