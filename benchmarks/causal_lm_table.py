"""The harness's causal-LM table (``table: causal_lm_table``): the grid of in-process
federations of :mod:`benchmarks.harness`, on a Branch-Train-MiX checkpoint's domains
(``fedmoe upcycle --method btx``, docs/btx.md) with next-token prediction, so that each
device's private text comes from one or a few of the domains the experts were trained on.

What differs from the grid table:

- **Data** (:func:`fedmoe.btx_domains.domain_items`): the checkpoint's own domains (its ``btx.json``: BBC News
  categories, tweets, Python source), split as the build split them (the held-out documents,
  never trained on by the build, are the test set; their ids are checked against the
  record). Documents are cut into ``chunk_chars``-character pieces (at most
  ``chunks_per_document`` per document, so a domain of long files is many files); each item
  is ``(text, domain)``, the domain serving as the label the ``classes:K`` partition deals
  out (``classes:1``: every device holds one domain). ``samples`` training and
  ``eval_samples`` test items, the same number from every domain, drawn by the seed.
- **Model**: ``model.base`` is the checkpoint directory; the experts and top-k are the
  checkpoint's (``moe_model.models.hf_moe.checkpoint_model``), ``objective: causal-lm``.
- **Figures**: held-out perplexity of the global MoE (exp of the mean next-token
  cross-entropy in nats, lower is better; its Holm-Bonferroni line is the headline), the
  next-token accuracy of the global MoE (*global*) and the devices' own sub-MoEs on their
  validation split (*local*, the only local figure a device reports), experts held, MiB
  per device-round, planned peak MiB, the usage CV.

    python -m benchmarks.harness benchmarks/configs/fedmoe_btx_llm.yaml --lock /tmp/fedmoe-heavy.lock
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import cells, harness, tables
from benchmarks.common import ci_text, diff_text, fmt, verdict
from fedmoe import btx_domains

REQUIRED = harness.REQUIRED
DEFAULTS: dict[str, Any] = {**harness.DEFAULTS, "chunk_chars": 600, "chunks_per_document": 4}
"""The grid's defaults plus the data's chunking (characters per item, items per document)."""
METRICS = (("ppl", "perplexity"), ("global", "accuracy"), ("local", "local_accuracy"), ("cv", "cv_usage"),
           ("mib", "mib_per_device_round"), ("plan_mib", "planned_peak_mib"))
"""(name, cell field) of the tested figures: held-out perplexity first (the headline)."""
EXTRA = ("experts_held_mean", "devices_trained", "initial_perplexity")


def check(cfg: dict[str, Any]) -> list[str]:
    """The grid's checks, with ``domains`` the only data source and ``model.objective`` causal-lm."""
    problems = harness.check({**cfg, "grid": {k: v for k, v in cfg["grid"].items() if k != "data"}})
    problems += [f"grid.data: {d!r} (this table's one data source is 'domains')"
                 for d in cfg["grid"].get("data", ["domains"]) if d != "domains"]
    if cfg["model"].get("objective") != "causal-lm":
        problems.append("model.objective must be causal-lm")
    if not cfg["model"].get("base"):
        problems.append("model.base: the BTX checkpoint directory (fedmoe upcycle --method btx --out DIR)")
    return problems


def settings_of(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The grid's settings, data ``domains``."""
    return harness.settings_of({**cfg, "grid": {**cfg["grid"], "data": ["domains"]}})


def run_cell(cfg: dict[str, Any], setting: dict[str, Any], method: dict[str, Any], seed: int, out: Path,
             url: str) -> dict[str, Any]:
    """One federation (:func:`cells.federate`) on the checkpoint's domains; returns its report."""
    from fedmoe.partition import partition
    from moe_model.models.hf_moe import checkpoint_model
    from protocol.messages import ModelSpec

    base = cfg["model"]["base"]
    train, test, domains = btx_domains.domain_items(base, seed, cfg["samples"], cfg["eval_samples"],
                                                    cfg["chunk_chars"], cfg["chunks_per_document"])
    parts = partition([domains.index(y) for _, y in train], setting["devices"], setting["partition"], seed)
    spec = ModelSpec(**{**checkpoint_model(base), **{k: v for k, v in cfg["model"].items() if k != "base"},
                        "seed": seed})
    fmt_ = cfg["weight_format"]
    return cells.federate(
        out, url, spec=spec, task="domains", labels=domains, test=test,
        device_data=[[train[j] for j in part] for part in parts],
        budgets=harness.budgets_for(cfg, spec, len(domains), setting["devices"], seed, fmt_), method=method,
        train=cfg["train"], rounds=cfg["rounds"], weight_format=method.get("weight_format", fmt_),
        eval_samples=len(test), seed=seed, defences=cfg["defences"], eval_threads_n=cfg["eval_threads"],
        round_timeout_s=cfg["round_timeout_s"], config={"setting": setting})


def own_domain_slots(report: dict[str, Any]) -> tuple[int, int]:
    """(slots holding an expert of the device's own domains, all slots) over the device-rounds
    from round 2 on of devices that hold fewer than every expert of a layer (expert i of a BTX
    build was trained on domain i, the task's label i)."""
    domains = report["config"]["aggregator"]["tasks"]["domains"]["labels"]
    experts = report["config"]["aggregator"]["model"]["num_experts"]
    own_of = {d["device_id"]: {domains.index(x) for x in d["labels"]} for d in report["config"]["devices"]}
    own = total = 0
    for r in report["rounds"][1:]:
        for dev, v in r["devices"].items():
            held = v.get("experts") or {}
            if not held or max(len(e) for e in held.values()) >= experts:
                continue
            slots = [int(e) for es in held.values() for e in es]
            own += sum(e in own_of.get(dev, ()) for e in slots)
            total += len(slots)
    return own, total


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """:func:`cells.summarise`'s row plus ``perplexity`` (global MoE, last round),
    ``initial_perplexity``, ``perplexity_per_round`` and ``own_domain_slots``
    (:func:`own_domain_slots`)."""
    row = cells.summarise(report)
    rounds = report["rounds"]
    row["perplexity"] = rounds[-1].get("perplexity") if rounds else None
    row["initial_perplexity"] = report.get("initial_perplexity")
    row["perplexity_per_round"] = [r.get("perplexity") for r in rounds]
    row["own_domain_slots"] = list(own_domain_slots(report))
    return row


def _head(result: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    return [f"# {cfg['name']} ({result['profile']} profile)", "", cfg["description"], "",
            cells.measured(result),
            f"Config: `{result['config_path']}`; checkpoint `{cfg['model']['base']}`; seeds {cfg['seeds']}, "
            f"{cfg['rounds']} rounds, training {cfg['train']}, budgets {cfg['budgets']}. {cells.cells_done(result)}",
            "", "*ppl*: held-out perplexity of the global MoE after the last round (the build's held-out documents, "
            "the same number of pieces from every domain; lower is better), *initial ppl* before round 1; *global*: "
            "its next-token accuracy; *local*: mean over devices of their latest validation next-token accuracy "
            "(own sub-MoE). Mean ± std over seeds [95% Student-t CI]. *MiB/dev-round*: up + down per device and round. "
            "*plan MiB*: the devices' memory plans, mean per device-round. *CV usage*: CV of the tokens routed to "
            "each expert (FLEX-MoE eq. 8), last round. \"better\"/\"worse\" only where the paired difference is "
            "significant.", ""]


def _holm_ppl(result: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = ["## Holm-Bonferroni over each setting's perplexity tests", ""]
    for setting, st in result["stats"].items():
        tested = [t for t in st["tests"] if t["ppl"].get("p_holm") is not None]
        kept = [f"{t['a']} − {t['b']} ({'lower' if t['ppl']['diff'] < 0 else 'higher'}, p_Holm={t['ppl']['p_holm']:.3f})"
                for t in tested if t["ppl"]["p_holm"] < 0.05]
        lines.append(f"- {setting}: {len(tested)} tests; " + (f"significant: {', '.join(kept)}." if kept
                                                               else "none significant."))
    return [*lines, ""]


def _holdings(result: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """Per method: the share of the small devices' expert slots that are an expert of their own
    domains (:func:`own_domain_slots`, summed over the cells)."""
    by: dict[str, list[int]] = {}
    for c in result["cells"]:
        agg = by.setdefault(c["method"], [0, 0])
        agg[0] += c["own_domain_slots"][0]
        agg[1] += c["own_domain_slots"][1]
    return ["## Own-domain experts held", "",
            "Share of the expert slots of devices that hold fewer than all experts of a layer (all layers, rounds 2 "
            "on, all seeds) that are an expert of one of the device's own domains (expert i of the build was trained "
            "on domain i); holding experts at random gives about (own domains) / (experts).", "",
            "| Method | own-domain share | slots |", "|---|---|---|",
            *(f"| {m} | {fmt(a / n if n else None, '.2f')} | {n} |" for m, (a, n) in by.items()), ""]


def _sections(result: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    return [*_holm_ppl(result, cfg), *_holdings(result, cfg)]


LAYOUT = tables.Layout(
    head=_head,
    columns=[("Method", lambda m, s, st: m), ("ppl", lambda m, s, st: ci_text(s["ppl"], ".2f")),
             ("initial ppl", lambda m, s, st: fmt(s["initial_perplexity"], ".2f")),
             ("global acc", lambda m, s, st: ci_text(s["global"])),
             ("local acc", lambda m, s, st: ci_text(s["local"])),
             ("experts held", lambda m, s, st: fmt(s["experts_held_mean"], ".1f")),
             ("MiB/dev-round", lambda m, s, st: ci_text(s["mib"], ".1f")),
             ("plan MiB", lambda m, s, st: ci_text(s["plan_mib"], ".0f")),
             ("CV usage", lambda m, s, st: ci_text(s["cv"], ".2f")),
             ("devices trained", lambda m, s, st: fmt(s["devices_trained"], ".0f"))],
    test_header="| a − b | Δ ppl [95% CI], p | | Δ global [95% CI], p | | Δ local [95% CI], p | | "
                "Δ MiB/dev-round [95% CI], p |",
    test_columns=[lambda t, st: f"{diff_text(t['ppl'], '+.2f')} | {verdict(t['ppl'], higher_is_better=False)}",
                  lambda t, st: f"{diff_text(t['global'])} | {verdict(t['global'])}",
                  lambda t, st: f"{diff_text(t['local'])} | {verdict(t['local'])}",
                  lambda t, st: diff_text(t["mib"], "+.1f")],
    all_ok="- Every round of every cell closed `ok`; no device was excluded or failed.",
    tests_when_none=False, sections=_sections)
"""The causal-LM table's markdown."""
