"""Poisoning benchmark: what one or two compromised devices cost, under each defence.

Setting: 10 devices fine-tune the real upcycled MiniLM MoE (8 experts, top-2, LoRA rank
8, int8 base shards) on BBC News topics (5 classes), Dirichlet(0.5) label skew, over a
real MQTT broker (Mosquitto on 127.0.0.1:1883 when it answers, else the embedded
broker), every device provisioned with an Ed25519 key and signing its updates. Devices'
memory budgets hold 2..6 experts per layer (seeded), ``random_moe`` assignment, so some
experts have a single holder. Accuracy: the global model on BBC's held-out 20% test
split after the last round.

Malicious devices are the last one or two devices. They are provisioned, sign correctly
and send schema-valid messages (an :class:`edge_sdk.EdgeClient` subclass); attacks:

- ``inflation``: claims 10^6 samples (hello and stats; the default
  ``max_samples_per_device`` lets that through) and sends a random update with the norm
  of its honest one: with |D_c| weights it would replace everyone's training;
- ``noise``: its update plus Gaussian noise of 100 x the update's norm;
- ``sign_flip``: -10 x its update;
- ``alie`` ("a little is enough", Baruch, Baruch, Goldberg 2019): the attacker trains
  three times from the received state on disjoint thirds of its data, and sends
  mu - z * sigma of those three updates, coordinate-wise, z = 1.0 (it cannot see the
  honest devices' updates; with 2 attackers each does this on its own);
- ``label_flip``: trains honestly on its data with every label shifted to the next class;
- ``expert``: honest backbone and head, but each expert it holds is replaced by a random
  change of 10 x its own backbone change's norm (the attack on experts with few holders;
  the report counts how many of the attacker's experts had no other holder).

Defences (the aggregator's ``defences`` section): ``bounds only`` (the protocol's bounds,
which cannot be switched off, no screening, no guard); ``screening`` (update screening +
pre-commit guard, no robust rule); ``trimmed mean`` (trim 0.1; 0.2 with two attackers),
``median`` and ``Multi-Krum`` (f = number of attackers) on top of screening; ``Multi-Krum``
with one attacker is the shipped default (chosen from this benchmark's full run, see the
README); ``screening, min_holders 2`` only in the few-holder setting ``sparse:`` (honest
devices hold 1 expert per layer, the attacker all 8).

Every (attackers, attack, defence) cell runs on the same data, budgets and seeds; the
clean run (``none``) of each defence is its reference. Reported: final accuracy mean ±
95% CI (t, over seeds), the paired accuracy change against the clean run of the same
defence (significant when its CI excludes 0), the global-state L2 norm per round, what
screening clipped/rejected. Cells are resumable (``runs/poisoning/<profile>/<cell>.json``).

    python -m benchmarks.poisoning --quick     # < 10 min: 1 seed, default vs bounds only, 1 attacker
    python -m benchmarks.poisoning             # 3 seeds, every defence, 1 and 2 attackers
    python -m benchmarks.poisoning --collect   # tables from the cells finished so far

Writes ``results/poisoning/poisoning[_quick].{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import tempfile
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch

from cloud.robust.guard import l2_norm
from benchmarks.common import heavy_lock
from edge_sdk import EdgeClient
from edge_sdk.filters import ClaimSamples, Filter, UpdateContext

ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("poisoning")

ATTACKS = ("none", "inflation", "noise", "sign_flip", "alie", "label_flip", "expert")
DEFENCES = ("bounds only", "screening", "median", "trimmed mean", "Multi-Krum", "screening, min_holders 2")
SPARSE = ("sparse:none", "sparse:expert")
"""The few-holder setting: honest devices hold 1 expert per layer, the attacker all 8, so
several experts have the attacker as their only holder (the clean run has the same
capacities, without the attack)."""
ONLY_ATTACKS = {"screening": ATTACKS + SPARSE, "bounds only": ATTACKS + SPARSE, "screening, min_holders 2": SPARSE}
"""The few-holder policy only matters for the attack on experts (and its clean cost)."""
INFLATED = 10**6
PROFILES: dict[str, dict[str, Any]] = {
    "quick": dict(seeds=[0], attackers=[1], defences=["Multi-Krum", "bounds only"], rounds=2, max_steps=3,
                  two_attacker_defences=[]),
    "full": dict(seeds=[0, 1, 2], attackers=[1], rounds=3,
                 defences=["screening", "Multi-Krum", "trimmed mean", "bounds only", "screening, min_holders 2"],
                 max_steps=4,
                 two_attacker_defences=[]),
    "extended": dict(seeds=[0, 1, 2], attackers=[1, 2], rounds=3, max_steps=4,
                     defences=["screening", "Multi-Krum", "trimmed mean", "bounds only", "median"],
                     two_attacker_defences=["bounds only", "median", "Multi-Krum"]),
    "two": dict(seeds=[0, 1, 2], attackers=[1, 2], rounds=3, max_steps=4, defences=["default"],
                one_attacker_attacks=("none",), two_attacker_defences=["default"]),
}
"""``full`` is what the committed results cover; ``two`` runs the shipped defaults against
two malicious devices (and its clean run); ``extended`` adds the median and two
attackers (the same cells are shared through ``runs/poisoning/full``)."""
DEVICES, BATCH, SEQ, LR = 10, 8, 32, 2e-3


def defence_config(name: str, attackers: int) -> dict[str, Any]:
    """The aggregator's ``defences`` section for a named defence."""
    if name == "bounds only":
        return {"screening": None, "guard": None, "robust": {"name": "none"}}
    if name == "screening":
        return {"robust": {"name": "none"}}
    if name == "default":
        return {}
    if name == "screening, min_holders 2":
        return {"robust": {"name": "none"}, "min_holders": 2}
    if name == "median":
        return {"robust": {"name": "median"}}
    if name == "trimmed mean":
        return {"robust": {"name": "trimmed_mean", "params": {"trim": 0.1 * attackers}}}
    if name == "Multi-Krum":
        return {"robust": {"name": "multi_krum", "params": {"f": attackers}}}
    raise KeyError(name)


class Attack(Filter):
    """A provisioned device's lie about its update (module docstring), as a filter in front
    of its signing: the device still signs what it sends. Inflation also claims
    :data:`INFLATED` samples (:class:`edge_sdk.filters.ClaimSamples`, :func:`attack_filters`)."""

    def __init__(self, device_id: str, attack: str, seed: int):
        self.attack, self.seed = attack, seed
        self._gen = torch.Generator().manual_seed(zlib.crc32(f"{device_id}/{attack}".encode()))


    def _noise_like(self, ref: dict[str, torch.Tensor], norm: float) -> dict[str, torch.Tensor]:
        z = {k: torch.randn(v.shape, generator=self._gen) for k, v in ref.items()}
        total = l2_norm(z.values()) or 1.0
        return {k: v * (norm / total) for k, v in z.items()}

    def on_update(self, trained, ctx: UpdateContext):
        a, model, sent, train_items = ctx.assignment, ctx.model, ctx.sent, ctx.train_items
        delta = {k: trained[k] - sent[k] for k in sent}
        norm = l2_norm(delta.values())
        if self.attack == "inflation":
            delta = self._noise_like(delta, norm)
        elif self.attack == "noise":
            delta = {k: v + n for (k, v), n in zip(delta.items(), self._noise_like(delta, 100 * norm).values())}
        elif self.attack == "sign_flip":
            delta = {k: -10 * v for k, v in delta.items()}
        elif self.attack == "alie":
            delta = self._alie(a, model, sent, train_items, z=1.0)
        elif self.attack == "expert":
            back = l2_norm(v for k, v in delta.items() if k.startswith("backbone."))
            experts = {k: v for k, v in delta.items() if k.startswith("expert.")}
            delta.update(self._noise_like(experts, 10 * back))
        return {k: (sent[k] + delta[k]).to(sent[k].dtype) for k in sent}

    def _alie(self, a, model, sent, items, z: float) -> dict[str, torch.Tensor]:
        from edge_sdk.objectives import terms_for
        from moe_model.train import train_local

        parts = [items[i::3] for i in range(3)]
        deltas = []
        for i, part in enumerate(parts):
            model.load_adapter_state(sent)
            train_local(model, part, a.train, terms=terms_for(a.train, a.objectives, sent), seed=self.seed * 7 + i)
            st = model.adapter_state()
            deltas.append({k: st[k] - sent[k] for k in sent})
        out = {}
        for k in sent:
            stack = torch.stack([d[k] for d in deltas])
            out[k] = stack.mean(0) - z * stack.std(0)
        return out


def attack_filters(device_id: str, attack: str, seed: int) -> list[Filter]:
    """The outgoing filters of a malicious device running ``attack``."""
    claim = [ClaimSamples(lambda n: INFLATED)] if attack == "inflation" else []
    return [*claim, Attack(device_id, attack, seed)]


def _flip(items: list[tuple[str, str]], labels: list[str]) -> list[tuple[str, str]]:
    return [(x, labels[(labels.index(y) + 1) % len(labels)]) for x, y in items]


def run_cell(seed: int, attackers: int, attack: str, defence: str, prof: dict, broker: str, tmp: Path,
             cache: Path) -> dict[str, Any]:
    """One federation; returns its summary (final accuracy, per-round figures)."""
    from cloud.service import Aggregator, AggregatorConfig, StrategyConfig, TaskConfig
    from moe_model.budget import estimate
    from fedmoe.inprocess import run_inprocess
    from fedmoe.partition import partition
    from fedmoe.simulate import split_task
    from protocol.messages import ModelSpec, TrainConfig
    from protocol.signing import generate_key, public_key_b64

    items, labels, train_idx, test_idx = split_task("bbc", 0)
    label_ids = [labels.index(items[i][1]) for i in train_idx]
    parts = partition(label_ids, DEVICES, "dirichlet:0.5", seed)
    rng = random.Random(f"poisoning/{seed}")
    ks = [rng.randint(2, 6) for _ in range(DEVICES)]
    if attack.startswith("sparse:"):
        attack = attack.split(":", 1)[1]
        ks = [1] * (DEVICES - attackers) + [8] * attackers
    spec = ModelSpec(num_experts=8, top_k=2, max_seq_len=SEQ, seed=seed, lora={"rank": 8, "alpha": 16})
    fed = f"poison-{uuid.uuid4().hex[:8]}"
    keys = {f"dev-{i:02d}": generate_key() for i in range(DEVICES)}
    key_file = tmp / "device_keys.json"
    key_file.write_text(json.dumps({d: public_key_b64(k) for d, k in keys.items()}))
    cfg = AggregatorConfig(
        federation=fed, model=spec, tasks={"bbc": TaskConfig(labels=labels)}, rounds=prof["rounds"],
        min_devices=DEVICES, start_timeout_s=300, round_timeout_s=600,
        train=TrainConfig(local_epochs=1, max_steps=prof["max_steps"], batch_size=BATCH, lr=LR),
        assignment=StrategyConfig(name="random_moe"), aggregation=StrategyConfig(name="modular"),
        defences=defence_config(defence, attackers), weight_format="int8", store=f"sqlite:///{tmp}/agg.db",
        clear_retained_on_exit=True, seed=seed, device_keys=str(key_file), eval_batch_size=64,
    )
    agg = Aggregator(cfg, broker, eval_data={"bbc": [(items[i][0], labels.index(items[i][1])) for i in test_idx]})
    bad = {f"dev-{i:02d}" for i in range(DEVICES - attackers, DEVICES)} if attack != "none" else set()
    clients = []
    for i, (part, k) in enumerate(zip(parts, ks)):
        d = f"dev-{i:02d}"
        data = [items[train_idx[j]] for j in part]
        kw = dict(federation=fed, task="bbc", runtime_bytes=0, headroom_bytes=0, low_memory=False,
                  budget_bytes=estimate(spec, k, BATCH, len(labels), runtime_bytes=0, weight_format="int8").total + 1,
                  cache_dir=str(cache / d), seed=seed * 100 + i, signing_key=keys[d])
        if d in bad:
            clients.append(EdgeClient(broker, d, _flip(data, labels) if attack == "label_flip" else data,
                                      filters=attack_filters(d, attack, kw["seed"]), **kw))
        else:
            clients.append(EdgeClient(broker, d, data, **kw))
    t0 = time.time()
    records, errors = run_inprocess(agg, clients, 600 * (prof["rounds"] + 1))
    if errors or len(records) < prof["rounds"]:
        raise RuntimeError(f"cell failed after {len(records)} rounds: {errors!r}")
    sole = 0
    for r in records:
        held: dict[tuple, int] = {}
        for dev in r["devices"].values():
            for layer, es in dev["experts"].items():
                for e in es:
                    held[(layer, e)] = held.get((layer, e), 0) + 1
        sole += sum(1 for d in bad & set(r["devices"]) for layer, es in r["devices"][d]["experts"].items()
                    for e in es if held[(layer, e)] == 1)
    return {
        "accuracy": records[-1]["accuracy"], "accuracy_curve": [r["accuracy"] for r in records],
        "state_norm": [r.get("global_state_norm") for r in records],
        "status": [r["status"] for r in records],
        "rejected": [sorted(r.get("screening", {}).get("rejected", {})) for r in records],
        "clipped": [sorted(r.get("screening", {}).get("clipped", {})) for r in records],
        "capped": [sorted(r.get("screening", {}).get("capped_samples", {})) for r in records],
        "dropped": [r.get("aggregation_report", {}).get("dropped", {}) for r in records],
        "excluded": [len(r.get("excluded", {})) for r in records],
        "experts_held": [{d: sum(len(v) for v in x["experts"].values()) for d, x in r["devices"].items()}
                         for r in records],
        "attacker_sole_experts": sole, "attackers": sorted(bad), "capacities": ks,
        "seconds": time.time() - t0, "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def cells_for(prof: dict) -> list[tuple[int, int, str, str]]:
    """(seed, attackers, attack, defence), seeds outermost so a partial run covers every cell of seed 0 first."""
    out = []
    for seed in prof["seeds"]:
        for n in prof["attackers"]:
            defences = prof["defences"] if n == 1 else prof["two_attacker_defences"]
            for defence in defences:
                attacks = prof.get("one_attacker_attacks") if n == 1 else None
                for attack in attacks or ONLY_ATTACKS.get(defence, ATTACKS):
                    if n > 1 and attack == "none":
                        continue  # the clean run does not depend on the number of attackers
                    out.append((seed, n, attack, defence))
    return out


def _key(seed: int, n: int, attack: str, defence: str) -> str:
    return f"s{seed}-m{n}-{attack.replace(':', '_')}-{defence.replace(', ', '-').replace(' ', '_')}"


def ci95(values: list[float]) -> float:
    """Half-width of the 95% confidence interval of the mean (Student t; 0 for one value)."""
    if len(values) < 2:
        return 0.0
    t = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571}.get(len(values), 2.0)
    return t * statistics.stdev(values) / math.sqrt(len(values))


def summarise(cells: dict[str, dict], prof: dict) -> dict[str, Any]:
    """Mean ± CI per (attackers, attack, defence) and paired changes against the clean run."""
    rows = []
    for n in prof["attackers"]:
        defences = prof["defences"] if n == 1 else prof["two_attacker_defences"]
        for defence in defences:
            for attack in ONLY_ATTACKS.get(defence, ATTACKS):
                if n > 1 and attack == "none":
                    continue
                accs, diffs, norms, rejected, clipped, sole = [], [], [], 0, 0, 0
                dropped = [0, 0]  # units Multi-Krum left out: attackers', honest devices'
                excluded = 0
                for seed in prof["seeds"]:
                    c = cells.get(_key(seed, n, attack, defence))
                    clean = cells.get(_key(seed, 1, "sparse:none" if attack.startswith("sparse:") else "none", defence))
                    if c is None:
                        continue
                    accs.append(c["accuracy"])
                    norms.append(c["state_norm"])
                    if clean is not None:
                        diffs.append(c["accuracy"] - clean["accuracy"])
                    rejected += sum(len(set(r) & set(c["attackers"])) for r in c["rejected"])
                    clipped += sum(len(set(r) & set(c["attackers"])) for r in c["clipped"])
                    sole += c["attacker_sole_experts"]
                    for per_round in c["dropped"]:
                        for d, units in per_round.items():
                            dropped[d not in c["attackers"]] += units
                    excluded += sum(c.get("excluded", []))
                if not accs:
                    continue
                d_mean = statistics.mean(diffs) if diffs else None
                d_ci = ci95(diffs) if diffs else None
                rows.append({
                    "attackers": n, "attack": attack, "defence": defence, "seeds": len(accs),
                    "accuracy": statistics.mean(accs), "accuracy_ci": ci95(accs),
                    "change": d_mean, "change_ci": d_ci,
                    "significant": None if d_mean is None or len(diffs) < 2 else abs(d_mean) > d_ci,
                    "state_norm": [statistics.mean(x) for x in zip(*norms)],
                    "attacker_updates_rejected": rejected, "attacker_updates_clipped": clipped,
                    "attacker_sole_experts": sole, "units_dropped_attacker": dropped[0],
                    "units_dropped_honest": dropped[1], "devices_excluded": excluded,
                })
    return {"rows": rows}


def write_outputs(summary: dict, cells: dict, prof: dict, profile: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = "poisoning" if profile == "full" else f"poisoning_{profile}"
    meta = {"profile": profile, **prof, "devices": DEVICES, "batch_size": BATCH, "max_seq_len": SEQ, "lr": LR,
            "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cells": len(cells)}
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "summary": summary, "cells": cells}, indent=1))
    pm = lambda v, ci: "–" if v is None else f"{v:.3f} ± {ci:.3f}"  # noqa: E731
    lines = [f"# Poisoning benchmark ({profile} profile)", "",
             f"10 devices, real MiniLM-MoE (8 experts, top-2, int8 base, LoRA r=8), BBC News, Dirichlet(0.5), "
             f"{prof['rounds']} rounds x {prof['max_steps']} local steps (batch {BATCH}, seq {SEQ}, lr {LR}), "
             f"random_moe with 2..6 experts per layer, seeds {prof['seeds']}. Accuracy of the global model on the "
             f"BBC test split after the last round, mean ± 95% CI over seeds; change = paired difference against "
             f"the clean run of the same defence (* = significant, CI excludes 0). {meta['written']}.", ""]
    for n in prof["attackers"]:
        lines += [f"## {n} malicious device{'s' if n > 1 else ''} of 10", "",
                  "| Defence | Attack | Accuracy | Change vs clean | Attacker updates rejected / clipped | "
                  "Units Multi-Krum dropped: attacker / honest | Attacker's sole-held experts | "
                  "Global-state norm, last round |", "|---|---|---|---|---|---|---|---|"]
        for r in summary["rows"]:
            if r["attackers"] != n:
                continue
            ch = "–" if r["change"] is None else pm(r["change"], r["change_ci"]) + (" *" if r["significant"] else "")
            lines.append(f"| {r['defence']} | {r['attack']} | {pm(r['accuracy'], r['accuracy_ci'])} | {ch} | "
                         f"{r['attacker_updates_rejected']} / {r['attacker_updates_clipped']} | "
                         f"{r['units_dropped_attacker']} / {r['units_dropped_honest']} | "
                         f"{r['attacker_sole_experts']} | {r['state_norm'][-1]:.4g} |")
        lines.append("")
    lines += goal_lines(summary, cells, prof)
    lines += paired_lines(cells, prof, "Multi-Krum", "screening")
    (out / f"{stem}.md").write_text("\n".join(lines))
    plot(summary, prof, out / f"{stem}.png")
    print("\n".join(lines))


def goal_lines(summary: dict, cells: dict, prof: dict) -> list[str]:
    """Per defence, 1 attacker: the worst attack's paired change against its clean run
    (goal: no worse than -2 points) and its clean run against ``bounds only`` (goal: no
    worse than -1 point)."""
    out = ["## Goal check (1 malicious device of 10)", "",
           "| Defence | Worst attack | Its change vs clean | Attacks significantly worse than clean | "
           "Clean run vs bounds only | Goals met |", "|---|---|---|---|---|---|"]
    for d in prof["defences"]:
        rows = [r for r in summary["rows"] if r["attackers"] == 1 and r["defence"] == d
                and r["attack"] not in ("none", "sparse:none") and r["change"] is not None]
        if not rows:
            continue
        worst = min(rows, key=lambda r: r["change"])
        sig = [r["attack"] for r in rows if r["significant"] and r["change"] < 0]
        clean = "sparse:none" if d in ONLY_ATTACKS and "none" not in ONLY_ATTACKS[d] else "none"
        diffs = [cells[_key(s, 1, clean, d)]["accuracy"] - cells[_key(s, 1, clean, "bounds only")]["accuracy"]
                 for s in prof["seeds"] if _key(s, 1, clean, d) in cells and _key(s, 1, clean, "bounds only") in cells]
        cost = statistics.mean(diffs) if diffs else None
        met = worst["change"] >= -0.02 and (d == "bounds only" or (cost is not None and cost >= -0.01))
        out.append(f"| {d} | {worst['attack']} | {worst['change']:+.3f} ± {worst['change_ci']:.3f} | "
                   f"{', '.join(sig) or 'none'} | "
                   f"{'–' if cost is None or d == 'bounds only' else f'{cost:+.3f} ± {ci95(diffs):.3f}'} | "
                   f"{'yes' if met else 'no'} |")
    return out + [""]


def paired_lines(cells: dict, prof: dict, a: str, b: str) -> list[str]:
    """Accuracy of defence ``a`` minus defence ``b`` under each attack, paired by seed."""
    out = [f"## {a} minus {b}, paired by seed (1 malicious device)", "", "| Attack | Accuracy difference |",
           "|---|---|"]
    for attack in ATTACKS:
        d = [cells[_key(s, 1, attack, a)]["accuracy"] - cells[_key(s, 1, attack, b)]["accuracy"]
             for s in prof["seeds"] if _key(s, 1, attack, a) in cells and _key(s, 1, attack, b) in cells]
        if d:
            m, ci = statistics.mean(d), ci95(d)
            out.append(f"| {attack} | {m:+.3f} ± {ci:.3f}{' *' if len(d) > 1 and abs(m) > ci else ''} |")
    return out + [""] if len(out) > 4 else []


def plot(summary: dict, prof: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["rows"] if r["attackers"] == 1]
    if not rows:
        return
    defences = [d for d in prof["defences"] if any(r["defence"] == d and r["attack"] in ATTACKS for r in rows)]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 4.5))
    width = 0.8 / len(defences)
    for j, d in enumerate(defences):
        ys = [next((r for r in rows if r["defence"] == d and r["attack"] == a), None) for a in ATTACKS]
        ax.bar([i + j * width for i in range(len(ATTACKS))], [r["accuracy"] if r else 0 for r in ys], width,
               yerr=[r["accuracy_ci"] if r else 0 for r in ys], label=d, capsize=2)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ATTACKS))], ATTACKS, rotation=20)
    ax.set_ylabel("final accuracy (mean ± 95% CI)")
    ax.set_title("1 malicious device of 10")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    for d, style in (("bounds only", "--"), ("screening", "-")):
        for a in ("none", "noise", "sign_flip", "inflation"):
            r = next((r for r in rows if r["defence"] == d and r["attack"] == a), None)
            if r:
                ax2.plot(range(1, len(r["state_norm"]) + 1), r["state_norm"], style, label=f"{d}: {a}")
    ax2.set_yscale("log")
    ax2.set_xlabel("round")
    ax2.set_ylabel("global-state L2 norm")
    ax2.legend(fontsize=6)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _broker():
    """Mosquitto on 127.0.0.1:1883 when it answers (the embedded amqtt broker otherwise)."""
    import socket

    try:
        socket.create_connection(("127.0.0.1", 1883), timeout=1).close()
        return "mqtt://127.0.0.1:1883", None
    except OSError:
        from fedmoe.broker import EmbeddedBroker

        b = EmbeddedBroker().start()
        return b.url, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--extended", action="store_true", help="also the median and two attackers")
    ap.add_argument("--two", action="store_true", help="the shipped defaults against two malicious devices")
    ap.add_argument("--collect", action="store_true", help="only build the tables from finished cells")
    ap.add_argument("--force", action="store_true", help="rerun finished cells")
    ap.add_argument("--lock", default=None, help="flock this file while a cell runs (shared machine)")
    ap.add_argument("--out", default=str(ROOT / "results" / "poisoning"))
    ap.add_argument("--reuse", nargs="*", default=[], metavar="JSON",
                    help="committed results (e.g. results/poisoning/poisoning.json): their cells stand in for cells "
                         "with no file under runs/ (a fresh checkout extends a table without rerunning it)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("cloud", "edge_sdk", "moe_model", "protocol", "amqtt", "transitions", "fedmoe"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    torch.set_num_threads(2)
    profile = "quick" if args.quick else "extended" if args.extended else "two" if args.two else "full"
    prof = PROFILES[profile]
    runs = ROOT / "runs" / "poisoning" / ("quick" if args.quick else "full")
    runs.mkdir(parents=True, exist_ok=True)
    cells: dict[str, dict] = {}
    reused: dict[str, dict] = {}
    for path in args.reuse:
        reused.update(json.loads(Path(path).read_text())["cells"])
    todo = cells_for(prof)
    broker = embedded = None
    try:
        for i, (seed, n, attack, defence) in enumerate(todo, 1):
            key = _key(seed, n, attack, defence)
            path = runs / f"{key}.json"
            if path.exists() and not args.force:
                cells[key] = json.loads(path.read_text())
                continue
            if key in reused and not args.force:
                cells[key] = reused[key]
                continue
            if args.collect:
                continue
            if broker is None:
                broker, embedded = _broker()
            with heavy_lock(args.lock), tempfile.TemporaryDirectory() as tmp:
                t0 = time.time()
                cells[key] = run_cell(seed, n, attack, defence, prof, broker, Path(tmp), runs.parent / "cache")
            path.write_text(json.dumps(cells[key]))
            log.info("[%d/%d] %s: accuracy %.3f, norms %s, rejected %s (%.0f s)", i, len(todo), key,
                     cells[key]["accuracy"], [f"{x:.3g}" for x in cells[key]["state_norm"]],
                     cells[key]["rejected"], time.time() - t0)
    finally:
        if embedded is not None:
            embedded.stop()
    write_outputs(summarise(cells, prof), cells, prof, profile, Path(args.out))


if __name__ == "__main__":
    main()
