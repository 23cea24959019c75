"""Do the experts of a Branch-Train-MiX model differ where it counts? (Sukhbaatar et al. 2024,
"Branch-Train-MiX: Mixing Expert LLMs into a Mixture-of-Experts LLM", arXiv:2403.07816.)

For a checkpoint built by ``fedmoe upcycle --method btx`` (its ``btx.json`` names the seed, the
domains and the held-out split, which is rebuilt and checked here), on each domain's held-out
text (never trained on):

- perplexity of the dense seed, of the plain upcycle (the same MoE with every expert a copy of
  the seed's FFN plus 1% noise, Komatsuzaki et al. 2022; the seed's other weights, the BTX router:
  the same parameter count) and of the BTX MoE. Causal LM: next-token perplexity; BERT: masked-LM
  perplexity over fixed 15% masks;
- the router's domain x expert affinity: the share of the domain's tokens whose top-1 expert is
  each expert (mean over the MoE layers);
- forced-expert perplexity: every MoE layer sends every token to expert e, for each domain and e;
- pairwise expert distance (``moe_model.models.btx.expert_distances``: ``||w_i - w_j|| / mean norm``)
  of BTX and of the upcycle, and the choice of a sub-MoE as in ``benchmarks/expert_choice.py``
  (FedMoE, Mei et al. 2024, arXiv:2408.11304): each MoE layer holds n experts, the n most activated
  on the domain (top-p) or n drawn at random; held-out perplexity of both sub-MoEs.

Acceptance (the issue "Experts that differ"): on every domain the own expert gets >= 50% of the
top-1 routing, forcing the own expert gives >= 10% lower perplexity than forcing any other, and
the BTX perplexity is below 100.

    python -m benchmarks.btx_experts --model runs/btx-minilm
    python -m benchmarks.btx_experts --model runs/btx-smollm2 --blocks 4

Writes ``<out>/<name>.{json,md,png}`` (default ``results/btx/``, name = the model directory's).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import os
import platform
import random
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from benchmarks.common import write_result
from moe_model.models import btx

log = logging.getLogger("btx_experts")
ROOT = Path(__file__).resolve().parent.parent
OWN_SHARE, FORCED_MARGIN, MAX_PPL = 0.5, 0.10, 100.0
UPCYCLE_NOISE = 0.01


# ---------------------------------------------------------------------------------------------
# the two kinds of model


class Subject:
    """One BTX checkpoint with its dense seed and plain upcycle, evaluated on held-out data.

    ``models``: name -> module; ``views``: name -> MoE layer views (MoE models only);
    ``nll(name, d)``: (summed nats, predicted tokens) of model ``name`` on domain ``d``.
    """

    models: dict
    views: dict
    names: list[str]

    def nll(self, name: str, d: int) -> tuple[float, int]:
        """Summed negative log-likelihood (nats) and token count of model ``name`` on domain ``d``."""
        raise NotImplementedError

    def ppl(self, name: str, d: int) -> float:
        """Perplexity ``exp(nats / tokens)`` of model ``name`` on domain ``d``'s held-out blocks."""
        s, n = self.nll(name, d)
        return math.exp(s / n)


class CausalLM(Subject):
    """A Mixtral / Qwen2-MoE BTX checkpoint (``btx_hf``). When the branches trained only the MoE
    layers' FFNs, every model shares the layers below the first MoE layer, so their output is
    computed once per domain and the models run from there (``inputs_embeds``)."""

    def __init__(self, path: Path, meta: dict, held: dict[str, list[str]], blocks: int, seq_len: int, device: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from moe_model.models.btx_hf import moe_views, tokenize_blocks
        from moe_model.models.upcycle import upcycle_ffn
        from moe_model.models.upcycle_hf import _resolve_source

        self.device = device
        tok = AutoTokenizer.from_pretrained(path)
        self.names = meta["domains"]
        self.data = [tokenize_blocks(tok, held[n], seq_len, blocks).to(device) for n in self.names]
        moe = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        src_dir, gguf = _resolve_source(meta["source"], meta.get("gguf"))
        kw = {"gguf_file": gguf} if gguf else {}
        dense = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32, **kw).to(device).eval()
        up = copy.deepcopy(moe)
        dsd = dense.state_dict()
        up.load_state_dict({k: v for k, v in dsd.items() if k in up.state_dict()}, strict=False)
        gen = torch.Generator().manual_seed(0)
        for v in moe_views(up):
            mlp = dense.model.layers[v.layer].mlp
            ffn = {"gate": mlp.gate_proj.weight, "up": mlp.up_proj.weight, "down": mlp.down_proj.weight}
            copies = upcycle_ffn({k: t.cpu() for k, t in ffn.items()}, v.num_experts, UPCYCLE_NOISE, gen)
            with torch.no_grad():
                v.experts.gate_up_proj.copy_(torch.stack([torch.cat([c["gate"], c["up"]]) for c in copies]))
                v.experts.down_proj.copy_(torch.stack([c["down"] for c in copies]))
        self.models = {"dense": dense, "upcycle": up, "btx": moe}
        self.views = {"upcycle": moe_views(up), "btx": moe_views(moe)}
        self.first = min(v.layer for v in self.views["btx"]) if meta.get("train") == "ffn" else 0
        self.bottom = [self._bottom(d) for d in range(len(self.names))] if self.first > 0 else None
        if self.first:
            log.info("models share layers 0-%d: computed once per domain", self.first - 1)

    @torch.no_grad()
    def _bottom(self, d: int) -> torch.Tensor:
        got = []
        model = self.models["btx"]
        h = model.model.layers[self.first].register_forward_pre_hook(lambda m, a, k=None: got.append(a[0]))
        try:
            with self._layers(model, 0, self.first + 1):
                model(input_ids=self.data[d], use_cache=False)
        finally:
            h.remove()
        return got[0]

    @staticmethod
    @contextlib.contextmanager
    def _layers(model, lo: int, hi: int | None = None) -> Iterator[None]:
        layers = model.model.layers
        model.model.layers = layers[lo:hi]
        try:
            yield
        finally:
            model.model.layers = layers

    @torch.no_grad()
    def nll(self, name: str, d: int) -> tuple[float, int]:
        model, ids = self.models[name], self.data[d]
        if self.bottom is not None:
            with self._layers(model, self.first):
                logits = model(inputs_embeds=self.bottom[d], use_cache=False).logits
        else:
            logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1),
                               reduction="sum")
        return float(loss), ids[:, 1:].numel()


class MaskedLMSubject(Subject):
    """A BERT MoE BTX checkpoint (``btx_bert``): masked-LM perplexity over fixed masks."""

    def __init__(self, path: Path, meta: dict, held: dict[str, list[str]], blocks: int, seq_len: int, device: str):
        from safetensors.torch import load_file
        from transformers import AutoTokenizer, BertForMaskedLM

        from moe_model.models import all_experts, get_adapter, moe_blocks
        from moe_model.models.bert_upcycled import BTX_WEIGHTS, resolve_path
        from moe_model.models.btx_bert import MaskedLM, mask_tokens, tokenize_blocks
        from protocol.messages import ModelSpec

        tok = AutoTokenizer.from_pretrained(path)
        self.names = meta["domains"]
        gen = torch.Generator().manual_seed(1234)
        self.data = [{k: v.to(device) for k, v in mask_tokens(tokenize_blocks(tok, held[n], seq_len, blocks), tok,
                                                                gen).items()} for n in self.names]
        saved = load_file(str(path / BTX_WEIGHTS))
        ad = get_adapter("bert-upcycled")
        common = dict(family="bert-upcycled", num_experts=len(self.names), top_k=meta["top_k"],
                      moe_layers=meta["moe_layers"], tokenizer=str(path))
        dense = BertForMaskedLM.from_pretrained(resolve_path(meta["source"]))
        seed_head = {k[len("seed.cls."):]: v for k, v in saved.items() if k.startswith("seed.cls.")}
        dense.cls.load_state_dict(seed_head, strict=False)
        models = {"dense": dense.to(device).eval()}
        for name, spec in (("upcycle", ModelSpec(**common, base=meta["source"], upcycle_noise=UPCYCLE_NOISE)),
                           ("btx", ModelSpec(**common, base=str(path)))):
            moe = ad.build(spec, all_experts(ad, spec), 1)
            moe.load_state_dict(ad.base_state(spec), strict=False)
            head = copy.deepcopy(dense.cls)
            if name == "btx":
                head.load_state_dict({k[len("cls."):]: v for k, v in saved.items() if k.startswith("cls.")},
                                     strict=False)
            rows = {k: v for k, v in saved.items() if ".router.rows." in k}
            moe.load_state_dict(rows, strict=False)  # both MoEs route with the BTX router
            models[name] = MaskedLM(moe, head).to(device).eval()
        self.models = models
        self.views = {n: [btx.SparseBlockView(b) for b in moe_blocks(models[n]).values()] for n in ("upcycle", "btx")}

    @torch.no_grad()
    def nll(self, name: str, d: int) -> tuple[float, int]:
        model, batch = self.models[name], self.data[d]
        labels = batch["labels"]
        if name == "dense":
            hidden = model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
            logits = model.cls(hidden[labels != -100])
        else:
            logits = model(batch)
        target = labels[labels != -100]
        return float(F.cross_entropy(logits.float(), target, reduction="sum")), target.numel()


# ---------------------------------------------------------------------------------------------
# measurements


def affinity(subject: Subject, name: str) -> list[list[list[float]]]:
    """``[domain][layer][expert]``: share of the domain's tokens whose top-1 expert is the expert."""
    views = subject.views[name]
    out = []
    for d in range(len(subject.names)):
        subject.nll(name, d)
        per_layer = []
        for v in views:
            top1 = v.last_logits().detach().argmax(-1).reshape(-1).cpu()
            per_layer.append((torch.bincount(top1, minlength=v.num_experts).double() / top1.numel()).tolist())
        out.append(per_layer)
    return out


def activation(subject: Subject, name: str, d: int) -> dict[int, torch.Tensor]:
    """FedMoE's activation probability on domain ``d``: share of routed slots (top-k) per expert, per layer."""
    subject.nll(name, d)
    out = {}
    for v in subject.views[name]:
        logits = v.last_logits().detach()
        k = min(2, v.num_experts)
        idx = logits.topk(k, dim=-1).indices.reshape(-1).cpu()
        out[v.layer] = torch.bincount(idx, minlength=v.num_experts).double() / idx.numel()
    return out


def subset_choice(subject: Subject, name: str, n: int, draws: int, seed: int = 0) -> dict:
    """Per domain: held-out perplexity of the sub-MoE holding the ``n`` most activated experts of each
    layer (top-p) and the mean over ``draws`` sub-MoEs of ``n`` random experts."""
    rng = random.Random(f"btx_experts/{seed}/{name}/{n}")
    views = subject.views[name]
    top, rand = [], []
    for d in range(len(subject.names)):
        p = activation(subject, name, d)
        held = {layer: sorted(torch.argsort(p[layer], descending=True)[:n].tolist()) for layer in p}
        with btx.held_only(views, held):
            top.append(subject.ppl(name, d))
        vals = []
        for _ in range(draws):
            pick = {v.layer: sorted(rng.sample(range(v.num_experts), n)) for v in views}
            with btx.held_only(views, pick):
                vals.append(subject.ppl(name, d))
        rand.append(sum(vals) / len(vals))
    return {"n": n, "draws": draws, "top": top, "random": rand}


def measure(subject: Subject, draws: int, sizes: list[int], progress: Callable[[str], None]) -> dict:
    """Every number of the module docstring, as a JSON-able dict."""
    names = subject.names
    res: dict = {"domains": names}
    for m in ("dense", "upcycle", "btx"):
        res[f"ppl_{m}"] = [subject.ppl(m, d) for d in range(len(names))]
        progress(f"perplexity {m}")
    res["affinity_layers"] = affinity(subject, "btx")
    res["affinity"] = [[sum(layer[e] for layer in dom) / len(dom) for e in range(len(names))]
                       for dom in res["affinity_layers"]]
    res["affinity_upcycle"] = [[sum(layer[e] for layer in dom) / len(dom) for e in range(len(names))]
                               for dom in affinity(subject, "upcycle")]
    progress("affinity")
    forced = []
    for e in range(len(names)):
        with btx.forced_expert(subject.views["btx"], e):
            forced.append([subject.ppl("btx", d) for d in range(len(names))])
        progress(f"forced expert {e}")
    res["forced"] = [[forced[e][d] for e in range(len(names))] for d in range(len(names))]  # [domain][expert]
    res["distance"] = {m: btx.expert_distances(subject.views[m]) for m in ("upcycle", "btx")}
    res["subsets"] = {m: [subset_choice(subject, m, n, draws) for n in sizes] for m in ("upcycle", "btx")}
    progress("sub-MoE choice")
    crit = []
    for d, name in enumerate(names):
        others = [res["forced"][d][e] for e in range(len(names)) if e != d]
        margin = 1 - res["forced"][d][d] / min(others)
        crit.append({"domain": name, "own_share": res["affinity"][d][d], "forced_margin": margin,
                     "ppl": res["ppl_btx"][d],
                     "pass_share": res["affinity"][d][d] >= OWN_SHARE, "pass_forced": margin >= FORCED_MARGIN,
                     "pass_ppl": res["ppl_btx"][d] < MAX_PPL})
    res["criteria"] = crit
    res["all_pass"] = all(c["pass_share"] and c["pass_forced"] and c["pass_ppl"] for c in crit)
    return res


# ---------------------------------------------------------------------------------------------
# report


def markdown(r: dict) -> str:
    """The result as a markdown page."""
    names = r["domains"]
    meta = r["build"]
    yes = {True: "yes", False: "**no**"}
    lines = [f"# Branch-Train-MiX experts: {r['name']}", "",
             f"Measured {r['date']} on {r['machine']} ({r['device']}), {r['seconds']:.0f} s. Model: "
             f"`{meta.get('source')}` -> {meta.get('target')} BTX, {len(names)} experts (one per domain), "
             f"top-{meta.get('top_k')}, MoE layers {meta.get('moe_layers')}, branches train `{meta.get('train')}` "
             f"for {meta.get('branch_steps')} steps of {meta.get('batch_size')} x {meta.get('seq_len')} tokens, "
             f"router {meta.get('router_steps')} steps, {meta.get('precision') or 'fp32'}; build "
             f"{meta.get('seconds', {}).get('total')} s. "
             f"Held-out: {r['eval']['blocks']} blocks of {r['eval']['seq_len']} tokens per domain "
             f"(the split recorded in btx.json, never trained on). Perplexity: "
             f"{'next-token' if meta.get('target') == 'causal-lm' else 'masked-LM (fixed 15% masks)'}.", "",
             "## Acceptance", "",
             f"Own expert's top-1 share >= {OWN_SHARE:.0%}; forcing the own expert >= {FORCED_MARGIN:.0%} lower "
             f"perplexity than forcing the best other expert; BTX perplexity < {MAX_PPL:.0f}.", "",
             "| domain | own top-1 share | pass | forced-own margin | pass | BTX ppl | pass |",
             "|---|---|---|---|---|---|---|"]
    for c in r["criteria"]:
        lines.append(f"| {c['domain']} | {c['own_share']:.2f} | {yes[c['pass_share']]} | {c['forced_margin']:+.1%} | "
                     f"{yes[c['pass_forced']]} | {c['ppl']:.1f} | {yes[c['pass_ppl']]} |")
    lines += ["", f"All criteria met: **{'yes' if r['all_pass'] else 'no'}**.", "",
              "## Held-out perplexity", "", "| domain | dense seed | upcycle (copies + 1% noise) | BTX |",
              "|---|---|---|---|"]
    for d, n in enumerate(names):
        lines.append(f"| {n} | {r['ppl_dense'][d]:.1f} | {r['ppl_upcycle'][d]:.1f} | {r['ppl_btx'][d]:.1f} |")
    lines += ["", "## Router affinity (share of the domain's tokens whose top-1 is the expert; rows: domains)", "",
              "| domain | " + " | ".join(f"e{e} {n}" for e, n in enumerate(names)) + " |",
              "|---|" + "---|" * len(names)]
    for d, n in enumerate(names):
        lines.append(f"| {n} | " + " | ".join(f"{x:.2f}" for x in r["affinity"][d]) + " |")
    lines += ["", "## Forced-expert perplexity (rows: domains, columns: the expert every token is sent to)", "",
              "| domain | " + " | ".join(f"e{e}" for e in range(len(names))) + " |", "|---|" + "---|" * len(names)]
    for d, n in enumerate(names):
        lines.append(f"| {n} | " + " | ".join((f"**{x:.1f}**" if e == d else f"{x:.1f}")
                                               for e, x in enumerate(r["forced"][d])) + " |")
    lines += ["", "## Expert distance and sub-MoE choice", "",
              "Distance: `||w_i - w_j|| / mean(||w_i||, ||w_j||)` over an expert's weights, mean over pairs and MoE "
              "layers. Sub-MoE: every MoE layer holds n experts, the n most activated on the domain (top-p, FedMoE's "
              "choice) or n at random; held-out perplexity, mean over domains; ratio = random / top-p (> 1: the "
              "choice matters).", "", "| model | expert distance | n held | ppl top-p | ppl random | ratio |",
              "|---|---|---|---|---|---|"]
    for m in ("upcycle", "btx"):
        dist = r["distance"][m]
        dmean = sum(dist.values()) / len(dist)
        for s in r["subsets"][m]:
            t, q = sum(s["top"]) / len(s["top"]), sum(s["random"]) / len(s["random"])
            lines.append(f"| {m} | {dmean:.3f} | {s['n']} | {t:.1f} | {q:.1f} | {q / t:.2f} |")
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    """Affinity and forced-expert heat maps and the per-domain perplexities, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = r["domains"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    im = ax.imshow(np.array(r["affinity"]), vmin=0, vmax=1, cmap="viridis")
    ax.set_title("router: top-1 share (domain x expert)")
    fig.colorbar(im, ax=ax, fraction=0.046)
    ax = axes[1]
    forced = np.array(r["forced"])
    rel = forced / forced.min(axis=1, keepdims=True)
    im = ax.imshow(np.log(rel), cmap="magma_r")
    ax.set_title("forced expert: ppl / best ppl of the domain (log)")
    fig.colorbar(im, ax=ax, fraction=0.046)
    for ax in axes[:2]:
        ax.set_xticks(range(len(names)), [f"e{e}" for e in range(len(names))])
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_xlabel("expert")
    ax = axes[2]
    x = np.arange(len(names))
    for i, m in enumerate(("dense", "upcycle", "btx")):
        ax.bar(x + (i - 1) * 0.27, r[f"ppl_{m}"], 0.27, label={"dense": "dense seed", "upcycle": "upcycle",
                                                               "btx": "BTX"}[m])
    ax.set_yscale("log")
    ax.axhline(MAX_PPL, color="gray", ls="--", lw=0.8)
    ax.set_xticks(x, names, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("held-out perplexity")
    ax.legend(fontsize=7)
    fig.suptitle(f"Branch-Train-MiX: {r['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a BTX checkpoint directory (fedmoe upcycle --method btx)")
    ap.add_argument("--blocks", type=int, default=8, help="held-out blocks per domain (default 8)")
    ap.add_argument("--seq-len", type=int, help="tokens per block (default: the build's)")
    ap.add_argument("--draws", type=int, default=2, help="random sub-MoE draws per domain (default 2)")
    ap.add_argument("--sizes", default="2", help="experts held per layer in the sub-MoE comparison (default 2)")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu)")
    ap.add_argument("--out", default=str(ROOT / "results" / "btx"), help="output directory (default results/btx)")
    ap.add_argument("--name", help="output file stem (default: the model directory's name)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from fedmoe.btx_domains import heldout_from_record

    if args.device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")
    path = Path(args.model).resolve()
    meta_file = path / "btx.json"
    if not meta_file.is_file():
        raise SystemExit(f"btx_experts: {path} has no btx.json (not a fedmoe upcycle --method btx output)")
    meta = json.loads(meta_file.read_text())
    t0 = time.time()
    held = heldout_from_record(meta)
    seq_len = args.seq_len or meta["seq_len"]
    cls = CausalLM if meta["target"] == "causal-lm" else MaskedLMSubject
    subject = cls(path, meta, held, args.blocks, seq_len, args.device)
    res = measure(subject, args.draws, [int(x) for x in args.sizes.split(",")],
                  lambda what: log.info("%s done (%.0f s)", what, time.time() - t0))
    name = args.name or path.name
    build = {k: meta.get(k) for k in ("source", "gguf", "target", "family", "domains", "moe_layers", "top_k", "train",
                                      "branch_steps", "router_steps", "batch_size", "seq_len", "lr", "precision",
                                      "seed", "device",
                                      "seconds", "branch_loss", "router_loss")}
    result = {"name": name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.get_num_threads()} threads",
              "device": args.device, "seconds": time.time() - t0, "build": build,
              "eval": {"blocks": args.blocks, "seq_len": seq_len, "draws": args.draws}, **res}
    print(write_result(args.out, name, result, markdown, plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
