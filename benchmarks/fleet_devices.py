"""Protocol-level devices for the fleet load test (``benchmarks/fleet.py``): no model, no torch.

One OS process runs many devices in one asyncio loop (aiomqtt; paho underneath). Each is a
real MQTT client of its own that speaks the device side of PROTOCOL.md: the retained
``status`` and ``hello``, an ``ack`` for every new assignment, reassembly of the adapter
state blob it was sent (chunk checksums, sha256), and then, after a simulated training
time, an update of exactly that state's names and shapes (the state plus noise, fp32
safetensors, chunked, every chunk Ed25519-signed) followed by signed ``stats`` that name
it. Over MQTT 3.1.1 the signature travels in the ``FMP1`` envelope (PROTOCOL.md §8.1).

    python -m benchmarks.fleet_devices --spec spec.json --index 0

``spec.json`` (written by ``fleet.py``) names the broker nodes, the federation, this
process's device ids and private keys. The process writes ``{out}/devices-{index}.json``
(per device: when it connected, per round when its last update chunk was acknowledged
by the broker, rejects it received) when it gets SIGTERM, and a one-line progress file
every 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import secrets
import signal
import time
import zlib
from pathlib import Path

import aiomqtt
import numpy as np
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from protocol import envelope
from protocol.chunking import DEFAULT_CHUNK_BYTES, ChunkError, Reassembler, split_blob
from protocol.messages import (PROTOCOL_MINOR, Ack, Assignment, BlobRef, Command, Hello, LayerStats,
                               MessageError, Stats, Status, encode, parse_message)
from protocol.signing import Signer, load_private_key
from protocol.topics import Topics


log = logging.getLogger("fleet.devices")
SAMPLES = 100
"""Samples every fleet device declares (its aggregation weight)."""


def node_for(device_id: str, nodes: list[tuple[str, int]]) -> tuple[str, int]:
    """The broker node a device connects to: crc32 of its id over the nodes, as
    ``protocol.transport`` picks a cluster node."""
    return nodes[zlib.crc32(device_id.encode()) % len(nodes)]


class FleetDevice:
    """One protocol-level device (module docstring); ``record`` is what it measured."""

    def __init__(self, device_id: str, key_b64: str, spec: dict, stop: asyncio.Event):
        self.id = device_id
        self.signer = Signer(device_id, load_private_key(key_b64))
        self.spec = spec
        self.topics = Topics(spec["federation"])
        self.v5 = spec["protocol"] == "5"
        self.stop = stop
        self.rng = np.random.default_rng(zlib.crc32(device_id.encode()))
        self.record: dict = {"connected_at": None, "connects": 0, "rounds": {}, "rejects": 0, "reject_reasons": []}
        self.served: tuple[int, int] = (-1, -1)
        self.states: dict[str, bytes] = {}
        self.waiting: Assignment | None = None
        self.reasm = Reassembler(max_blob_bytes=256 * 2**20, max_pending=4)

    async def run(self) -> None:
        """Connect (retrying with back-off while the broker refuses), serve rounds until
        ``stop`` is set."""
        host, port = node_for(self.id, self.spec["nodes"])
        status_off = encode(Status(device_id=self.id, state="offline"))
        will = aiomqtt.Will(self.topics.up(self.id, "status"), status_off, qos=1, retain=True)
        proto = aiomqtt.ProtocolVersion.V5 if self.v5 else aiomqtt.ProtocolVersion.V311
        delay = 1.0
        while not self.stop.is_set():
            client = aiomqtt.Client(host, port, identifier=self.id, protocol=proto, will=will, keepalive=600,
                                    timeout=120, clean_session=None if self.v5 else True)
            try:
                async with client:
                    self.record["connects"] += 1
                    self.record["connected_at"] = self.record["connected_at"] or time.time()
                    await self._serve(client)
                    return
            except aiomqtt.MqttError as e:
                if self.stop.is_set():
                    return
                log.debug("%s: %s; reconnecting in %.0f s", self.id, e, delay)
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 30.0)

    async def _serve(self, client: aiomqtt.Client) -> None:
        await client.subscribe(self.topics.device_down(self.id), qos=self.spec.get("down_qos", 1))
        await client.publish(self.topics.up(self.id, "status"), encode(Status(device_id=self.id, state="online")),
                             qos=1, retain=True)
        hello = Hello(device_id=self.id, sdk_version="fleet-0", protocol_minor=PROTOCOL_MINOR,
                      budget_bytes=8 * 2**30, weight_formats=["int8"], num_samples=SAMPLES, task=self.spec["task"],
                      runtime_bytes=64 * 2**20)
        await client.publish(self.topics.up(self.id, "hello"), encode(hello), qos=1, retain=True)
        tasks: set[asyncio.Task] = set()

        async def consume() -> None:
            async for msg in client.messages:
                self._on_message(client, msg, tasks)

        consumer = asyncio.ensure_future(consume())
        stopper = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({consumer, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for t in (consumer, stopper, *tasks):
            t.cancel()
        if consumer.done() and not consumer.cancelled() and consumer.exception():
            raise consumer.exception()

    def _on_message(self, client: aiomqtt.Client, msg: aiomqtt.Message, tasks: set) -> None:
        kind = str(msg.topic).rsplit("/", 1)[-1]
        payload = bytes(msg.payload)
        if kind == "state":
            try:
                blob = self.reasm.add("cloud", payload)
            except ChunkError as e:
                log.debug("%s: bad state chunk: %s", self.id, e)
                return
            if blob is not None:
                self.states[blob.transfer_id] = blob.data
        elif kind == "assignment":
            try:
                a = parse_message(payload, Assignment)
            except MessageError as e:
                log.debug("%s: bad assignment: %s", self.id, e)
                return
            if (a.round, a.attempt) < self.served:
                return
            if (a.round, a.attempt) == self.served:  # re-sent: take its state if the first is still missing
                if self.waiting is not None and (self.waiting.round, self.waiting.attempt) == self.served:
                    self.waiting = a
                    self.record["rounds"][str(a.round)]["resent"] = \
                        self.record["rounds"][str(a.round)].get("resent", 0) + 1
                return
            self.served = (a.round, a.attempt)
            self.waiting = a
            self.record["rounds"][str(a.round)] = {"assigned": time.time()}
        elif kind == "command":
            try:
                c = parse_message(payload, Command)
            except MessageError:
                return
            if c.command == "reject":
                self.record["rejects"] += 1
                if len(self.record["reject_reasons"]) < 3:
                    self.record["reject_reasons"].append(c.reason)
        a = self.waiting
        if a is not None and a.state.transfer_id in self.states:
            self.waiting = None  # acknowledged once the state is here, as the SDK does (PROTOCOL.md §4.2)
            ack = Ack(device_id=self.id, round=a.round, accepted=True, attempt=a.attempt)
            self._spawn(tasks, client.publish(self.topics.up(self.id, "ack"), encode(ack), qos=1))
            self._spawn(tasks, self._train_and_upload(client, a, self.states.pop(a.state.transfer_id)))
            self.states.clear()

    @staticmethod
    def _spawn(tasks: set, coro) -> None:
        t = asyncio.ensure_future(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    async def _publish(self, client: aiomqtt.Client, topic: str, payload: bytes, props: dict[str, str]) -> None:
        if self.v5:
            p = Properties(PacketTypes.PUBLISH)
            p.UserProperty = list(props.items())
            await client.publish(topic, payload, qos=1, properties=p)
        else:
            await client.publish(topic, envelope.wrap(payload, props), qos=1)

    async def _train_and_upload(self, client: aiomqtt.Client, a: Assignment, state_bytes: bytes) -> None:
        """Simulated training (a uniform wait of up to ``train_s``), then the signed update
        and stats of round ``a.round``."""
        rec = self.record["rounds"][str(a.round)]
        try:
            await asyncio.sleep(random.uniform(0, self.spec["train_s"]))
            state = st_load(state_bytes)
            update = {k: (v + self.rng.standard_normal(v.shape, dtype=np.float32) * 1e-3).astype(np.float32)
                      for k, v in state.items() if k not in a.tensors}
            data = st_save(update)
            upload_id = secrets.token_hex(8)
            payloads, sha = split_blob(data, self.spec.get("max_payload", DEFAULT_CHUNK_BYTES), upload_id, "update",
                                       a.round)
            props = self.signer.properties("update", a.round, upload_id, sha)
            for p in payloads:
                await self._publish(client, self.topics.up(self.id, "update", a.uplink), p, props)
            rec["last_chunk"] = time.time()
            rec["update_bytes"] = len(data)
            stats = self._stats(a, BlobRef(transfer_id=upload_id, bytes=len(data), sha256=sha, chunks=len(payloads)))
            body = encode(stats)
            await self._publish(client, self.topics.up(self.id, "stats", a.uplink), body,
                                self.signer.stats_properties(a.round, upload_id, body))
            rec["stats_sent"] = time.time()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - one device's failure is recorded, never stops the others
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
            log.debug("%s round %d: %s", self.id, a.round, rec["error"])

    def _stats(self, a: Assignment, ref: BlobRef) -> Stats:
        """Plausible statistics within every bound the cloud checks: a few tokens routed
        to the held experts."""
        E, steps = a.model.num_experts, a.train.max_steps or 1
        tokens = min(64, steps * a.train.batch_size * a.model.max_seq_len)
        layers = []
        for layer in sorted(a.experts):
            held = a.experts[layer]
            usage = [0] * E
            for i in range(tokens * a.model.top_k):
                usage[held[i % len(held)]] += 1
            p = [u / max(1, tokens * a.model.top_k) for u in usage]
            layers.append(LayerStats(layer=layer, tokens=tokens, usage=usage, activation_prob=p, routing_dist=p,
                                     margin=[0.1 if u else 0.0 for u in usage], expert_loss=[None] * E,
                                     expert_acc=[None] * E, expert_samples=[0] * E))
        return Stats(device_id=self.id, round=a.round, task=a.task, num_samples=SAMPLES, train_loss=1.0,
                     layers=layers, update=ref, train_seconds=0.0, bytes_up=ref.bytes, bytes_down=0,
                     peak_rss_bytes=64 * 2**20, baseline_rss_bytes=64 * 2**20, shards_fetched=[])


async def main_async(spec: dict, index: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    out = Path(spec["out"])
    devices = [FleetDevice(d, k, spec, stop) for d, k in spec["devices"][index]]
    rate = spec.get("connect_rate", 200.0)  # connects per second from this process
    tasks = []

    async def progress() -> None:
        while not stop.is_set():
            up = sum(d.record["connected_at"] is not None for d in devices)
            tmp = out / f"progress-{index}.tmp"
            tmp.write_text(f"{up} {len(devices)}\n")
            tmp.replace(out / f"progress-{index}.txt")  # atomic: the reader never sees a partial line
            await asyncio.sleep(2.0)

    prog = asyncio.ensure_future(progress())
    for i, d in enumerate(devices):
        if stop.is_set():
            break
        tasks.append(asyncio.ensure_future(d.run()))
        if i % 20 == 19:
            await asyncio.sleep(20 / rate)
    await stop.wait()
    await asyncio.wait(tasks, timeout=10) if tasks else None
    prog.cancel()
    (out / f"devices-{index}.json").write_text(json.dumps({d.id: d.record for d in devices}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--index", type=int, required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(main_async(json.loads(Path(args.spec).read_text()), args.index))


if __name__ == "__main__":
    main()
