"""Memory benchmark: experts held per layer, predicted vs measured peak, per budget x format.

For every budget in {0.5, 1, 2, 4} GiB and weight format in {fp32, int8, nf4}, a fresh
device process (``--cell``) does what ``EdgeClient`` does in a round, without the
network: it measures its baseline RSS, asks the memory plan (``moe_model.budget.plan``)
how many experts per layer fit the budget with the device's default headroom
(``DEFAULT_HEADROOM_BYTES``, 32 MiB) kept free above that baseline, as ``EdgeClient``
does (the predicted peak reported is the plan without the headroom), memory-maps those
expert shards from a shard cache (``moe_model.shards.ShardCache``), builds the sub-MoE (expert linears held in the
shard format), trains LoRA for a few steps, and reports the RSS high-water mark
(``VmHWM``). Model: all-MiniLM-L6-v2 upcycled to 128 experts in layers 1, 3, 5 (so
budgets matter), T = 64, batch 8, LoRA rank 8, BBC News; or, with ``--model DIR``, a local
Hugging Face MoE checkpoint (``family = "hf-moe"``, e.g. SmolLM2 upcycled by ``fedmoe
upcycle``) trained as a causal LM on BBC News texts, every MoE layer holding k experts.

    python -m benchmarks.memory [--steps 3] [--out results/memory]
    python -m benchmarks.memory --model runs/smollm2-moe --budgets 1,1.5,2,3 --out results/llm/memory

Writes ``memory.json``, ``memory.md`` and ``memory.png``; checks measured <= budget in
every cell and |predicted - measured| / measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from benchmarks.common import module_command, module_env

ROOT = Path(__file__).resolve().parents[1]
BUDGETS_GIB = (0.5, 1, 2, 4)
FORMATS = ("fp32", "int8", "nf4")
E, T, BATCH, LABELS = int(os.environ.get("FEDMOE_BENCH_EXPERTS", 128)), 64, 8, 5
MODEL: str | None = None
"""``--model DIR``: a Hugging Face MoE checkpoint instead of the upcycled MiniLM."""
CHECKPOINTING = False
"""``--gradient-checkpointing``: ``ModelSpec.gradient_checkpointing`` (recompute activations)."""


def spec():
    from protocol.messages import ModelSpec

    if MODEL is not None:
        from moe_model.models.hf_moe import checkpoint_model

        return ModelSpec(**checkpoint_model(MODEL), max_seq_len=T, objective="causal-lm",
                         gradient_checkpointing=CHECKPOINTING)
    return ModelSpec(num_experts=E, top_k=2, max_seq_len=T, gradient_checkpointing=CHECKPOINTING)


def prepare(cache_root: Path, formats=FORMATS) -> dict:
    """Write every shard in every format into per-format caches; return shard sha256 by format."""
    import torch

    from moe_model.models import all_experts, get_adapter
    from moe_model.shards import ShardCache, encode_shard
    from protocol.codec import sha256_hex

    s = spec()
    adapter = get_adapter(s.family)
    skeleton = adapter.build(s, all_experts(adapter, s), 2, device="meta")
    index = {fmt: {} for fmt in formats}
    caches = {fmt: ShardCache(cache_root / fmt) for fmt in formats}
    for sid, t in adapter.base_shards(s, skeleton):  # one shard in memory at a time
        for fmt in formats:
            data = encode_shard(t, fmt)
            sha = sha256_hex(data)
            if not caches[fmt].has(sha):
                caches[fmt].put(sha, data)
            index[fmt][sid] = sha
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return index


def _sampler(stop, out: list) -> None:
    """Read this process's footprint every millisecond (a lower bound of its peak, to check
    ``PeakMeter``'s upper bound against)."""
    from moe_model import budget as B

    while not stop.wait(0.001):
        out[0] = max(out[0], B.current_footprint_bytes())


def cell(fmt: str, budget: int, index_file: Path, cache_root: Path, steps: int, allocator: str = "mmap",
         experts: int | None = None) -> dict:
    """One device process: plan, load, train, measure (see the module docstring).
    ``allocator``: ``mmap`` (:func:`moe_model.budget.tune_allocator`, the device default)
    or ``default`` (glibc's own; the oneDNN cache is bounded either way, as
    ``EdgeClient`` does); ``experts``: hold this many per layer instead of the plan's.

    Returns the plan, both peaks (RSS; footprint, the budget's measure, as
    ``moe_model.budget.PeakMeter`` bounds it, and as sampled every millisecond), and the
    footprint's decomposition (bytes): ``baseline`` (imports, as ``fedmoe device``),
    ``backbone`` (its shard loaded), ``experts`` (their shards loaded), ``model`` (the
    sub-MoE built: LoRA, router, head, module objects), ``tokenizer`` (loaded),
    ``training`` (the peak above that: activations, gradients, optimizer state,
    workspace) and ``growth`` (what stays after training)."""
    import threading

    from edge_sdk.lean import keep_out_unused

    keep_out_unused()  # as `fedmoe device` does, before torch/transformers/peft
    import torch

    import edge_sdk.client  # noqa: F401  (a device process's imports: its baseline)
    from moe_model import budget as B

    torch.set_num_threads(1)
    if allocator == "mmap":
        B.tune_allocator()  # bounds the oneDNN cache too
    else:
        B.bound_native_caches()
    from moe_model.shards import ShardCache
    from moe_model.submoe import SubMoE
    from moe_model.train import train_local
    from fedmoe.datasets import bbc_news
    from protocol.messages import TrainConfig

    items, labels = bbc_news()
    train = [(x, labels.index(y)) for x, y in items[: steps * BATCH]]
    s = spec()
    B.release_free_memory()
    baseline, baseline_rss = B.current_footprint_bytes(), B.current_rss_bytes()
    # as EdgeClient does: the plan keeps the default headroom free above the measured baseline
    k = experts or B.max_experts_per_layer(s, budget, BATCH, LABELS, baseline + B.DEFAULT_HEADROOM_BYTES, fmt)
    out = {"format": fmt, "budget_bytes": budget, "baseline_bytes": baseline, "baseline_rss_bytes": baseline_rss,
           "experts_per_layer": k, "headroom_bytes": B.DEFAULT_HEADROOM_BYTES, "allocator": allocator}
    if k == 0:
        out.update(predicted_peak_bytes=None, peak_rss_bytes=baseline_rss, peak_footprint_bytes=baseline,
                   note="not even one expert per layer fits")
        return out
    p = B.plan(s, k, fmt, batch=BATCH, num_labels=LABELS, runtime_bytes=baseline)
    sampled, stop = [0], threading.Event()
    sampler = threading.Thread(target=_sampler, args=(stop, sampled), daemon=True)
    meter = B.PeakMeter().start()
    sampler.start()
    index = json.loads(index_file.read_text())[fmt]
    from moe_model.models import get_adapter

    experts = {layer: list(range(k)) for layer in get_adapter(s.family).moe_layers(s)}
    cache = ShardCache(cache_root / fmt)
    keep_bb = get_adapter(s.family).quantized_backbone  # as EdgeClient holds it
    held = {"backbone": cache.load(index["backbone"], keep_quantized=keep_bb)}
    at = {"backbone": B.current_footprint_bytes()}
    held.update({sid: cache.load(index[sid]) for sid in [f"L{x}.E{e}" for x in experts for e in experts[x]]})
    at["experts"] = B.current_footprint_bytes()
    model = SubMoE(s, experts, "bbc", LABELS, held)
    del held
    B.release_free_memory()
    at["model"] = B.current_footprint_bytes()
    model.collate(train[:1])  # loads the tokenizer
    B.release_free_memory()
    meter.mark()
    at["tokenizer"] = B.current_footprint_bytes()
    t0 = time.perf_counter()
    r = train_local(model, train, TrainConfig(max_steps=steps, batch_size=BATCH, lr=1e-3), seed=0,
                    progress=meter.mark)  # as EdgeClient measures
    step = (time.perf_counter() - t0) / max(r.steps, 1)
    peak, footprint = meter.peaks()
    stop.set()
    sampler.join()
    end = B.current_footprint_bytes()
    out.update(predicted_peak_bytes=p.total, plan=p.as_dict(), peak_rss_bytes=peak, peak_footprint_bytes=footprint,
               sampled_peak_footprint_bytes=sampled[0], model_peak_bytes=footprint - baseline, step_seconds=step,
               base_bytes_held=model.num_base_bytes(),
               measured={"baseline": baseline, "backbone": at["backbone"] - baseline,
                         "experts": at["experts"] - at["backbone"], "model": at["model"] - at["experts"],
                         "tokenizer": at["tokenizer"] - at["model"], "training": footprint - at["tokenizer"],
                         "growth": end - at["tokenizer"]})
    return out


def main() -> None:
    global MODEL, T, CHECKPOINTING, BATCH
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/memory")
    ap.add_argument("--work", default="runs/bench-memory")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cell", nargs=2, metavar=("FORMAT", "BUDGET"))
    ap.add_argument("--allocator", default="mmap", choices=("mmap", "default"), help="with --cell (see cell())")
    ap.add_argument("--experts", type=int, help="with --cell: experts per layer instead of the plan's")
    ap.add_argument("--model", help="a Hugging Face MoE checkpoint directory (causal LM) instead of MiniLM")
    ap.add_argument("--budgets", help="comma-separated budgets in GiB (default 0.5,1,2,4)")
    ap.add_argument("--seq-len", type=int, default=T, help="tokens per sample (default 64)")
    ap.add_argument("--batch", type=int, default=BATCH, help="training batch size (default 8)")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="recompute activations in backward (ModelSpec.gradient_checkpointing)")
    ap.add_argument("--experts-grid", help="comma-separated experts per layer, e.g. 1,2,4,8: one int8 cell each at "
                                           "the tightest budget that holds them (the plan + headroom), instead of "
                                           "the budget x format grid")
    args = ap.parse_args()
    MODEL, T, CHECKPOINTING, BATCH = args.model, args.seq_len, args.gradient_checkpointing, args.batch
    budgets = tuple(float(x) for x in args.budgets.split(",")) if args.budgets else BUDGETS_GIB
    extra = ((["--model", args.model] if args.model else []) + ["--seq-len", str(T), "--batch", str(BATCH)]
             + (["--gradient-checkpointing"] if CHECKPOINTING else []))
    work = Path(args.work)
    if args.cell:
        res = cell(args.cell[0], int(args.cell[1]), work / "index.json", work / "cache", args.steps, args.allocator,
                   args.experts)
        print("RESULT " + json.dumps(res))
        return
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "index.json").exists():
        print("preparing shards (every expert of every MoE layer x 3 formats) ...", flush=True)
        (work / "index.json").write_text(json.dumps(prepare(work / "cache")))
    rows = []
    env = module_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                     HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    grid = ([("int8", 0, int(k)) for k in args.experts_grid.split(",")] if args.experts_grid else
            [(fmt, int(gib * 2**30), None) for gib in budgets for fmt in FORMATS])
    for i, (fmt, budget, k) in enumerate(grid):
        proc = subprocess.run(module_command("memory", "--cell", fmt, str(budget), "--work", str(work),
                                             "--steps", str(args.steps), *extra, *(["--experts", str(k)] if k else [])),
                              capture_output=True, text=True, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"cell {fmt} {budget} {k} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(line[7:])
        if k:  # the tightest budget that holds k experts per layer, as EdgeClient would need it
            r["budget_bytes"] = (r["predicted_peak_bytes"] or 0) + r["headroom_bytes"]
        r["budget_gib"] = round(r["budget_bytes"] / 2**30, 3)
        r["within_budget"] = r["peak_footprint_bytes"] <= r["budget_bytes"]
        if r.get("predicted_peak_bytes"):
            r["error"] = (r["predicted_peak_bytes"] - r["peak_footprint_bytes"]) / r["peak_footprint_bytes"]
        rows.append(r)
        print(f"[{i + 1}/{len(grid)}] {r['budget_gib']:>5} GiB {fmt:>5}: {r['experts_per_layer']:>3} experts/layer, "
              f"predicted {(r.get('predicted_peak_bytes') or 0) / 2**20:5.0f} MiB, footprint "
              f"{r['peak_footprint_bytes'] / 2**20:5.0f} MiB (RSS {r['peak_rss_bytes'] / 2**20:5.0f}), error "
              f"{100 * r.get('error', 0):+5.1f}%, within budget: {r['within_budget']}", flush=True)
    write(rows, Path(args.out))


PARTS = ("baseline", "backbone", "experts", "model", "tokenizer", "training")


def write(rows: list[dict], out: Path) -> None:
    """``memory.json`` (summary + cells), ``memory.md`` (plan vs both measures, and the
    footprint's decomposition per cell) and ``memory.png``."""
    out.mkdir(parents=True, exist_ok=True)
    errs = [abs(r["error"]) for r in rows if "error" in r]
    summary = {"cells": len(rows), "all_within_budget": all(r["within_budget"] for r in rows),
               "max_abs_error": max(errs) if errs else None, "measure": "footprint (moe_model.budget.PeakMeter)",
               "setup": {"experts": spec().num_experts, "seq_len": T, "batch": BATCH, "lora_rank": 8,
                         "model": MODEL or "all-MiniLM-L6-v2 upcycled, MoE layers 1, 3, 5",
                         "objective": spec().objective, "threads": 1,
                         "gradient_checkpointing": CHECKPOINTING}}
    (out / "memory.json").write_text(json.dumps({"summary": summary, "cells": rows}, indent=1))
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    lines = ["| budget MiB | format | experts/layer | plan MiB | peak footprint MiB | error | peak RSS MiB "
             "| baseline footprint / RSS MiB | <= budget |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred = r.get("predicted_peak_bytes")
        err = f"{100 * r['error']:+.1f}%" if pred else "-"
        lines.append(f"| {mib(r['budget_bytes'])} | {r['format']} | {r['experts_per_layer']} | "
                     f"{mib(pred) if pred else '-'} | {mib(r['peak_footprint_bytes'])} | "
                     f"{err} | {mib(r['peak_rss_bytes'])} | "
                     f"{mib(r['baseline_bytes'])} / {mib(r['baseline_rss_bytes'])} | "
                     f"{'yes' if r['within_budget'] else 'NO'} |")
    lines += ["", "Footprint by part (MiB): measured / planned. " + ", ".join(PARTS) + "; planned training = "
              "gradients + optimizer + activations + workspace (+ copies; the cell receives no state).", "",
              "| format | experts/layer | " + " | ".join(PARTS) + " | growth kept |",
              "|---|---|" + "---|" * (len(PARTS) + 1)]
    for r in rows:
        if "measured" not in r:
            continue
        m, p = r["measured"], r["plan"]
        planned = {"baseline": p["runtime"], "backbone": None, "experts": None, "model": p["lora"] + p["overhead"],
                   "tokenizer": p["tokenizer"], "training": p["training"] + p["copies"]}
        lines.append(f"| {r['format']} | {r['experts_per_layer']} | " + " | ".join(
            f"{mib(m[x])} / {mib(planned[x])}" if planned[x] is not None else mib(m[x]) for x in PARTS)
            + f" | {mib(m['growth'])} |")
    lines.append("\nweights planned (backbone + experts): " + ", ".join(
        f"{r['experts_per_layer']}e {r['format']} {mib(r['plan']['weights'])}" for r in rows if "plan" in r))
    (out / "memory.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        xs = range(len(rows))
        ax.bar([x - 0.27 for x in xs], [(r.get("predicted_peak_bytes") or 0) / 2**20 for r in rows], 0.27,
               label="plan")
        ax.bar(list(xs), [r["peak_footprint_bytes"] / 2**20 for r in rows], 0.27, label="peak footprint")
        ax.bar([x + 0.27 for x in xs], [r["peak_rss_bytes"] / 2**20 for r in rows], 0.27, label="peak RSS")
        ax.scatter(list(xs), [r["budget_bytes"] / 2**20 for r in rows], color="k", marker="_", s=300, label="budget")
        ax.set_xticks(list(xs), [f"{r['budget_bytes'] / 2**20:.0f}M\n{r['format']}\n{r['experts_per_layer']}e"
                                 for r in rows], fontsize=7)
        ax.set_ylabel("MiB")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "memory.png", dpi=110)
    except ImportError:
        pass
    print("\n".join(lines))


if __name__ == "__main__":
    main()
