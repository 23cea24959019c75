"""Shared fixtures: tiny model specs, real brokers (Mosquitto and the embedded amqtt)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from protocol.messages import ModelSpec  # noqa: E402

TINY_CONFIG = {"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
               "intermediate_size": 64}


def tiny_spec(**kw) -> ModelSpec:
    """A tiny randomly initialised BERT upcycled to 4 experts (1 MoE layer)."""
    args = dict(base=None, config=TINY_CONFIG, num_experts=4, top_k=2, max_seq_len=32, upcycle_noise=0.0)
    args.update(kw)
    return ModelSpec(**args)


@pytest.fixture
def spec() -> ModelSpec:
    return tiny_spec()


def native_binary(name: str = "fedmoe-device", *, optional: bool = False):
    """The native device's binary ``name`` (built on first use, ``fedmoe.native``). Where it
    cannot be built the test skips, saying why, or, with ``optional``, gets None; under
    ``FEDMOE_REQUIRE_NATIVE=1`` (``make test`` sets it where the build's Debian packages are
    installed) a failed build fails the test instead: a native device that stops building must
    not pass as a skip."""
    from fedmoe.native import NativeBuildError, binary

    try:
        return binary(name)
    except NativeBuildError as e:
        if os.environ.get("FEDMOE_REQUIRE_NATIVE") == "1":
            pytest.fail(f"the native build failed and FEDMOE_REQUIRE_NATIVE=1: {e}")
        if optional:
            return None
        pytest.skip(f"native build unavailable: {e}")


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def mosquitto_url():
    """A Mosquitto broker of this test session's own, started on a free port (each xdist
    worker is a session of its own), or, without a mosquitto binary, the one at
    127.0.0.1:1883. Not the shared one where a binary exists: a device's MQTT client id is
    ``dev-{device_id}`` (PROTOCOL.md), and test federations on two workers name their
    devices alike, so on one broker each took over the other's session ("disconnected
    (Unspecified error)" over and over) until a round timed out."""
    exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not os.path.exists(exe):
        if _listening("127.0.0.1", 1883):
            yield "mqtt://127.0.0.1:1883"
            return
        pytest.skip("no Mosquitto broker running and no mosquitto binary to start one")
    port = _free_port()
    d = tempfile.mkdtemp()
    conf = Path(d) / "m.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        if _listening("127.0.0.1", port):
            break
        time.sleep(0.1)
    else:
        proc.terminate()
        pytest.fail(f"{exe} did not listen on 127.0.0.1:{port} within 10 s")
    yield f"mqtt://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(5)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def embedded_url():
    """An embedded amqtt broker for the test session."""
    from fedmoe.broker import EmbeddedBroker

    b = EmbeddedBroker().start()
    yield b.url
    b.stop()


PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
"""The PostgreSQL server this machine and CI run (trust auth); tests skip without it."""


def _pg_available() -> bool:
    try:
        import psycopg

        psycopg.connect(PG_URL, connect_timeout=2).close()
        return True
    except Exception:
        return False


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    """A fresh aggregator store URL: a SQLite file, or a throw-away PostgreSQL schema."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/agg.db"
        return
    if not _pg_available():
        pytest.skip("no PostgreSQL server at 127.0.0.1:5432")
    import uuid

    import psycopg

    schema = f"t_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_URL, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {schema}")
    yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    with psycopg.connect(PG_URL, autocommit=True) as c:
        c.execute(f"DROP SCHEMA {schema} CASCADE")


def pytest_unconfigure(config):
    """A test that leaves a non-daemon thread running (a client that never got its stop
    command) would keep the interpreter alive after the summary and CI would time out:
    name the threads, with their stacks, and exit with a failure instead."""
    import sys
    import threading
    import traceback

    time.sleep(0.5)
    left = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if not left:
        return
    frames = sys._current_frames()
    for t in left:
        sys.stderr.write(f"\nnon-daemon thread still running after the tests: {t.name}\n")
        sys.stderr.write("".join(traceback.format_stack(frames.get(t.ident))) if t.ident in frames else "")
    sys.stderr.flush()
    os._exit(3)


CLUSTER_TEST_FILES = ("test_cluster.py",)
"""Test files whose tests start a NATS cluster: one xdist worker runs them all, in turn."""
ONE_WORKER_FILES = {"test_native_trainer.py": "native-build", "test_native_device.py": "native-device",
                    "test_training_program.py": "program-export"}
"""Test files whose module-scoped fixtures are costly (the native device's CMake build, about
30 s; an ExecuTorch program export, about 15 s): one xdist worker runs each file's tests, so
its fixtures are built once instead of on each worker."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """`make test` runs the tests that start a 3-node NATS cluster (``tests/test_cluster.py``)
    alone first, then the rest on pytest-xdist workers (``-n 3 --dist loadgroup``). Where
    pytest-xdist runs them with others (``pytest -n 2 --dist loadgroup`` over the whole
    suite), the cluster tests stay in one group, so they run one after another on one
    worker: two clusters at once on two cores dropped their clients and both tests failed.
    The files of :data:`ONE_WORKER_FILES` each stay on one worker too. Without xdist the
    group marker does nothing. ``tryfirst``: xdist's own hook turns the
    group markers into node-id suffixes (``...@nats-cluster``); run after it, as this hook
    did by default, the markers came too late and grouped nothing. pytest 9.2 ignores that
    suffix (pytest-dev/pytest-xdist#1386), hence ``pytest<9.2`` in the test extra.
    ``tests/test_repo_hygiene.py`` checks that the grouping holds."""
    for item in items:
        if item.path.name in CLUSTER_TEST_FILES:
            item.add_marker(pytest.mark.xdist_group("nats-cluster"))
        elif item.path.name in ONE_WORKER_FILES:
            item.add_marker(pytest.mark.xdist_group(ONE_WORKER_FILES[item.path.name]))
