"""The experiment harness: every method-comparison table is a YAML config
(``benchmarks/configs/*.yaml``), run cell by cell through the production code, over
several seeds, with confidence intervals, paired tests and the Holm-Bonferroni correction;
one aggregation (:func:`benchmarks.common.compare_methods`), one markdown skeleton and one
set of plots (:mod:`benchmarks.tables`) for all of them.

    python -m benchmarks.harness benchmarks/configs/<table>.yaml [--quick] [--lock FILE]
    python -m benchmarks.harness --render results/<table>.json   # markdown + PNG again from a committed JSON

Most configs describe a grid of in-process federations (below). A table whose cells are
something else names a module with ``table: <module>`` (``benchmarks/<module>.py``): it
overrides the hooks it needs (``REQUIRED``, ``DEFAULTS``, ``check``, ``settings_of``,
``run_cell``, ``summarise``, ``METRICS``, ``EXTRA``, ``LAYOUT`` or ``markdown``, ``plot``,
``PROFILE_KEYS``, ``result_fields``, ``STATS``) and keeps the rest of this module's.
``fusion_table``, ``fedalign_table`` and ``fedmoe_table`` are such modules (their
``python -m benchmarks.<table>`` commands still work and run this harness on
``benchmarks/configs/<table>.yaml``), and ``causal_lm_table`` (the grid as a causal LM on a
Branch-Train-MiX build's domains, perplexity the headline). Keys every config may have: ``ablations`` (methods
run only in ``ablation_setting``, each tested against ``ablations_against``), ``only``
(method -> the settings it runs in), ``cell_order`` (``setting``: a setting at a time;
``seed``: a seed at a time), ``results`` (the results folder, default ``results/evidence``).

A config names the model, the data, a grid of settings, the devices' budgets, the
training, the rounds, the methods (strategy × assignment × aggregation × training
options), the pairs to test and the seeds, plus profiles (``quick``, ``full``) that
override any of these by dotted key::

    name: example                    # <results>/<name>{,_quick}.{json,md,png}
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
      Ranks 8-2: {strategy: composed, assignment: full, min_lora_rank: 2}   # heterogeneous LoRA ranks
      Rank 2: {strategy: composed, assignment: full, lora_rank: 2}          # every device at rank 2 (budgets
                                                                            # stay those of the model's rank)
      FlexLoRA: {strategy: composed, assignment: full, min_lora_rank: 2, lora: {train_a: true},
                 aggregation: flexlora}  # model.lora fields for this method (budgets: the config's model's)
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
difference excludes 0; each setting's line "Holm-Bonferroni ..." says which differences in
global accuracy survive the correction for the setting's number of tests. Peak memory is
not a column: the devices share one process here (``benchmarks/memory.py`` measures it per
process).

``--render RESULT_JSON`` recomputes the statistics from the JSON's cells (a warning names
any setting where they differ from the recorded ones), rewrites the JSON (with each test's
Holm-adjusted p) and writes its markdown and PNG again beside it; nothing is run.

    python -m benchmarks.harness benchmarks/configs/fedmoe_experts.yaml --quick --lock /tmp/fedmoe-heavy.lock
"""

from __future__ import annotations

import copy
import importlib
import itertools
import json
import logging
import math
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks import cells, tables
from benchmarks.common import ROOT, ci_text, compare_methods, diff_text, fmt, rel, verdict, write_result
from protocol.codec import WEIGHT_FORMATS

log = logging.getLogger("harness")

BASE_DEFAULTS: dict[str, Any] = {"description": "", "compare": [], "target_fraction": 0.9, "profiles": {},
                                 "ablations": {}, "ablation_setting": None, "ablations_against": None, "only": {},
                                 "cell_order": "setting", "results": "results/evidence"}
"""Keys every config may leave out (any table)."""

REQUIRED = ("name", "model", "grid", "samples", "eval_samples", "budgets", "train", "rounds", "seeds", "methods")
DEFAULTS: dict[str, Any] = {"model_by_data": {}, "weight_format": "int8",
                            "defences": {"robust": {"name": "none"}, "screening": None},
                            "eval_threads": 2, "round_timeout_s": 600.0}
"""The grid table's required keys and defaults (a ``table:`` module has its own)."""

METRICS = (("global", "accuracy"), ("local", "local_accuracy"), ("cv", "cv_usage"), ("cv_assigned", "cv_assigned"),
           ("mib", "mib_per_device_round"), ("plan_mib", "planned_peak_mib"))
"""(name, cell field) of the figures given with a CI and tested pairwise: global and local
accuracy, the expert-usage CV (FLEX-MoE eq. 8), the CV of the assigned data volume, MiB on
the wire per device-round and the devices' planned peak memory (MiB)."""
EXTRA = ("experts_held_mean", "devices_trained")
"""Cell fields reported as their mean over seeds."""
PROFILE_KEYS: tuple[str, ...] | None = None
"""The config keys a result records as its ``profile_config`` (None: the whole config)."""
STATS = True
"""Whether the table has statistics over seeds (``stats``)."""
summarise = cells.summarise


class ConfigError(ValueError):
    """A harness config that cannot run, with the reason."""


def set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    """``d["a"]["b"] = value`` for ``key`` ``"a.b"`` (intermediate dicts created)."""
    *path, last = key.split(".")
    for k in path:
        d = d.setdefault(k, {})
    d[last] = value


def table_of(cfg: dict[str, Any]) -> ModuleType:
    """The module of a config's ``table`` (``benchmarks.<table>``), or this module (the grid).

    Raises:
        ConfigError: no such module under ``benchmarks/``.
    """
    name = cfg.get("table")
    if not name:
        return sys.modules[__name__]
    try:
        return importlib.import_module(f"benchmarks.{name}")
    except ModuleNotFoundError as e:
        raise ConfigError(f"table {name!r}: no module benchmarks.{name} ({e})") from None


def hook(table: ModuleType, name: str) -> Any:
    """A table module's ``name``, or the grid table's (this module's) where it has none."""
    return getattr(table, name) if hasattr(table, name) else globals()[name]


def complete(raw: dict[str, Any]) -> dict[str, Any]:
    """A config with the defaults of every table and of its own table filled in."""
    return {**copy.deepcopy(BASE_DEFAULTS), **copy.deepcopy(hook(table_of(raw), "DEFAULTS")), **raw}


def load_config(path: str | Path, profile: str = "full") -> dict[str, Any]:
    """The config at ``path`` with its defaults and the ``profile``'s overrides applied.

    Raises:
        ConfigError: a required key missing, an unknown profile (other than ``full``) or
            ``table``, a compared or ablated method that is not defined, an unknown
            ``cell_order``, or what the table's ``check`` finds (the grid: a method without
            ``strategy`` or with an ``update`` encoding that cannot be built, an unknown
            ``state_precision``, a grid axis other than data/partition/devices, an unknown
            data source, or budgets that are neither ``experts: [lo, hi]`` nor ``cycle: [...]``).
    """
    import yaml

    raw = yaml.safe_load(Path(path).read_text())
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a YAML mapping expected")
    cfg = complete(raw)
    table = table_of(cfg)
    missing = [k for k in hook(table, "REQUIRED") if k not in cfg]
    if missing:
        raise ConfigError(f"{path}: missing {', '.join(missing)}")
    if profile != "full" and profile not in cfg["profiles"]:
        raise ConfigError(f"{path}: no profile {profile!r} (has: {', '.join(cfg['profiles']) or 'none'})")
    for key, value in (cfg["profiles"].get(profile) or {}).items():
        set_dotted(cfg, key, value)
    known = {**cfg["methods"], **cfg["ablations"]}
    problems = [f"compare: {a!r} or {b!r} is not a method" for a, b in cfg["compare"] if a not in known or b not in known]
    if cfg["ablations"] and cfg["ablations_against"] not in cfg["methods"]:
        problems.append(f"ablations_against: {cfg['ablations_against']!r} is not a method")
    if cfg["cell_order"] not in ("setting", "seed"):
        problems.append(f"cell_order: {cfg['cell_order']!r} (setting or seed)")
    problems += hook(table, "check")(cfg)
    if problems:
        raise ConfigError(f"{path}: " + "; ".join(problems))
    return cfg


def check(cfg: dict[str, Any]) -> list[str]:
    """The grid table's problems with a config (see :func:`load_config`)."""
    problems = [f"method {m!r} has no strategy" for m, v in cfg["methods"].items() if "strategy" not in v]
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
    return problems


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


def settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config's settings, name -> what its table's ``run_cell`` gets (the table's ``settings_of``)."""
    return hook(table_of(cfg), "settings_of")(cfg)


def methods_for(cfg: dict[str, Any], setting: str, ablations: bool = True) -> dict[str, dict[str, Any]]:
    """The methods run in ``setting``: those whose ``only`` list (if any) names it, and the
    ablations in the ablation setting (unless ``ablations`` is False)."""
    main = {m: v for m, v in cfg["methods"].items() if setting in cfg["only"].get(m, [setting])}
    return {**main, **(cfg["ablations"] if ablations and setting == cfg["ablation_setting"] else {})}


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
    ``k[i % len]`` experts plus 1 byte, where ``k`` may be ``"k@r"``: k experts per layer at
    LoRA rank r (a budget below one expert at the model's rank: docs/ranks.md)."""
    from moe_model.budget import estimate
    from moe_model.ranks import spec_at_rank

    batch = cfg["train"].get("batch_size", 8)

    def plan(k: int | str) -> int:
        experts, _, rank = str(k).partition("@")
        at = spec_at_rank(spec, int(rank)) if rank else spec
        return estimate(at, int(experts), batch, labels, runtime_bytes=0, weight_format=weight_format).total

    b = cfg["budgets"]
    if b.get("cycle"):
        return [plan(b["cycle"][i % len(b["cycle"])]) + 1 for i in range(devices)]
    lo, hi = (plan(k) for k in b["experts"])
    rng = random.Random(f"harness/{cfg['name']}/{seed}")
    return [rng.randint(lo, hi) for _ in range(devices)]


def run_cell(cfg: dict[str, Any], setting: dict[str, Any], method: dict[str, Any], seed: int, out: Path,
             url: str) -> dict[str, Any]:
    """One federation of the grid (:func:`cells.federate`); returns its report. A method's
    ``lora`` (``LoraSpec`` fields, e.g. ``train_a``) changes the model's LoRA for it, and its
    ``lora_rank`` trains the whole federation at that rank (the LoRA scaling kept,
    ``moe_model.ranks.spec_at_rank``); the budgets stay those of the config's model."""
    from fedmoe.partition import partition
    from moe_model.ranks import spec_at_rank
    from protocol.messages import LoraSpec

    data = setting["data"]
    train, test, labels = cells.load_data(data, seed, cfg["samples"], cfg["eval_samples"])
    parts = partition([cells.label_id(y, labels) for _, y in train], setting["devices"], setting["partition"], seed)
    spec = spec_for(cfg, data, seed)
    fmt_ = _per_data(cfg["weight_format"], data)
    model = spec
    if "lora" in method:
        model = spec.model_copy(update={"lora": LoraSpec.model_validate({**spec.lora.model_dump(), **method["lora"]})})
    if "lora_rank" in method:
        model = spec_at_rank(model, method["lora_rank"])
    return cells.federate(
        out, url, spec=model, task=data,
        labels=labels, test=test, device_data=[[train[j] for j in part] for part in parts],
        budgets=budgets_for(cfg, spec, len(labels), setting["devices"], seed, fmt_), method=method,
        train=cfg["train"], rounds=cfg["rounds"], weight_format=method.get("weight_format", fmt_),
        eval_samples=cfg["eval_samples"], seed=seed,
        defences=cfg["defences"], eval_threads_n=cfg["eval_threads"], round_timeout_s=cfg["round_timeout_s"],
        config={"setting": setting})


def result_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """More fields of a table's result JSON (the grid: none)."""
    return {}


def aggregate(cfg: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting: statistics over seeds, the target (from the config's ``methods``, not
    its ablations) and the paired tests of ``compare`` (plus each ablation against
    ``ablations_against`` in the ablation setting), with the table's metrics and extras."""
    table = table_of(cfg)
    pairs = [tuple(p) for p in cfg["compare"]]
    ablated = [(a, cfg["ablations_against"]) for a in cfg["ablations"]]
    return compare_methods(rows, cfg["seeds"], cfg["rounds"], target_methods=list(cfg["methods"]),
                           target_fraction=cfg["target_fraction"],
                           pairs_of=lambda s: pairs + (ablated if s == cfg["ablation_setting"] else []),
                           metrics=hook(table, "METRICS"), extra=hook(table, "EXTRA"))


# --------------------------------------------------------------------------- the grid table's markdown and plot


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> str:
    """``mean(a) / mean(b)`` of two :func:`common.mean_ci` results (– without both)."""
    return "–" if a["mean"] is None or not b["mean"] else f"{a['mean'] / b['mean']:.2f}"


def _head(result: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    return [f"# {cfg['name']} ({result['profile']} profile)", "", cfg["description"], "",
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


LAYOUT = tables.Layout(
    head=_head,
    columns=[("Method", lambda m, s, st: m), ("global acc", lambda m, s, st: ci_text(s["global"])),
             ("local acc", lambda m, s, st: ci_text(s["local"])),
             ("rounds", lambda m, s, st: ci_text(s["rounds_to_target"], ".1f")),
             ("experts held", lambda m, s, st: fmt(s["experts_held_mean"], ".1f")),
             ("MiB/dev-round", lambda m, s, st: ci_text(s["mib"], ".2f")),
             ("plan MiB", lambda m, s, st: ci_text(s["plan_mib"], ".0f")),
             ("CV usage", lambda m, s, st: ci_text(s["cv"], ".2f")),
             ("CV assigned", lambda m, s, st: ci_text(s["cv_assigned"], ".2f")),
             ("devices trained", lambda m, s, st: fmt(s["devices_trained"], ".0f"))],
    test_header="| a − b | Δ global [95% CI], p | | Δ local [95% CI], p | | Δ CV usage [95% CI], p | | "
                "CV usage a / b | Δ MiB/dev-round [95% CI], p |",
    test_columns=[lambda t, st: f"{diff_text(t['global'])} | {verdict(t['global'])}",
                  lambda t, st: f"{diff_text(t['local'])} | {verdict(t['local'])}",
                  lambda t, st: f"{diff_text(t['cv'])} | {verdict(t['cv'], higher_is_better=False)}",
                  lambda t, st: _ratio(st["methods"][t["a"]]["cv"], st["methods"][t["b"]]["cv"]),
                  lambda t, st: diff_text(t["mib"], "+.2f")],
    all_ok="- Every round of every cell closed `ok`; no device was excluded or failed.",
    tests_when_none=False)
"""The grid table's markdown."""


def markdown(result: dict[str, Any], cfg: dict[str, Any] | None = None) -> str:
    """A table's markdown (its ``markdown`` hook, else :mod:`tables` with its ``LAYOUT``);
    ``cfg`` defaults to the result's ``config``."""
    cfg = complete(result["config"]) if cfg is None else cfg
    table = table_of(cfg)
    if hasattr(table, "markdown") and table is not sys.modules[__name__]:
        return table.markdown(result, cfg)
    return tables.markdown(result, cfg, hook(table, "LAYOUT"))


def plot(result: dict[str, Any], path: Path, cfg: dict[str, Any]) -> None:
    """The grid table's plot (:func:`tables.plot`, the config's methods in legend order)."""
    tables.plot(result, path, list(cfg["methods"]))


# --------------------------------------------------------------------------- running and rendering


def profile_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """What a result records as its profile: the table's ``PROFILE_KEYS`` of the config, or all of it."""
    keys = hook(table_of(cfg), "PROFILE_KEYS")
    return cfg if keys is None else {k: cfg[k] for k in keys}


def _outputs(cfg: dict[str, Any]):
    table = table_of(cfg)
    return (lambda r: markdown(r, cfg)), (lambda r, path: hook(table, "plot")(r, path, cfg))


def config_of(result: dict[str, Any], path: Path, config: str | None = None) -> dict[str, Any]:
    """The config a result JSON was made with: ``config`` (a YAML path) if given, else the
    result's own ``config``, else ``benchmarks/configs/<stem without _quick>.yaml`` with
    the result's recorded profile on top.

    Raises:
        ConfigError: none of these exists.
    """
    if config is None and "config" in result:
        return complete(result["config"])
    yaml_path = Path(config) if config else ROOT / "benchmarks" / "configs" / f"{path.stem.removesuffix('_quick')}.yaml"
    if not yaml_path.exists():
        raise ConfigError(f"{path}: no config recorded and no {rel(yaml_path)}")
    cfg = load_config(yaml_path, result.get("profile", "full"))
    if hook(table_of(cfg), "PROFILE_KEYS") is not None:
        cfg.update(result["profile_config"])
    return cfg


def _differs(a: Any, b: Any, where: str = "") -> str | None:
    """Where two statistics trees differ (floats to 1e-9 relative; ``p_holm`` ignored), or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in (set(a) | set(b)) - {"p_holm"}:
            if (d := _differs(a.get(k), b.get(k), f"{where}/{k}")):
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _differs(x, y, f"{where}[{i}]"))), None)
    if isinstance(a, float) and isinstance(b, float):
        return None if math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) else f"{where}: {a} vs {b}"
    return None if a == b else f"{where}: {a!r} vs {b!r}"


def render(path: str | Path, config: str | None = None) -> str:
    """Recompute a result JSON's statistics from its cells, rewrite it (Holm-adjusted p
    added, machine paths relative) and write its markdown and plot beside it; returns the
    markdown. A warning names where the recomputed statistics differ from the recorded ones."""
    path = Path(path)
    result = json.loads(path.read_text())
    cfg = config_of(result, path, config)
    if "stats" in result and hook(table_of(cfg), "STATS"):
        stats = aggregate(cfg, result["cells"])
        if (d := _differs(result["stats"], stats)):
            log.warning("%s: the recomputed statistics differ from the recorded ones at %s", path, d)
        result["stats"] = stats
    for c in result["cells"]:
        for key in ("dir", "reused_from"):
            if isinstance(c.get(key), str) and c[key].startswith("/"):
                c[key] = machine_free(c[key])
    md, plot_ = _outputs(cfg)
    return write_result(path.parent, path.stem, result, md, plot_ if result["cells"] else None)


def machine_free(path: str) -> str:
    """An absolute path recorded on another machine, from its ``runs/`` or ``results/`` on
    (the checkout's layout), else its file name."""
    for top in ("runs", "results"):
        if f"/{top}/" in path:
            return top + "/" + path.split(f"/{top}/", 1)[1]
    return Path(path).name


def main(argv: list[str] | None = None) -> int:
    ap = cells.parser(__doc__.split("\n\n")[0], "the config's quick profile", ROOT / "runs", None)
    ap.add_argument("config", nargs="?", help="a YAML config (benchmarks/configs/)")
    ap.add_argument("--render", metavar="RESULT_JSON",
                    help="write the markdown and PNG of a committed result again from its JSON (its statistics "
                         "recomputed from its cells; with CONFIG, that config instead of the recorded one)")
    args = ap.parse_args(argv)
    if args.render:
        try:
            print(render(args.render, args.config))
        except (ConfigError, OSError, KeyError) as e:
            ap.error(f"--render {args.render}: {e}")
        return 0
    if not args.config:
        ap.error("a config (benchmarks/configs/<table>.yaml) or --render RESULT_JSON is needed")
    profile = "quick" if args.quick else "full"
    try:
        cfg = load_config(args.config, profile)
    except (ConfigError, OSError) as e:
        ap.error(str(e))
    _, cfg = cells.profile_of(args, {profile: cfg}, ap.error)  # --set/--seeds on top of the applied profile
    table = table_of(cfg)
    settings_ = settings(cfg)
    chosen = args.settings.split(",") if args.settings else list(settings_)
    unknown = [s for s in chosen if s not in settings_]
    if unknown:
        ap.error(f"--settings: unknown {unknown}; the config has {list(settings_)}")
    wanted = set(args.methods.split(",")) if args.methods else None
    base = Path(args.runs) / cfg["name"] / profile
    order = ((s, seed) for s in chosen for seed in cfg["seeds"]) if cfg["cell_order"] == "setting" else \
        ((s, seed) for seed in cfg["seeds"] for s in chosen)
    todo = [(seed, s, name, method) for s, seed in order
            for name, method in methods_for(cfg, s, not args.no_ablations).items() if not wanted or name in wanted]
    run_cell_ = hook(table, "run_cell")

    def run(seed: int, setting: str, method: dict[str, Any], out: Path, url: str) -> dict[str, Any]:
        return run_cell_(cfg, settings_[setting], method, seed, out, url)

    rows, missing = cells.run_cells(todo, base, args, run, hook(table, "summarise"))
    result = {**cells.header(args, profile, profile_config(cfg), rows, missing), **hook(table, "result_fields")(cfg),
              "config": cfg, "config_path": rel(args.config),
              **({"stats": aggregate(cfg, rows)} if hook(table, "STATS") else {}), "cells": rows}
    stem = cfg["name"] + ("" if profile == "full" else "_quick")
    md, plot_ = _outputs(cfg)
    print(cells.write(args.results or str(ROOT / cfg["results"]), stem, result, md, plot_))
    return 0 if not missing or args.collect else 1


if __name__ == "__main__":
    sys.exit(main())
