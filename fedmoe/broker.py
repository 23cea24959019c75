"""The embedded MQTT broker (amqtt, MQTT 3.1.1) run in a background thread on loopback.

``fedmoe simulate`` and ``fedmoe aggregator`` without ``--broker`` start one, so a whole
federation runs from one command. Production deployments use Mosquitto or another
MQTT 5 broker (``examples/deploy/``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedBroker:
    """amqtt broker in a daemon thread.

    Args:
        host: interface to listen on (loopback by default).
        port: TCP port; 0 picks a free one.

    Use as a context manager or call :meth:`start` / :meth:`stop`; :attr:`url` is the
    ``mqtt://`` URL clients connect to.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self.port = port or free_port(host)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broker = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """``mqtt://{host}:{port}``."""
        return f"mqtt://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "EmbeddedBroker":
        """Start listening. Raises RuntimeError if the broker does not come up."""
        for name in ("amqtt", "transitions"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self._thread = threading.Thread(target=self._run, name="embedded-mqtt-broker", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"embedded MQTT broker failed to start: {self._error}")
        log.info("embedded MQTT broker (amqtt) listening on %s", self.url)
        return self

    def _run(self) -> None:
        from amqtt.broker import Broker

        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}", "max_connections": 10000}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
        try:
            self._broker = Broker(config, loop=self._loop)
            self._loop.run_until_complete(self._broker.start())
        except BaseException as e:  # surfaced by start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        """Shut the broker down and join its thread."""
        if self._loop is None or self._broker is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop)
        try:
            fut.result(timeout=10)
        except Exception as e:
            log.debug("broker shutdown: %s", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._loop = None

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class MosquittoBroker:
    """A Mosquitto broker process on a free port with a generated config (tests, benchmarks).

    Args:
        workdir: directory for the config, persistence and log.
        config: extra config lines (auth, TLS, ACL; e.g. from
            :func:`fedmoe.provision.mosquitto_conf` minus its listener); the listener
            line is added here.
        port: TCP port; 0 picks a free one (kept across :meth:`restart`).
        persistence: keep sessions and retained messages on disk across restarts.
        exe: the mosquitto binary (default: found on PATH or /usr/sbin/mosquitto).

    Raises:
        RuntimeError: no mosquitto binary, or the broker did not start listening.
    """

    def __init__(self, workdir: str, config: str = "allow_anonymous true\n", port: int = 0,
                 persistence: bool = True, exe: str | None = None, host: str = "127.0.0.1"):
        import shutil
        from pathlib import Path

        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.exe = exe or shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not Path(self.exe).exists():
            raise RuntimeError("mosquitto binary not found")
        self.host = host
        self.port = port or free_port(host)
        self.config = config
        self.persistence = persistence
        self.proc = None

    @staticmethod
    def available() -> bool:
        """Whether a mosquitto binary is on PATH or at /usr/sbin/mosquitto."""
        import shutil
        from pathlib import Path

        return bool(shutil.which("mosquitto")) or Path("/usr/sbin/mosquitto").exists()

    def url(self, tls: bool = False, username: str | None = None, password: str | None = None) -> str:
        """``mqtt[s]://[username:password@]{host}:{port}`` (credentials only when ``username`` is given)."""
        auth = f"{username}:{password}@" if username else ""
        return f"{'mqtts' if tls else 'mqtt'}://{auth}{self.host}:{self.port}"

    def _conf(self) -> str:
        lines = [line for line in self.config.splitlines() if not line.startswith(("listener", "persistence"))]
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        body = "\n".join(lines)
        # listener-scoped options (certfile, keyfile, ...) must follow the listener line
        listener_opts = ("certfile", "keyfile", "cafile", "tls_version", "require_certificate")
        glob = [x for x in body.splitlines() if not x.startswith(listener_opts)]
        scoped = [x for x in body.splitlines() if x.startswith(listener_opts)]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            glob.append("user root")  # else mosquitto drops to `mosquitto` and cannot read 0600 files
        return "\n".join(glob + [
            f"persistence {'true' if self.persistence else 'false'}",
            f"persistence_location {data}/",
            "autosave_interval 1",
            f"log_dest file {self.workdir / 'mosquitto.log'}",
            f"listener {self.port} {self.host}",
        ] + scoped) + "\n"

    def start(self, timeout: float = 20.0) -> "MosquittoBroker":
        """Write ``mosquitto.conf`` into ``workdir``, launch the process and wait (``timeout`` seconds)
        until its port accepts connections.

        Raises:
            RuntimeError: the process exited (its stderr tail in the message) or did not listen in time
                (it is stopped then).
        """
        import subprocess
        import time

        conf = self.workdir / "mosquitto.conf"
        conf.write_text(self._conf())
        self.proc = subprocess.Popen([self.exe, "-c", str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode}: {err[-2000:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    log.info("mosquitto listening on %s:%d", self.host, self.port)
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mosquitto did not listen on {self.port} within {timeout} s")

    def stop(self, kill: bool = False) -> None:
        """Stop the broker (SIGTERM saves persistence; ``kill=True`` sends SIGKILL)."""
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def restart(self) -> "MosquittoBroker":
        """Stop and start again on the same port (persistent state kept)."""
        self.stop()
        return self.start()

    def __enter__(self) -> "MosquittoBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
