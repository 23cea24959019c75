"""Solve time and objective of the FLEX-MoE assignment program (Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070
eq. 10-13) as C x E grows, through PuLP+CBC, PuLP+HiGHS and the LP-relaxation fast path
(cloud/assignment/lp_fast.py).

Instances: Q ~ U(0,1), |D_c| ~ U{50..500}, k_c ~ U{2..6}, bounds of round 1 (eq. 14-19
with D = 0: target tau, delta = 0.1 tau), L layers solved one after the other (one
program per layer, as the ``flex`` strategy does). Exact solvers get a per-layer time
limit; a solve that hits it is reported as such (no objective).

    python -m benchmarks.assignment_scaling            # writes results/assignment_scaling.{json,md,png}
    python -m benchmarks.assignment_scaling --quick    # 20x8 and 1000x64 only
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import numpy as np

from cloud.assignment.flex import LoadBounds, solve_exact
from cloud.assignment.lp_fast import solve_fast


def instance(C: int, E: int, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.random((C, E))
    sizes = rng.integers(50, 501, C).astype(np.float64)
    k = rng.integers(2, 7, C)
    b = LoadBounds(E).bounds(sizes, k)
    return q, sizes, k, b.lower, b.upper


def run_cell(C: int, E: int, L: int, solver: str, time_limit: float, layers_exact: int) -> dict:
    total_t, total_obj, statuses, bound = 0.0, 0.0, [], 0.0
    n_layers = L if solver == "fast" else min(L, layers_exact)
    for layer in range(n_layers):
        q, sizes, k, lo, up = instance(C, E, 1000 * C + 10 * E + layer)
        t0 = time.perf_counter()
        if solver == "fast":
            r = solve_fast(q, sizes, k, lo, up)
            x, status = r.x, r.status
            bound += r.lp_bound
        else:
            x, status, _ = solve_exact(q, sizes, k, lo, up, solver, time_limit)
        dt = time.perf_counter() - t0
        total_t += dt
        statuses.append(status)
        if x is None:
            total_obj = float("nan")
        else:
            assert (x.sum(1) == k).all()
            load = sizes @ x
            assert (load >= lo - 1e-6).all() and (load <= up + 1e-6).all(), "bounds violated"
            total_obj += float((q * x).sum())
        logging.info("%dx%d layer %d %s: %s in %.2f s", C, E, layer, solver, status, dt)
    return {"C": C, "E": E, "layers": n_layers, "solver": solver, "seconds": total_t,
            "seconds_per_layer": total_t / n_layers, "objective": total_obj, "status": statuses,
            **({"lp_bound": bound} if solver == "fast" else {})}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=120.0, help="per exact solve, seconds")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    sizes = [(20, 8), (1000, 64)] + ([] if args.quick else [(10000, 64)])
    rows = []
    for C, E in sizes:
        # exact solvers on the largest size: one layer only (minutes each); the fast path always all L
        layers_exact = args.layers if C * E <= 64_000 else 1
        for solver in ("fast", "highs", "cbc"):
            rows.append(run_cell(C, E, args.layers, solver, args.time_limit, layers_exact))
            print(json.dumps(rows[-1]))
    # gap of the fast path to the exact optimum on the layers both solved
    for C, E in sizes:
        fast = next(r for r in rows if (r["C"], r["E"], r["solver"]) == (C, E, "fast"))
        for r in rows:
            if (r["C"], r["E"]) == (C, E) and r["solver"] != "fast" and all(s == "Optimal" for s in r["status"]):
                n = r["layers"]
                f = sum(float((lambda q, s, k, lo, up: solve_fast(q, s, k, lo, up).objective)(
                    *instance(C, E, 1000 * C + 10 * E + layer))) for layer in range(n)) if n != fast["layers"] \
                    else fast["objective"]
                fast.setdefault("gap_to_exact", {})[r["solver"]] = (r["objective"] - f) / r["objective"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
            "note": "2 CPU cores shared with other jobs while measured (timings contended)",
            "time_limit_s": args.time_limit, "layers": args.layers}
    (out / "assignment_scaling.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| C x E | solver | layers | seconds (total) | s/layer | objective | status | gap to exact |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = ", ".join(f"{k}: {v:.2e}" for k, v in r.get("gap_to_exact", {}).items())
        lines.append(f"| {r['C']}x{r['E']} | {r['solver']} | {r['layers']} | {r['seconds']:.2f} | "
                     f"{r['seconds_per_layer']:.2f} | {r['objective']:.2f} | {','.join(sorted(set(r['status'])))} | "
                     f"{gap} |")
    (out / "assignment_scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for solver in ("fast", "highs", "cbc"):
        rs = [r for r in rows if r["solver"] == solver]
        ax.plot([r["C"] * r["E"] for r in rs], [r["seconds_per_layer"] for r in rs], "o-", label=solver)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("C x E (binary variables per layer)")
    ax.set_ylabel("seconds per layer")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    ax.set_title("FLEX-MoE assignment solve time")
    fig.tight_layout()
    fig.savefig(out / "assignment_scaling.png", dpi=120)


if __name__ == "__main__":
    main()
