"""The experiment harness: a comparison of federated methods declared in YAML
(``benchmarks/configs/*.yaml``), run cell by cell through the production code, over
several seeds, with confidence intervals and paired tests.

A config names the model, the data, a grid of settings, the devices' budgets, the
training, the rounds, the methods (strategy × assignment × aggregation × training
options), the pairs to test and the seeds, plus profiles (``quick``, ``full``) that
override any of these by dotted key::

    name: example                    # results/evidence/<name>{,_quick}.{json,md,png}
    description: one line for the table
    model: {num_experts: 8, top_k: 2, max_seq_len: 24}   # protocol.messages.ModelSpec fields
    model_by_data: {fmnist: {family: conv-moe, base: null, tokenizer: null}}   # per data source
    weight_format: int8              # or {fmnist: fp32, default: int8}
    grid:                            # settings = the product of the axes, named "<data> <partition> <devices>"
      data: [bbc]                    # bbc | tweets | fmnist (cells.load_data)
      partition: {"Dir(0.5)": "dirichlet:0.5"}
      devices: [6]
    samples: 900                     # training items per setting (seeded subset)
    eval_samples: 180
    budgets: {experts: [2, 8]}       # each device: a seeded draw between the memory plans of 2 and 8 experts
                                     # per layer (model only); {cycle: [2, 8]}: devices take 2, 8, 2, ... in turn
    train: {max_steps: 2, batch_size: 8, lr: 0.003}
    rounds: 4
    seeds: [0, 1, 2]
    defences: {robust: {name: none}, screening: null}
    methods:
      FedAvg: {strategy: composed, assignment: full}
      FedMoE: {strategy: composed, assignment: fedmoe, assignment_params: {probe_steps: 2}}
      FedAvg int8: {strategy: composed, assignment: full, update: {precision: int8, delta: true}}   # device upload
      FedAvg int8 down: {strategy: composed, assignment: full, state_precision: int8}              # cloud download
      FedAvg nf4 base: {strategy: composed, assignment: full, weight_format: nf4}  # base shards in nf4 (budgets
                                                                                    # stay those of weight_format)
    compare: [[FedMoE, FedAvg]]      # a − b, paired over seeds, in every setting
    target_fraction: 0.9             # rounds to this fraction of the best method's final accuracy
    profiles:
      quick: {seeds: [0], rounds: 2, samples: 300}

Every cell is one in-process federation (:func:`cells.federate`: the aggregator and one
``EdgeClient`` per device as threads, a fresh embedded MQTT broker), resumable
(``runs/<name>/<profile>/s<seed>/<cell>/report.json``) and run under ``--lock``. Per
method and setting: global and mean local accuracy (mean ± std, 95% Student-t CI), rounds
to the target, experts held, MiB per device-round, the expert-usage CV; every listed pair
gets a paired t-test, and "better" is written only where the 95% CI of the paired
difference excludes 0. Peak memory is not a column: the devices share one process here
(``benchmarks/memory.py`` measures it per process).

    python -m benchmarks.harness benchmarks/configs/fedmoe_experts.yaml --quick --lock /tmp/fedmoe-heavy.lock
"""

from __future__ import annotations

import copy
import itertools
import random
import sys
from pathlib import Path
from typing import Any

from benchmarks import cells
from protocol.codec import WEIGHT_FORMATS
from benchmarks.common import ci_text, compare_methods, diff_text, fmt, verdict

ROOT = Path(__file__).resolve().parent.parent

REQUIRED = ("name", "model", "grid", "samples", "eval_samples", "budgets", "train", "rounds", "seeds", "methods")
DEFAULTS: dict[str, Any] = {"description": "", "model_by_data": {}, "weight_format": "int8", "compare": [],
                            "target_fraction": 0.9, "defences": {"robust": {"name": "none"}, "screening": None},
                            "profiles": {}, "eval_threads": 2, "round_timeout_s": 600.0}


METRICS = (("global", "accuracy"), ("local", "local_accuracy"), ("cv", "cv_usage"), ("cv_assigned", "cv_assigned"),
           ("mib", "mib_per_device_round"), ("plan_mib", "planned_peak_mib"))
"""(name, cell field) of the figures given with a CI and tested pairwise: global and local
accuracy, the expert-usage CV (FLEX-MoE eq. 8), the CV of the assigned data volume, MiB on
the wire per device-round and the devices' planned peak memory (MiB)."""


class ConfigError(ValueError):
    """A harness config that cannot run, with the reason."""


def set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    """``d["a"]["b"] = value`` for ``key`` ``"a.b"`` (intermediate dicts created)."""
    *path, last = key.split(".")
    for k in path:
        d = d.setdefault(k, {})
    d[last] = value


def load_config(path: str | Path, profile: str = "full") -> dict[str, Any]:
    """The config at ``path`` with its defaults and the ``profile``'s overrides applied.

    Raises:
        ConfigError: a required key missing, an unknown profile (other than ``full``), a
            method without ``strategy`` or with an ``update`` encoding that cannot be built, a
            compared method that is not defined, an unknown ``state_precision``, a grid axis
            other than data/partition/devices,
            an unknown data source, or budgets that are neither ``experts: [lo, hi]`` nor
            ``cycle: [...]``.
    """
    import yaml

    raw = yaml.safe_load(Path(path).read_text())
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a YAML mapping expected")
    cfg = {**copy.deepcopy(DEFAULTS), **raw}
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ConfigError(f"{path}: missing {', '.join(missing)}")
    if profile != "full" and profile not in cfg["profiles"]:
        raise ConfigError(f"{path}: no profile {profile!r} (has: {', '.join(cfg['profiles']) or 'none'})")
    for key, value in (cfg["profiles"].get(profile) or {}).items():
        set_dotted(cfg, key, value)
    problems = [f"method {m!r} has no strategy" for m, v in cfg["methods"].items() if "strategy" not in v]
    problems += [f"compare: {a!r} or {b!r} is not a method" for a, b in cfg["compare"]
                 if a not in cfg["methods"] or b not in cfg["methods"]]
    problems += [f"grid: unknown axis {k!r} (data, partition, devices)" for k in cfg["grid"]
                 if k not in ("data", "partition", "devices")]
    problems += [f"grid.data: unknown source {d!r} ({', '.join(cells.DATA_SOURCES)})"
                 for d in cfg["grid"].get("data", []) if d not in cells.DATA_SOURCES]
    problems += [f"method {m!r}: update {v['update']!r}: {e}" for m, v in cfg["methods"].items()
                 if (e := _update_problem(v.get("update")))]
    problems += [f"method {m!r}: {k} {v[k]!r} is not one of {', '.join(WEIGHT_FORMATS)}"
                 for m, v in cfg["methods"].items() for k in ("state_precision", "weight_format")
                 if v.get(k, "fp32") not in WEIGHT_FORMATS]
    b = cfg["budgets"]
    if not (isinstance(b, dict) and (len(b.get("experts", ())) == 2 or b.get("cycle"))):
        problems.append("budgets: {experts: [lo, hi]} or {cycle: [k, ...]} expected")
    if problems:
        raise ConfigError(f"{path}: " + "; ".join(problems))
    return cfg


def _update_problem(update: Any) -> str | None:
    """Why a method's ``update`` (``edge_sdk.filters.UpdateEncoding`` arguments) cannot be
    built, or None (also for no ``update``)."""
    if update is None:
        return None
    if not isinstance(update, dict):
        return "a mapping of UpdateEncoding arguments expected"
    from edge_sdk.filters import UpdateEncoding

    try:
        UpdateEncoding(**update)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def settings_of(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Setting name -> ``{"data", "partition", "devices"}``: the product of the grid axes
    (defaults: bbc, IID, 6 devices)."""
    g = cfg["grid"]
    parts = g.get("partition") or {"IID": "iid"}
    out = {}
    for data, (pname, scheme), n in itertools.product(g.get("data") or ["bbc"], parts.items(), g.get("devices") or [6]):
        out[f"{data} {pname} {n}"] = {"data": data, "partition": scheme, "devices": int(n)}
    return out


def _per_data(value: Any, data: str) -> Any:
    return value.get(data, value.get("default")) if isinstance(value, dict) else value


def spec_for(cfg: dict[str, Any], data: str, seed: int):
    """The ``ModelSpec`` of a data source's cells (``model`` updated by ``model_by_data``)."""
    from protocol.messages import ModelSpec

    return ModelSpec(**{**cfg["model"], **cfg["model_by_data"].get(data, {}), "seed": seed})


def budgets_for(cfg: dict[str, Any], spec, labels: int, devices: int, seed: int, weight_format: str) -> list[int]:
    """Each device's budget (bytes, model only; ``moe_model.budget.estimate`` at the
    training batch size): ``experts: [lo, hi]``: a seeded uniform draw between the plans of
    lo and hi experts per layer; ``cycle: [k, ...]``: device i gets the plan of
    ``k[i % len]`` experts plus 1 byte."""
    from moe_model.budget import estimate

    batch = cfg["train"].get("batch_size", 8)
    plan = lambda k: estimate(spec, int(k), batch, labels, runtime_bytes=0, weight_format=weight_format).total  # noqa
    b = cfg["budgets"]
    if b.get("cycle"):
        return [plan(b["cycle"][i % len(b["cycle"])]) + 1 for i in range(devices)]
    lo, hi = (plan(k) for k in b["experts"])
    rng = random.Random(f"harness/{cfg['name']}/{seed}")
    return [rng.randint(lo, hi) for _ in range(devices)]


def run_cell(cfg: dict[str, Any], setting: dict[str, Any], method: dict[str, Any], seed: int, out: Path,
             url: str) -> dict[str, Any]:
    """One federation of the grid (:func:`cells.federate`); returns its report."""
    from fedmoe.partition import partition

    data = setting["data"]
    train, test, labels = cells.load_data(data, seed, cfg["samples"], cfg["eval_samples"])
    parts = partition([cells.label_id(y, labels) for _, y in train], setting["devices"], setting["partition"], seed)
    spec = spec_for(cfg, data, seed)
    fmt_ = _per_data(cfg["weight_format"], data)
    return cells.federate(
        out, url, spec=spec, task=data, labels=labels, test=test,
        device_data=[[train[j] for j in part] for part in parts],
        budgets=budgets_for(cfg, spec, len(labels), setting["devices"], seed, fmt_), method=method,
        train=cfg["train"], rounds=cfg["rounds"], weight_format=method.get("weight_format", fmt_),
        eval_samples=cfg["eval_samples"], seed=seed,
        defences=cfg["defences"], eval_threads_n=cfg["eval_threads"], round_timeout_s=cfg["round_timeout_s"],
        config={"setting": setting})


def aggregate(cfg: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting: statistics over seeds and the paired tests of ``compare``."""
    return compare_methods(rows, cfg["seeds"], cfg["rounds"], target_methods=list(cfg["methods"]),
                           target_fraction=cfg["target_fraction"],
                           pairs_of=lambda s: [tuple(p) for p in cfg["compare"]], metrics=METRICS,
                           extra=("experts_held_mean", "devices_trained"))


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> str:
    """``mean(a) / mean(b)`` of two :func:`common.mean_ci` results (– without both)."""
    return "–" if a["mean"] is None or not b["mean"] else f"{a['mean'] / b['mean']:.2f}"


def markdown(result: dict[str, Any]) -> str:
    cfg, stats = result["config"], result["stats"]
    lines = [f"# {cfg['name']} ({result['profile']} profile)", "", cfg["description"], "",
             cells.measured(result),
             f"Config: `{result['config_path']}`; seeds {cfg['seeds']}, {cfg['rounds']} rounds, training "
             f"{cfg['train']}, budgets {cfg['budgets']}. {cells.cells_done(result)}", "",
             "*global*: the method's model on the held-out test split after the last round; *local*: mean over "
             "devices of their latest validation accuracy. Mean ± std over seeds [95% Student-t CI]. *rounds*: to "
             f"{cfg['target_fraction']:.0%} of the best method's mean final accuracy (not reached: "
             f"{cfg['rounds'] + 1}). *MiB/dev-round*: up + down per device and round. *plan MiB*: the devices' "
             "memory plans (peak bytes), mean per device-round. *CV usage*: CV of the tokens routed to each expert "
             "(FLEX-MoE eq. 8), *CV assigned*: of the data volume assigned to each expert (sum of the holders' "
             "samples), both cumulative over the rounds, last round. \"better\"/\"worse\" only where the paired "
             "difference is significant; for the CVs, lower is better.", ""]
    for setting, st in stats.items():
        lines += [f"## {setting} (target {fmt(st['target'])})", "",
                  "| Method | global acc | local acc | rounds | experts held | MiB/dev-round | plan MiB | CV usage | "
                  "CV assigned | devices trained |", "|---|---|---|---|---|---|---|---|---|---|"]
        for m, s in st["methods"].items():
            lines.append(f"| {m} | {ci_text(s['global'])} | {ci_text(s['local'])} | "
                         f"{ci_text(s['rounds_to_target'], '.1f')} | {fmt(s['experts_held_mean'], '.1f')} | "
                         f"{ci_text(s['mib'], '.2f')} | {ci_text(s['plan_mib'], '.0f')} | "
                         f"{ci_text(s['cv'], '.2f')} | {ci_text(s['cv_assigned'], '.2f')} | "
                         f"{fmt(s['devices_trained'], '.0f')} |")
        if st["tests"]:
            lines += ["", "| a − b | Δ global [95% CI], p | | Δ local [95% CI], p | | Δ CV usage [95% CI], p | | "
                      "CV usage a / b | Δ MiB/dev-round [95% CI], p |", "|---|---|---|---|---|---|---|---|---|"]
            lines += [f"| {t['a']} − {t['b']} | {diff_text(t['global'])} | {verdict(t['global'])} | "
                      f"{diff_text(t['local'])} | {verdict(t['local'])} | {diff_text(t['cv'])} | "
                      f"{verdict(t['cv'], higher_is_better=False)} | "
                      f"{_ratio(st['methods'][t['a']]['cv'], st['methods'][t['b']]['cv'])} | "
                      f"{diff_text(t['mib'], '+.2f')} |"
                      for t in st["tests"]]
        lines.append("")
    problems = [f"- s{c['seed']} {c['setting']} / {c['method']}: {p}" for c in result["cells"]
                for p in c["sanity"]["problems"]]
    lines += ["## Per-round sanity", "", *(problems or ["- Every round of every cell closed `ok`; no device was "
                                                          "excluded or failed."]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = cells.parser(__doc__.split("\n\n")[0], "the config's quick profile", ROOT / "runs",
                      ROOT / "results" / "evidence")
    ap.add_argument("config", help="a YAML config (benchmarks/configs/)")
    args = ap.parse_args(argv)
    profile = "quick" if args.quick else "full"
    try:
        cfg = load_config(args.config, profile)
    except (ConfigError, OSError) as e:
        ap.error(str(e))
    _, cfg = cells.profile_of(args, {profile: cfg}, ap.error)  # --set/--seeds on top of the applied profile
    settings = settings_of(cfg)
    chosen = args.settings.split(",") if args.settings else list(settings)
    unknown = [s for s in chosen if s not in settings]
    if unknown:
        ap.error(f"--settings: unknown {unknown}; the grid has {list(settings)}")
    wanted = set(args.methods.split(",")) if args.methods else None
    base = Path(args.runs) / cfg["name"] / profile
    todo = [(seed, s, name, method) for s in chosen for seed in cfg["seeds"] for name, method in cfg["methods"].items()
            if not wanted or name in wanted]

    def run(seed: int, setting: str, method: dict[str, Any], out: Path, url: str) -> dict[str, Any]:
        return run_cell(cfg, settings[setting], method, seed, out, url)

    rows, missing = cells.run_cells(todo, base, args, run, cells.summarise)
    result = {**cells.header(args, profile, cfg, rows, missing), "config": cfg, "config_path": str(args.config),
              "stats": aggregate(cfg, rows), "cells": rows}
    stem = cfg["name"] + ("" if profile == "full" else "_quick")
    print(cells.write(args.results, stem, result, markdown,
                      lambda r, path: cells.plot(r, path, list(cfg["methods"]))))
    return 0 if not missing or args.collect else 1


if __name__ == "__main__":
    sys.exit(main())
