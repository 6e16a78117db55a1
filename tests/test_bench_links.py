"""bench-links refuses arms it cannot shape before it plans or builds anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("arms", "said"),
    [
        ("1,up:0", "'up:0' needs a multiple > 0"),
        ("sideways:4", "the side is up or down"),
        ("fast", "'fast' is not a multiple of the plan's bandwidth"),
    ],
)
def test_bad_arms_are_named_before_anything_runs(arms, said):
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_links.py"), "--arms", arms],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert said in res.stderr and "Traceback" not in res.stderr
