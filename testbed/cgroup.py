"""A fixed CPU for a set of processes: a cgroup CPU quota, so that one host with few cores
can compare one router with two at the same CPU each (docs/design/router-tier.md).

cgroup v1 (a `cpu` hierarchy: /sys/fs/cgroup/cpu/NAME, `cpu.cfs_quota_us` over
`cpu.cfs_period_us`) and v2 (the unified hierarchy: /sys/fs/cgroup/NAME, `cpu.max` =
"QUOTA PERIOD", with the cpu controller enabled in the parent's `cgroup.subtree_control`).
Needs root; the group is removed on close (its processes moved back to the root group
first)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from poolpipe.errors import PoolpipeError

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CgroupError(PoolpipeError):
    pass


def hierarchy() -> tuple[str, Path]:
    """("v1", the cpu hierarchy) or ("v2", the unified one); CgroupError saying why
    neither can be used here."""
    if (V1 / "cpu.cfs_quota_us").exists():
        return "v1", V1
    controllers = V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return "v2", V2
    raise CgroupError(
        "no cgroup CPU controller here (neither /sys/fs/cgroup/cpu/cpu.cfs_quota_us, v1, nor "
        "'cpu' in /sys/fs/cgroup/cgroup.controllers, v2): CPU caps need one"
    )


class CpuCap:
    """Processes held to `cpus` CPUs (0.25: a quarter of one core) together."""

    def __init__(self, name: str, cpus: float):
        if not cpus > 0:
            raise CgroupError(f"a CPU cap must be > 0 CPUs, got {cpus}")
        self.version, root = hierarchy()
        self.root = root
        self.path = root / name
        self.cpus = cpus
        quota = max(1000, round(cpus * PERIOD_US))
        try:
            if self.version == "v2":
                control = root / "cgroup.subtree_control"
                if "cpu" not in control.read_text().split():
                    control.write_text("+cpu")
            self.path.mkdir(exist_ok=True)
            if self.version == "v1":
                (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        except OSError as exc:
            self.close()
            raise CgroupError(
                f"cannot make the cgroup {self.path} with a CPU quota ({exc.strerror}): "
                "run as root on a host whose cgroups are writable"
            ) from None

    def add(self, pids: list[int]) -> None:
        """Move these processes into the group (each thread goes with its process)."""
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, OSError):
                (self.path / "cgroup.procs").write_text(str(pid))

    def throttled(self) -> int:
        """Periods in which the quota held the group back."""
        return _field((self.path / "cpu.stat").read_text(), "nr_throttled", default=0)

    def close(self) -> None:
        if not self.path.exists():
            return
        with contextlib.suppress(OSError):
            for pid in (self.path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (self.root / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            os.rmdir(self.path)

    def __enter__(self) -> CpuCap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _field(stat: str, key: str, default: int) -> int:
    for line in stat.splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return int(v)
    return default
