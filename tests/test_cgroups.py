"""Hard memory limits for device processes (fedmoe.cgroups): the kernel's OOM kills and
peaks read back; a simulation that asks for limits where none can be set fails fast."""

import subprocess
import sys

import pytest

from fedmoe.cgroups import MemoryLimit, unavailable
from fedmoe.simulate import SimulationConfig, SimulationConfigError, simulate

WHY = unavailable()


def _allocate(mib: int) -> list[str]:
    return [sys.executable, "-c", f"x = bytearray({mib} * 2**20); x[::4096] = b'1' * len(x[::4096])"]


@pytest.mark.skipif(WHY is not None, reason=f"no writable memory cgroup: {WHY}")
def test_a_process_over_its_limit_is_killed_and_counted_one_under_it_is_not():
    for mib, killed in ((40, False), (300, True)):
        lim = MemoryLimit(f"test-{mib}", 150 * 2**20)
        try:
            p = subprocess.Popen(_allocate(mib), preexec_fn=lim.preexec())  # in the group before it runs
            rc = p.wait(60)
            got = lim.report()
        finally:
            lim.remove()
        assert (rc == -9, got["oom_kills"] == 1) == (killed, killed), (mib, rc, got)
        assert got["peak_bytes"] is None or got["peak_bytes"] <= got["limit_bytes"]
        if not killed and got["peak_bytes"] is not None:
            assert got["peak_bytes"] >= mib * 2**20
    with pytest.raises(ValueError, match="name"):
        MemoryLimit("a/b", 2**30)


def test_simulate_with_limits_where_none_can_be_set_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setattr("fedmoe.cgroups.unavailable", lambda: "cannot create a memory cgroup: read-only")
    with pytest.raises(SimulationConfigError, match="device-memory-limit: cannot create a memory cgroup"):
        simulate(SimulationConfig(out=str(tmp_path), device_memory_limit=True, rounds=1, devices=1))
