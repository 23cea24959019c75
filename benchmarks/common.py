"""Helpers shared by the benchmark scripts (imported as ``common`` from beside them)."""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def heavy_lock(path: str | None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) while a heavy run goes,
    so benchmarks started side by side on one machine take turns; ``None``/``""``: no lock."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
