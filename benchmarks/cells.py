"""The method-comparison tables' shared runner (``benchmarks.cells``):
the command-line options, and a loop over (seed, setting, method) cells that is
resumable, takes the machine's heavy-run lock per cell, gives each cell a fresh embedded
broker, survives a failed cell and writes the tables at the end.

The harness (:mod:`benchmarks.harness`) supplies what is a table's own: the cells to run,
``run(seed, setting, method, out, url) -> report`` (one federation) and ``summarise(report)
-> row``; :func:`federate` is the in-process federation most tables' cells are, and
:func:`load_data` / :func:`summarise` the data sources and rows they share.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import fmt, heavy_lock, rel, slug, write_result

log = logging.getLogger("cells")

Cell = tuple[int, str, str, dict]
"""(seed, setting, method name, method definition)."""


def parser(description: str, quick_help: str, runs: Path, results: Path | None) -> argparse.ArgumentParser:
    """The options every table script takes (``--quick``, ``--settings``, ``--methods``,
    ``--seeds``, ``--no-ablations``, ``--set``, ``--threads``, ``--verbose``, ``--note``,
    ``--force``, ``--lock``, ``--collect``, ``--reuse``, ``--runs``, ``--results``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--settings", help="comma-separated settings (default: the profile's)")
    ap.add_argument("--methods", help="comma-separated methods/ablations (default: all)")
    ap.add_argument("--seeds", help="comma-separated seeds (default: the profile's)")
    ap.add_argument("--no-ablations", action="store_true")
    ap.add_argument("--set", dest="overrides", default="",
                    help="override scalar profile entries, e.g. rounds=2 (recorded in the results)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of this process (default 1)")
    ap.add_argument("--verbose", action="store_true", help="keep the aggregator's and devices' INFO logs")
    ap.add_argument("--note", default="", help="a line for the table's header (e.g. what else ran on the machine)")
    ap.add_argument("--force", action="store_true", help="rerun cells that already have a report")
    ap.add_argument("--lock", help="flock this file while a cell runs")
    ap.add_argument("--collect", action="store_true", help="only tabulate cells that already finished")
    ap.add_argument("--reuse", metavar="TABLE_JSON",
                    help="a table's committed results JSON: its rows stand in for cells with no report under --runs "
                         "(a fresh checkout completes a partial table without rerunning what was measured)")
    ap.add_argument("--runs", default=str(runs))
    ap.add_argument("--results", default=None if results is None else str(results),
                    help="where the table's JSON, markdown and plot go" + ("" if results else " (default: the config's)"))
    return ap


def profile_of(args: argparse.Namespace, profiles: dict[str, dict[str, Any]], error: Callable[[str], Any]
               ) -> tuple[str, dict[str, Any]]:
    """(profile name, profile with ``--set`` and ``--seeds`` applied); quiets the libraries'
    logs unless ``--verbose``; ``error`` reports a bad ``--set`` entry (argparse's ``error``)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for name in ("amqtt", "transitions", *(() if args.verbose else ("cloud", "edge_sdk", "moe_model", "protocol",
                                                                    "fedmoe"))):
        logging.getLogger(name).setLevel(logging.WARNING)
    name = "quick" if args.quick else "full"
    p = dict(profiles[name])
    for kv in filter(None, args.overrides.split(",")):
        k, _, v = kv.partition("=")
        if k not in p or isinstance(p[k], (list, dict)):
            error(f"--set: unknown or non-scalar profile entry {k!r} (scalars: "
                  f"{', '.join(k2 for k2, v2 in p.items() if not isinstance(v2, (list, dict)))})")
        p[k] = type(p[k])(v)
    if args.seeds:
        p["seeds"] = [int(s) for s in args.seeds.split(",")]
    return name, p


def cell_dir(base: Path, seed: int, setting: str, method: str) -> Path:
    """Where a cell's ``report.json`` lives: ``base/s<seed>/<setting>--<method>`` (slugged)."""
    return base / f"s{seed}" / slug(f"{setting}--{method}")


def run_cells(todo: list[Cell], base: Path, args: argparse.Namespace,
              run: Callable[[int, str, dict, Path, str], dict], summarise: Callable[[dict], dict]
              ) -> tuple[list[dict], list[str]]:
    """Run (or reuse) every cell of ``todo`` in order.

    Args:
        base: the profile's cell directory (:func:`cell_dir`).
        args: the parsed :func:`parser` options (``force``, ``collect``, ``lock``, ``threads``).
        run: ``(seed, setting, method definition, out dir, broker URL) -> report``; writes
            ``out/report.json``. What it raises loses that cell only (listed as missing).
        summarise: report -> the cell's row (``accuracy``, ``local_accuracy``,
            ``wall_seconds``, ``sanity.problems``, ...).

    Returns:
        (rows, each with ``seed``, ``setting``, ``method``, ``dir``, ``measured``; missing
        or failed cells in words).
    """
    import torch

    from fedmoe.broker import EmbeddedBroker

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t0 = time.time()
    rows: list[dict] = []
    missing: list[str] = []
    ran_seconds, ran = 0.0, 0
    reused = reusable_rows(args.reuse)
    for i, (seed, setting, name, method) in enumerate(todo, 1):
        out = cell_dir(base, seed, setting, name)
        if (out / "report.json").exists() and not args.force:
            report = json.loads((out / "report.json").read_text())
        elif (seed, setting, name) in reused and not args.force:
            rows.append(reused[seed, setting, name])
            continue
        elif args.collect:
            missing.append(f"s{seed} {setting} / {name}")
            continue
        else:
            with heavy_lock(args.lock):
                torch.set_num_threads(args.threads)
                log.info("cell %d/%d s%d %s / %s: running", i, len(todo), seed, setting, name)
                t1 = time.time()
                # a fresh broker per cell: devices keep their MQTT client ids ("dev-dev-00") from cell to
                # cell, and on a shared broker a new cell's device resumed the previous cell's session (its
                # queued messages arrived and were rejected as another federation's; such cells ran up to 30 s longer)
                broker = EmbeddedBroker().start()
                try:
                    report = run(seed, setting, method, out, broker.url)
                except Exception as e:  # one failed cell must not lose the others
                    log.exception("cell s%d %s / %s failed", seed, setting, name)
                    missing.append(f"s{seed} {setting} / {name} (failed: {e})")
                    continue
                finally:
                    broker.stop()
                ran_seconds += time.time() - t1
                ran += 1
            left = sum(1 for s2, st2, n2, _ in todo[i:]
                       if args.force or not (cell_dir(base, s2, st2, n2) / "report.json").exists())
            log.info("cell %d/%d done in %.0f s; elapsed %.1f min, %d cells to run, ETA %.1f min (at this pace)", i,
                     len(todo), time.time() - t1, (time.time() - t0) / 60, left, ran_seconds / ran * left / 60)
        row = {"seed": seed, "setting": setting, "method": name, "dir": rel(out),
               "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime((out / "report.json").stat().st_mtime)),
               **summarise(report)}
        rows.append(row)
        problems = row["sanity"]["problems"]
        print(f"s{seed} {setting:14s} {name:28s} global {_figure(row['accuracy'])} local "
              f"{_figure(row['local_accuracy'])} ({row['wall_seconds']:.0f} s)"
              f"{' PROBLEMS: ' + '; '.join(problems) if problems else ''}", flush=True)
    return rows, missing


def _figure(x: Any) -> str:
    """An accuracy for the progress line: a number, or ``task=number`` per task."""
    return " ".join(f"{k}={fmt(v)}" for k, v in x.items()) if isinstance(x, dict) else fmt(x)


def reusable_rows(path: str | None) -> dict[tuple[int, str, str], dict]:
    """The rows of a committed table JSON (``--reuse``), by (seed, setting, method); each
    keeps its ``measured`` date and gets ``reused_from`` (the file).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a table result (no ``cells`` list).
    """
    if not path:
        return {}
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise ValueError(f"--reuse {path}: not a table result (no 'cells' list)")
    return {(c.get("seed", 0), c["setting"], c["method"]): {**c, "reused_from": rel(path)} for c in data["cells"]}


def header(args: argparse.Namespace, profile: str, p: dict[str, Any], rows: list[dict], missing: list[str]
           ) -> dict[str, Any]:
    """The fields every table's JSON starts with (profile, date, machine, note, cells, wall time)."""
    return {"profile": profile, "profile_config": p, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores", "note": args.note,
            "transport": "in-process (fedmoe.inprocess), a fresh embedded MQTT broker per cell",
            "cells_missing": missing, "cells_wall_seconds": sum(c["wall_seconds"] or 0 for c in rows)}


def measured(result: dict[str, Any]) -> str:
    """The table's provenance line: when, on what, the note."""
    return f"Measured {result['date']} on {result['machine']}. {result['note']}".rstrip()


def cells_done(result: dict[str, Any]) -> str:
    """``Cells: N finished[; missing: ...].`` of a table's result."""
    missing = result["cells_missing"]
    return f"Cells: {len(result['cells'])} finished" + (f"; missing: {', '.join(missing)}" if missing else "") + "."


def write(results: str, stem: str, result: dict[str, Any], markdown: Callable[[dict], str],
          plot: Callable[[dict, Path], None]) -> str:
    """``results/<stem>.{json,md,png}`` (the plot only with at least one cell); returns the markdown."""
    return write_result(results, stem, result, markdown, plot if result["cells"] else None)


def federate(out: Path, url: str, *, spec: Any, task: str, labels: list[str], test: list,
             device_data: list[list], budgets: list[int], method: dict[str, Any], train: dict[str, Any], rounds: int,
             weight_format: str, eval_samples: int, seed: int, defences: dict[str, Any],
             reserved: list | None = None, eval_threads_n: int = 2, round_timeout_s: float = 600.0,
             probe: Any = None, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """One federation of a table cell through the production code: a ``cloud.service.Aggregator``
    and one ``edge_sdk.EdgeClient`` per device as threads of this process
    (``fedmoe.inprocess.run_inprocess``) over the MQTT broker at ``url``. Devices plan memory
    for the model alone (``runtime_bytes=0``, no headroom: the process is shared). Every
    device starts with an empty shard cache of its own (under ``out``, removed after the
    run), as a freshly provisioned device would: the base shards it fetches count in its
    bytes, whichever cells ran before.

    Args:
        out: the cell directory (emptied first); gets ``report.json`` and ``rounds.md``.
        spec: the ``ModelSpec``; task/labels/test: the one task, its labels and test items.
        device_data: each device's training items (``(input, label)``); budgets: bytes each.
        method: ``strategy``, ``assignment`` (default ``full``), ``aggregation`` (default
            ``modular``), ``params``, ``assignment_params``, ``aggregation_params``, and
            ``TrainConfig`` fields (``prox_mu``, ``local_epochs``, ``router``) overriding ``train``,
            and ``update``: the devices' update encoding, ``edge_sdk.filters.UpdateEncoding``
            arguments (``precision``, ``delta``, ``error_feedback``; one filter per device),
            ``state_precision``: the down-link encoding (``AggregatorConfig.state_precision``), and
            ``min_lora_rank``: heterogeneous LoRA ranks (``AggregatorConfig.min_lora_rank``).
        train: ``TrainConfig`` fields (``max_steps``, ``batch_size``, ``lr``, ...).
        reserved: the cloud-only labelled set D^r (``Aggregator(reserved_data=...)``).
        eval_threads_n: torch threads of the cloud's evaluation (:func:`common.eval_threads`).
        probe: a context manager around the run with a ``summary()`` (e.g. FedAlign's gate
            diagnostics), reported under ``probe``.
        config: more fields for the report's ``config``.

    Returns:
        The report: ``config``, ``initial_accuracy``, ``rounds`` (the round records),
        ``wall_seconds``, ``phase_seconds`` (and ``probe``).

    Raises:
        RuntimeError: a thread failed or fewer than ``rounds`` rounds were recorded.
    """
    import shutil
    import uuid
    from contextlib import nullcontext

    from cloud.service import Aggregator, AggregatorConfig, StrategyConfig, TaskConfig
    from benchmarks.common import eval_threads
    from edge_sdk import EdgeClient
    from edge_sdk.filters import UpdateEncoding
    from fedmoe import report as R
    from fedmoe.inprocess import run_inprocess
    from protocol.messages import TrainConfig

    t0 = time.time()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    fed = f"cell-{uuid.uuid4().hex[:8]}"
    overrides = {k: method[k] for k in ("prox_mu", "local_epochs", "router") if k in method}
    cfg = AggregatorConfig(
        federation=fed, model=spec, tasks={task: TaskConfig(labels=labels)}, rounds=rounds,
        min_devices=len(device_data), start_timeout_s=300, round_timeout_s=round_timeout_s, clients_per_round=1.0,
        train=TrainConfig(**{"local_epochs": 1.0, **train, **overrides}),
        strategy=StrategyConfig(name=method["strategy"], params=dict(method.get("params", {}))),
        assignment=StrategyConfig(name=method.get("assignment", "full"),
                                  params=dict(method.get("assignment_params", {}))),
        aggregation=StrategyConfig(name=method.get("aggregation", "modular"),
                                   params=dict(method.get("aggregation_params", {}))), weight_format=weight_format,
        store=f"sqlite:///{out}/aggregator.db", clear_retained_on_exit=True, protocol="3.1.1", near_miss_hellos=False,
        eval_max_samples=eval_samples, eval_batch_size=64, seed=seed, defences=defences,
        state_precision=method.get("state_precision", "fp32"), min_lora_rank=method.get("min_lora_rank"),
    )
    agg = Aggregator(cfg, url, eval_data={task: test}, reserved_data={task: reserved} if reserved else None)
    devices, clients = [], []
    for i, (data, budget) in enumerate(zip(device_data, budgets)):
        d = f"dev-{i:02d}"
        devices.append({"device_id": d, "task": task, "samples": len(data), "budget_bytes": budget,
                        "labels": {str(y): sum(1 for _, x in data if x == y) for y in sorted({x for _, x in data},
                                                                                         key=str)}})
        clients.append(EdgeClient(url, d, data, federation=fed, budget_bytes=budget, task=task,
                                  cache_dir=str(out / "shards" / d), protocol="3.1.1", runtime_bytes=0,
                                  headroom_bytes=0, low_memory=False, seed=seed * 100 + i,
                                  filters=[UpdateEncoding(**method["update"])] if method.get("update") else ()))
    t_setup = time.time() - t0
    with probe if probe is not None else nullcontext(), eval_threads(eval_threads_n):
        records, errors = run_inprocess(agg, clients, round_timeout_s * (rounds + 1))
    if errors or len(records) < rounds:
        raise RuntimeError(f"cell failed after {len(records)} rounds: {errors!r}")
    initial = agg.initial or {}
    report = {
        "config": {"aggregator": cfg.model_dump(mode="json"), "devices": devices, "task": task, "seed": seed,
                   "method": method, "reserved": len(reserved or ()),
                   "transport": "in-process threads, embedded MQTT broker", **(config or {})},
        "initial_accuracy": initial.get("accuracy"), "initial_per_task": initial.get("per_task"),
        **({"initial_perplexity": initial["perplexity"]} if initial.get("perplexity") is not None else {}),
        "rounds": records, "wall_seconds": time.time() - t0,
        "phase_seconds": {"setup": t_setup, "rounds": sum(r["seconds"] for r in records)},
        **({"probe": probe.summary()} if probe is not None else {}),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "rounds.md").write_text("```\n" + R.table(report) + "\n```\n")
    (out / "aggregator.db").unlink(missing_ok=True)  # global-state blobs; the report has what the table needs
    shutil.rmtree(out / "shards", ignore_errors=True)
    return report


# --------------------------------------------------------------------------- data and rows shared by tables

DATA_SOURCES = ("bbc", "tweets", "fmnist")


def load_data(source: str, seed: int, samples: int, eval_samples: int, test_fraction: float = 0.2
              ) -> tuple[list, list, list[str]]:
    """(training items, test items, labels) of a data source, items ``(input, label)``.

    ``bbc``/``tweets`` (the packaged text tasks): a seeded subset of ``samples /
    (1 − test_fraction)`` items split as ``fedmoe simulate`` splits them, all of the test
    part. ``fmnist`` (Debian ``dataset-fashion-mnist``, installed with apt-get when missing
    and root): ``samples`` seeded training images and ``eval_samples`` test images.

    Raises:
        KeyError: an unknown source. FileNotFoundError: Fashion-MNIST missing.
    """
    import random

    if source in ("bbc", "tweets"):
        from fedmoe.simulate import split_task

        items, labels, train_idx, test_idx = split_task(source, seed, test_fraction, int(samples / (1 - test_fraction)))
        return [items[i] for i in train_idx], [items[i] for i in test_idx], labels
    if source == "fmnist":
        from benchmarks.common import install_fashion_mnist
        from fedmoe.datasets import FASHION_MNIST_DIR, fashion_mnist

        if not Path(FASHION_MNIST_DIR).exists():
            install_fashion_mnist()
        train, test, labels = fashion_mnist()
        rng = random.Random(f"fusion_table/{seed}/fmnist")  # the seed string fusion_table.py's cells were drawn with
        train = [train[i] for i in sorted(rng.sample(range(len(train)), samples))]
        return train, [test[i] for i in rng.sample(range(len(test)), eval_samples)], labels
    raise KeyError(f"unknown data source {source!r}; known: {', '.join(DATA_SOURCES)}")


def label_id(y: Any, labels: list[str]) -> int:
    """A label (its name or its id) as its id."""
    return y if isinstance(y, int) else labels.index(y)


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """The table row of one cell's report, with its per-round sanity report.

    Returns:
        ``accuracy`` (last round, the strategy's evaluation), ``fused_accuracy``
        (``fusion_hybrid``), ``local_accuracy`` (mean of the devices' latest validation
        accuracy), ``initial_accuracy``, ``accuracy_per_round``, ``experts_held_mean`` (per
        device-round, all layers), ``mib_per_device_round`` (up + down), ``cv_usage`` (the
        last round's expert-usage CV, cumulative; FLEX-MoE eq. 8), ``cv_assigned`` (the same
        over the assigned data volume), ``planned_peak_mib`` (the devices' memory plans,
        mean per device-round; measured RSS is not per device here), ``devices_trained``,
        ``devices_total``, ``reserved``, ``wall_seconds``, ``sanity`` (``rounds``: clients
        trained, experts held, excluded/failed, Fed-MoE's α and gate entropy; ``problems``:
        rounds not ``ok``, devices excluded or failed).
    """
    rounds = report["rounds"]
    latest: dict[str, float] = {}
    rows, problems = [], []
    for r in rounds:
        for d, v in r["devices"].items():
            if v.get("val_accuracy") is not None:
                latest[d] = v["val_accuracy"]
        held = [sum(len(v) for v in d["experts"].values()) for d in r["devices"].values()]
        sm = r.get("strategy_metrics") or {}
        rows.append({"round": r["round"], "status": r["status"], "trained": len(r["devices"]),
                     "held_min": min(held) if held else None, "held_max": max(held) if held else None,
                     "excluded": r.get("excluded") or {}, "failures": r.get("failures") or {},
                     "accuracy": r.get("accuracy"), "fused": (r.get("fused") or {}).get("accuracy"),
                     "alpha": sm.get("alpha"), "gate_entropy": sm.get("gate_entropy"),
                     "compact_clients": sm.get("compact_clients", sm.get("clients")),
                     "sub_moe_clients": sm.get("sub_moe_clients"), "cv": r.get("cv"),
                     "cv_assigned": r.get("assigned_cv")})
        if r["status"] != "ok":
            problems.append(f"round {r['round']}: status {r['status']} {r.get('error', '')}")
        if r.get("excluded") or r.get("failures"):
            problems.append(f"round {r['round']}: excluded {sorted(r.get('excluded') or {})} "
                            f"failed {sorted(r.get('failures') or {})}")
    device_rounds = [d for r in rounds for d in r["devices"].values()]
    held = [sum(len(v) for v in d["experts"].values()) for d in device_rounds]
    traffic = [(d.get("bytes_up") or 0) + (d.get("bytes_down") or 0) for d in device_rounds]
    peaks = [d["predicted_peak_bytes"] for d in device_rounds if d.get("predicted_peak_bytes")]
    fused = [x["fused"] for x in rows]
    return {
        "accuracy": rounds[-1].get("accuracy") if rounds else None,
        "fused_accuracy": fused[-1] if fused and fused[-1] is not None else None,
        "local_accuracy": sum(latest.values()) / len(latest) if latest else None,
        "initial_accuracy": report.get("initial_accuracy"),
        "accuracy_per_round": [r.get("accuracy") for r in rounds],
        "experts_held_mean": sum(held) / len(held) if held else None,
        "mib_per_device_round": sum(traffic) / len(traffic) / 2**20 if traffic else None,
        "cv_usage": rounds[-1].get("cv") if rounds else None,
        "cv_assigned": rounds[-1].get("assigned_cv") if rounds else None,
        "planned_peak_mib": (sum(peaks) / len(peaks) / 2**20) if peaks else None,
        "devices_trained": len({d for r in rounds for d in r["devices"]}),
        "devices_total": len(report["config"]["devices"]), "reserved": report["config"].get("reserved"),
        "wall_seconds": report.get("wall_seconds"),
        "sanity": {"rounds": rows, "problems": problems},
    }
