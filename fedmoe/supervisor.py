"""Process supervision for ``fedmoe simulate``: the aggregator and device processes it
starts (``python -m fedmoe ...``), each logging to its own file, and all of them stopped
when the command ends, however it ends. A signal ends it like Ctrl-C does: SIGINT raises
KeyboardInterrupt and, while :func:`stop_on_signals` is open, SIGTERM and SIGHUP raise
SystemExit, so the command's ``finally`` blocks stop every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that :func:`stop_on_signals` turns into ``SystemExit(128 + signal)``."""


class Processes:
    """Child processes with their log files (``{log_dir}/{name}.log``); :meth:`stop` ends them all."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], threads: int, preexec: Callable[[], None] | None = None,
              program: str | os.PathLike | None = None) -> None:
        """Start ``python -m fedmoe ARGS`` (or ``program ARGS``) as ``name`` with ``threads``
        torch/BLAS threads; ``preexec`` runs in the child before it does (e.g. joining a memory
        cgroup)."""
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        logf = (self.log_dir / f"{name}.log").open("w")
        argv = [str(program), *args] if program is not None else [sys.executable, "-m", "fedmoe", *args]
        self.procs[name] = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec)

    def tail(self, name: str, lines: int = 30) -> str:
        """The last ``lines`` lines of ``name``'s log."""
        text = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, timeout: float = 20.0) -> None:
        """Let every process exit on its own for up to ``timeout`` seconds in all, then
        terminate (SIGTERM) those still running, and kill (SIGKILL) any still there 5 s later."""
        deadline = time.time() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """While open, SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` in the main thread
    (as SIGINT raises KeyboardInterrupt), so that cleanup code runs instead of the process
    dying with its children left running; the previous handlers come back on exit. Outside
    the main thread (where Python cannot set handlers) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, _exit) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
