"""The base model's shards, made available to devices in each weight format they load:
as retained MQTT messages (chunked blobs under ``shard_prefix``), or as files in
``shard_dir`` that a web server serves at ``shard_url`` for devices that fetch them by
HTTP (protocol minor 6 or later; ``AggregatorConfig.shard_url``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterable, Iterator

from protocol.topics import Topics
from protocol.transport import Transport

from .global_model import GlobalModel

log = logging.getLogger(__name__)


class ShardPublisher:
    """Publishes or writes the base shards of ``model``, each format on first use.

    Args:
        model: the global model (its ``encoded`` shards and their ``sha``, per format).
        topics: the federation's topics.
        transport: the aggregator's MQTT transport.
        shard_dir: the directory the shard files are written to (with ``shard_url``).
        shard_url: the base URL devices fetch the files from; None: retained messages only.
    """

    def __init__(self, model: GlobalModel, topics: Topics, transport: Transport, shard_dir: str | None,
                 shard_url: str | None):
        self.model, self.topics, self.transport = model, topics, transport
        self.shard_dir, self.shard_url = shard_dir, shard_url
        self.published: set[str] = set()
        """Formats whose shards are retained on the broker (cleared by :meth:`clear_retained`)."""
        self.written: set[str] = set()
        """Formats whose shards are files in ``shard_dir``."""

    def start(self) -> None:
        """Make the primary format's shards available, in the form most devices take: files
        when ``shard_url`` is set, else retained messages."""
        if self.shard_url is None:
            self.publish()
        else:
            self.write_files(self.model.weight_format)

    def ensure(self, fmt: str, by_url: bool = False) -> None:
        """Make ``fmt``'s shards available the first time they are needed: as files in
        ``shard_dir`` for devices that fetch them by URL (``by_url``), else as retained
        messages (the primary format's, in the form most devices take, when :meth:`start`
        runs)."""
        if by_url and fmt not in self.written:
            self.write_files(fmt)
        elif not by_url and fmt not in self.published:
            if fmt == self.model.weight_format and self.shard_url is None:
                return  # published by start()
            self.publish(fmt)

    def _items(self, formats: Iterable[str] | None = None) -> Iterator[tuple[str, str, bytes, str]]:
        """``(shard id, topic prefix, encoded bytes, format)`` of ``formats`` (default: the published ones)."""
        for fmt in formats if formats is not None else sorted(self.published):
            for sid, data in self.model.encoded[fmt].items():
                prefix = self.topics.shard_prefix(self.model.version, sid, fmt)
                yield sid, prefix, data, fmt

    def publish(self, fmt: str | None = None) -> None:
        """Publish the base shards of ``fmt`` (default: the primary format) as retained messages."""
        fmt = fmt or self.model.weight_format
        t0 = time.perf_counter()
        total = 0
        for sid, prefix, data, _ in self._items([fmt]):
            self.transport.publish_blob(lambda i, p=prefix: f"{p}/{i}", data, "shard", self.model.version,
                                        transfer_id=f"shard-{self.model.sha[fmt][sid][:32]}", retain=True)
            total += len(data)
        self.published.add(fmt)
        log.info("published %d %s base shards (%.1f MiB, retained) in %.1f s", len(self.model.encoded[fmt]), fmt,
                 total / 2**20, time.perf_counter() - t0)

    def write_files(self, fmt: str) -> None:
        """Write ``fmt``'s shards to ``shard_dir`` as ``{sha256}.safetensors``
        (``moe_model.shards.ShardCache.put``: atomically, hash checked; a file already there
        is content-addressed, so it is kept), for a web server to serve at ``shard_url``.
        Raises OSError when the directory cannot be written."""
        from moe_model.shards import ShardCache

        files = ShardCache(Path(self.shard_dir))  # the same {sha256}.safetensors layout a device caches
        t0, written = time.perf_counter(), 0
        for sid, data in self.model.encoded[fmt].items():
            sha = self.model.sha[fmt][sid]
            if not files.has(sha):
                files.put(sha, data)
                written += len(data)
        self.written.add(fmt)
        log.info("wrote %s base shards to %s (%.1f MiB new) in %.1f s; devices fetch them from %s", fmt,
                 files.directory, written / 2**20, time.perf_counter() - t0, self.shard_url)

    def clear_retained(self, timeout: float = 10.0) -> None:
        """Delete the retained shard messages published (an empty retained payload clears a
        topic), waiting at most ``timeout`` seconds for the broker's acknowledgements; a
        failure is logged, never raised. Not attempted while the broker is unreachable (the
        next model's shards replace them)."""
        if not self.transport.connected:
            log.warning("broker unreachable: the retained shards stay on it until the next model replaces them")
            return
        from protocol.chunking import chunk_data_bytes

        step = chunk_data_bytes(self.transport.chunk_payload_bytes)
        items = []
        for _, prefix, data, _ in self._items():
            items += [(f"{prefix}/{i}", b"", True) for i in range(max(1, -(-len(data) // step)))]
        try:
            self.transport.publish_many(items, timeout=timeout)
        except Exception as e:
            log.warning("could not clear retained shards: %s", e)
