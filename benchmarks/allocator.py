"""The device's allocator setting as a measured choice (issue 22): peak RSS against step time.

A device either lets glibc serve allocations above 64 KiB by ``mmap`` (``allocator:
mmap``, the default: :func:`moe_model.budget.tune_allocator`; freed activations go back to
the OS at once) or keeps glibc's own setting (``allocator: default``: freed memory stays in
the heap for reuse, faster steps, a higher peak). Per model, each setting runs
``--repeats`` fresh device processes (``benchmarks/memory.py --cell``: baseline, load the
same experts from int8 shards, train LoRA for ``--steps`` steps, one thread) holding the
same number of experts per layer; reported are peak RSS (VmHWM) and seconds per step, mean
± 95% CI, and the paired difference (repeat r of one setting against repeat r of the
other). Models: all-MiniLM-L6-v2 upcycled (128 experts in 3 layers, classification) and,
with ``--model DIR``, a Hugging Face MoE checkpoint (causal LM; e.g. the random-init
Qwen3-MoE of ``benchmarks/peer.py`` at ``runs/peer/qwen3moe-random``).

    python -m benchmarks.allocator --lock /tmp/fedmoe-heavy.lock
    python -m benchmarks.allocator --model runs/peer/qwen3moe-random --experts 16 --gradient-checkpointing

Writes ``results/allocator/allocator.{json,md,png}`` (one section per model; a later run
adds or replaces its model's section).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from benchmarks.common import fmt, heavy_lock, mean_ci, module_command, module_env, paired_test

ROOT = Path(__file__).resolve().parents[1]

MiB = 2**20
SETTINGS = ("mmap", "default")


def run_cell(args, allocator: str) -> dict:
    """One fresh device process (``memory.py --cell``) with ``allocator``; its RESULT dict.

    Raises:
        RuntimeError: the cell failed (its stderr tail attached).
    """
    extra = (["--model", args.model] if args.model else []) + ["--seq-len", str(args.seq_len)] \
        + (["--gradient-checkpointing"] if args.gradient_checkpointing else [])
    env = module_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                     HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = module_command("memory", "--cell", "int8", str(64 * 2**30), "--work", args.work, "--steps", str(args.steps),
                         "--allocator", allocator, "--experts", str(args.experts), *extra)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"cell {allocator} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[7:])


def prepare_shards(args) -> None:
    """int8 shards of every expert in ``args.work`` (``memory.py``'s cache), once."""
    from benchmarks import memory

    memory.MODEL, memory.T, memory.CHECKPOINTING = args.model, args.seq_len, args.gradient_checkpointing
    work = Path(args.work)
    if not (work / "index.json").exists():
        work.mkdir(parents=True, exist_ok=True)
        (work / "index.json").write_text(json.dumps(memory.prepare(work / "cache", formats=("int8",))))


def summarise(rows: dict[str, list[dict]]) -> dict:
    """Per setting: peak RSS (MiB) and s/step, mean ± CI; mmap − default, paired by repeat."""
    out = {"settings": {}}
    for a, cells in rows.items():
        out["settings"][a] = {"peak_mib": mean_ci([c["peak_rss_bytes"] / MiB for c in cells]),
                              "model_peak_mib": mean_ci([c["model_peak_bytes"] / MiB for c in cells]),
                              "step_seconds": mean_ci([c["step_seconds"] for c in cells])}
    m, d = rows["mmap"], rows["default"]
    out["mmap_minus_default"] = {
        "peak_mib": paired_test([c["peak_rss_bytes"] / MiB for c in m], [c["peak_rss_bytes"] / MiB for c in d]),
        "step_seconds": paired_test([c["step_seconds"] for c in m], [c["step_seconds"] for c in d])}
    return out


def markdown(result: dict) -> str:
    lines = ["# The device's allocator setting: peak RSS against step time", "",
             "Fresh device process per cell (benchmarks/memory.py --cell: int8 shards, LoRA rank 8, batch 8, one "
             "thread); `mmap`: glibc serves allocations above 64 KiB by mmap (the device default, "
             "moe_model.budget.tune_allocator); `default`: glibc's own setting. Mean ± std [95% CI] over repeats; "
             "the difference is paired by repeat and called only where its CI excludes 0.", ""]
    for name, sec in result["models"].items():
        s = sec["summary"]
        lines += [f"## {name}", "", f"{sec['experts']} experts per MoE layer, T = {sec['seq_len']}, "
                  f"{sec['steps']} steps, gradient checkpointing {'on' if sec['gradient_checkpointing'] else 'off'}, "
                  f"{sec['repeats']} repeats.", "",
                  "| allocator | peak RSS MiB | peak over baseline MiB | s / step |", "|---|---|---|---|"]
        for a in SETTINGS:
            x = s["settings"][a]
            lines.append(f"| {a} | {_ci(x['peak_mib'], '.0f')} | {_ci(x['model_peak_mib'], '.0f')} | "
                         f"{_ci(x['step_seconds'], '.3f')} |")
        for k, unit, spec in (("peak_mib", "MiB", "+.0f"), ("step_seconds", "s/step", "+.3f")):
            p = s["mmap_minus_default"][k]
            sig = "significant" if p["significant"] else "not significant"
            lines.append(f"\nmmap − default, {k.replace('_', ' ')}: {fmt(p['diff'], spec)} {unit} "
                         f"[{fmt(p['ci_lo'], spec)}, {fmt(p['ci_hi'], spec)}], {sig}")
        lines.append("")
    return "\n".join(lines) + "\n"


def _ci(x: dict, spec: str) -> str:
    return f"{fmt(x['mean'], spec)} ± {fmt(x['std'], spec)} [{fmt(x['ci_lo'], spec)}, {fmt(x['ci_hi'], spec)}]"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, sec in result["models"].items():
        pts = sec["summary"]["settings"]
        xs = [pts[a]["step_seconds"]["mean"] for a in SETTINGS]
        ys = [pts[a]["peak_mib"]["mean"] for a in SETTINGS]
        ax.plot(xs, ys, "-", color="grey", lw=0.8)
        for a, x, y in zip(SETTINGS, xs, ys):
            ax.scatter([x], [y], marker="o" if a == "mmap" else "s")
            ax.annotate(f"{name}: {a}", (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set(xlabel="seconds per training step", ylabel="device peak RSS (MiB)",
           title="allocator: memory against step time (mean over repeats)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a Hugging Face MoE checkpoint directory (default: the upcycled MiniLM)")
    ap.add_argument("--experts", type=int, default=32, help="experts held per MoE layer")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--work", help="shard cache (default runs/bench-allocator/<model>)")
    ap.add_argument("--out", default=str(ROOT / "results" / "allocator"))
    ap.add_argument("--lock")
    args = ap.parse_args(argv)
    name = Path(args.model).name if args.model else "minilm-moe"
    args.work = args.work or str(ROOT / "runs" / "bench-allocator" / name)
    rows: dict[str, list[dict]] = {a: [] for a in SETTINGS}
    with heavy_lock(args.lock):
        prepare_shards(args)
        for r in range(args.repeats):
            for a in (SETTINGS if r % 2 == 0 else SETTINGS[::-1]):  # alternate the order: drift hits both
                c = run_cell(args, a)
                rows[a].append(c)
                print(f"{name} repeat {r + 1}/{args.repeats} {a:>7}: peak {c['peak_rss_bytes'] / MiB:.0f} MiB, "
                      f"{c['step_seconds']:.3f} s/step", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "allocator.json"
    result = json.loads(path.read_text()) if path.is_file() else {"models": {}}
    result["models"][name] = {"experts": args.experts, "steps": args.steps, "seq_len": args.seq_len,
                              "repeats": args.repeats, "gradient_checkpointing": args.gradient_checkpointing,
                              "cells": rows, "summary": summarise(rows)}
    path.write_text(json.dumps(result, indent=1))
    (out / "allocator.md").write_text(markdown(result))
    plot(result, out / "allocator.png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
