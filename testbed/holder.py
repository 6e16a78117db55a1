"""What other processes do to the warehouse, for tests and benchmarks to stage: another
process holding the DuckDB file (a second writer, someone's `duckdb` shell)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_HOLD = (
    "import duckdb, sys, time\n"
    "con = duckdb.connect(sys.argv[1])\n"
    "print('held', flush=True)\n"
    "time.sleep(float(sys.argv[2]))\n"
)


def hold_elsewhere(path: str | Path, seconds: float) -> subprocess.Popen:
    """Another process with the warehouse at `path` open for `seconds`; returns once it
    holds the file (wait() on it to know it let go)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "held":
        proc.wait()
        raise RuntimeError(f"could not hold {path} from another process (exit {proc.returncode})")
    return proc
