"""Hard memory limits for simulated devices: a memory cgroup per device process.

A phone or a container enforces a memory limit; a budget the device only reports is not
proof that it would survive one. :class:`MemoryLimit` puts a child process into its own
memory cgroup (v2 where the memory controller is there, else v1), created under this
process's own cgroup, with a hard limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``)
and reads back what the kernel recorded: OOM kills and the peak charge (v2
``memory.peak``, v1 ``memory.max_usage_in_bytes``; anonymous memory plus page cache, the
kernel reclaiming clean cache under the limit first). ``fedmoe simulate
--device-memory-limit`` runs every device this way with its budget as the limit.

Needs a writable cgroup hierarchy (root, or delegation); :func:`unavailable` says why not.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

log = logging.getLogger(__name__)


def _mounts() -> list[tuple[str, str, set[str]]]:
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4:
            out.append((parts[1], parts[2], set(parts[3].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per hierarchy: ``"0"`` for v2, controller names for v1."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        num, controllers, path = line.split(":", 2)
        if num == "0" and controllers == "":
            paths["0"] = path
        for c in controllers.split(","):
            if c:
                paths[c] = path
    return paths


def memory_cgroup() -> tuple[str, Path]:
    """``("v2" | "v1", directory of this process's memory cgroup)``.

    Raises:
        OSError: no memory controller is mounted where this process can use it.
    """
    if not Path("/proc/self/cgroup").is_file():
        raise OSError("no /proc/self/cgroup: not Linux")
    mounts, own = _mounts(), _own_paths()
    for point, fstype, _ in mounts:
        if fstype == "cgroup2" and "0" in own:
            d = Path(point) / own["0"].lstrip("/")
            if "memory" in (d / "cgroup.controllers").read_text().split() if (d / "cgroup.controllers").is_file() \
                    else False:
                return "v2", d
    for point, fstype, opts in mounts:
        if fstype == "cgroup" and "memory" in opts and "memory" in own:
            return "v1", Path(point) / own["memory"].lstrip("/")
    raise OSError("no memory cgroup controller (v2 or v1) is mounted")


def unavailable() -> str | None:
    """Why :class:`MemoryLimit` cannot work here, or None when it can (a child group is
    created and removed to find out)."""
    try:
        version, base = memory_cgroup()
        probe = base / f"fedmoe-probe-{os.getpid()}"
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"cannot create a memory cgroup: {e}"
    return None


class MemoryLimit:
    """A memory cgroup with a hard limit of ``limit_bytes`` for the processes :meth:`add` puts in it.

    Args:
        name: a name unique among this process's groups ([A-Za-z0-9_.-]).
        limit_bytes: the hard limit (bytes).

    Raises:
        OSError: no writable memory cgroup (:func:`unavailable`).
        ValueError: a bad name or a limit below 1 MiB.
    """

    def __init__(self, name: str, limit_bytes: int):
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"cgroup name {name!r} must be 1-64 of [A-Za-z0-9_.-]")
        if limit_bytes < 2**20:
            raise ValueError(f"memory limit {limit_bytes} bytes is below 1 MiB")
        self.version, base = memory_cgroup()
        self.limit_bytes = int(limit_bytes)
        self.path = base / f"fedmoe-{os.getpid()}-{name}"
        self.path.mkdir(exist_ok=True)
        if self.version == "v2":
            (self.path / "memory.max").write_text(str(self.limit_bytes))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
            for knob, value in (("memory.memsw.limit_in_bytes", self.limit_bytes),  # no swapping past it
                                ("memory.move_charge_at_immigrate", 3)):  # earlier charges move along
                try:
                    (self.path / knob).write_text(str(value))
                except OSError:
                    pass

    def add(self, pid: int) -> None:
        """Move process ``pid`` into the group (its children follow it)."""
        (self.path / "cgroup.procs").write_text(str(int(pid)))

    def _read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except OSError:
            return ""

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer killed in this group (0 where the kernel does
        not count them)."""
        text = self._read("memory.events" if self.version == "v2" else "memory.oom_control")
        m = re.search(r"^oom_kill (\d+)$", text, re.M)
        return int(m.group(1)) if m else 0

    def peak_bytes(self) -> int | None:
        """The group's highest memory charge (bytes; anonymous + page cache), or None where
        the kernel keeps none (v2 before Linux 5.19)."""
        text = self._read("memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes").strip()
        return int(text) if text.isdigit() else None

    def report(self) -> dict[str, int | str | None]:
        """``limit_bytes``, ``peak_bytes``, ``oom_kills`` and the cgroup ``version``."""
        return {"version": self.version, "limit_bytes": self.limit_bytes, "peak_bytes": self.peak_bytes(),
                "oom_kills": self.oom_kills()}

    def remove(self, timeout: float = 5.0) -> None:
        """Delete the group once its processes have exited (waits up to ``timeout`` s; a
        group still busy then is left, with a warning)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    log.warning("memory cgroup %s not removed: %s", self.path, e)
                    return
                time.sleep(0.1)
