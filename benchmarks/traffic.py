"""Traffic benchmark: bytes per device per round, ours vs full-MoE FedAvg vs Flower, and
the throughput of our chunked blob transfer against one raw MQTT publish.

Three federations on the same model (all-MiniLM-L6-v2 upcycled to 8 experts in layers
1, 3, 5, top-2), the same BBC News Dirichlet(0.5) shards, seed, rounds and local steps:

- **ours**: ``fedmoe simulate`` defaults (randomMoE assignment within each device's
  budget, int8 base shards fetched once and cached by sha256, LoRA B / router rows /
  head moving each round), devices as separate processes over Mosquitto;
- **full-MoE FedAvg (fp32), through our system**: the same programs with
  ``--assignment full --weight-format fp32 --full-finetune``: every device holds every
  expert and ships every weight in fp32 each round (the traffic upper bound);
- **Flower**: ``flwr``'s own ``FedAvg`` strategy over the same full MoE, driven
  round by round in this process (its simulation engine needs Ray, which we do not
  install): each selected client receives ``FitIns`` and returns ``FitRes`` carrying the
  full model's parameters as Flower serialises them (``ndarrays_to_parameters``), after
  training on its shard with the same local steps; bytes are the sizes of those messages
  serialised as Flower's protobufs (``flwr.common.serde``), i.e. what its gRPC transport
  carries before HTTP/2 framing.

Bytes for ours and full-MoE FedAvg are counted by the devices on the wire (MQTT
PUBLISH packets, chunk headers and control messages included); ``payload_up/down``
are the tensor-blob bytes inside them, so ``(bytes - payload) / payload`` is our
protocol overhead.

Blob throughput: a 64 MiB random blob through a Mosquitto on loopback, (a) with our
transport (``Transport.publish_blob``: 256 KiB chunks, QoS 1, sha256, reassembled by a
subscriber ``Transport``), (b) as one raw paho QoS 1 publish to a raw paho subscriber
(the ceiling; brokers limit packet sizes, so production cannot do this). Time from
the first publish to the complete blob at the receiver, median of ``--repeats``.

    python -m benchmarks.traffic            # 4 devices, 3 rounds (~15 min on 2 cores)
    python -m benchmarks.traffic --quick    # tiny model, 2 devices, 2 rounds (~2 min)

Writes ``results/traffic/traffic.{json,md,png}`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("traffic")
MiB = 2**20


# ---------------------------------------------------------------------------- federations
def sim_config(args, out: Path, full: bool):
    from fedmoe.simulate import SimulationConfig

    kw = dict(out=str(out), devices=args.devices, rounds=args.rounds, max_steps=args.steps,
              max_seq_len=args.seq_len, broker=args.broker_url, eval_max_samples=args.eval_samples,
              max_samples_per_task=args.samples, budget_range=tuple(args.budget_range.split(":")))
    if args.quick:
        kw.update(base=None, model_config={"vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 2,
                                           "num_attention_heads": 2, "intermediate_size": 128},
                  budget_range=("700MiB", "700MiB"))
    if full:  # every device holds the whole fp32 MoE with AdamW state
        kw.update(assignment="full", weight_format="fp32", full_finetune=True, budget_range=("6GiB", "6GiB"))
    return SimulationConfig(**kw)


def per_device_rounds(report: dict) -> list[dict]:
    """One row per (round, device): wire and payload bytes."""
    rows = []
    for r in report["rounds"]:
        for dev, d in r["devices"].items():
            rows.append({"round": r["round"], "device": dev, "bytes_up": d["bytes_up"], "bytes_down": d["bytes_down"],
                         "payload_up": d.get("payload_up") or 0, "payload_down": d.get("payload_down") or 0,
                         "experts": sum(len(v) for v in d["experts"].values())})
    return rows


def summarise(rows: list[dict], accuracy: list[float]) -> dict:
    """Mean bytes per device per round: over all rounds, and from round 2 on (steady state)."""
    def mean(key, pred=lambda r: True):
        xs = [r[key] for r in rows if pred(r)]
        return statistics.fmean(xs) if xs else float("nan")

    out = {"accuracy": accuracy, "device_rounds": len(rows)}
    for name, pred in (("all", lambda r: True), ("steady", lambda r: r["round"] >= 2), ("round1", lambda r: r["round"] == 1)):
        up, down = mean("bytes_up", pred), mean("bytes_down", pred)
        pu, pd = mean("payload_up", pred), mean("payload_down", pred)
        out[name] = {"bytes_up": up, "bytes_down": down, "bytes_total": up + down, "payload_up": pu,
                     "payload_down": pd, "payload_total": pu + pd}
        if pu + pd > 0:
            out[name]["overhead_fraction"] = (up + down - pu - pd) / (pu + pd)
    return out


def run_system(args, name: str, full: bool) -> dict:
    from fedmoe.simulate import simulate

    out = Path(args.work) / name
    cfg = sim_config(args, out, full)
    log.info("[%s] fedmoe simulate: %d devices x %d rounds -> %s", name, cfg.devices, cfg.rounds, out)
    t0 = time.time()
    report = simulate(cfg)
    rows = per_device_rounds(report)
    res = summarise(rows, [r["accuracy"] for r in report["rounds"]])
    res.update(rows=rows, seconds=time.time() - t0, config=cfg.model_dump(mode="json"))
    log.info("[%s] %.1f MiB per device per round (steady %.2f MiB), %.0f s", name, res["all"]["bytes_total"] / MiB,
             res["steady"]["bytes_total"] / MiB, res["seconds"])
    return res


def run_flower(args, ours_report_dir: Path) -> dict:
    """flwr's FedAvg over the full MoE on the same shards; message sizes as Flower serialises them."""
    import numpy as np
    import torch
    import yaml
    from flwr.common import Code, FitIns, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.common import serde
    from flwr.server.strategy import FedAvg

    from edge_sdk.data import encode_labels, load_text_file, train_val_split
    from moe_model.models import all_experts, get_adapter
    from moe_model.shards import split_base
    from moe_model.submoe import SubMoE
    from moe_model.train import evaluate, train_local
    from protocol.messages import ModelSpec, TrainConfig

    torch.set_num_threads(1)
    agg = yaml.safe_load((ours_report_dir / "aggregator.yaml").read_text())
    spec = ModelSpec(**{**agg["model"], "full_finetune": True})
    task, tcfg = next(iter(agg["tasks"].items()))
    labels = tcfg["labels"]
    train_cfg = TrainConfig(**agg["train"])
    devices = json.loads((ours_report_dir / "report.json").read_text())["config"]["devices"]
    adapter = get_adapter(spec.family)
    experts = all_experts(adapter, spec)
    skeleton = adapter.build(spec, experts, 2, device="meta")
    base = split_base(adapter.base_state(spec), skeleton)
    model = SubMoE(spec, experts, task, len(labels), base)  # one full fp32 MoE, reused by every client in turn
    keys = sorted(model.trainable())
    test = encode_labels(load_text_file(tcfg["eval_data"]).items, labels)[: args.eval_samples]

    def weights() -> list:
        state = model.adapter_state()
        return [state[k].numpy() for k in keys]

    def load(nds) -> None:
        model.load_adapter_state({k: torch.from_numpy(np.asarray(a)) for k, a in zip(keys, nds)})

    strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=len(devices),
                      min_available_clients=len(devices))
    params = ndarrays_to_parameters(weights())
    rows, accuracy = [], []
    t0 = time.time()
    for rnd in range(1, args.rounds + 1):
        results = []
        for i, d in enumerate(devices):
            fit_ins = FitIns(params, {"server_round": rnd, "local_steps": train_cfg.max_steps or 0})
            down = len(serde.fit_ins_to_proto(fit_ins).SerializeToString())
            items = encode_labels(load_text_file(d["data"]).items, labels)
            train, _ = train_val_split(items, 0.2, args.seed)
            load(parameters_to_ndarrays(fit_ins.parameters))
            train_local(model, train, train_cfg, seed=args.seed * 100_003 + rnd)
            res = FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters(weights()), len(train), {})
            up = len(serde.fit_res_to_proto(res).SerializeToString())
            payload = sum(len(t) for t in res.parameters.tensors)
            rows.append({"round": rnd, "device": d["device_id"], "bytes_up": up, "bytes_down": down,
                         "payload_up": payload, "payload_down": payload, "experts": sum(map(len, experts.values()))})
            results.append((None, res))
            log.info("[flower] round %d client %d/%d: %.1f MiB down, %.1f MiB up", rnd, i + 1, len(devices),
                     down / MiB, up / MiB)
        params, _ = strategy.aggregate_fit(rnd, results, [])
        load(parameters_to_ndarrays(params))
        accuracy.append(evaluate(model, test).accuracy)
        log.info("[flower] round %d: accuracy %.3f", rnd, accuracy[-1])
    res = summarise(rows, accuracy)
    res.update(rows=rows, seconds=time.time() - t0, note="flwr FedAvg driven in-process; bytes = serialised "
               "FitIns/FitRes protobufs (flwr.common.serde), HTTP/2 framing not counted")
    return res


# ---------------------------------------------------------------------------- blob throughput
def blob_throughput(url: str, size: int, repeats: int) -> dict:
    import paho.mqtt.client as mqtt

    from protocol.chunking import Reassembler
    from protocol.transport import Transport

    blob = os.urandom(size)
    ours, raw = [], []
    topic_root = f"bench/{uuid.uuid4().hex[:8]}"
    for i in range(repeats):
        # ours: chunked QoS 1 publishes, reassembled by a subscriber
        rx, tx = Transport(url, f"rx-{i}-{uuid.uuid4().hex[:6]}"), Transport(url, f"tx-{i}-{uuid.uuid4().hex[:6]}")
        rx.connect(), tx.connect()
        topic = f"{topic_root}/ours/{i}"
        rx.subscribe(topic)
        time.sleep(0.2)
        reasm = Reassembler(max_blob_bytes=size)
        t0 = time.perf_counter()
        done = threading.Event()

        def drain():
            while not done.is_set():
                m = rx.get(1.0)
                if m is not None and reasm.add("tx", m.payload) is not None:
                    done.set()

        th = threading.Thread(target=drain, daemon=True)
        th.start()
        tx.publish_blob(topic, blob, "state", 1, uuid.uuid4().hex[:16])
        if not done.wait(300):
            raise RuntimeError("our transfer did not complete in 300 s")
        ours.append(time.perf_counter() - t0)
        wire = tx.bytes_sent
        tx.close(), rx.close()
        th.join(2)

        # ceiling: one raw paho publish of the whole blob
        got = threading.Event()
        sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        rtopic = f"{topic_root}/raw/{i}"
        sub.on_message = lambda c, u, m: got.set() if len(m.payload) == size else None
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        for c in (sub, pub):
            c.connect(host, int(port))
            c.loop_start()
        sub.subscribe(rtopic, qos=1)
        time.sleep(0.5)
        t0 = time.perf_counter()
        pub.publish(rtopic, blob, qos=1)
        if not got.wait(300):
            raise RuntimeError("raw publish did not arrive in 300 s")
        raw.append(time.perf_counter() - t0)
        for c in (sub, pub):
            c.loop_stop()
            c.disconnect()
        log.info("%d MiB blob, try %d: ours %.2f s, raw %.2f s", size // MiB, i + 1, ours[-1], raw[-1])
    o, r = statistics.median(ours), statistics.median(raw)
    return {"bytes": size, "repeats": repeats, "ours_seconds": ours, "raw_seconds": raw,
            "ours_MiB_per_s": size / MiB / o, "raw_MiB_per_s": size / MiB / r, "fraction_of_ceiling": r / o,
            "ours_wire_bytes": wire, "ours_overhead_fraction": (wire - size) / size}


# ---------------------------------------------------------------------------- output
def write_outputs(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "traffic.json").write_text(json.dumps(res, indent=1))
    systems = res["systems"]
    ours = systems["ours"]
    lines = [f"# Traffic per device per round (`benchmarks/traffic.py`{' --quick' if res['meta']['quick'] else ''})", "",
             f"Measured {res['meta']['date']} on {res['meta']['machine']}; {res['meta']['setup']}.", "",
             "| system | MiB/device/round (all rounds) | round 1 | rounds >= 2 | up / down (rounds >= 2) | "
             "x ours (all) | x ours (rounds >= 2) | protocol overhead | final accuracy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in systems.items():
        ov = s["all"].get("overhead_fraction")
        lines.append(
            f"| {name} | {s['all']['bytes_total'] / MiB:.2f} | {s['round1']['bytes_total'] / MiB:.2f} | "
            f"{s['steady']['bytes_total'] / MiB:.2f} | {s['steady']['bytes_up'] / MiB:.2f} / "
            f"{s['steady']['bytes_down'] / MiB:.2f} | {s['all']['bytes_total'] / ours['all']['bytes_total']:.1f} | "
            f"{s['steady']['bytes_total'] / ours['steady']['bytes_total']:.1f} | "
            f"{'-' if ov is None else f'{100 * ov:.2f}%'} | {s['accuracy'][-1]:.3f} |")
    b = res["blob"]
    lines += ["", "Protocol overhead = (wire bytes - tensor-blob bytes) / tensor-blob bytes: chunk headers, "
              "MQTT framing and control messages (hello, assignment, stats, status). Flower's bytes are its "
              "serialised FitIns/FitRes protobufs (no transport framing).", "",
              f"## {b['bytes'] // MiB} MiB blob through Mosquitto on loopback (median of {b['repeats']})", "",
              "| path | seconds | MiB/s |", "|---|---|---|",
              f"| ours (256 KiB chunks, QoS 1, sha256, reassembled) | {statistics.median(b['ours_seconds']):.2f} | "
              f"{b['ours_MiB_per_s']:.1f} |",
              f"| one raw paho publish (ceiling) | {statistics.median(b['raw_seconds']):.2f} | {b['raw_MiB_per_s']:.1f} |",
              "", f"Ours reaches **{100 * b['fraction_of_ceiling']:.0f}%** of the ceiling; chunk-header + framing "
              f"overhead {100 * b['ours_overhead_fraction']:.3f}% of the blob."]
    (out / "traffic.md").write_text("\n".join(lines) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, s in systems.items():
        rounds = sorted({r["round"] for r in s["rows"]})
        per = [statistics.fmean(x["bytes_up"] + x["bytes_down"] for x in s["rows"] if x["round"] == rd) / MiB
               for rd in rounds]
        a1.plot(rounds, per, marker="o", label=name)
    a1.set_yscale("log")
    a1.set_xlabel("round")
    a1.set_ylabel("MiB per device (up + down, log)")
    a1.set_title("traffic per device per round")
    a1.legend(fontsize=8)
    a2.bar(["ours (chunked)", "raw publish"], [b["ours_MiB_per_s"], b["raw_MiB_per_s"]], color=["C0", "C7"])
    a2.set_ylabel("MiB/s")
    a2.set_title(f"{b['bytes'] // MiB} MiB blob via Mosquitto (loopback)")
    fig.tight_layout()
    fig.savefig(out / "traffic.png", dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 2 devices, 2 rounds, 16 MiB blob")
    p.add_argument("--devices", type=int)
    p.add_argument("--rounds", type=int)
    p.add_argument("--steps", type=int, default=4, help="local steps per round (all systems)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--samples", type=int, default=800, help="BBC News articles used (seeded subset)")
    p.add_argument("--eval-samples", type=int, default=200)
    p.add_argument("--budget-range", default="0.75GiB:0.8GiB",
                   help="ours: device budgets LO:HI (the process baseline is ~440-480 MiB, by what is installed)")
    p.add_argument("--blob-mib", type=int)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help="comma list of ours,full,flower,blob to skip")
    p.add_argument("--work", default="runs/traffic")
    p.add_argument("--out", help="default results/traffic (results/traffic_quick with --quick)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args.devices = args.devices or (2 if args.quick else 4)
    args.rounds = args.rounds or (2 if args.quick else 3)
    blob_mib = args.blob_mib or (16 if args.quick else 64)
    out = Path(args.out or ("results/traffic_quick" if args.quick else "results/traffic"))
    skip = set(filter(None, args.skip.split(",")))

    from fedmoe.broker import MosquittoBroker

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    # as examples/deploy/mosquitto.conf: a queue deep enough for every device's chunked update
    # (the default 1000 messages drops chunks of 190 MB fp32 updates); no disk persistence
    broker = MosquittoBroker(str(work / "mosquitto"), "allow_anonymous true\nmax_queued_messages 100000\n",
                             persistence=False).start()
    args.broker_url = broker.url()
    res = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "quick": args.quick,
                    "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
                    "setup": f"{args.devices} devices, {args.rounds} rounds of {args.steps} local steps, "
                             f"sequence length {args.seq_len}, Mosquitto on loopback",
                    "args": {k: v for k, v in vars(args).items()}},
           "systems": {}}
    try:
        if "ours" not in skip:
            res["systems"]["ours"] = run_system(args, "ours", full=False)
        if "full" not in skip:
            res["systems"]["full-MoE FedAvg fp32 (our system)"] = run_system(args, "full_fedavg", full=True)
        if "flower" not in skip:
            res["systems"]["Flower FedAvg, full MoE"] = run_flower(args, work / "ours")
        if "blob" not in skip:
            res["blob"] = blob_throughput(args.broker_url, blob_mib * MiB, args.repeats)
    finally:
        broker.stop()
    write_outputs(res, out)
    print((out / "traffic.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
