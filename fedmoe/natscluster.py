"""A NATS cluster with its MQTT gateway and JetStream, started on loopback (tests, benchmarks).

Why NATS for a clustered broker (docs/deployment.md, "A clustered broker"): the MQTT gateway of
``nats-server`` keeps MQTT sessions, QoS 1 queues and retained messages in JetStream
streams replicated over the cluster (``stream_replicas``/``consumer_replicas`` 3 here), so
a client whose node dies reconnects to any other node and finds its session, its queued
messages and the retained ones there. RabbitMQ 3.10's ``rabbitmq_mqtt`` keeps retained
messages in a node-local store and sends none for wildcard topic filters (rabbitmq-server
issue #8096), and the aggregator reads the retained hellos and statuses through
``dev/+/up/...``. Both speak MQTT 3.1.1 only.

Every node's configuration is :func:`node_config` (the same text as
``examples/deploy/nats/node.conf`` with its ports filled in). Clients name the cluster by
its nodes' URLs, comma-separated (:class:`protocol.transport.Transport`).

    with NatsCluster(tmp_dir) as cluster:     # 3 nodes on free loopback ports
        url = cluster.url                     # "mqtt://127.0.0.1:p1,mqtt://127.0.0.1:p2,..."
        cluster.kill(0)                       # SIGKILL node 0 (its clients move on)
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .broker import free_port

log = logging.getLogger(__name__)

NODE_TEMPLATE = """\
# One node of a 3-node NATS cluster serving MQTT 3.1.1 (fedmoe's clustered broker).
server_name: {name}
listen: {host}:{client_port}
http: {host}:{monitor_port}
max_payload: 8MB                # above protocol.messages.MAX_CONTROL_BYTES (4 MiB) and any chunk
jetstream {{
  store_dir: "{store_dir}"
}}
cluster {{
  name: {cluster}
  listen: {host}:{route_port}
  routes: [{routes}]
}}
mqtt {{
  listen: {host}:{mqtt_port}
  stream_replicas: {replicas}          # sessions, QoS 1 messages and retained messages on every node
  consumer_replicas: {replicas}
  ack_wait: "{ack_wait}"                 # a QoS 1 message not acknowledged in this time is sent again
  max_ack_pending: 1024
}}
"""
"""Node configuration; ``examples/deploy/nats/node.conf`` is this text with example values."""


ACK_WAIT = "30s"
"""The shipped redelivery time of an unacknowledged QoS 1 message (tests shorten it)."""


def node_config(name: str, host: str, client_port: int, monitor_port: int, route_port: int, mqtt_port: int,
                routes: list[str], store_dir: str, cluster: str = "fedmoe", replicas: int = 3,
                ack_wait: str = ACK_WAIT) -> str:
    """The configuration file text of one node (:data:`NODE_TEMPLATE`).

    Args:
        routes: ``host:port`` of every node's cluster (route) listener, this one included.
        replicas: JetStream replicas of the MQTT streams and consumers (at most the node count).
        ack_wait: how long a QoS 1 message may stay unacknowledged before it is sent again.
    """
    return NODE_TEMPLATE.format(name=name, host=host, client_port=client_port, monitor_port=monitor_port,
                                route_port=route_port, mqtt_port=mqtt_port, store_dir=store_dir, cluster=cluster,
                                routes=", ".join(f"nats-route://{r}" for r in routes), replicas=replicas,
                                ack_wait=ack_wait)


class NatsCluster:
    """``nodes`` ``nats-server`` processes forming one cluster on ``host``, free ports.

    Args:
        workdir: where configurations, JetStream stores and logs go (one folder per node).
        nodes: cluster size (3 keeps a JetStream quorum when one node dies).
        exe: the ``nats-server`` binary (default: from PATH, else ``/usr/sbin/nats-server``).
        users: a file every node includes, e.g. the ``nats-users.conf`` of ``fedmoe
            provision`` (accounts and per-device permissions); None: no authentication.
        probe: ``(username, password)`` the readiness probe connects with (needed with
            ``users``).

    Raises:
        FileNotFoundError: no ``nats-server`` binary.
        RuntimeError: from :meth:`start`, when the cluster does not accept MQTT clients
            within the timeout (the reason and the last log lines are in the message).
    """

    def __init__(self, workdir: str | Path, nodes: int = 3, host: str = "127.0.0.1", exe: str | None = None,
                 users: str | Path | None = None, probe: tuple[str, str] | None = None, ack_wait: str = ACK_WAIT):
        self.ack_wait = ack_wait
        self.exe = exe or shutil.which("nats-server") or "/usr/sbin/nats-server"
        if not os.path.exists(self.exe):
            raise FileNotFoundError("no nats-server binary (Debian package nats-server)")
        self.workdir, self.host, self.size = Path(workdir), host, int(nodes)
        self.users, self.probe = (Path(users).resolve() if users else None), probe
        self.attempt = 0
        self.procs: list[subprocess.Popen | None] = [None] * self.size
        self._pick_ports()

    def _pick_ports(self) -> None:
        ports: list[int] = []
        while len(ports) < 4 * self.size:  # free_port may hand the same port out twice
            p = free_port(self.host)
            if p not in ports:
                ports.append(p)
        self.client_ports = ports[0::4]
        self.monitor_ports = ports[1::4]
        self.route_ports = ports[2::4]
        self.mqtt_ports = ports[3::4]

    @property
    def urls(self) -> list[str]:
        """Each node's MQTT URL."""
        return [f"mqtt://{self.host}:{p}" for p in self.mqtt_ports]

    @property
    def url(self) -> str:
        """The cluster as a :class:`protocol.transport.Transport` URL (nodes comma-separated)."""
        return ",".join(self.urls)

    def node_of(self, port: int) -> int:
        """The index of the node whose MQTT port is ``port``."""
        return self.mqtt_ports.index(port)

    def _node_dir(self, i: int) -> Path:
        return self.workdir / (f"n{i}" if self.attempt == 0 else f"try{self.attempt}-n{i}")

    def start_node(self, i: int) -> None:
        """(Re)start node ``i`` with its configuration and its JetStream store kept."""
        d = self._node_dir(i)
        d.mkdir(parents=True, exist_ok=True)
        routes = [f"{self.host}:{p}" for p in self.route_ports]
        conf = d / "node.conf"
        if self.users:  # NATS resolves an include relative to the including file
            shutil.copyfile(self.users, d / "users.conf")
            os.chmod(d / "users.conf", 0o600)
        conf.write_text(node_config(f"n{i}", self.host, self.client_ports[i], self.monitor_ports[i],
                                    self.route_ports[i], self.mqtt_ports[i], routes, str(d / "js"),
                                    replicas=min(3, self.size), ack_wait=self.ack_wait)
                        + ('include "users.conf"\n' if self.users else ""))
        with open(d / "log", "ab") as logf:
            self.procs[i] = subprocess.Popen([self.exe, "-c", str(conf)], stdout=logf, stderr=subprocess.STDOUT,
                                             start_new_session=True)

    def start(self, timeout: float = 60.0, attempts: int = 3) -> "NatsCluster":
        """Start every node and wait until each accepts an MQTT client (JetStream ready).

        A cluster that does not become ready within ``timeout`` s is stopped and started
        again on fresh ports and stores, up to ``attempts`` times: a port handed out by
        :func:`free_port` may be taken by another process before the node binds it, and a
        loaded machine once left a fresh NATS 2.9 cluster refusing every MQTT connect for a
        minute ("no suitable peers for placement") although all three nodes ran.

        Raises:
            RuntimeError: not ready after ``attempts`` tries (every node's last log lines).
        """
        for self.attempt in range(attempts):
            for i in range(self.size):
                self.start_node(i)
            try:
                self.wait_ready(timeout)
                break
            except RuntimeError as e:
                self.stop()
                if self.attempt + 1 >= attempts:
                    raise
                log.warning("NATS cluster not ready (try %d of %d), starting again on new ports: %s",
                            self.attempt + 1, attempts, e)
                self._pick_ports()
        log.info("NATS cluster of %d nodes ready: %s", self.size, self.url)
        return self

    def wait_ready(self, timeout: float = 60.0, nodes: list[int] | None = None) -> None:
        """Wait until every live node (or ``nodes``) completes an MQTT connect.

        Raises:
            RuntimeError: a node exited, or not ready within ``timeout`` s.
        """
        from protocol.transport import Transport, TransportError

        deadline = time.monotonic() + timeout
        live = nodes if nodes is not None else [i for i, p in enumerate(self.procs) if p is not None]
        for i in live:
            while True:
                for j in live:  # a node that exited (e.g. its port was taken) fails fast
                    proc = self.procs[j]
                    if proc is None or proc.poll() is not None:
                        raise RuntimeError(f"NATS node {j} exited: {self.log_tail(j)}")
                try:
                    user, password = self.probe or (None, None)
                    Transport(self.urls[i], f"ready-probe-{i}", protocol="3.1.1", username=user,
                              password=password).connect(
                        timeout=max(1.0, min(10.0, deadline - time.monotonic()))).close()
                    break
                except TransportError as e:
                    if time.monotonic() > deadline:
                        tails = " || ".join(f"node {j}: {self.log_tail(j, 3)}" for j in live)
                        raise RuntimeError(f"NATS node {i} not ready in {timeout} s ({e}): {tails}") from None
                    time.sleep(0.5)

    def log_tail(self, i: int, lines: int = 5) -> str:
        """The last ``lines`` lines of node ``i``'s log."""
        f = self._node_dir(i) / "log"
        return " | ".join(f.read_text(errors="replace").splitlines()[-lines:]) if f.is_file() else ""

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (as a crash would; its store stays for :meth:`start_node`)."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self.procs[i] = None
        log.info("NATS node %d killed", i)

    def stop(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL after 10 s)."""
        for i, proc in enumerate(self.procs):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for i, proc in enumerate(self.procs):
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)
            self.procs[i] = None

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
