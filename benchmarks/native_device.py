"""The native training core (``native/``, C++ on ExecuTorch's runtime) against the Python
device on the same training: memory before any model, peak memory, the experts' share of it,
step time, and the update's agreement.

One shape of a model (:data:`MODELS`: the demo model, all-MiniLM-L6-v2 upcycled, or a
Qwen3-MoE whose experts are most of its weights; int8 base shards, ``--experts`` of its
experts in each MoE layer, batch ``--batch`` x ``--seq`` tokens), the same ``--steps``
AdamW steps on the same BBC News batches, each side in a fresh process:

- native: ``build/native/fedmoe-train`` with the cloud's training program
  (``cloud.programs.ProgramCache``), the device's base-shard files as downloaded and its
  LoRA ``A`` factors; it reports its resident memory before loading anything and its peak
  (``VmHWM``);
- Python: this module with ``--python-worker``: imports what a Python device imports
  (torch, transformers, peft, ``edge_sdk``), measures its resident memory there (before any
  model), then builds the sub-MoE from the same shards (int8 kept in memory, as a device
  holds them) and trains the same steps as the device trains (training mode, sparse
  dispatch, no dropout difference: dropout is on, as on a device), and reports its peak.

Step times of the first step include one-time work on both sides; the table gives the
median. The update agreement compares the native update with the Python device's in the
program's mode (no dropout), as ``tests/test_native_trainer.py`` does.

    python -m benchmarks.native_device                  # 2 experts per MoE layer, B 8, T 64, 5 steps
    python -m benchmarks.native_device --experts 4
    python -m benchmarks.native_device --model qwen3-moe --experts 16 --batch 4 --name native_qwen3moe
    python -m benchmarks.native_device --model qwen3-moe --experts 64 --batch 2 --capacity-factor 2
    python -m benchmarks.native_device --model qwen3-moe --experts 16 --batch 4 --ops core

Writes ``results/native/native_device.{json,md,png}`` (``--name`` changes the stem).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, module_command, module_env, write_result

WORK = ROOT / "runs" / "native_device"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    """VmHWM (bytes): this process's own peak (``getrusage``'s carries the parent's over fork and exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def python_worker(work: Path, held: dict[int, list[int]], steps: int, lr: float) -> dict[str, Any]:
    """The Python device's side (a fresh process): memory before any model, then the
    training, then the peak."""
    import torch  # noqa: F401  (what a device imports)

    import edge_sdk  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    before = _rss()
    from safetensors.torch import load_file

    from moe_model import objectives
    from moe_model.shards import decode_shard
    from moe_model.submoe import SubMoE
    from protocol.messages import ModelSpec

    cfg = json.loads((work / "setup.json").read_text())
    spec = ModelSpec(**cfg["spec"])
    shards = {sid: decode_shard((work / "shards" / f"{sid}.safetensors").read_bytes(), keep_quantized=True)
              for sid in cfg["shards"]}
    model = SubMoE(spec, held, cfg["task"], cfg["num_labels"], shards)
    model.load_adapter_state(load_file(str(work / "global_state.safetensors")))
    b = load_file(str(work / "batches.safetensors"))
    opt = torch.optim.AdamW(list(model.trainable().values()), lr=lr, weight_decay=0.01)
    model.train()
    times = []
    for i in range(steps):
        t = time.perf_counter()
        loss = objectives.sample_loss(model.objective, model({"input_ids": b["input_ids"][i],
                                                              "attention_mask": b["attention_mask"][i]}),
                                      b["labels"][i]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return {"rss_before_model_bytes": before, "peak_rss_bytes": _peak_rss(),
            "step_s": times}


MODELS = ("demo", "qwen3-moe")
"""``demo``: the demo model (MiniLM upcycled, BBC News topics); ``qwen3-moe``: the peer
benchmark's random-init Qwen3-MoE (:func:`benchmarks.peer.make_checkpoint`: 64 experts in
each of 8 layers, experts 89% of the weights, SmolLM2's tokenizer), causal LM on BBC News
texts: a model whose experts, not its dense part, decide what a device can hold."""


def spec_for(model: str, seq: int):
    """The ``ModelSpec`` of a :data:`MODELS` name at sequence length ``seq``."""
    from protocol.messages import ModelSpec

    if model == "demo":
        return ModelSpec(max_seq_len=seq)
    from benchmarks.peer import CHECKPOINT, make_checkpoint

    ckpt = make_checkpoint(ROOT / "runs" / "qwen3-moe")
    return ModelSpec(family="hf-moe", base=str(ckpt), tokenizer=None, num_experts=CHECKPOINT["num_experts"],
                     top_k=CHECKPOINT["num_experts_per_tok"], max_seq_len=seq, objective="causal-lm")


def dropped_share(model, batches: list[dict], capacity_factor: float | None) -> float:
    """The share of routed (token, expert) pairs that skip their expert because it is full
    (``MoELayer.capacity`` under ``capacity_factor``), over ``batches`` and every MoE layer,
    at ``model``'s current adapter state (the round's start); 0 without a factor."""
    import torch

    from moe_model.training_program import exportable

    routed = dropped = 0
    with torch.no_grad(), exportable(model, capacity_factor):
        for b in batches:
            model({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]})
            for block in model.model.moe_blocks().values():
                idx = block.last.topk_idx
                cap = block.capacity(idx.shape[0], idx.shape[1])
                counts = torch.bincount(idx.reshape(-1), minlength=len(block.expert_ids))
                routed += int(counts.sum())
                dropped += 0 if cap is None else int((counts - cap).clamp_min(0).sum())
    return dropped / max(routed, 1)


def run(experts: int, batch: int, seq: int, steps: int, lr: float, model_name: str = "demo",
        capacity_factor: float | None = None, ops: str = "fedmoe") -> dict[str, Any]:
    """Both sides on one shape (module docstring); the native program with the operators
    ``ops`` (``moe_model.training_program.OPS``), its experts each on their capacity of tokens
    under ``capacity_factor`` (None: every routed token)."""
    import torch
    from safetensors.torch import load_file, save_file

    from cloud.global_model import GlobalModel
    from cloud.programs import ProgramCache
    from fedmoe.datasets import bbc_news
    from fedmoe.native import build
    from moe_model.shards import shards_for
    from moe_model.training_program import from_slots, pad_batch, to_slots

    binary = build()
    WORK.mkdir(parents=True, exist_ok=True)
    items, labels = bbc_news()
    spec = spec_for(model_name, seq)
    gm = GlobalModel(spec, {"bbc": labels}, "int8")
    held = {layer: list(range(experts)) for layer in gm.all_experts}
    cache = ProgramCache(gm, WORK / "programs")
    before = set((WORK / "programs").glob("*.pte")) if (WORK / "programs").exists() else set()
    t0 = time.perf_counter()
    manifest = cache.get("bbc", held, batch, seq, capacity_factor, ops)
    export_s = time.perf_counter() - t0
    cached = cache.path(manifest["key"]) in before
    (WORK / "manifest.json").write_text(json.dumps(manifest))
    (WORK / "shards").mkdir(exist_ok=True)
    sids = shards_for(held)
    for sid in sids:
        (WORK / "shards" / f"{sid}.safetensors").write_bytes(gm.shard_bytes[sid])
    save_file(cache.lora_a(manifest, held), str(WORK / "lora_a.safetensors"))
    state = gm.state_for(held, "bbc")
    save_file({k: v.contiguous() for k, v in state.items()}, str(WORK / "global_state.safetensors"))
    save_file({k: v.contiguous() for k, v in to_slots(state, held).items()}, str(WORK / "state.safetensors"))
    model = gm.models["bbc"]
    batches = [pad_batch(*model.collate([(x, labels.index(c)) for x, c in items[i * batch:(i + 1) * batch]]), seq)
               for i in range(steps)]
    save_file({k: torch.stack([b[k] for b in batches]) for k in batches[0]}, str(WORK / "batches.safetensors"))
    (WORK / "setup.json").write_text(json.dumps({"spec": spec.model_dump(mode="json"), "shards": sids, "task": "bbc",
                                                 "num_labels": len(labels)}))
    native = subprocess.run(
        [str(binary), "--program", str(cache.path(manifest["key"])), "--manifest", str(WORK / "manifest.json"),
         "--shards", str(WORK / "shards"), "--held", json.dumps(held), "--lora-a", str(WORK / "lora_a.safetensors"),
         "--state", str(WORK / "state.safetensors"), "--batches", str(WORK / "batches.safetensors"),
         "--steps", str(steps), "--lr", str(lr), "--out", str(WORK / "native_out.safetensors")],
        capture_output=True, text=True, timeout=3600, check=True)
    nat = json.loads(native.stdout.strip().splitlines()[-1])
    py = subprocess.run(module_command("native_device", "--python-worker", "--experts", str(experts), "--steps",
                                       str(steps), "--lr", str(lr)),
                        capture_output=True, text=True, timeout=3600, env=module_env(), check=True)
    pyr = json.loads(py.stdout.strip().splitlines()[-1])
    out = from_slots(load_file(str(WORK / "native_out.safetensors")), held)
    moved = sum((out[k] - state[k]).norm().item() ** 2 for k in state) ** 0.5
    expert_bytes = sum(len(gm.shard_bytes[s]) for s in sids if s != "backbone")
    return {"model": model_name, "family": spec.family, "objective": spec.objective, "num_experts": spec.num_experts,
            "experts_per_layer": experts, "moe_layers": sorted(held), "batch": batch, "seq_len": seq, "steps": steps,
            "lr": lr, "weight_format": "int8", "program_bytes": manifest["bytes"], "export_s": export_s,
            "program_cached": cached,
            "expert_shard_bytes": expert_bytes, "backbone_shard_bytes": len(gm.shard_bytes["backbone"]),
            "capacity_factor": capacity_factor, "ops": manifest["shape"]["ops"], "top_k": spec.top_k,
            "planned_bytes": manifest["planned_bytes"],
            "dropped_share": dropped_share(cache.model_for("bbc", held)[0], batches, capacity_factor),
            "native": nat, "python": pyr, "native_update_norm": moved}


MODEL_TEXT = {"demo": "Demo model (all-MiniLM-L6-v2 upcycled, BBC News topics)",
              "qwen3-moe": "Random-init Qwen3-MoE (the peer benchmark's: experts 89% of the weights; causal LM on "
                           "BBC News texts)"}


def markdown(r: dict[str, Any]) -> str:
    """The result page."""
    n, p = r["native"], r["python"]
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    ns, ps = statistics.median(n["step_s"][1:] or n["step_s"]), statistics.median(p["step_s"][1:] or p["step_s"])
    rows = [("memory before any model", mib(n["rss_before_model_bytes"]), mib(p["rss_before_model_bytes"]),
             f"{n['rss_before_model_bytes'] / p['rss_before_model_bytes']:.3f}"),
            ("peak memory", mib(n["peak_rss_bytes"]), mib(p["peak_rss_bytes"]),
             f"{n['peak_rss_bytes'] / p['peak_rss_bytes']:.3f}"),
            ("experts' share of the peak", f"{r['expert_shard_bytes'] / n['peak_rss_bytes']:.1%}",
             f"{r['expert_shard_bytes'] / p['peak_rss_bytes']:.1%}", ""),
            ("step time (median after the first)", f"{ns * 1000:.0f} ms", f"{ps * 1000:.0f} ms", f"{ns / ps:.2f}")]
    cf = r.get("capacity_factor")
    grouped = r.get("ops") == "fedmoe" and r.get("top_k", 0) < r["experts_per_layer"]  # else every token, every expert
    dispatch = ("each held expert on exactly its routed tokens (grouped dispatch: the Python device's function)"
                if grouped and cf is None else
                "every held expert on every token (dense dispatch; the Python device runs each token's top-k)"
                if cf is None else
                f"each held expert on at most ceil({cf} x B·T x k / n) tokens of largest gate (capacity factor {cf}); "
                f"{r['dropped_share']:.1%} of the routed (token, expert) pairs of these batches skip a full expert "
                "(the Python device runs every token's top-k)")
    return "\n".join([
        "# The native training core against the Python device", "",
        f"Measured {r['date']} on {r['machine']}. {r['note']}", "", f"Command: `{r['command']}`", "",
        f"{MODEL_TEXT[r.get('model', 'demo')]}, int8 base shards, {r['experts_per_layer']} of its "
        f"{r.get('num_experts', 4)} experts in each of the MoE layers {r['moe_layers']}, batch {r['batch']} x {r['seq_len']} tokens, {r['steps']} AdamW steps (lr "
        f"{r['lr']}) on the same BBC News batches, each side a fresh process. Expert shards "
        f"{mib(r['expert_shard_bytes'])}, backbone shard {mib(r['backbone_shard_bytes'])}; training program "
        f"{r['program_bytes'] / 1024:.0f} KiB, "
        + ("from the cloud's cache (built by an earlier run)" if r.get("program_cached")
           else f"built by the cloud in {r['export_s']:.0f} s")
        + (f", {r['planned_bytes'] / 2**20:.1f} MiB planned by ExecuTorch for a step's intermediate tensors"
           if "planned_bytes" in r else "") + f". The program runs {dispatch}.", "",
        "| | native (C++, ExecuTorch) | Python device | native / Python |", "|---|---|---|---|",
        *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows], "",
        f"Losses, native: {', '.join(f'{x:.4f}' for x in n['losses'])} (no dropout); the Python device trains with "
        "dropout, so its losses differ; `tests/test_native_trainer.py` checks the update against the Python "
        "device's without dropout (relative L2 error < 1e-3).", "", *_phases(n)])


def _phases(n: dict[str, Any]) -> list[str]:
    """The native side's resident memory after each phase (``fedmoe-train``'s ``rss_bytes``), as lines."""
    p = n.get("rss_bytes")
    if not p:
        return []
    steps = ", ".join(f"{x / 2**20:.1f}" for x in p.get("step", []))
    return [f"Native resident memory after each phase: the program loaded (with its memory plan) "
            f"{p['program'] / 2**20:.1f} MiB; base weights and LoRA A bound {p['weights'] / 2**20:.1f} MiB; "
            f"adapter state put in {p['state'] / 2**20:.1f} MiB; after each step {steps} MiB.", ""]


def plot(r: dict[str, Any], path: Path) -> None:
    """Memory before any model and peak, native vs Python (bar chart)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    labels = ["before any model", "peak"]
    for i, (side, color) in enumerate((("native", "#4c72b0"), ("python", "#dd8452"))):
        vals = [r[side]["rss_before_model_bytes"] / 2**20, r[side]["peak_rss_bytes"] / 2**20]
        ax.barh([y + 0.4 * i for y in range(2)], vals, height=0.4, color=color,
                label="native (C++)" if side == "native" else "Python device")
    ax.axvline(r["expert_shard_bytes"] / 2**20, color="gray", ls="--", lw=0.8, label="expert shards")
    ax.set_yticks([0.2, 1.2], labels)
    ax.set_xlabel("resident memory (MiB)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=MODELS, default="demo", help="the model (default: demo)")
    ap.add_argument("--experts", type=int, default=2, help="experts held per MoE layer (default 2)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--capacity-factor", type=float, default=None,
                    help="the native program's experts' capacity factor (default: none, every routed token)")
    ap.add_argument("--ops", choices=("fedmoe", "core"), default="fedmoe",
                    help="the native program's operators (default fedmoe: grouped dispatch, the fused output-layer "
                         "loss; core: ExecuTorch's own, dense dispatch)")
    ap.add_argument("--note", default="", help="what else ran on the machine (recorded)")
    ap.add_argument("--out", default=str(ROOT / "results" / "native"))
    ap.add_argument("--name", default="native_device")
    ap.add_argument("--python-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.python_worker:
        from protocol.experts import layers_from_json

        held = layers_from_json(json.loads((WORK / "manifest.json").read_text())["shape"]["experts_per_layer"])
        print(json.dumps(python_worker(WORK, {layer: list(range(n)) for layer, n in held.items()}, args.steps, args.lr)))
        return 0
    r = run(args.experts, args.batch, args.seq, args.steps, args.lr, args.model, args.capacity_factor, args.ops)
    r.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             machine=f"{platform.machine()}, {os.cpu_count()} CPU cores", note=args.note,
             command="python -m benchmarks.native_device " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(write_result(args.out, args.name, r, markdown, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
