"""A CPU cap for benchmark processes (testbed/cgroup.py): the quota written where this
host's cgroups keep it, a process moved in, the group gone on close. Skipped where no
cgroup CPU controller can be written (not root, or none mounted)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testbed.cgroup import CgroupError, CpuCap, hierarchy


def _cap_or_skip(name: str, cpus: float) -> CpuCap:
    try:
        hierarchy()
        return CpuCap(name, cpus)
    except CgroupError as exc:
        pytest.skip(str(exc))


def test_a_cap_holds_its_quota_and_its_process_and_goes_on_close():
    cap = _cap_or_skip(f"poolpipe-test-{os.getpid()}", 0.5)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        if cap.version == "v1":
            assert (cap.path / "cpu.cfs_quota_us").read_text().strip() == "50000"
        else:
            assert (cap.path / "cpu.max").read_text().split() == ["50000", "100000"]
        cap.add([proc.pid])
        assert str(proc.pid) in (cap.path / "cgroup.procs").read_text().split()
    finally:
        cap.close()
        proc.kill()
        proc.wait()
    assert not cap.path.exists()


def test_a_cap_of_no_cpu_is_refused():
    with pytest.raises(CgroupError, match="must be > 0 CPUs"):
        CpuCap("poolpipe-test-none", 0)
