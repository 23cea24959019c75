"""The ``fedmoe`` command line: ``simulate``, ``aggregator``, ``device``, ``provision``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import fields

log = logging.getLogger("fedmoe")


class UsageError(ValueError):
    """A bad option or config, found before any work starts: ``main`` prints
    ``fedmoe: error: ...`` (one line, no traceback) and returns 2, as argparse does."""


def _setup_logging(verbose: bool) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("amqtt", "transitions", "bitsandbytes", "httpx", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _kv(text: str) -> dict:
    """``a=1,b=x`` -> {"a": 1, "b": "x"} (YAML-typed values)."""
    import yaml

    out = {}
    for part in filter(None, text.split(",")):
        k, _, v = part.partition("=")
        out[k.strip()] = yaml.safe_load(v)
    return out


def _simulate(args: argparse.Namespace) -> int:
    from .simulate import SimulationConfig, SimulationConfigError, simulate

    cfg = SimulationConfig()
    names = {f.name for f in fields(SimulationConfig)}
    for k, v in vars(args).items():
        if k in names and v is not None:
            setattr(cfg, k, v)
    cfg.tasks = args.tasks.split(",") if args.tasks else cfg.tasks
    if args.budget_range:
        lo, _, hi = args.budget_range.partition(":")
        cfg.budget_range = (lo, hi or lo)
    cfg.budgets = args.budgets.split(",") if args.budgets else None
    if args.strategy_params:
        cfg.strategy_params = _kv(args.strategy_params)
    if args.assignment_params:
        cfg.assignment_params = _kv(args.assignment_params)
    if args.aggregation_params:
        cfg.aggregation_params = _kv(args.aggregation_params)
    if args.tiny:
        cfg.base = None
        cfg.model_config = {"vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 2,
                            "num_attention_heads": 2, "intermediate_size": 128}
        cfg.budget_range = ("700MiB", "700MiB") if not args.budget_range else cfg.budget_range
    try:
        cfg.validate()  # within a second; simulate() then checks strategies and budgets before any process
        simulate(cfg)
    except SimulationConfigError as e:
        raise UsageError(str(e)) from None
    return 0


def _builtin_eval_data(cfg) -> dict[str, list[tuple[str, str]]]:
    """Items of each task whose ``eval_data`` is ``builtin:NAME``: the held-out test split
    of built-in data set NAME that ``fedmoe simulate`` evaluates on (80/20, seed 0;
    ``fedmoe.simulate.builtin_test_set``). The cloud layer cannot resolve these names.

    Raises:
        ValueError: an unknown data set, or labels the task does not list.
    """
    from .datasets import TASKS
    from .simulate import builtin_test_set

    out, bad = {}, []
    for name, task in cfg.tasks.items():
        ref = task.eval_data or ""
        if not ref.startswith("builtin:"):
            continue
        data = ref[len("builtin:"):]
        if data not in TASKS:
            bad.append(f"tasks.{name}.eval_data {ref!r}: unknown built-in data set {data!r} "
                       f"(built-in: {', '.join('builtin:' + t for t in sorted(TASKS))})")
            continue
        items, _ = builtin_test_set(data)
        missing = sorted({y for _, y in items} - set(task.labels))
        if missing:
            bad.append(f"tasks.{name}.eval_data {ref!r} has labels {missing} that tasks.{name}.labels lacks")
            continue
        out[name] = items
    if bad:
        raise ValueError("; ".join(bad))
    return out


def _aggregator(args: argparse.Namespace) -> int:
    import yaml

    from cloud.service import Aggregator, AggregatorConfig

    try:  # every problem of the config and the files it names, before the model is set up
        cfg = AggregatorConfig.load(args.config, store=args.store, rounds=args.rounds, protocol=args.protocol,
                                    username=args.username, password=args.password, tls_ca=args.tls_ca,
                                    credentials=args.credentials, device_keys=args.device_keys)
        eval_data = _builtin_eval_data(cfg)
        cfg.check_paths(eval_given=eval_data)
    except (OSError, ValueError, yaml.YAMLError) as e:
        from protocol.messages import error_summary

        raise UsageError(f"{args.config}: {error_summary(e, root=type(e).__name__)}") from None
    broker = None
    url = args.broker
    if url is None:
        from .broker import EmbeddedBroker

        host, _, port = (args.listen or "127.0.0.1:0").rpartition(":")
        broker = EmbeddedBroker(host or "127.0.0.1", int(port or 0)).start()
        url = broker.url
        cfg = cfg.model_copy(update={"protocol": "3.1.1"})
        log.info("no --broker given: devices connect to %s", url)
    try:
        Aggregator(cfg, url, eval_data=eval_data).run()
    finally:
        if broker is not None:
            broker.stop()
    return 0


def _device(args: argparse.Namespace) -> int:
    from edge_sdk import EdgeClient
    from moe_model.budget import parse_bytes
    from edge_sdk.data import load_text_file
    from protocol.transport import TlsConfig

    tls = TlsConfig(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca else None
    common = dict(federation=args.federation, budget_bytes=args.budget, task=args.task, cache_dir=args.cache_dir,
                  val_fraction=args.val_fraction, seed=args.seed, threads=args.threads, protocol=args.protocol,
                  tls=tls, weight_formats=args.formats.split(","), cache_max=args.cache_max,
                  quant_backend=args.quant_backend,
                  headroom_bytes=parse_bytes(args.headroom) if args.headroom is not None else None)
    data = load_text_file(args.data)
    if args.credentials:
        client = EdgeClient.from_credentials(args.broker, args.credentials, data, **common)
    else:
        if not args.device_id:
            raise ValueError("give --device-id or --credentials")
        client = EdgeClient(args.broker, args.device_id, data, username=args.username, password=args.password,
                            **common)
    client.run(max_rounds=args.max_rounds, idle_timeout=args.idle_timeout)
    return 0


def _export(args: argparse.Namespace) -> int:
    from cloud.service import AggregatorConfig
    from cloud.export import model_from_store
    from edge_sdk.export import export_onnx

    cfg = AggregatorConfig.load(args.config)
    task = args.task or next(iter(cfg.tasks))
    model = model_from_store(cfg, args.store or cfg.store, task, args.device)
    out = export_onnx(model, args.out, int8=args.int8)
    print(f"wrote {out} ({'int8' if args.int8 else 'fp32'}, task {task}, "
          f"{'device ' + args.device if args.device else 'global MoE'}, {out.stat().st_size / 2**20:.1f} MiB)")
    return 0


def _provision(args: argparse.Namespace) -> int:
    from .provision import provision

    ids = [d for d in (args.devices or "").split(",") if d]
    if args.count:
        ids += [f"{args.prefix}{i}" for i in range(args.count)]
    hosts = [h for h in (args.tls_host or "").split(",") if h]
    p = provision(args.out, ids, tls_hosts=hosts, port=args.port)
    print(f"{len(p.devices)} devices in {p.out}: devices/<id>.json (device --credentials), aggregator.json "
          f"(aggregator --credentials), device_keys.json (aggregator --device-keys), passwd, acl, mosquitto.conf"
          + (", tls/" if p.ca_file else ""))
    return 0


def _mqtt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--protocol", default="auto", choices=["auto", "5", "3.1.1"], help="MQTT protocol version")
    p.add_argument("--username")
    p.add_argument("--password")
    p.add_argument("--tls-ca", help="CA certificate (PEM) for TLS")
    p.add_argument("--credentials", help="credentials JSON from `fedmoe provision` (account, signing key, CA)")


def build_parser() -> argparse.ArgumentParser:
    """The ``fedmoe`` argument parser: subcommands simulate, aggregator, device, export, provision,
    each with ``func`` set to its handler."""
    p = argparse.ArgumentParser(prog="fedmoe", description="Federated MoE fine-tuning over MQTT")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("simulate", help="run a whole federation on this machine")
    s.add_argument("--out", help="output directory (default runs/demo)")
    s.add_argument("--devices", type=int)
    s.add_argument("--rounds", type=int)
    s.add_argument("--tasks", help="comma-separated built-in tasks: bbc, tweets")
    s.add_argument("--partition", help="iid | dirichlet:ALPHA | classes:K")
    s.add_argument("--strategy", help="federated method (composed: --assignment + --aggregation; default)")
    s.add_argument("--strategy-params", help="k=v,... method parameters")
    s.add_argument("--assignment", help="assignment strategy (random_kept, full, fedmoe, flex, ...)")
    s.add_argument("--assignment-params", help="k=v,... strategy parameters")
    s.add_argument("--aggregation", help="aggregation strategy (modular, ...)")
    s.add_argument("--aggregation-params", help="k=v,... strategy parameters")
    s.add_argument("--budgets", help="per-device memory budgets, e.g. 700MiB,1GiB (device i gets the i-th, "
                                     "cycling; devices numbered task by task); overrides --budget-range")
    s.add_argument("--budget-range", help="device memory budgets LO:HI, e.g. 0.7GiB:0.75GiB (default: from 2 to all "
                                          "experts per layer by the memory plan, on top of a device process's "
                                          "baseline measured on this machine)")
    s.add_argument("--broker", help="use this broker instead of the embedded one")
    s.add_argument("--seed", type=int)
    s.add_argument("--num-experts", type=int)
    s.add_argument("--top-k", type=int)
    s.add_argument("--max-seq-len", type=int)
    s.add_argument("--local-epochs", type=float)
    s.add_argument("--max-steps", type=int)
    s.add_argument("--batch-size", type=int)
    s.add_argument("--lr", type=float)
    s.add_argument("--prox-mu", type=float)
    s.add_argument("--lora-rank", type=int)
    s.add_argument("--weight-format")
    s.add_argument("--full-finetune", action="store_true", default=None,
                   help="train and ship every weight, no LoRA (full-model FedAvg baseline; needs --weight-format fp32)")
    s.add_argument("--eval-max-samples", type=int)
    s.add_argument("--max-samples-per-task", type=int, help="seeded random subset of each task's data")
    s.add_argument("--tiny", action="store_true", help="a tiny randomly initialised model (quick checks)")
    s.set_defaults(func=_simulate)

    a = sub.add_parser("aggregator", help="run the cloud aggregator service")
    a.add_argument("--broker", help="broker URL; omitted: start an embedded broker (see --listen)")
    a.add_argument("--listen", help="HOST:PORT of the embedded broker when --broker is omitted")
    a.add_argument("--config", required=True, help="aggregator YAML config")
    a.add_argument("--store", help="store URL (overrides the config)")
    a.add_argument("--rounds", type=int)
    a.add_argument("--device-keys", help="device_keys.json from `fedmoe provision`: require signed updates")
    _mqtt_args(a)
    a.set_defaults(func=_aggregator)

    d = sub.add_parser("device", help="run one edge device")
    d.add_argument("--broker", required=True)
    d.add_argument("--device-id", help="device id (or take it from --credentials)")
    d.add_argument("--budget", required=True, help="memory budget, e.g. 1.5GiB")
    d.add_argument("--data", required=True, help="CSV or JSONL file with text,label")
    d.add_argument("--task", default="default")
    d.add_argument("--federation", default="default")
    d.add_argument("--cache-dir")
    d.add_argument("--cache-max", help="shard cache size limit, e.g. 2GiB (least recently used evicted)")
    d.add_argument("--threads", type=int)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--val-fraction", type=float, default=0.2)
    d.add_argument("--formats", default="int8,fp32", help="weight formats this device loads")
    d.add_argument("--headroom", help="memory kept free below the plan for allocator growth, e.g. 32MiB "
                                      "(default: moe_model.budget.DEFAULT_HEADROOM_BYTES)")
    d.add_argument("--quant-backend", default="torch", choices=["torch", "bitsandbytes"],
                   help="kernels for int8/nf4 expert linears (bitsandbytes needs the quant extra)")
    d.add_argument("--max-rounds", type=int)
    d.add_argument("--idle-timeout", type=float)
    d.add_argument("--tls-cert")
    d.add_argument("--tls-key")
    _mqtt_args(d)
    d.set_defaults(func=_device)

    x = sub.add_parser("export", help="export the global MoE or a device's sub-MoE to ONNX for onnxruntime")
    x.add_argument("--out", required=True, help="output .onnx file")
    x.add_argument("--int8", action="store_true", help="dynamic int8 quantization (onnxruntime)")
    x.add_argument("--config", required=True, help="the aggregator YAML config")
    x.add_argument("--store", help="the aggregator's store URL (default: the config's)")
    x.add_argument("--task", help="task head to export (default: the config's first task)")
    x.add_argument("--device", help="export this device's last assigned sub-MoE instead of the global MoE")
    x.set_defaults(func=_export)

    v = sub.add_parser("provision", help="create device credentials, signing keys, broker password file, ACL, TLS")
    v.add_argument("--out", required=True, help="deployment secrets directory (created or extended)")
    v.add_argument("--devices", help="comma-separated device ids")
    v.add_argument("--count", type=int, help="also provision PREFIX0..PREFIX{N-1}")
    v.add_argument("--prefix", default="dev")
    v.add_argument("--tls-host", help="comma-separated broker host names/IPs: write a CA and server certificate")
    v.add_argument("--port", type=int, default=8883, help="listener port in the generated mosquitto.conf")
    v.set_defaults(func=_provision)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the ``fedmoe`` command line (``argv`` default: ``sys.argv[1:]``); returns the exit status:
    the subcommand's, 2 for a usage error (argparse exits with 2 itself), 130 on Ctrl-C, 1 for any
    other exception (logged, not raised)."""
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except UsageError as e:
        print(f"fedmoe: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # report cleanly; details in the log at debug level
        log.error("%s: %s", type(e).__name__, e)
        log.debug("traceback", exc_info=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
