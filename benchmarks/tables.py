"""What every method-comparison table writes (``benchmarks.tables``): the markdown skeleton
and the plots, for the harness (:mod:`benchmarks.harness`) and the tables it runs.

A table's markdown is: its head (title, provenance, what the columns mean), then per
setting a heading with the convergence target, the methods (one row each, the table's
:class:`Layout` columns over :func:`benchmarks.common.compare_methods` statistics), the
paired tests (a − b, the table's test columns) and the setting's Holm-Bonferroni line,
then the table's own sections, the per-round sanity (every cell's problems, or that there
were none, and the table's own sanity lines) and its tail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import fmt, holm_text

Column = tuple[str, Callable[..., str]]
"""(header, cell text): for a method row ``f(method, method_stats, setting_stats)``; for a
test row ``f(test, setting_stats)``, whose text may span several columns (``" | "``)."""


@dataclass
class Layout:
    """How one table's markdown differs from the others'."""

    head: Callable[[dict, dict], list[str]]
    """(result, config) -> the lines before the first setting (the last one blank)."""
    columns: list[Column]
    test_header: str
    """The header row of the paired-tests table (``| a − b | ... |``)."""
    test_columns: list[Callable[[dict, dict], str]]
    all_ok: str
    """The sanity line when no cell had a problem."""
    tests_when_none: bool = True
    """Write the tests table's header also for a setting without tests."""
    sections: Callable[[dict, dict], list[str]] = lambda result, cfg: []
    """Lines after the settings, before the sanity (e.g. a summary across settings)."""
    sanity: Callable[[dict, dict], list[str]] = lambda result, cfg: []
    """More sanity lines (after the problems)."""
    tail: Callable[[dict, dict], list[str]] = lambda result, cfg: []
    """Lines after the sanity."""


def markdown(result: dict[str, Any], cfg: dict[str, Any], layout: Layout) -> str:
    """The table's markdown from its result (``stats``, ``cells``, provenance) and config."""
    lines = layout.head(result, cfg)
    for setting, st in result["stats"].items():
        lines += [f"## {setting} (target {fmt(st['target'])})", "",
                  "| " + " | ".join(h for h, _ in layout.columns) + " |", "|" + "---|" * len(layout.columns)]
        lines += ["| " + " | ".join(f(m, s, st) for _, f in layout.columns) + " |" for m, s in st["methods"].items()]
        if st["tests"] or layout.tests_when_none:
            width = layout.test_header.count("|") - 1
            lines += ["", layout.test_header, "|" + "---|" * width]
            lines += ["| " + " | ".join([f"{t['a']} − {t['b']}", *(f(t, st) for f in layout.test_columns)]) + " |"
                      for t in st["tests"]]
        for name in ("global", "local"):  # local: each device's own sub-model on its own data
            if (line := holm_text(st, name)):
                lines += ["", line]
        lines.append("")
    lines += layout.sections(result, cfg)
    problems = [f"- s{c['seed']} {c['setting']} / {c['method']}: {p}" for c in result["cells"]
                for p in c["sanity"]["problems"]]
    lines += ["## Per-round sanity", "", *(problems or [layout.all_ok]), *layout.sanity(result, cfg)]
    lines += layout.tail(result, cfg) or [""]
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, stats: dict, settings: list[str], methods: list[str], colors: list[str]) -> None:
    """Global accuracy per setting and method, bars with the 95% CI."""
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        xs, ys, err = [], [], [[], []]
        for i, s in enumerate(settings):
            g = stats[s]["methods"].get(m, {}).get("global")
            if g and g["mean"] is not None:
                xs.append(i + (j - (len(methods) - 1) / 2) * width)
                ys.append(g["mean"])
                err[0].append(g["mean"] - (g["ci_lo"] if g["ci_lo"] is not None else g["mean"]))
                err[1].append((g["ci_hi"] if g["ci_hi"] is not None else g["mean"]) - g["mean"])
        ax.bar(xs, ys, width, yerr=err, capsize=2, label=m, color=colors[j % len(colors)])
    ax.set_xticks(range(len(settings)), settings)
    ax.set_ylabel("global test accuracy (95% CI)")
    ax.grid(axis="y", alpha=0.3)


def plot(result: dict[str, Any], path: Path, methods: list[str]) -> None:
    """Global accuracy per setting and method (bars, 95% CI) over the mean accuracy per round
    of each setting (one panel a setting); ``methods`` in legend order."""
    plt = _pyplot()
    stats = result["stats"]
    settings = list(stats)
    main = [m for m in methods if any(m in st["methods"] for st in stats.values())]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    cols = max(2, len(settings))
    fig, axes = plt.subplots(2, cols, figsize=(4.2 * cols, 7.5), squeeze=False)
    ax = plt.subplot2grid((2, cols), (0, 0), colspan=cols, fig=fig)
    for a in axes[0]:
        a.set_visible(False)
    _bars(ax, stats, settings, main, colors)
    # at most 2 legend columns per panel column: long method names stay inside the figure
    ax.legend(fontsize=8, ncol=min(len(main), 2 * cols - 1))
    for k, s in enumerate(settings[:cols]):
        a = axes[1][k]
        for j, m in enumerate(main):
            st = stats[s]["methods"].get(m)
            if st:
                ys = [float("nan") if y is None else y for y in [st["initial"], *st["mean_curve"]]]
                a.plot(range(len(ys)), ys, "o-", ms=3, label=m, color=colors[j % len(colors)])
        a.set_title(f"{s}: accuracy per round (mean)", fontsize=9)
        a.set_xlabel("round")
        a.grid(alpha=0.3)
    for a in axes[1][len(settings):]:  # one setting still gets two columns: no empty panel
        a.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_with_ablations(result: dict[str, Any], path: Path, methods: list[str], ablations: list[str],
                        ablation_setting: str | None) -> None:
    """Global accuracy per setting and method (bars, 95% CI, y-axis zoomed to the bars),
    three curve panels a row (mean ± std per round, the target dotted) and, where the
    ablation setting has ablations, their global and local accuracy against ``ablations[0]``
    (the method they ablate)."""
    plt = _pyplot()
    stats = result["stats"]
    settings = list(stats)
    main = [m for m in methods if any(m in st["methods"] for st in stats.values())]
    abl = [m for m in ablations if m in stats.get(ablation_setting, {}).get("methods", {})]
    cols = 3
    rows_curve = math.ceil(len(settings) / cols)
    fig = plt.figure(figsize=(15, 4.2 + 3.2 * rows_curve + (3.6 if len(abl) > 1 else 0)))
    gs = fig.add_gridspec(1 + rows_curve + (1 if len(abl) > 1 else 0), cols)
    ax = fig.add_subplot(gs[0, :])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    _bars(ax, stats, settings, main, colors)
    finite = [st["methods"][m]["global"]["mean"] for st in stats.values() for m in st["methods"]
              if st["methods"][m]["global"]["mean"] is not None]
    if finite:
        ax.set_ylim(max(0.0, min(finite) - 0.15), min(1.0, max(finite) + 0.08))
    ax.legend(fontsize=8, ncol=len(main))
    for k, s in enumerate(settings):
        a = fig.add_subplot(gs[1 + k // cols, k % cols])
        for j, m in enumerate(main):
            st = stats[s]["methods"].get(m)
            if not st:
                continue
            ys = [st["initial"]] + st["mean_curve"]
            sd = [0.0] + [x or 0.0 for x in st["std_curve"]]
            xr = range(len(ys))
            yv = [float("nan") if y is None else y for y in ys]
            a.plot(xr, yv, "o-", ms=3, label=m, color=colors[j % len(colors)])
            a.fill_between(xr, [y - d for y, d in zip(yv, sd)], [y + d for y, d in zip(yv, sd)], alpha=0.12,
                           color=colors[j % len(colors)])
        if stats[s]["target"] is not None:
            a.axhline(stats[s]["target"], ls=":", color="grey", lw=1)
        a.set_title(f"{s}: global accuracy per round (mean ± std)", fontsize=9)
        a.set_xlabel("round")
        a.grid(alpha=0.3)
    if len(abl) > 1:
        a = fig.add_subplot(gs[-1, :])
        st = stats[ablation_setting]["methods"]
        for j, metric in enumerate(("global", "local")):
            ys = [st[m][metric]["mean"] or 0 for m in abl]
            err = [[(st[m][metric]["mean"] or 0) - (st[m][metric]["ci_lo"] or st[m][metric]["mean"] or 0) for m in abl],
                   [(st[m][metric]["ci_hi"] or st[m][metric]["mean"] or 0) - (st[m][metric]["mean"] or 0) for m in abl]]
            a.bar([i + (j - 0.5) * 0.38 for i in range(len(abl))], ys, 0.38, yerr=err, capsize=2, label=metric)
        a.set_xticks(range(len(abl)), abl, fontsize=8)
        a.set_title(f"Ablations, {ablation_setting} (95% CI)", fontsize=9)
        vals = [st[m][k]["mean"] for m in abl for k in ("global", "local") if st[m][k]["mean"] is not None]
        if vals:
            a.set_ylim(max(0.0, min(vals) - 0.15), min(1.0, max(vals) + 0.08))
        a.legend(fontsize=8)
        a.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def profile_head(title: str, result: dict[str, Any], seeds_note: str) -> list[str]:
    """The first lines of a paper table's page: ``# <title> (<profile> profile)``, when and where
    it was measured, the profile, the seeds (``seeds_note``: what a seed fixes) with the cells
    done, and the cells' wall time (minutes)."""
    import json

    from benchmarks import cells

    p = result["profile_config"]
    return [f"# {title} ({result['profile']} profile)", "", cells.measured(result), f"Profile: {json.dumps(p)}.",
            f"Seeds {p['seeds']} ({seeds_note}). {cells.cells_done(result)}",
            f"Wall time of the cells: {result['cells_wall_seconds'] / 60:.1f} min.", ""]
