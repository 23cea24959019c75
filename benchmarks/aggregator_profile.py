"""Where the aggregator's CPU goes while it ingests a round (issue "the aggregator at the
hardware's pace", step 1): one ``benchmarks.fleet`` setting (Mosquitto, one ``fedmoe
aggregator`` process, signed 1.08 MiB updates in 256 KiB chunks, SQLite store) with the
aggregator run under the sampling profiler py-spy (``--rate`` samples per second of each
thread that is on a CPU, idle threads not sampled). Every sample is put in one category by
the frames of its stack (:data:`CATEGORIES`): the store, the MQTT client,
chunk hashing and parsing, update decoding, screening and aggregation, signatures, sending
states, start-up, other.

    pip install py-spy
    python -m benchmarks.aggregator_profile                      # 1,000 devices, 1,000 updates, 1 round (~3 min)
    python -m benchmarks.aggregator_profile --devices 300 --per-round 100 --name profile_quick
    python -m benchmarks.aggregator_profile --fedmoe OTHER/fedmoe --name profile_baseline   # another build

Writes ``results/fleet/<name>.{json,md,png}``: the aggregator's CPU per accepted update as
the fleet measures it (psutil), split by the categories' shares of the samples; the top
functions by own time; and an icicle graph of the stacks (the flame graph upside down:
callers above callees, width = share of the samples).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import linecache
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path

from benchmarks.common import fmt, heavy_lock, write_result
from benchmarks.fleet import main as fleet_main

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("aggregator_profile")

CATEGORIES = (
    ("start-up (imports, model)", ("importlib", "cloud/global_model.py", "torch/nn/")),
    ("states sent (encode, publish)", ("cloud/rounds/dispatch.py",)),
    ("screening, aggregation", ("cloud/robust/", "cloud/aggregation/")),
    ("store (SQLAlchemy, SQLite)", ("sqlalchemy/", "cloud/store.py", "sqlite3")),
    ("signatures (Ed25519)", ("protocol/signing.py", "cryptography/")),
    ("chunks: hash, parse, reassemble", ("protocol/chunking.py",)),
    ("update decode (safetensors)", ("decode_tensors", "safetensors/")),
    ("MQTT client (paho)", ("paho/",)),
)
"""(category, frame substrings), in priority order: a sample belongs to the first category
any of whose substrings is in any frame of its stack (so the store's writes while sending a
state count as sending states, the store's writes of an update as the store)."""


STARTUP = CATEGORIES[0][0]
WAITING = "waiting (blocked, sampled as running)"
"""Samples whose innermost Python frame is on a line that blocks (``select``, a lock's
``acquire``, ``wait``, ``sleep``, a queue's ``get``): py-spy counted about half of the
aggregator's samples as running while its threads sat in ``Condition.wait`` (waiting for the
PUBACKs of the states it sent) and paho's ``select``, against the CPU that psutil measured.
They are left out of the shares that split the measured CPU."""
_BLOCKING = re.compile(r"\bselect\.select\(|\.acquire\(|\.wait\(|\bsleep\(|\.get\(.*timeout|\.poll\(")


@functools.cache
def blocks(frame: str) -> bool:
    """Whether py-spy's ``frame`` (``func (path:line)``, the path relative to an entry of
    ``sys.path`` or absolute) is a line that blocks (:data:`WAITING`)."""
    m = re.fullmatch(r".* \((.+):(\d+)\)", frame)
    if m is None:
        return False
    for root in ["", *sys.path]:
        path = os.path.join(root, m.group(1))
        if os.path.isfile(path):
            return bool(_BLOCKING.search(linecache.getline(path, int(m.group(2)))))
    return False


def category(frames: list[str]) -> str:
    """:data:`WAITING` where the innermost frame blocks, else the :data:`CATEGORIES` name of
    one stack, or ``other``."""
    if frames and blocks(frames[-1]):
        return WAITING
    for name, keys in CATEGORIES:
        if any(k in frame for frame in frames for k in keys):
            return name
    return "other"


def read_stacks(path: Path) -> collections.Counter:
    """py-spy's ``--format raw`` output: ``frame;frame;... count`` lines -> Counter of
    stack tuples (thread frame dropped) -> samples."""
    stacks: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            stacks[tuple(f for f in stack.split(";")[1:] if f)] += int(n)
    return stacks


def summarise(stacks: collections.Counter, rate: float, updates: int, measured_ms: float | None) -> dict:
    """Sampled seconds per category; each category's milliseconds per update (its share of
    the samples outside start-up and :data:`WAITING` times ``measured_ms``, the aggregator's CPU per update that
    the fleet measured in its rounds with psutil); the top functions by own time."""
    total = sum(stacks.values())
    by_cat: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    for st, n in stacks.items():
        by_cat[category(list(st))] += n
        if st:
            own[st[-1]] += n
    running = total - by_cat[STARTUP] - by_cat[WAITING]
    return {
        "sampled_s": total / rate, "updates": updates, "measured_ms_per_update": measured_ms,
        "categories": [{"name": c, "sampled_s": n / rate, "share": n / total,
                        "ms_per_update": None if c in (STARTUP, WAITING) or measured_ms is None or not running
                        else measured_ms * n / running}
                       for c, n in by_cat.most_common()],
        "top_functions": [{"frame": f, "sampled_s": n / rate, "share": n / total} for f, n in own.most_common(20)],
    }


def markdown(r: dict) -> str:
    """The result page."""
    s = r["summary"]
    f = r["fleet"]
    lines = [f"# Aggregator CPU profile: {r['name']}", "",
             f"Measured {r['date']} on {r['machine']}: `python -m benchmarks.aggregator_profile "
             f"{' '.join(r['argv'])}`. One `benchmarks.fleet` setting: Mosquitto, {r['devices']} devices, "
             f"{r['per_round']} signed updates of 1.08 MiB per round (256 KiB chunks), {r['rounds']} round(s), one "
             f"`fedmoe aggregator` process, SQLite store, py-spy attached to it at {r['rate']:g} samples/s of each "
             f"thread on a CPU. The device processes and Mosquitto ran beside it on the same cores. "
             f"{r.get('note', '')}", "",
             f"**Aggregator CPU per accepted update (the fleet's psutil reading over its rounds): "
             f"{fmt(s['measured_ms_per_update'], '.1f')} ms**; {f['accepted']} updates accepted "
             f"({f['not_accepted']} lost, {f['reported_twice']} twice), {fmt(f['ingest_per_s'], '.1f')} updates/s "
             f"ingesting, aggregator peak RSS {fmt((f['aggregator_peak_rss_bytes'] or 0) / 2**20, '.0f')} MiB. "
             f"py-spy sampled {s['sampled_s']:.1f} s in all (start-up included). A category's ms per update is its "
             f"share of the samples outside start-up and waiting times the measured figure; samples whose innermost frame is a line that blocks (select, a lock, a wait, a queue get) count as waiting.", "",
             "| category | sampled s | share | ms per update |", "|---|---|---|---|"]
    lines += [f"| {c['name']} | {c['sampled_s']:.1f} | {100 * c['share']:.1f}% | {fmt(c['ms_per_update'], '.1f')} |"
              for c in s["categories"]]
    lines += ["", "Functions by own time (the leaf frame):", "", "| function | sampled s | share |", "|---|---|---|"]
    lines += [f"| `{x['frame'][:110]}` | {x['sampled_s']:.1f} | {100 * x['share']:.1f}% |"
              for x in s["top_functions"]]
    return "\n".join(lines) + "\n"


MAX_DEPTH = 24
"""Frames drawn below the root in :func:`plot`."""


def plot(r: dict, path: Path) -> None:
    """Icicle graph of the stacks outside start-up and waiting (frames under 0.5% of those samples, and
    below :data:`MAX_DEPTH`, left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stacks = collections.Counter({st: v for k, v in r["stacks"].items()
                                  if category(list(st := tuple(k.split(";")))) not in (STARTUP, WAITING)})
    total = sum(stacks.values())
    fig, ax = plt.subplots(figsize=(16, 9))
    colours = {name: plt.cm.tab10(i) for i, (name, _) in enumerate(CATEGORIES)}
    colours["other"] = (0.7, 0.7, 0.7, 1.0)

    def draw(prefix: tuple, x0: float, depth: int) -> None:
        children: collections.Counter = collections.Counter()
        for st, n in stacks.items():
            if len(st) > len(prefix) and st[:len(prefix)] == prefix:
                children[st[len(prefix)]] += n
        x = x0
        for frame, n in sorted(children.items()):
            w = n / total
            if w >= 0.005:
                st = prefix + (frame,)
                ax.barh(-depth, w, left=x, height=0.95, color=colours[category(list(st))], edgecolor="white",
                        linewidth=0.3)
                if w > 0.03:
                    ax.text(x + 0.002, -depth, frame.split(" (")[0][:int(w * 160)], fontsize=6, va="center")
                if depth < MAX_DEPTH:
                    draw(st, x, depth + 1)
            x += w

    draw((), 0.0, 0)
    ax.set_xlim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel("share of the aggregator's CPU samples outside start-up and waiting")
    ax.set_title(f"{r['name']}: {fmt(r['summary']['measured_ms_per_update'], '.1f')} ms of aggregator CPU per update "
                 "(callers above callees, width = share of samples)")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], labels=list(colours),
              fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--per-round", type=int, default=1000, help="updates per round")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--rate", type=float, default=200.0, help="py-spy samples per second")
    ap.add_argument("--fedmoe", default=str(Path(sys.executable).parent / "fedmoe"), help="the fedmoe command profiled")
    ap.add_argument("--name", default="profile")
    ap.add_argument("--note", default="", help="a sentence for the page (what else ran, what build)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "aggregator-profile"))
    ap.add_argument("--out", default=str(ROOT / "results" / "fleet"))
    ap.add_argument("--lock")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(pyspy).exists():
        ap.error("py-spy is not installed: pip install py-spy")
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    raw = work / "aggregator-stacks.txt"
    # fleet starts "fedmoe aggregator ..." through it: py-spy attaches to the aggregator's own
    # process (the shell's pid, which exec makes the aggregator), so the fleet's monitor
    # reads the aggregator's CPU and RSS, not py-spy's
    wrapper = work / "fedmoe-profiled"
    wrapper.write_text(f"#!/bin/sh\n({pyspy} record --pid $$ --format raw --rate {args.rate:g} --nonblocking "
                       f"-o {raw} > {work / 'py-spy.log'} 2>&1 &)\nexec {args.fedmoe} \"$@\"\n")
    wrapper.chmod(0o755)
    fleet_argv = ["--sizes", str(args.devices), "--per-round", str(args.per_round), "--rounds", str(args.rounds),
                  "--cluster-sizes", "", "--worker-counts", "", "--cluster-worker-counts", "",
                  "--fedmoe", str(wrapper), "--work", str(work / "fleet"), "--out", str(work / "result")]
    with heavy_lock(args.lock):
        log.info("fleet run with the aggregator under py-spy: benchmarks.fleet %s", " ".join(fleet_argv))
        rc = fleet_main(fleet_argv)  # in this process: a SIGTERM stops what the fleet started
    fleet = json.loads((work / "result" / "fleet.json").read_text())
    if rc or not raw.exists():
        log.error("the fleet run failed (exit %s) or py-spy wrote nothing (%s)", rc, raw)
        return 1
    setting = fleet["settings"][0]
    stacks = read_stacks(raw)
    result = {"name": args.name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{os.cpu_count()} CPU cores", "argv": sys.argv[1:] if argv is None else argv,
              "devices": args.devices, "per_round": args.per_round, "rounds": args.rounds, "rate": args.rate,
              "note": args.note, "fleet": {k: setting.get(k) for k in (
                  "accepted", "not_accepted", "reported_twice", "ingest_per_s", "latency_p50_s",
                  "aggregator_cpu_s_per_update", "aggregator_peak_rss_bytes")},
              "summary": summarise(stacks, args.rate, int(setting.get("accepted") or 0),
                                   1000 * setting["aggregator_cpu_s_per_update"]
                                   if setting.get("aggregator_cpu_s_per_update") else None),
              "stacks": {";".join(k): v for k, v in stacks.items() if v * 1000 >= sum(stacks.values())}}
    print(write_result(args.out, args.name, result, markdown, plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
