"""The embedded MQTT broker (amqtt, MQTT 3.1.1) run in a background thread on loopback.

``fedmoe simulate`` and ``fedmoe aggregator`` without ``--broker`` start one, so a whole
federation runs from one command. Production deployments use Mosquitto or another
MQTT 5 broker (``examples/deploy/``).

**Late PUBACKs.** amqtt 0.12.1 waits a fixed 5 s for a subscriber's PUBACK after it wrote
a QoS 1 PUBLISH to that subscriber's socket, then logs "Timeout waiting for PUBACK",
raises ``TimeoutError`` in the delivery task (a traceback: "Task failed and will be
skipped" or asyncio's "Task exception was never retrieved") and forgets the message; the
PUBACK that arrives later is logged as "Received PUBACK for unknown pending message".
The aggregator acknowledges a message only after handling it (``manual_ack``, so that a
crash makes the broker redeliver), and it handles none while it evaluates the model or
aggregates a round (seconds to minutes on a small machine): every device message of that
time gets its PUBACK late. Nothing is lost: the PUBLISH had been written to the socket
before the wait started and the client processes it when it gets to it; amqtt only
drops its in-flight record, which matters for redelivery after a reconnect of a
persistent session, and the embedded broker gives every 3.1.1 client a clean session.
So the embedded broker counts these records (:attr:`EmbeddedBroker.late_acks`) and keeps
them off the terminal: they go to ``log_file`` when one is given, else to this module's
logger at DEBUG.

**Connect races.** amqtt 0.12.1 iterates its table of subscriptions, awaiting inside the
loop, while it sets up a connecting client; another client's SUBSCRIBE at that moment
raises "dictionary changed size during iteration" and drops the connecting client, which
reconnects (paho) and subscribes again (:mod:`protocol.transport`); nothing is lost. These
are counted (:attr:`EmbeddedBroker.connect_races`) and kept off the terminal the same way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_LATE_ACK = ("Timeout waiting for PUBACK", "Received PUBACK for unknown pending message")
"""What amqtt 0.12.1 says about a PUBACK that came after its fixed 5 s wait (module docstring)."""

_AMQTT_LOGGERS = ("amqtt", "transitions")
_LATE_ACK_LOGGERS = ("amqtt.broker", "amqtt.mqtt.protocol.handler")
"""The amqtt loggers that make the late-PUBACK records."""


_CONNECT_RACE = "dictionary changed size during iteration"
"""What amqtt 0.12.1 raises when a client's SUBSCRIBE races another's connect (module docstring)."""


def _is_late_ack(text: str, exc: BaseException | None = None) -> bool:
    """Whether a log message or exception is amqtt's report of a late PUBACK."""
    return any(s in text or (exc is not None and s in str(exc)) for s in _LATE_ACK)


def _is_connect_race(exc: BaseException | None) -> bool:
    """Whether a task's exception is amqtt's connect race (module docstring)."""
    return isinstance(exc, RuntimeError) and _CONNECT_RACE in str(exc)


class _LateAcks(logging.Filter):
    """On amqtt's loggers: counts the late-PUBACK records and keeps them from the terminal
    (written to ``file`` if set, else re-logged at DEBUG); passes every other record."""

    def __init__(self, broker: "EmbeddedBroker"):
        super().__init__()
        self.broker = broker

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not _is_late_ack(record.getMessage(), exc):
            return True
        if record.getMessage().startswith(_LATE_ACK[0]):  # once per late PUBACK (a traceback and a line follow)
            self.broker.late_acks += 1
        self.broker.note(record)
        return False


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
        log_file: where amqtt's own log (warnings and errors, late PUBACKs included) goes
            instead of the terminal; None: amqtt's warnings go to the terminal as any
            library's, except the late PUBACKs (see the module docstring), which go to
            DEBUG.

    Use as a context manager or call :meth:`start` / :meth:`stop`; :attr:`url` is the
    ``mqtt://`` URL clients connect to.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, log_file: str | Path | None = None):
        self.host = host
        self.port = port or free_port(host)
        self.log_file = Path(log_file) if log_file is not None else None
        self.log_handler: logging.Handler | None = None
        """The file handler on amqtt's loggers while running (``log_file``)."""
        self.late_acks = 0
        """PUBACKs that came after amqtt's 5 s wait (harmless; see the module docstring)."""
        self.connect_races = 0
        """Clients dropped by amqtt's connect race, which reconnect (harmless; module docstring)."""
        self._filter = _LateAcks(self)
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
        """Start listening. Raises RuntimeError if the broker does not come up, OSError if
        ``log_file`` cannot be opened."""
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            self.log_handler = logging.FileHandler(self.log_file)
            self.log_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                                                            "%H:%M:%S"))
        for name in _AMQTT_LOGGERS:
            logger = logging.getLogger(name)
            logger.setLevel(logging.WARNING)
            if self.log_handler is not None:
                logger.addHandler(self.log_handler)
                logger.propagate = False
        for name in _LATE_ACK_LOGGERS:
            logging.getLogger(name).addFilter(self._filter)
        self._thread = threading.Thread(target=self._run, name="embedded-mqtt-broker", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"embedded MQTT broker failed to start: {self._error}")
        log.info("embedded MQTT broker (amqtt) listening on %s", self.url)
        return self

    def _on_task_error(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """The broker loop's exception handler: a late PUBACK or a connect race is counted
        and noted (:meth:`note`); any other error is logged on the ``amqtt`` logger
        (``log_file`` when given)."""
        exc, message = context.get("exception"), context.get("message", "task error")
        race = _is_connect_race(exc)
        if race or isinstance(exc, TimeoutError) and _is_late_ack("", exc):
            self.connect_races += race
            self.note(logging.LogRecord("amqtt.broker", logging.WARNING, __file__, 0, f"{message}: {exc}", (), None))
            return
        logging.getLogger("amqtt").error("embedded broker: %s", message,
                                         exc_info=(type(exc), exc, exc.__traceback__) if exc else None)

    def note(self, record: logging.LogRecord) -> None:
        """Write ``record`` (a late PUBACK or a connect race) to ``log_file``, or as a DEBUG line
        of this module."""
        if self.log_handler is not None:
            self.log_handler.handle(record)
        else:
            log.debug("amqtt notice (harmless, see fedmoe.broker): %s", record.getMessage())

    def _run(self) -> None:
        from amqtt.broker import Broker

        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._on_task_error)
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
        """Shut the broker down and join its thread; detach from amqtt's loggers."""
        if self._loop is None or self._broker is None:
            self._detach()
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
        if self.late_acks:
            self.note(logging.LogRecord(log.name, logging.INFO, __file__, 0, f"{self.late_acks} PUBACKs came after "
                                        "amqtt's fixed 5 s wait (a client with manual acks was busy): harmless, the "
                                        "messages had been delivered (fedmoe.broker)", (), None))
        self._detach()

    def _detach(self) -> None:
        """Undo :meth:`start`'s changes to amqtt's loggers."""
        for name in _LATE_ACK_LOGGERS:
            logging.getLogger(name).removeFilter(self._filter)
        if self.log_handler is not None:
            for name in _AMQTT_LOGGERS:
                logging.getLogger(name).removeHandler(self.log_handler)
                logging.getLogger(name).propagate = True
            self.log_handler.close()
            self.log_handler = None

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
