"""Plots and the per-round table of a simulation report (``report.json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cloud.dashboard import budget_peak  # noqa: F401  (re-exported: benchmarks use it)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    """Lay out, write (120 dpi) and close ``fig``; return ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(report: dict[str, Any], out: Path) -> list[Path]:
    """Write accuracy.png, bytes.png and expert_load.png (and perplexity.png for a
    causal-LM run) into ``out``; return their paths."""
    paths = [plot_accuracy(report, out / "accuracy.png"), plot_bytes(report, out / "bytes.png"),
             plot_expert_load(report, out / "expert_load.png")]
    if _is_lm(report):
        paths.append(plot_perplexity(report, out / "perplexity.png"))
    return paths


def _is_lm(report: dict[str, Any]) -> bool:
    return any("perplexity" in r for r in report["rounds"]) or report.get("initial_perplexity") is not None


def plot_perplexity(report: dict[str, Any], path: Path) -> Path:
    """Held-out perplexity of the global model per round (round 0 = before training), per
    task and overall (log scale)."""
    plt = _plt()
    rounds = report["rounds"]
    xs = [0] + [r["round"] for r in rounds]
    fig, ax = plt.subplots(figsize=(6, 4))
    tasks = sorted({t for r in rounds for t in (r.get("per_task") or {})})
    initial = report.get("initial_per_task") or {}
    for t in tasks:
        ys = [initial.get(t, {}).get("perplexity")] + [(r.get("per_task") or {}).get(t, {}).get("perplexity")
                                                      for r in rounds]
        ax.plot(xs, [np.nan if y is None else y for y in ys], "o-", label=f"{t} (test split)")
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("perplexity")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    ax.set_title("Held-out perplexity per round")
    return _save(plt, fig, path)


def plot_accuracy(report: dict[str, Any], path: Path) -> Path:
    """Global test accuracy (round 0 = before training) and mean local validation accuracy."""
    plt = _plt()
    rounds = report["rounds"]
    xs = [0] + [r["round"] for r in rounds]
    acc = [report.get("initial_accuracy")] + [r["accuracy"] for r in rounds]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [np.nan if a is None else a for a in acc], "o-", label="global model, test split")
    ax.plot([r["round"] for r in rounds], [np.nan if r["mean_local_accuracy"] is None else r["mean_local_accuracy"]
                                           for r in rounds], "s--", label="mean local validation")
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Accuracy per round")
    return _save(plt, fig, path)


def plot_bytes(report: dict[str, Any], path: Path) -> Path:
    """Bytes received and published per device per round (log scale)."""
    plt = _plt()
    rounds = report["rounds"]
    devices = sorted({d for r in rounds for d in r["devices"]})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for key, ax in zip(("bytes_down", "bytes_up"), axes):
        for d in devices:
            xs = [r["round"] for r in rounds if d in r["devices"]]
            ys = [r["devices"][d][key] / 2**20 for r in rounds if d in r["devices"]]
            ax.plot(xs, ys, "o-", label=d)
        ax.set_yscale("log")
        ax.set_xlabel("round")
        ax.set_ylabel("MiB")
        ax.set_title(f"{'received' if key == 'bytes_down' else 'published'} per device (on the wire)")
        ax.grid(alpha=0.3, which="both")
    axes[1].legend(fontsize=7, ncol=2)
    return _save(plt, fig, path)


def plot_expert_load(report: dict[str, Any], path: Path) -> Path:
    """Heat map per MoE layer: training tokens routed to each expert in each round."""
    plt = _plt()
    rounds = report["rounds"]
    layers = sorted({int(k) for r in rounds for k in r["expert_load"]})
    fig, axes = plt.subplots(1, max(1, len(layers)), figsize=(4 * max(1, len(layers)), 3.6), squeeze=False)
    for ax, layer in zip(axes[0], layers):
        m = np.array([r["expert_load"].get(str(layer), []) for r in rounds], dtype=float).T
        im = ax.imshow(m, aspect="auto", cmap="viridis", origin="lower",
                       extent=(0.5, len(rounds) + 0.5, -0.5, m.shape[0] - 0.5))
        ax.set_xlabel("round")
        ax.set_ylabel("expert")
        ax.set_title(f"MoE layer {layer}: tokens per expert")
        fig.colorbar(im, ax=ax)
    return _save(plt, fig, path)


def table(report: dict[str, Any]) -> str:
    """A fixed-width per-round table."""
    lm = _is_lm(report)
    ppl_head = f"{'ppl':>8} " if lm else ""
    head = f"{'round':>5} {ppl_head}{'acc':>6} {'local':>6} {'loss':>6} {'sec':>6} {'MiB up':>8} {'MiB down':>9} " \
           f"{'CV':>6} {'gap':>9} {'devs':>5} {'experts':>8} {'peak%':>6} {'out':>4}"
    lines = [head, "-" * len(head)]
    f = lambda v, spec: format(v, spec) if v is not None else format(float("nan"), spec)  # noqa: E731
    ia = report.get("initial_accuracy")
    ippl = f"{f(report.get('initial_perplexity'), '8.2f')} " if lm else ""
    lines.append(f"{0:>5} {ippl}{ia if ia is not None else float('nan'):>6.3f} {'':>6} {'':>6} {'':>6} {'':>8} "
                 f"{'':>9}")
    for r in report["rounds"]:
        ppl = f"{f(r.get('perplexity'), '8.2f')} " if lm else ""
        lines.append(
            f"{r['round']:>5} {ppl}{f(r['accuracy'], '6.3f')} {f(r['mean_local_accuracy'], '6.3f')} "
            f"{f(r['loss'], '6.3f')} {r['seconds']:>6.1f} {r['bytes_up'] / 2**20:>8.2f} "
            f"{r['bytes_down'] / 2**20:>9.2f} {r['cv']:>6.3f} {r['max_min_gap']:>9.0f} {len(r['devices']):>5} "
            f"{_held_range(r):>8} {f(_peak_share(r), '6.0f')} "
            f"{len(r.get('excluded') or {}) + len(r.get('failures') or {}):>4}"
        )
    notes = [f"round {r['round']}: {d} {'excluded' if d in (r.get('excluded') or {}) else 'failed'}: {why}"
             for r in report["rounds"] for d, why in sorted({**(r.get("failures") or {}),
                                                             **(r.get("excluded") or {})}.items())]
    lines += ["", "experts = held per device, of all layers; peak% = the highest peak footprint as % of its device's "
                  "budget; out = devices excluded + failed"]
    if notes:
        lines += ["devices left out:", *notes]
    return "\n".join(lines)


def where(report: dict[str, Any], out: Path) -> str:
    """The closing lines of ``fedmoe simulate``: accuracy before and after, the run's
    wall time, and where its report, plots and logs are."""
    rounds = report["rounds"]
    first, last = report.get("initial_accuracy"), rounds[-1]["accuracy"] if rounds else None
    f = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    plots = ", ".join(p.name for p in sorted(out.glob("*.png")))
    return (f"global test accuracy {f(first)} before training -> {f(last)} after {len(rounds)} rounds "
            f"({report['wall_seconds'] / 60:.1f} min)\n"
            f"report: {out / 'report.json'}, table: {out / 'rounds.md'}\n"
            f"plots:  {out}/ {plots}\n"
            f"logs:   {out / 'logs'}/ (aggregator, devices, broker)")


def device_table(report: dict[str, Any]) -> str:
    """A fixed-width table of the devices: memory budget (MiB), training samples, the
    experts each held per MoE layer in its last reporting round (of the model's E), and
    what it trained there (on the native device where the device config says so): its
    sub-MoE, or the one-expert compact model
    (``fusion``/``fusion_hybrid``; the round records' ``assignment.compact``, at a smaller
    batch where ``assignment.smaller_batch`` says so), or nothing (never reported)."""
    experts = (report["config"].get("simulation") or {}).get("model", {}).get("num_experts")
    last: dict[str, tuple[dict[str, Any], str]] = {}  # device -> (its last record, what it trained then)
    for r in report["rounds"]:
        plan = r.get("assignment") or {}
        compact, smaller = set(plan.get("compact") or []), plan.get("smaller_batch") or {}
        for d, rec in r["devices"].items():
            what = "its sub-MoE" if d not in compact else "the compact model (one expert)" + (
                f", batch {smaller[d]}" if d in smaller else "")
            last[d] = (rec, what)
    head = f"{'device':<8} {'budget MiB':>10} {'samples':>7} {'experts per MoE layer':<24} {'LoRA rank':>9} trained"
    lines = [head, "-" * len(head)]
    for d in report["config"]["devices"]:
        rec, what = last.get(d["device_id"], (None, "nothing (never reported)"))
        held, rank = "-", "-"
        if rec is not None:
            counts = sorted({len(v) for v in rec["experts"].values()})
            held = "/".join(map(str, counts)) + (f" of {experts}" if experts else "") + \
                f" ({len(rec['experts'])} layers)"
            rank = str(rec.get("lora_rank", "-"))
        if d.get("runtime") == "native":
            what += " (native device)"
        lines.append(f"{d['device_id']:<8} {d['budget_bytes'] / 2**20:>10.0f} {d['samples']:>7} {held:<24} "
                     f"{rank:>9} {what}")
    return "\n".join(lines)


def _peak_share(record: dict[str, Any]) -> float | None:
    """The highest measured peak over the round's reporting devices (:func:`budget_peak`),
    as % of that device's memory budget (None when no device reported both)."""
    peaks = [(budget_peak(d), d.get("budget_bytes")) for d in record["devices"].values()]
    shares = [100 * p / b for p, b in peaks if p and b]
    return max(shares) if shares else None


def _held_range(record: dict[str, Any]) -> str:
    """``min-max`` experts held (all layers) over the round's reporting devices."""
    held = [sum(len(v) for v in d["experts"].values()) for d in record["devices"].values()]
    if not held:
        return "-"
    return f"{min(held)}-{max(held)}" if min(held) != max(held) else str(held[0])
