"""Helpers shared by the benchmark scripts (imported as ``common`` from beside them)."""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from typing import Iterator


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
    """A cell name as a directory name: spaces to ``_``; ``/``, ``(`` and ``)`` dropped."""
    return text.replace(" ", "_").replace("/", "").replace("(", "").replace(")", "")


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
    p < 0.05). With zero spread (every pair differs by the same amount, as happens with
    round counts) the t-test is undefined: ``p`` is None, ``zero_spread`` True, and the
    difference counts as significant only with at least three pairs, all the same."""
    import math

    diffs = [float(x) - float(y) for x, y in zip(a, b) if x is not None and y is not None]
    out = {"n": len(diffs), **{k: v for k, v in mean_ci(diffs).items() if k != "n"}, "p": None, "significant": False}
    out["diff"] = out.pop("mean")
    if len(diffs) < 2:
        return out
    sd = out["std"]
    out["zero_spread"] = sd == 0
    if sd == 0:
        out["significant"] = len(diffs) >= 3 and out["diff"] != 0
        return out
    else:
        t = out["diff"] / (sd / math.sqrt(len(diffs)))
        try:
            from scipy import stats

            out["p"] = float(2 * stats.t.sf(abs(t), len(diffs) - 1))
        except ImportError:  # pragma: no cover
            out["p"] = None
    out["significant"] = out["diff"] != 0 and (out["ci_lo"] > 0 or out["ci_hi"] < 0)
    return out
