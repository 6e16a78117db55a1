"""The compiled hot path (poolpipe/native.py): the modules mypyc compiles simulate exactly as
their sources do, and a compiled module older than its source is never run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from poolpipe import native

REPO = Path(__file__).resolve().parents[1]

# The published group-2 plan on hc2-large near capacity, with L4s lost and back: drops,
# waits, retries and every data-plane path, on the shipped profiles.
SIMULATE = """
import json, sys
from poolpipe import native
from poolpipe.domain.plan import Plan
from poolpipe.domain.profiles import load_ppipe_dir
from poolpipe.scheduler import build_topology
from poolpipe.sim import ArrivalSpec, SimConfig, run_once
from poolpipe.sim.scenario import GpuChange, Scenario

profiles = {p.name: p for p in load_ppipe_dir(sys.argv[1])}
plan = Plan.load(sys.argv[2])
topo = build_topology(plan, profiles, larger_batches=True)
scenario = Scenario((GpuChange("gpu_down", 0.5, "L4", 3), GpuChange("gpu_up", 1.0, "L4", 3)))
res = run_once(topo, ArrivalSpec.parse("poisson"), 0.95, SimConfig(1.5, seed=3),
               scenario=scenario)
print(json.dumps({
    "status": native.status(),
    "models": [m.__dict__ for m in res.models],
    "per_second": res.per_second,
    "batches": res.batches,
    "probes": res.probes_per_batch,
}, sort_keys=True, default=str))
"""


def test_the_compiled_modules_are_the_ones_imported():
    """No silent fall-back: where nobody asked for the sources (POOLPIPE_PURE), every module
    of the hot path is its mypyc extension (./run compiles them; a stale build is rebuilt
    by ./run, and named here)."""
    if native.pure_requested():
        pytest.skip(f"{native.PURE_ENV} is set: the sources run on purpose")
    import poolpipe.sim  # noqa: F401  (imports every hot-path module)

    assert native.status() == "compiled (mypyc)"
    for path in native.HOT_PATH:
        module = sys.modules[native.module_name(path)]
        assert module.__file__ is not None and module.__file__.endswith(EXTENSION_SUFFIXES[0])
    assert (
        type(sys.modules["poolpipe.scheduler.adaptive"].ReservationScheduler.probe).__name__
        != "function"
    )  # a native method, not a Python function


# A machine without librt (mypyc's runtime library: the unboxed vectors the reservation
# tables keep their intervals in), as a lent GPU machine may be.
NO_LIBRT = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "librt":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
"""


def run_sim(ppipe_dir: Path, pure: bool, librt: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    if pure:
        env[native.PURE_ENV] = "1"
    published = REPO / "data" / "reference" / "ppipe-published-g2-hc2-large.json"
    code = SIMULATE if librt else NO_LIBRT + SIMULATE
    out = subprocess.run(
        [sys.executable, "-c", code, str(ppipe_dir), str(published)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=True,
    )
    return json.loads(out.stdout)


def test_compiled_and_source_hot_paths_simulate_alike(ppipe_dir):
    if not native.is_compiled():
        pytest.skip(f"the hot path runs as {native.status()}")
    compiled = run_sim(ppipe_dir, pure=False)
    source = run_sim(ppipe_dir, pure=True)
    assert compiled.pop("status") == "compiled (mypyc)"
    assert source.pop("status") == f"pure Python ({native.PURE_ENV} is set)"
    assert sum(m["dropped"] for m in source["models"]) > 0  # the lost L4s were felt
    assert compiled == source


def test_the_sources_run_alike_without_librt(ppipe_dir):
    """Where librt cannot be imported the sources still run (lists stand in for its
    vectors: native.py), and decide exactly as with it."""
    with_librt = run_sim(ppipe_dir, pure=True)
    without = run_sim(ppipe_dir, pure=True, librt=False)
    assert without.pop("status") == with_librt.pop("status")
    assert without == with_librt


def copy_package(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(REPO / "poolpipe", root / "poolpipe", ignore=shutil.ignore_patterns("*.pyc"))
    return root


def test_a_compiled_module_older_than_its_source_is_not_run(tmp_path):
    if not native.is_compiled():
        pytest.skip(f"the hot path runs as {native.status()}")
    root = copy_package(tmp_path)
    edited = root / native.HOT_PATH[2]
    edited.write_text(edited.read_text() + "\n# edited after the build\n")
    probe = (
        "from poolpipe import native; import poolpipe.scheduler.adaptive as a, "
        "poolpipe.runtime.core as c, poolpipe.sim.engine as e; "
        "print(native.status()); print(a.__file__, c.__file__, e.__file__); "
        "print(native.unasked_sources())"
    )
    env = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # not the checkout: `python -c` puts the working directory first
        check=True,
    ).stdout.splitlines()
    assert out[0] == (
        f"pure Python ({native.HOT_PATH[2]} changed since the build; rebuild with ./run build)"
    )
    files = out[1].split()
    assert all(f.startswith(str(root)) and f.endswith(".py") for f in files), files
    assert out[2] == f"{native.HOT_PATH[2]} changed since the build; rebuild with ./run build"


def test_a_command_says_when_the_sources_run_unasked(tmp_path, monkeypatch, capsys):
    """What `poolpipe` prints on stderr before a command where the sources run though
    nobody asked (a build older than an edit: the simulator several times slower), and
    that it says nothing where they run on purpose or the build is current."""
    from poolpipe_cli import main

    missing = str(tmp_path / "no-plan.json")  # (a command that stops at once, on an error)
    monkeypatch.setattr(native, "unasked_sources", lambda: "x.py changed since the build")
    assert main(["simulate", "--plan", missing]) == 2
    err = capsys.readouterr().err
    assert "warning: the hot path runs from its sources, several times slower" in err
    assert "x.py changed since the build" in err and "does not exist" in err
    monkeypatch.undo()
    monkeypatch.setenv(native.PURE_ENV, "1")
    assert native.unasked_sources() is None  # asked for (or compiled and current)
    assert main(["simulate", "--plan", missing]) == 2
    assert "hot path" not in capsys.readouterr().err


def test_why_the_sources_run(tmp_path, monkeypatch):
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    root = tmp_path
    for p in native.HOT_PATH:
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_text(f"# {p}\n")
    assert native._why_pure(root) == "not compiled (run ./run build, or pip install -e .)"
    ext = root / native.HOT_PATH[0].replace(".py", EXTENSION_SUFFIXES[0])
    ext.write_bytes(b"")
    assert native._why_pure(root) == "not compiled (run ./run build, or pip install -e .)"
    (root / native.RECORD).parent.mkdir(parents=True, exist_ok=True)
    (root / native.RECORD).write_text(native.digest_record(root))
    assert native._why_pure(root) is None
    monkeypatch.setenv(native.PURE_ENV, "1")
    assert native._why_pure(root) == f"{native.PURE_ENV} is set"
    monkeypatch.setenv(native.PURE_ENV, "0")
    assert native._why_pure(root) is None
    (root / native.RECORD).write_text("{not json")
    assert "unreadable" in (native._why_pure(root) or "")
