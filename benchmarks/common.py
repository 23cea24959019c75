"""Helpers shared by the benchmark scripts (``benchmarks.common``)."""

from __future__ import annotations

import fcntl
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
"""The repository root (benchmarks write under ``runs/`` and ``results/`` there)."""


def stop_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit`` in the main thread, as Ctrl-C raises
    ``KeyboardInterrupt``: the benchmark's ``finally`` blocks then stop the brokers,
    aggregators and devices it started instead of leaving them running."""
    import signal

    def _exit(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def rel(path: str | Path) -> str:
    """``path`` relative to the repository root where it lies inside it (results record no
    machine's absolute paths), else as given."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def module_command(name: str, *args: str) -> list[str]:
    """The argv that runs ``python -m benchmarks.<name> args`` with this interpreter, for a
    benchmark that starts another as a fresh process (run it with :func:`module_env`)."""
    return [sys.executable, "-m", f"benchmarks.{name}", *args]


def module_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository root first on ``PYTHONPATH`` (so a
    :func:`module_command` finds ``benchmarks`` and this checkout's packages from any
    working directory), plus ``extra``."""
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return {**os.environ, **extra, "PYTHONPATH": path}


def write_result(out: str | Path, stem: str, result: dict[str, Any], markdown: Callable[[dict], str],
                 plot: Callable[[dict, Path], None] | None) -> str:
    """``out/<stem>.{json,md,png}`` (no PNG when ``plot`` is None); returns the markdown."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out / f"{stem}.md").write_text(md)
    if plot is not None:
        plot(result, out / f"{stem}.png")
    return md


@contextmanager
def heavy_lock(path: str | None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) while a heavy run goes,
    so benchmarks started side by side on one machine take turns; ``None``/``""``: no lock."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fmt(x, spec: str = ".3f") -> str:
    """``x`` formatted with ``spec``, or an en dash for None (table cells)."""
    return "–" if x is None else format(x, spec)


def slug(text: str) -> str:
    """A cell name as a directory name: spaces to ``_``; ``/``, ``(``, ``)``, ``|`` and ``^``
    dropped; ``%`` to ``pc``."""
    for a, b in ((" ", "_"), ("/", ""), ("(", ""), (")", ""), ("|", ""), ("^", ""), ("%", "pc")):
        text = text.replace(a, b)
    return text


def t_quantile(df: int, q: float = 0.975) -> float:
    """Student t quantile (scipy when installed, else a table for 95% two-sided)."""
    try:
        from scipy import stats

        return float(stats.t.ppf(q, df))
    except ImportError:  # pragma: no cover - scipy is in the venv
        if q != 0.975:
            raise
        return {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}.get(df, 2.0)


def mean_ci(values) -> dict:
    """Mean, sample std and the 95% Student-t confidence interval of the mean of ``values``
    (None entries dropped): ``{"n", "mean", "std", "ci_lo", "ci_hi"}`` (std and CI None
    with fewer than two values; everything None with none)."""
    import math
    import statistics

    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"n": 0, "mean": None, "std": None, "ci_lo": None, "ci_hi": None}
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return {"n": 1, "mean": m, "std": None, "ci_lo": None, "ci_hi": None}
    sd = statistics.stdev(xs)
    half = t_quantile(len(xs) - 1) * sd / math.sqrt(len(xs))
    return {"n": len(xs), "mean": m, "std": sd, "ci_lo": m - half, "ci_hi": m + half}


def paired_test(a, b) -> dict:
    """Paired comparison of ``a`` against ``b`` (same seeds in the same order; pairs with a
    None dropped): the mean difference a − b, the 95% CI of the paired difference and the
    two-sided paired t-test p-value. ``significant``: the CI excludes 0 (equivalently
    p < 0.05). With zero spread (every pair differs by the same amount up to 1e-9, as happens
    with round counts and with accuracies over the same small sets) the t-test is undefined:
    ``p`` is None, ``zero_spread`` True, and the difference counts as significant only with
    at least three pairs, all the same."""
    import math

    diffs = [float(x) - float(y) for x, y in zip(a, b) if x is not None and y is not None]
    out = {"n": len(diffs), **{k: v for k, v in mean_ci(diffs).items() if k != "n"}, "p": None, "significant": False}
    out["diff"] = out.pop("mean")
    if len(diffs) < 2:
        return out
    sd = out["std"]
    out["zero_spread"] = sd <= 1e-9  # equal differences up to float rounding (e.g. 1/48 − 1/96 in every seed)
    if out["zero_spread"]:
        out["significant"] = len(diffs) >= 3 and out["diff"] != 0
        return out
    t = out["diff"] / (sd / math.sqrt(len(diffs)))
    try:
        from scipy import stats

        out["p"] = float(2 * stats.t.sf(abs(t), len(diffs) - 1))
    except ImportError:  # pragma: no cover
        out["p"] = None
    out["significant"] = out["diff"] != 0 and (out["ci_lo"] > 0 or out["ci_hi"] < 0)
    return out


def holm(ps) -> list:
    """Holm-Bonferroni adjusted p-values of one family of tests, in the order given (None
    entries stay None and do not count in the family): sorted ascending, the i-th smallest
    (0-based) of m becomes ``min(1, max over j <= i of (m − j)·p_(j))``. A test is significant
    at family-wise level 0.05 where its adjusted p < 0.05. Holm, "A simple sequentially
    rejective multiple test procedure", Scandinavian Journal of Statistics 6(2), 1979."""
    idx = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])
    out: list = [None] * len(ps)
    running = 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (len(idx) - rank) * ps[i]))
        out[i] = running
    return out


def rounds_to(curve, target: float) -> int | None:
    """First round (1-based) whose accuracy in ``curve`` reaches ``target``; None if none does."""
    for i, a in enumerate(curve, 1):
        if a is not None and a >= target:
            return i
    return None


def compare_methods(cells, seeds, rounds: int, *, target_methods, target_fraction: float, pairs_of,
                    metrics=(("global", "accuracy"), ("local", "local_accuracy")), extra=()) -> dict:
    """Per setting: each method's statistics over seeds, a convergence target and paired tests.

    Args:
        cells: dicts with ``seed``, ``setting``, ``method``, ``accuracy_per_round`` (list),
            ``initial_accuracy`` and one field per ``metrics`` entry (and per ``extra``).
        seeds: the seeds in pairing order.
        rounds: rounds per run (a seed that never reaches the target counts as rounds + 1).
        target_methods: the methods whose best mean final accuracy sets the target.
        target_fraction: the target is this fraction of that best mean.
        pairs_of: setting -> list of (a, b): a − b is tested, paired over seeds.
        metrics: (name, cell field) pairs tested; the first is the headline figure.
        extra: further cell fields reported as their mean over seeds.

    Returns:
        setting -> ``{"target", "methods": {method: {name: mean_ci, name + "_values",
        "rounds_to_target", "rounds_to_target_values", "reached", "mean_curve", "std_curve",
        "initial", "seeds", *extra}}, "tests": [{"a", "b", name: paired_test, "rounds"}]}``;
        each paired test also gets ``p_holm``: its p adjusted by :func:`holm` over the
        setting's tests of the same figure.
    """
    out: dict = {}
    for setting in dict.fromkeys(c["setting"] for c in cells):
        by: dict = {}
        for c in cells:
            if c["setting"] == setting:
                by.setdefault(c["method"], {})[c["seed"]] = c
        finals = [mean_ci([by[m][s]["accuracy"] for s in seeds if s in by[m]])["mean"] for m in target_methods
                  if m in by]
        finals = [f for f in finals if f is not None]
        target = target_fraction * max(finals) if finals else None
        methods = {}
        for m, runs in by.items():
            curves = [runs[s]["accuracy_per_round"] for s in seeds if s in runs]
            rtt = [rounds_to(runs[s]["accuracy_per_round"], target) if s in runs and target else None for s in seeds]
            censored = [(x if x is not None else rounds + 1) if s in runs else None for x, s in zip(rtt, seeds)]
            st = {"seeds": [s for s in seeds if s in runs], "rounds_to_target_values": censored,
                  "rounds_to_target": mean_ci(censored), "reached": sum(x is not None for x in rtt),
                  "mean_curve": [mean_ci([c[i] for c in curves if i < len(c)])["mean"] for i in range(rounds)],
                  "std_curve": [mean_ci([c[i] for c in curves if i < len(c)])["std"] for i in range(rounds)],
                  "initial": mean_ci([runs[s]["initial_accuracy"] for s in seeds if s in runs])["mean"]}
            for name, field in metrics:
                vals = [runs[s][field] if s in runs else None for s in seeds]
                st[name], st[f"{name}_values"] = mean_ci(vals), vals
            for field in extra:
                st[field] = mean_ci([runs[s].get(field) for s in seeds if s in runs])["mean"]
            methods[m] = st
        tests = []
        for a, b in pairs_of(setting):
            if a in methods and b in methods:
                row = {"a": a, "b": b}
                for name, _ in metrics:
                    row[name] = paired_test(methods[a][f"{name}_values"], methods[b][f"{name}_values"])
                row["rounds"] = paired_test(methods[a]["rounds_to_target_values"],
                                            methods[b]["rounds_to_target_values"])
                tests.append(row)
        for name in [m for m, _ in metrics] + ["rounds"]:  # one family per setting and figure
            for row, p in zip(tests, holm([row[name]["p"] for row in tests])):
                row[name]["p_holm"] = p
        out[setting] = {"target": target, "methods": methods, "tests": tests}
    return out


def ci_text(s: dict, spec: str = ".3f") -> str:
    """``mean ± std [CI]`` of a :func:`mean_ci` result (just the mean with one value; – with none)."""
    if s["mean"] is None:
        return "–"
    if s["std"] is None:
        return fmt(s["mean"], spec)
    return f"{fmt(s['mean'], spec)} ± {fmt(s['std'], spec)} [{fmt(s['ci_lo'], spec)}, {fmt(s['ci_hi'], spec)}]"


def verdict(t: dict, higher_is_better: bool = True) -> str:
    """A :func:`paired_test` result in words: better / worse (bold) only where significant."""
    if t["n"] < 2 or t["diff"] is None:
        return "n/a"
    if not t["significant"]:
        return "no sig. difference" + (" (zero spread)" if t.get("zero_spread") and t["diff"] else "")
    better = (t["diff"] > 0) == higher_is_better
    return ("**better**" if better else "**worse**") + (" (same in every seed)" if t.get("zero_spread") else "")


def holm_text(setting_stats: dict, name: str = "global") -> str | None:
    """The setting's Holm-Bonferroni line for figure ``name``: which of its paired tests stay
    significant (adjusted p < 0.05) when corrected for the number of tests; None without a
    test that has a p-value (e.g. one seed)."""
    tested = [t for t in setting_stats["tests"] if (t.get(name) or {}).get("p_holm") is not None]
    if not tested:
        return None
    kept = [f"{t['a']} − {t['b']} (p_Holm={t[name]['p_holm']:.3f})" for t in tested if t[name]["p_holm"] < 0.05]
    return (f"Holm-Bonferroni over this setting's {len(tested)} test{'s' * (len(tested) > 1)} of {name} accuracy (family-wise 5%): "
            + (f"significant: {', '.join(kept)}." if kept else "none significant."))


def marks(setting_stats: dict, method: str) -> str:
    """`` ▲X ▼Y`` after a method's global accuracy in a :func:`compare_methods` setting: it is
    significantly above X / below Y (paired); empty where no test of it is significant."""
    out = [f"{'▲' if t['global']['diff'] > 0 else '▼'}{t['b']}" for t in setting_stats["tests"]
           if t["a"] == method and t["global"]["significant"]]
    return f" {' '.join(out)}" if out else ""


def diff_text(t: dict, spec: str = "+.3f") -> str:
    """``Δ [95% CI], p=`` of a :func:`paired_test` result."""
    if t["diff"] is None:
        return "–"
    ci = f" [{fmt(t['ci_lo'], spec)}, {fmt(t['ci_hi'], spec)}]" if t["ci_lo"] is not None else ""
    p = f", p={t['p']:.3f}" if t.get("p") is not None else ""
    return f"{fmt(t['diff'], spec)}{ci}{p}"


@contextmanager
def eval_threads(n: int) -> Iterator[None]:
    """While a cell runs, the cloud's evaluation (``Strategy.evaluate``, after every device
    reported) uses ``n`` torch threads and then gives the previous count back (the devices,
    threads of this process, train with ``--threads``). Speed only."""
    import torch

    from cloud.strategies.base import Strategy

    orig = Strategy.evaluate

    def evaluate(self, *a, **kw):
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return orig(self, *a, **kw)
        finally:
            torch.set_num_threads(before)

    Strategy.evaluate = evaluate
    try:
        yield
    finally:
        Strategy.evaluate = orig


def install_fashion_mnist() -> None:
    """Install Debian's ``dataset-fashion-mnist`` with apt-get when running as root (a fresh
    machine may need ``apt-get update`` first); otherwise do nothing (the loader then names
    the missing files)."""
    import logging
    import os
    import subprocess

    if hasattr(os, "geteuid") and os.geteuid() == 0:
        logging.getLogger(__name__).info("installing dataset-fashion-mnist with apt-get")
        if subprocess.run(["apt-get", "install", "-y", "dataset-fashion-mnist"], check=False).returncode != 0:
            subprocess.run(["apt-get", "update"], check=False)
            subprocess.run(["apt-get", "install", "-y", "dataset-fashion-mnist"], check=False)
