"""Base shards over HTTP (protocol minor 6): content-addressed files any web server serves,
fetched by range requests and refused when their sha256 does not match."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from edge_sdk.http_shards import ShardDownloadError, download
from fedmoe.file_server import FileServer
from tests.federation import Federation


class ShardServer(FileServer):
    """:class:`fedmoe.file_server.FileServer` on a free loopback port (as nginx or a CDN
    would serve ``directory``), optionally misbehaving: ``tamper`` flips a byte of every file,
    ``ignore_ranges`` answers 200 with the whole file, ``drop_first`` closes the first
    connection after half its bytes. ``requests`` records ``(file name, Range header)``."""

    def __init__(self, directory: Path):
        self.tamper, self.ignore_ranges, self.drop_first = False, False, False
        super().__init__(directory)

    def read(self, name: str) -> bytes | None:
        data = super().read(name)
        return data[:-1] + bytes([data[-1] ^ 1]) if data is not None and self.tamper else data

    def handle(self, h, ranges: bool = True) -> None:
        super().handle(h, ranges=not self.ignore_ranges)

    def send(self, h, body: bytes) -> None:
        if self.drop_first:
            self.drop_first = False
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            return
        h.wfile.write(body)


@pytest.fixture
def server(tmp_path):
    s = ShardServer(tmp_path / "served")
    s.directory.mkdir()
    yield s
    s.close()


def _file(server: ShardServer, size: int) -> tuple[str, bytes]:
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    sha = hashlib.sha256(data).hexdigest()
    (server.directory / f"{sha}.safetensors").write_bytes(data)
    return sha, data


def test_download_reads_range_windows_and_verifies(server, tmp_path):
    sha, data = _file(server, 10_000)
    dest = download(f"{server.url}/{sha}.safetensors", sha, len(data), tmp_path / "part", window=4096)
    assert dest.read_bytes() == data
    assert [r for _, r in server.requests] == ["bytes=0-4095", "bytes=4096-8191", "bytes=8192-9999"]


def test_a_tampered_shard_is_refused_by_its_sha256_and_nothing_is_kept(server, tmp_path):
    sha, data = _file(server, 5000)
    server.tamper = True
    dest = tmp_path / "part"
    with pytest.raises(ShardDownloadError, match="sha256 check"):
        download(f"{server.url}/{sha}.safetensors", sha, len(data), dest, window=4096)
    assert not dest.exists()


def test_a_server_without_ranges_a_dropped_connection_and_bad_servers(server, tmp_path):
    sha, data = _file(server, 9000)
    url = f"{server.url}/{sha}.safetensors"
    server.ignore_ranges = True  # a plain server: the whole file in one 200
    assert download(url, sha, len(data), tmp_path / "a", window=4096).read_bytes() == data
    server.ignore_ranges, server.drop_first = False, True  # the first response is cut short: resumed
    assert download(url, sha, len(data), tmp_path / "b", window=4096).read_bytes() == data
    with pytest.raises(ShardDownloadError, match="bytes"):  # the manifest says more than the server has
        download(url, sha, len(data) + 10, tmp_path / "c", window=4096)
    with pytest.raises(ShardDownloadError, match="404|Not Found"):
        download(f"{server.url}/{'0' * 64}.safetensors", "0" * 64, 10, tmp_path / "d", retries=0)
    with pytest.raises(ShardDownloadError, match="not http"):
        download("file:///etc/passwd", sha, 10, tmp_path / "e")
    n = len(server.requests)
    with pytest.raises(ShardDownloadError, match="over this device's limit"):  # a manifest claiming a huge shard
        download(url, sha, 2**40, tmp_path / "f", max_bytes=2**31)
    assert len(server.requests) == n and not (tmp_path / "f").exists()  # nothing asked for, nothing written


def test_config_needs_shard_url_and_dir_together(tmp_path):
    from pydantic import ValidationError

    from cloud.service import AggregatorConfig, TaskConfig
    from tests.conftest import tiny_spec

    kw = dict(model=tiny_spec(), tasks={"t": TaskConfig(labels=["a", "b"])})
    with pytest.raises(ValidationError, match="shard_url and shard_dir go together"):
        AggregatorConfig(**kw, shard_url="http://cdn.example/shards")
    with pytest.raises(ValidationError, match="shard_url"):
        AggregatorConfig(**kw, shard_url="ftp://cdn.example/shards", shard_dir=str(tmp_path))
    AggregatorConfig(**kw, shard_url="https://cdn.example/shards", shard_dir=str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["http", "tampered", "minor5"])
def test_a_federation_fetches_shards_over_http(mosquitto_url, server, tmp_path, monkeypatch, mode):
    """The aggregator writes the shard files to shard_dir and holds none in the broker;
    devices fetch them from shard_url by range requests and train. A tampered file fails
    the sha256 check: the device refuses it, trains nothing, and says why. Devices below
    minor 6 get the shards as retained messages instead, as before."""
    import edge_sdk.client

    server.tamper = mode == "tampered"
    if mode == "minor5":
        monkeypatch.setattr(edge_sdk.client, "PROTOCOL_MINOR", 5)
    fed = Federation(mosquitto_url, str(tmp_path), rounds=1, experts=(2, 2), round_timeout_s=30,
                     config_kw={"shard_url": server.url, "shard_dir": str(server.directory)})
    records = fed.run(timeout=120)
    (rec,) = records
    names = {p.name for p in server.directory.glob("*.safetensors")}
    assert names  # written at start for the devices that fetch by URL
    if mode == "minor5":
        assert rec["status"] == "ok" and not server.requests
        assert fed.aggregator.shards.published == {"int8"}
        return
    assert fed.aggregator.shards.published == set()  # no shard bytes held by the broker
    assert {n for n, _ in server.requests} <= names
    assert all(r and r.startswith("bytes=") for _, r in server.requests)
    if mode == "http":
        assert rec["status"] == "ok" and set(rec["devices"]) == {"dev0", "dev1"}
        for v in rec["devices"].values():
            assert v["shards_fetched"] and v["bytes_down"] < sum(p.stat().st_size for p in server.directory.iterdir())
    else:
        assert rec["status"] == "no_quorum" and not rec["devices"]
        assert all("sha256 check" in why for why in rec["failures"].values()), rec["failures"]
        assert not any(p.suffix == ".part" for p in tmp_path.glob("cache*/*"))
