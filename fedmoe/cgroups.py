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


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """``(mount point, root inside its hierarchy, fs type, super options)`` from mountinfo."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        a, b = left.split(), right.split()
        if len(a) >= 5 and len(b) >= 3:
            out.append((a[4], a[3], b[0], set(b[2].split(","))))
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


def _under(point: str, root: str, path: str) -> Path:
    """The directory of cgroup ``path`` in a hierarchy mounted at ``point`` from ``root``
    (a container's mount shows only its own part of the tree)."""
    rel = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
    return Path(point) / ("" if rel == "." else rel)


def memory_cgroup() -> tuple[str, Path]:
    """``("v2" | "v1", directory of this process's memory cgroup)``: v2 where the memory
    controller is enabled for its child groups, else the v1 memory hierarchy.

    Raises:
        OSError: no memory controller is mounted where this process can use it.
    """
    if not Path("/proc/self/cgroup").is_file():
        raise OSError("no /proc/self/cgroup: not Linux")
    mounts, own = _mounts(), _own_paths()
    for point, root, fstype, _ in mounts:
        if fstype == "cgroup2" and "0" in own:
            d = _under(point, root, own["0"])
            control = d / "cgroup.subtree_control"
            if control.is_file() and "memory" in control.read_text().split():
                return "v2", d
    for point, root, fstype, opts in mounts:
        if fstype == "cgroup" and "memory" in opts and "memory" in own:
            return "v1", _under(point, root, own["memory"])
    raise OSError("no memory controller for child cgroups (v2: 'memory' not in this cgroup's "
                  "cgroup.subtree_control, which needs a delegated cgroup; v1: not mounted)")


_LIMIT_FILE = {"v2": "memory.max", "v1": "memory.limit_in_bytes"}


def unavailable() -> str | None:
    """Why :class:`MemoryLimit` cannot work here, or None when it can (a child group is
    created, its limit file looked for, and removed)."""
    try:
        version, base = memory_cgroup()
        probe = base / f"fedmoe-probe-{os.getpid()}"
        probe.mkdir()
        try:
            if not (probe / _LIMIT_FILE[version]).is_file():
                return f"a child of {base} has no {_LIMIT_FILE[version]} (memory controller not enabled for it)"
        finally:
            probe.rmdir()
    except OSError as e:
        return f"cannot create a memory cgroup: {e}"
    return None


def _swap_bytes() -> int:
    try:
        return sum(int(line.split()[2]) * 1024 for line in Path("/proc/swaps").read_text().splitlines()[1:])
    except (OSError, ValueError, IndexError):
        return 0


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
        try:
            self._limit()
        except OSError:
            self.remove(0)
            raise

    def _limit(self) -> None:
        if self.version == "v2":
            (self.path / "memory.max").write_text(str(self.limit_bytes))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
            try:  # no swapping past the limit
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(self.limit_bytes))
            except OSError:
                if _swap_bytes():
                    log.warning("swap is on and %s cannot limit it (no swap accounting): a process over its "
                                "limit may swap instead of being killed", self.path)

    def preexec(self):
        """For ``subprocess.Popen(preexec_fn=...)``: the child joins the group before it runs
        anything, so every byte it allocates is charged to it."""
        procs = str(self.path / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        return join

    def add(self, pid: int) -> None:
        """Move a running process ``pid`` into the group (its later children follow it; what
        it allocated before stays charged where it was on v2, :meth:`preexec` avoids that)."""
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
