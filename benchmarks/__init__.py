"""The benchmarks: each module is a script run from the repository root as
``python -m benchmarks.<name> ...`` (see ``docs/benchmarks.md``); the method-comparison
tables run on one harness (``python -m benchmarks.harness benchmarks/configs/<table>.yaml``).
Not installed with the ``fedmoe`` package: benchmarks write under ``runs/`` and
``results/`` of the checkout they run from."""
