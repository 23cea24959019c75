"""Builds the native (phone-class) device's C++ code under ``native/`` with CMake, against
ExecuTorch's runtime from its Python wheel (:data:`INSTALL`; ``make install`` runs it).

:func:`build` configures and builds once per build directory and source state (CMake's own
dependency tracking makes a second call cheap), and returns the path of ``fedmoe-train``
(``native/tools/fedmoe_train.cpp``); the native device ``fedmoe-device``
(``native/tools/fedmoe_device.cpp``) and the protocol check tool ``fedmoe-native-check`` lie
beside it (:func:`binary`). ``make install`` installs the compiler and library packages it
needs (:data:`PACKAGES`).
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "native"
BUILD = ROOT / "build" / "native"
INSTALL = "pip install --no-deps 'executorch>=1.5.1,<1.6' && pip install flatbuffers ruamel.yaml tabulate"
"""How ExecuTorch is installed: without its declared dependencies (torchao, coremltools, pandas
and test tools, which neither the export nor the runtime uses; torchao, once installed, is
imported by peft in every process and logs warnings)."""
PACKAGES = ("g++", "cmake", "pkg-config", "nlohmann-json3-dev", "libmosquitto-dev", "libsodium-dev",
            "libcurl4-openssl-dev", "zlib1g-dev", "libopenblas-dev")
"""The Debian packages the build needs besides the ``executorch`` wheel: a compiler, CMake, the
libraries the device speaks the protocol with (nlohmann/json, libmosquitto for MQTT, libsodium for
SHA-256 and Ed25519, libcurl for HTTP, zlib for compressed payloads), and OpenBLAS for the
training kernels' matrix products (without it they use ExecuTorch's slower ``sgemm_``)."""


NATIVE_BASELINE_BYTES = 16 * 2**20
"""The baseline a native device reports (``Hello.runtime_bytes``), rounded up: its footprint
before any model (5-6 MiB measured with 40 samples of token ids, PROTOCOL.md §5.3a) plus its
8 MiB headroom; what ``fedmoe simulate`` plans its budgets with before it starts."""


class NativeBuildError(RuntimeError):
    """The native code could not be configured or built (the message says why and what to install)."""


def executorch_dir() -> Path:
    """The installed ``executorch`` package's directory (its ``share/cmake`` has the CMake package).

    Raises:
        NativeBuildError: ExecuTorch is not installed.
    """
    try:
        import executorch
    except ImportError as e:
        raise NativeBuildError(f"ExecuTorch is not installed: {INSTALL}") from e
    return Path(list(executorch.__path__)[0])


def build(build_dir: str | Path = BUILD, timeout_s: float = 900.0) -> Path:
    """Configure (first time) and build ``native/``; returns the ``fedmoe-train`` binary.

    Args:
        build_dir: the CMake build directory (default ``build/native``, git-ignored).
        timeout_s: limit for each of configure and build (seconds).

    Two processes that build the same directory at once take turns (an exclusive ``flock``
    on ``build_dir/.lock``).

    Raises:
        NativeBuildError: a tool is missing (the Debian packages are named) or CMake failed
            (its last output lines are in the message).
    """
    missing = [t for t in ("cmake", "g++") if shutil.which(t) is None]
    if missing:
        raise NativeBuildError(f"{', '.join(missing)} not found: apt-get install {' '.join(PACKAGES)}")
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "a") as lock:  # two processes building at once (pytest workers) take turns
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(build_dir, timeout_s)


def _build(build_dir: Path, timeout_s: float) -> Path:
    steps = [["cmake", "-S", str(SOURCE), "-B", str(build_dir), f"-DCMAKE_PREFIX_PATH={executorch_dir()}"],
             ["cmake", "--build", str(build_dir), "-j2"]]
    for cmd in steps:
        log.info("native build: %s", " ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
            hint = (f" (apt-get install {' '.join(PACKAGES)})"
                    if any(w in tail for w in ("nlohmann", "mosquitto", "sodium", "CURL", "ZLIB", "PkgConfig")) else "")
            raise NativeBuildError(f"{' '.join(cmd[:2])} failed{hint}:\n{tail}")
    return build_dir / "fedmoe-train"


def load_kernels(build_dir: str | Path = BUILD) -> Path:
    """Build (:func:`build`) and load ``libfedmoe_kernels.so`` into this process, so that
    ExecuTorch's Python runtime (its pybindings, which share ``libexecutorch.so``'s kernel
    registry) runs programs with the project's operators (those of
    ``moe_model.training_program.FEDMOE_RUNTIME``). Returns the library's path.

    Raises:
        NativeBuildError: see :func:`build`; or the library was not built.
    """
    import ctypes

    import executorch.extension.pybindings.portable_lib  # noqa: F401  (libexecutorch.so first)

    path = build(build_dir).parent / "libfedmoe_kernels.so"
    if not path.is_file():
        raise NativeBuildError(f"{path} was not built (native/CMakeLists.txt names it)")
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return path


def binary(name: str, build_dir: str | Path = BUILD) -> Path:
    """The path of the native program ``name`` (``fedmoe-train``, ``fedmoe-device``,
    ``fedmoe-native-check``), built first (:func:`build`).

    Raises:
        NativeBuildError: see :func:`build`; or no such program was built.
    """
    path = build(build_dir).parent / name
    if not path.is_file():
        raise NativeBuildError(f"{path} was not built (native/CMakeLists.txt names the programs)")
    return path
