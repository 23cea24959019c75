"""Does *which* experts a device holds matter? The measurement behind FedMoE vs randomMoE
(Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of Experts", arXiv:2408.11304, stage one: keep the experts with the highest activation
probability p[c,l,e] on the device's data; randomMoE: as many experts, drawn at random).

Holding a subset S of a layer's experts turns the full MoE into a sub-MoE whose router
picks its top-k among S only. How far that moves the model's function is what expert
choice can win or lose. Per device (the grid of ``configs/fedmoe_experts.yaml``: MiniLM
upcycled to 16 experts in each of its 6 layers, int8, BBC News split over 6 devices with
Dirichlet(0.5) label skew) and per number n of experts held in every layer, this measures
the relative deviation ``‖h_S − h_full‖ / ‖h_full‖`` of the mean-pooled last hidden state
(``(B, hidden)``, before the task head) on the device's own samples, for

- S = the n experts of highest p on the device's data (FedMoE's choice for that size), and
- S = n experts drawn uniformly (randomMoE's choice; ``--draws`` draws per device),

at the upcycling noise our models use (0.01: experts are the dense MLP plus noise of 1% of
each weight's std, ``moe_model/models/upcycle.py``) and at larger noise levels, where the
experts differ as they do in a pre-trained MoE. Also the mean relative Frobenius distance
between two experts of a layer (fc1). The model is the one every cell starts from (LoRA B
is zero, so the adapters do not change the function yet); the sub-MoE is emulated by
masking the router logits of the experts not held (:func:`held_only`, equal to building
the sub-MoE: ``tests/test_expert_choice.py``).

Seeds 0, 1, 2 (model, router and partition draws); mean and 95% CI over seeds. Writes
``results/evidence/expert_choice.{json,md,png}``.

    python -m benchmarks.expert_choice            # 18 min on 2 cores shared with a harness run
    python -m benchmarks.expert_choice --quick    # 1 seed, 2 noise levels
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import os
import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from benchmarks.common import ci_text, heavy_lock, mean_ci, write_result

ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("expert_choice")
NOISES = [0.01, 0.1, 1.0]
SIZES = [2, 4, 8]


@contextmanager
def held_only(model, held: dict[int, list[int]]) -> Iterator[None]:
    """While inside, every MoE layer of ``model`` (a :class:`moe_model.submoe.SubMoE` with all
    experts) routes only among ``held[layer]`` (global expert ids): the other experts' router
    logits are ``-inf``, so the softmax and top-k run over the held experts, as in a sub-MoE
    that holds just them (whose router rows are the same seeded rows).

    Raises:
        KeyError: ``held`` lacks one of the model's MoE layers.
    """
    blocks = model.model.moe_blocks()
    originals = {}
    try:
        for layer, block in blocks.items():
            router = block.router
            mask = torch.full((len(router.expert_ids),), float("-inf"))
            mask[[router.expert_ids.index(e) for e in held[layer]]] = 0.0
            originals[layer] = router.forward
            router.forward = (lambda f, m: (lambda x: f(x) + m))(router.forward, mask)
        yield
    finally:
        for layer in originals:
            del blocks[layer].router.forward  # the instance attribute goes; the class's method is back


@torch.no_grad()
def pooled(model, items: list) -> torch.Tensor:
    """Mean-pooled last hidden state of the model's encoder, ``(len(items), hidden)``."""
    model.eval()
    batch, _ = model.collate(items)
    hidden = model.model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).float()
    return (hidden * m).sum(1) / m.sum(1)


@torch.no_grad()
def activation_prob(model, items: list) -> dict[int, torch.Tensor]:
    """FedMoE's p[l][e]: the fraction of the items' tokens routed to each expert (top-k
    counted), ``{layer: (E,)}``, from one forward pass of the full MoE."""
    model.eval()
    batch, _ = model.collate(items)
    model(batch)
    valid = batch["attention_mask"].reshape(-1).bool()
    out = {}
    for layer, block in model.model.moe_blocks().items():
        idx = block.last.topk_idx[valid].reshape(-1)
        counts = torch.bincount(idx, minlength=len(block.expert_ids)).double()
        out[layer] = counts / counts.sum()
    return out


def rel_dev(h: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over rows of ``‖h − ref‖ / ‖ref‖`` (both ``(B, hidden)``)."""
    return float(((h - ref).norm(dim=1) / ref.norm(dim=1)).mean())


def expert_distance(model) -> float:
    """Mean over layers and expert pairs of ``‖W_i − W_j‖_F / ‖W_i‖_F`` of the experts' fc1."""
    from moe_model.quant import QuantLinear

    vals = []
    for block in model.model.moe_blocks().values():
        ws = []
        for e in block.expert_ids:
            fc1 = block.experts[str(e)].fc1
            base = getattr(fc1, "base_layer", fc1)
            ws.append(base.dequantize() if isinstance(base, QuantLinear) else base.weight.detach())
        for i in range(len(ws)):
            for j in range(i + 1, len(ws)):
                vals.append(float((ws[i] - ws[j]).norm() / ws[i].norm()))
    return sum(vals) / len(vals)


def measure(seed: int, noise: float, per_device: int, draws: int) -> dict:
    """One model (``seed``, ``noise``): per size n, the mean over devices of the deviation with
    the top-p experts and with random experts (mean over ``draws``), and the expert distance."""
    import yaml

    from benchmarks import cells
    from fedmoe.partition import partition
    from moe_model.models import all_experts, get_adapter
    from moe_model.shards import decode_shard, encode_shard, split_base
    from moe_model.submoe import SubMoE
    from protocol.messages import ModelSpec

    cfg = yaml.safe_load((Path(__file__).resolve().parent / "configs" / "fedmoe_experts.yaml").read_text())
    spec = ModelSpec(**cfg["model"], upcycle_noise=noise, seed=seed)
    ad = get_adapter(spec.family)
    experts = all_experts(ad, spec)
    train, _, labels = cells.load_data("bbc", seed, cfg["samples"], cfg["eval_samples"])
    skel = ad.build(spec, experts, len(labels), device="meta")
    shards = {k: decode_shard(encode_shard(v, cfg["weight_format"])) for k, v in
              split_base(ad.base_state(spec), skel).items()}
    model = SubMoE(spec, experts, "bbc", len(labels), shards)
    parts = partition([cells.label_id(y, labels) for _, y in train], cfg["grid"]["devices"][0], "dirichlet:0.5", seed)
    rng = random.Random(f"expert_choice/{seed}/{noise}")
    out = {"top": {n: [] for n in SIZES}, "random": {n: [] for n in SIZES}, "distance": expert_distance(model)}
    for part in parts:
        items = [(train[i][0], cells.label_id(train[i][1], labels)) for i in part[:per_device]]
        if not items:
            continue
        full = pooled(model, items)
        p = activation_prob(model, items)
        for n in SIZES:
            top = {layer: sorted(torch.argsort(p[layer], descending=True)[:n].tolist()) for layer in p}
            with held_only(model, top):
                out["top"][n].append(rel_dev(pooled(model, items), full))
            devs = []
            for _ in range(draws):
                pick = {layer: sorted(rng.sample(range(spec.num_experts), n)) for layer in p}
                with held_only(model, pick):
                    devs.append(rel_dev(pooled(model, items), full))
            out["random"][n].append(sum(devs) / len(devs))
    return {"top": {n: sum(v) / len(v) for n, v in out["top"].items()},
            "random": {n: sum(v) / len(v) for n, v in out["random"].items()}, "distance": out["distance"]}


def markdown(result: dict) -> str:
    lines = ["# Does the choice of experts change the model? (FedMoE's top-p experts vs random experts)", "",
             f"Measured {result['date']} on {result['machine']}; seeds {result['seeds']}, {result['per_device']} "
             f"samples per device, {result['draws']} random draws per device and size. Mean ± std over seeds "
             "[95% CI]. *deviation*: ‖h_S − h_full‖ / ‖h_full‖ of the pooled last hidden state on the device's "
             "own samples, mean over the 6 devices; *ratio*: random / top-p (> 1: FedMoE's choice keeps the "
             "function closer to the full MoE). *expert distance*: ‖W_i − W_j‖ / ‖W_i‖ of fc1, mean over pairs.", "",
             "| upcycle noise | expert distance | n held / layer | deviation, top-p | deviation, random | ratio |",
             "|---|---|---|---|---|---|"]
    for noise, r in result["noises"].items():
        for n in SIZES:
            n = str(n)
            lines.append(f"| {noise} | {ci_text(r['distance'], '.3f')} | {n} | {ci_text(r['top'][n], '.4f')} | "
                         f"{ci_text(r['random'][n], '.4f')} | {ci_text(r['ratio'][n], '.2f')} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    noises = [float(x) for x in result["noises"]]
    for i, (n, style) in enumerate(zip(SIZES, ("o", "s", "^"))):
        for kind, ls in (("top", "-"), ("random", "--")):
            ys = [r[kind][str(n)]["mean"] for r in result["noises"].values()]
            ax.plot(noises, ys, ls, marker=style, color=f"C{i}",
                    label=f"{n} experts/layer, {'top-p (FedMoE)' if kind == 'top' else 'random'}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("upcycling noise (x weight std); ours: 0.01")
    ax.set_ylabel("‖h_S − h_full‖ / ‖h_full‖")
    ax.set_title("How far holding n of 16 experts moves the model")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="seed 0, noise 0.01 and 1.0")
    ap.add_argument("--per-device", type=int, default=32, help="samples per device (default 32)")
    ap.add_argument("--draws", type=int, default=4, help="random draws per device and size (default 4)")
    ap.add_argument("--lock", help="flock this file while measuring")
    ap.add_argument("--results", default=str(ROOT / "results" / "evidence"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    torch.set_num_threads(1)
    seeds, noises = ([0], [0.01, 1.0]) if args.quick else ([0, 1, 2], NOISES)
    raw: dict = {}
    t0 = time.time()
    for noise in noises:
        for seed in seeds:
            with heavy_lock(args.lock):
                raw.setdefault(str(noise), []).append(measure(seed, noise, args.per_device, args.draws))
            r = raw[str(noise)][-1]
            log.info("noise %s seed %d: distance %.4f, top %s, random %s (%.0f s)", noise, seed, r["distance"],
                     {n: round(v, 4) for n, v in r["top"].items()}, {n: round(v, 4) for n, v in r["random"].items()},
                     time.time() - t0)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores", "seeds": seeds,
              "per_device": args.per_device, "draws": args.draws, "raw": raw, "noises": {}}
    for noise, runs in raw.items():
        result["noises"][noise] = {
            "distance": mean_ci([r["distance"] for r in runs]),
            "top": {str(n): mean_ci([r["top"][n] for r in runs]) for n in SIZES},
            "random": {str(n): mean_ci([r["random"][n] for r in runs]) for n in SIZES},
            "ratio": {str(n): mean_ci([r["random"][n] / r["top"][n] for r in runs]) for n in SIZES}}
    print(write_result(args.results, "expert_choice" + ("_quick" if args.quick else ""), result, markdown, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
