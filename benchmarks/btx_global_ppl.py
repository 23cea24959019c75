"""The initial global model of a federation on a BTX build's own domains, per domain: held-out
perplexity of the MoE exactly as the aggregator holds it before round 1 (``hf-moe`` family,
int8 base shards, every expert), on the pieces the causal-LM table federates (the build's
held-out documents cut into pieces of about 96 tokens, ``fedmoe.btx_domains.domain_items``),
with more pieces per domain than the table evaluates each round.

    python -m benchmarks.btx_global_ppl --model runs/btx-smollm2-l20 --pieces 80

Writes ``results/btx/<name>.{json,md}`` (default name: ``<model dir>_global_ppl``).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, write_result

MAX_PPL = 100.0
"""The acceptance bound on every domain (issue "experts that differ")."""


def measure(model: Path, pieces: int, weight_format: str, seed: int) -> dict[str, Any]:
    """Perplexity per domain of the global model (module docstring)."""
    from cloud.global_model import GlobalModel
    from fedmoe.btx_domains import domain_items, read_record
    from protocol.messages import ModelSpec

    meta = read_record(model)
    _, test, domains = domain_items(model, seed, len(meta["domains"]), pieces * len(meta["domains"]), chunk_chars=450)
    spec = ModelSpec(family="hf-moe", base=str(model), tokenizer=None, objective="causal-lm", max_seq_len=96,
                     num_experts=len(domains), top_k=int(meta.get("top_k", 2)))
    gm = GlobalModel(spec, {"domains": domains}, weight_format)
    out = {}
    for i, d in enumerate(domains):
        items = [(x, i) for x, y in test if y == d]
        r = gm.evaluate("domains", items, batch_size=8)
        out[d] = {"pieces": len(items), "tokens": r.tokens, "perplexity": math.exp(min(r.loss, 700.0))}
    return {"domains": out, "weight_format": weight_format, "seed": seed}


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# Initial global model per domain: {r['name']}", "",
             f"Measured {r['date']} on {r['machine']}, {r['seconds']:.0f} s: `python -m {r['command']}`. The "
             f"checkpoint `{r['model']}` as a federation's aggregator holds it before round 1 ({r['weight_format']} "
             f"base shards, every expert), on held-out pieces of about 96 tokens (the causal-LM table's items, drawn "
             f"by seed {r['seed']}; a tweet is one short piece). Acceptance: every domain below {MAX_PPL:.0f}.", "",
             "| domain | pieces | target tokens | perplexity | < 100 |", "|---|---|---|---|---|"]
    for d, x in r["domains"].items():
        lines.append(f"| {d} | {x['pieces']} | {x['tokens']} | {x['perplexity']:.1f} | "
                     f"{'yes' if x['perplexity'] < MAX_PPL else '**no**'} |")
    ok = all(x["perplexity"] < MAX_PPL for x in r["domains"].values())
    lines += ["", f"Every domain below {MAX_PPL:.0f}: **{'yes' if ok else 'no'}**.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a BTX checkpoint (fedmoe upcycle --method btx)")
    ap.add_argument("--pieces", type=int, default=80, help="held-out pieces per domain (default 80)")
    ap.add_argument("--format", default="int8", help="base-shard format of the global model (default int8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "results" / "btx"))
    ap.add_argument("--name")
    args = ap.parse_args(argv)
    model = Path(args.model).resolve()
    t0 = time.time()
    res = measure(model, args.pieces, args.format, args.seed)
    res.update(name=args.name or f"{model.name}_global_ppl", model=os.path.relpath(model, ROOT),
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), seconds=time.time() - t0,
               machine=f"{platform.machine()}, {os.cpu_count()} CPU cores",
               command="benchmarks.btx_global_ppl " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(write_result(args.out, res["name"], res, markdown, None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
