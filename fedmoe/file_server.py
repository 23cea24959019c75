"""A local web server for content-addressed files (base shards and training programs,
PROTOCOL.md §6.4a/§6.4b) on a loopback port, for federations on one machine
(``fedmoe simulate --native-devices``, ``python -m fedmoe.conformance --serve-files``).

A deployment serves ``shard_dir`` with any web server or CDN that answers ``Range``
requests (nginx, a bucket); the standard library's ``http.server`` answers none, hence this
small handler: ``GET /{anything}/{name}`` gives the file ``{directory}/{name}``, a
``Range: bytes=a-b`` header a ``206`` with ``Content-Range: bytes a-b/{size}``, no header the
whole file (``200``), an unknown name ``404``.
"""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FileServer:
    """Serves ``directory`` at :attr:`url` (``http://127.0.0.1:{port}/shards``) from a daemon
    thread until :meth:`close`.

    Args:
        directory: the files (read at each request, so files written later are served).
        host: the address to listen on (default loopback).
        port: the port (default 0: a free one).
    """

    def __init__(self, directory: str | Path, host: str = "127.0.0.1", port: int = 0):
        self.directory = Path(directory)
        self.requests: list[tuple[str, str | None]] = []
        """``(file name, Range header)`` of each request."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                server.handle(self)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.httpd.server_address[1]}/shards"
        threading.Thread(target=self.httpd.serve_forever, daemon=True, name="file-server").start()

    def read(self, name: str) -> bytes | None:
        """The bytes served for ``name`` (None: 404)."""
        path = self.directory / Path(name).name
        return path.read_bytes() if path.is_file() else None

    def handle(self, h: BaseHTTPRequestHandler, ranges: bool = True) -> None:
        """Answer one GET (``ranges``: honour a Range header)."""
        name = Path(h.path).name
        self.requests.append((name, h.headers.get("Range")))
        data = self.read(name)
        if data is None:
            h.send_error(404)
            return
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", h.headers.get("Range") or "")
        if m and ranges:
            a, b = int(m.group(1)), min(int(m.group(2)), len(data) - 1)
            body = data[a:b + 1]
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {a}-{b}/{len(data)}")
        else:
            body = data
            h.send_response(200)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        self.send(h, body)

    def send(self, h: BaseHTTPRequestHandler, body: bytes) -> None:
        """Write the response body."""
        h.wfile.write(body)

    def close(self) -> None:
        """Stop serving and release the port."""
        self.httpd.shutdown()
        self.httpd.server_close()
