"""The architecture's import rules ([tool.importlinter] in pyproject.toml), checked by
import-linter on the real tree: the algorithm packages import no framework, database or
serving client, serving policy reads no clock, flows and Triton adapters stay apart, and
what serves imports neither the simulator nor the test bed; the library (`poolpipe`) imports
none of its adapters, the test bed or the command line (`poolpipe_cli`, the composition
root), and the adapters do not import the command line; the reservation data plane's
layers (docs/design/dataplane.md) import downward only, and no package or module imports
back what imports it. Each rule is shown to catch a planted violation in a copy of the
tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT), "--no-logo", "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_tree_keeps_every_contract():
    r = _lint(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "8 kept, 0 broken" in r.stdout


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    for pkg in ("poolpipe", "poolpipe_cli", "flows", "triton_backend", "testbed"):
        shutil.copytree(REPO / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("poolpipe/planner/_planted.py", "import duckdb", "import no framework"),
        ("poolpipe/sim/_planted.py", "import tritonclient.grpc", "import no framework"),
        ("poolpipe/runtime/_planted.py", "from triton_backend import env", "import no framework"),
        ("poolpipe/scheduler/_planted.py", "import time", "reads no clock"),
        ("poolpipe/runtime/_planted.py", "import asyncio", "reads no clock"),
        ("flows/_planted.py", "import triton_backend.node.triton", "do not import each other"),
        ("triton_backend/_planted.py", "import flows.plan", "do not import each other"),
        ("triton_backend/_planted.py", "import poolpipe.sim.engine", "neither the simulator"),
        ("flows/_planted.py", "from testbed import loadgen", "neither the simulator"),
        ("poolpipe/store/_planted.py", "import testbed.holder", "neither the simulator"),
        ("poolpipe/planner/_planted.py", "import testbed.predict", "import no framework"),
        ("poolpipe/store/_planted.py", "import flows.plan", "imports none of its adapters"),
        ("poolpipe/client/_planted.py", "import poolpipe_cli.common", "imports none of its"),
        ("poolpipe/_planted.py", "from triton_backend import env", "imports none of its"),
        ("testbed/_planted.py", "from poolpipe_cli import serve", "do not import the command"),
        ("triton_backend/_planted.py", "import poolpipe_cli", "do not import the command"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(tree_copy, module, line, contract):
    planted = tree_copy / module
    planted.write_text(f'"""A planted violation."""\n\n{line}\n')
    try:
        r = _lint(tree_copy)
    finally:
        planted.unlink()
    assert r.returncode != 0, r.stdout
    broken = r.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and "_planted" in broken, r.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract", "culprit"),
    [
        # the state records reaching up to the probe that reads them
        (
            "poolpipe/scheduler/state.py",
            "import poolpipe.scheduler.probe",
            "downward only",
            "state",
        ),
        # the bounds reading the batching policy
        (
            "poolpipe/scheduler/bounds.py",
            "import poolpipe.scheduler.adaptive",
            "downward",
            "bounds",
        ),
        # the domain reaching back into the planner that builds on it
        ("poolpipe/domain/plan.py", "import poolpipe.planner.exact", "imports back", "domain"),
        # the router reaching into the deployment that composes it
        (
            "triton_backend/router/core.py",
            "import triton_backend.deploy.load",
            "imports back",
            "router",
        ),
    ],
)
def test_an_upward_import_breaks_its_contract(tree_copy, module, line, contract, culprit):
    target = tree_copy / module
    before = target.read_text()
    target.write_text(before + f"\n{line}  # planted\n")
    try:
        r = _lint(tree_copy)
    finally:
        target.write_text(before)
    assert r.returncode != 0, r.stdout
    broken = r.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and culprit in broken, r.stdout
