"""Fetch a base shard over HTTP(S) by range requests, verified by its sha256 (protocol minor 6).

When the cloud serves shards as content-addressed files (``ShardManifest.url``, any web
server or CDN), a device downloads each with ``GET`` + ``Range: bytes=a-b`` windows of
``window`` bytes (:data:`moe_model.budget.FETCH_WINDOW_BYTES`: what the memory plan counts
for a download), appends them to a partial file in its shard cache while hashing, resumes
from the last byte it has after a dropped connection, and adopts the file only if its
size and sha256 match the manifest. Nothing unverified is ever loaded. Standard library
only (``urllib``): a device needs no HTTP client package.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class ShardDownloadError(ValueError):
    """A shard could not be downloaded, or its bytes are not the manifest's (size, sha256)."""


def download(url: str, sha256: str, size: int, dest: Path, *, deadline: float | None = None,
             window: int = 8 * 2**20, retries: int = 3, max_bytes: int | None = None) -> Path:
    """Download ``size`` bytes from ``url`` into ``dest`` and verify them.

    Args:
        url: an ``http://`` or ``https://`` URL (the manifest's).
        sha256: the expected hex digest; size: the expected length in bytes.
        dest: the partial file to write (created or truncated).
        deadline: ``time.time()`` by which the download must finish (None: none).
        window: bytes asked for per request.
        retries: failed requests in a row tolerated (each resumes where the file ends).
        max_bytes: the largest ``size`` accepted (the device's shard limit, as the MQTT
            path's reassembler applies it); None: no limit.

    Returns:
        ``dest``, holding exactly the verified bytes.

    Raises:
        ShardDownloadError: ``size`` is above ``max_bytes`` (nothing is requested), the
            server sent more or other bytes than asked for, the
            sha256 does not match (``dest`` is deleted), the deadline passed, or the
            requests kept failing.
    """
    if not url.startswith(("http://", "https://")):
        raise ShardDownloadError(f"shard URL {url[:100]!r} is not http(s)")
    if max_bytes is not None and size > max_bytes:
        raise ShardDownloadError(f"a shard of {size} bytes is over this device's limit of {max_bytes}")
    digest, done, failures = hashlib.sha256(), 0, 0
    with open(dest, "wb") as f:
        while done < size:
            left = None if deadline is None else deadline - time.time()
            if left is not None and left <= 0:
                raise ShardDownloadError(f"shard {sha256[:12]}: deadline passed after {done} of {size} bytes")
            end = min(done + window, size) - 1
            req = urllib.request.Request(url, headers={"Range": f"bytes={done}-{end}"})
            try:
                with urllib.request.urlopen(req, timeout=max(1.0, min(left or 60.0, 60.0))) as r:
                    data = _window(r, done, end, size)
            except (urllib.error.URLError, OSError, TimeoutError) as e:
                failures += 1
                if failures > retries:
                    raise ShardDownloadError(f"shard {sha256[:12]} from {url[:100]}: {e}") from None
                log.info("shard %s: request failed (%s); resuming at byte %d", sha256[:12], e, done)
                time.sleep(min(0.2 * failures, 2.0))
                continue
            if len(data) < end - done + 1 and len(data) < size - done:  # cut short: keep it, resume after it
                failures += 1
                if failures > retries:
                    raise ShardDownloadError(f"shard {sha256[:12]} from {url[:100]}: responses keep ending early")
                log.info("shard %s: response ended after %d bytes; resuming at byte %d", sha256[:12], len(data),
                         done + len(data))
            else:
                failures = 0
            f.write(data)
            digest.update(data)
            done += len(data)
    if digest.hexdigest() != sha256:
        dest.unlink(missing_ok=True)
        raise ShardDownloadError(f"shard from {url[:100]} failed its sha256 check (got {digest.hexdigest()[:16]}..., "
                                 f"expected {sha256[:16]}...): refused")
    return dest


def _window(r, start: int, end: int, size: int) -> bytes:
    """The body of one response to a request for bytes ``start..end``: a 206 whose
    Content-Range says exactly that range; or, from a server that ignores ranges, a 200
    carrying the whole file, accepted for the first request only (then the whole file is
    taken at once). Never more bytes than asked for; fewer when the connection ended early."""
    want = end - start + 1
    if r.status == 206:
        m = _CONTENT_RANGE.match(r.headers.get("Content-Range", ""))
        if not m or int(m.group(1)) != start or int(m.group(2)) != end or m.group(3) not in ("*", str(size)):
            raise ShardDownloadError(f"range response {r.headers.get('Content-Range')!r} for bytes "
                                     f"{start}-{end}/{size}")
    elif r.status == 200 and start == 0:
        want = size
    else:
        raise ShardDownloadError(f"HTTP {r.status} for bytes {start}-{end} (ranges needed)")
    data = r.read(want + 1)  # one byte more than asked for shows a server sending too much
    if len(data) > want:
        raise ShardDownloadError(f"got more than the {want} bytes asked for")
    return data  # possibly fewer (a connection cut short): the caller resumes after them
