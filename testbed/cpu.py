"""CPU accounting of processes and everything below them (Linux /proc): what a benchmark
reads to say how much CPU a router, its Triton or a node spent per request."""

from __future__ import annotations

import os
from pathlib import Path


def own_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` alone (None: it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and all their descendants (Linux
    /proc; processes gone meanwhile count nothing)."""
    total, seen, todo = 0.0, set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        own = own_cpu_seconds(pid)
        if own is None:
            continue
        total += own
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        todo += [int(k) for k in kids]
    return total


def host_cpu_ticks() -> tuple[int, int]:
    """(busy, all) CPU ticks of this host so far, over every core (Linux /proc/stat):
    two samples' differences give the share of the host's CPU time that was busy."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # (guest time is counted in user already)
    return total - idle, total
