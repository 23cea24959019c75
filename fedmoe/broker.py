"""The embedded MQTT broker (amqtt, MQTT 3.1.1) run in a background thread on loopback.

``fedmoe simulate`` and ``fedmoe aggregator`` without ``--broker`` start one, so a whole
federation runs from one command. Production deployments use Mosquitto or another
MQTT 5 broker (``examples/deploy/``).
"""

from __future__ import annotations

import asyncio
import logging
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
