"""FLEX-MoE's table (Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070, the shape of Tables 2-4) on Fashion-MNIST:
the experiment harness on ``benchmarks/configs/flex.yaml`` (20 clients, E = 8 experts,
capacities 2-6, five partitions, Random / Greedy / FLEX and the usage-aware variants,
3 seeds; CV of usage, eq. 8, and of the assigned data volume, with CIs and paired tests).

Kept so that its command still works; every harness option passes through::

    python -m benchmarks.flex_table --quick      # = python -m benchmarks.harness benchmarks/configs/flex.yaml --quick
    python -m benchmarks.flex_table --lock /tmp/fedmoe-heavy.lock

Writes ``results/evidence/flex{,_quick}.{json,md,png}`` (:mod:`harness`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks import harness

CONFIG = Path(__file__).resolve().parent / "configs" / "flex.yaml"


def main(argv: list[str] | None = None) -> int:
    """Run the harness on :data:`CONFIG` with ``argv`` (harness options)."""
    return harness.main([*(sys.argv[1:] if argv is None else argv), str(CONFIG)])


if __name__ == "__main__":
    sys.exit(main())
