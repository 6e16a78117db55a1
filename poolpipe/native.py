"""The compiled hot path: which modules mypyc compiles, and whether this process runs them.

`pip install -e .` (what `./run` does) compiles the modules of HOT_PATH with mypyc into
extension modules beside their sources (setup.py); the sources stay the one implementation.
A build records each source's SHA-256 in `poolpipe/_native_build.json`. When poolpipe is
imported, `guard()` compares them: if any compiled source changed since (an edit without a
rebuild), or POOLPIPE_PURE=1 is set, every module of HOT_PATH is imported from its source
instead, all together (a compiled class cannot be subclassed by an interpreted one, so they
cannot be mixed). `status()` says which is running and why; the benchmarks print it.

This module imports nothing of poolpipe: setup.py reads HOT_PATH from it before the package
is built.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# Relative to the repository root; one group, so calls between them are native calls.
HOT_PATH = (
    "poolpipe/scheduler/messages.py",
    "poolpipe/scheduler/reservations.py",
    "poolpipe/scheduler/state.py",
    "poolpipe/scheduler/bounds.py",
    "poolpipe/scheduler/memo.py",
    "poolpipe/scheduler/reference.py",
    "poolpipe/scheduler/probe.py",
    "poolpipe/scheduler/adaptive.py",
    "poolpipe/runtime/ports.py",
    "poolpipe/runtime/heap.py",
    "poolpipe/runtime/stats.py",
    "poolpipe/runtime/overdue.py",
    "poolpipe/runtime/health.py",
    "poolpipe/runtime/migration.py",
    "poolpipe/runtime/core.py",
    "poolpipe/sim/engine.py",
)
GROUP = "poolpipe._hot"  # the shared library: poolpipe/_hot__mypyc.*.so
RECORD = "poolpipe/_native_build.json"
PURE_ENV = "POOLPIPE_PURE"
ROOT = Path(__file__).resolve().parent.parent


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def source_digests(root: Path = ROOT) -> dict[str, str]:
    return {p: hashlib.sha256((root / p).read_bytes()).hexdigest() for p in HOT_PATH}


def digest_record(root: Path = ROOT) -> str:
    """What setup.py writes to RECORD once the extensions are built."""
    return json.dumps(source_digests(root), indent=1) + "\n"


def _compiled_present(root: Path) -> bool:
    return any(
        m.name.startswith(Path(p).stem + ".")
        for p in HOT_PATH
        for m in (root / p).parent.glob("*" + importlib.machinery.EXTENSION_SUFFIXES[0])
    )


def pure_requested() -> bool:
    """POOLPIPE_PURE set (to anything but 0): run the sources on purpose."""
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def _why_pure(root: Path) -> str | None:
    """None when the compiled modules are current; else why the sources run."""
    if pure_requested():
        return f"{PURE_ENV} is set"
    record = root / RECORD
    if not record.is_file() or not _compiled_present(root):
        return "not compiled (run ./run build, or pip install -e .)"
    try:
        built = json.loads(record.read_text())
    except ValueError:
        return f"{RECORD} is unreadable; rebuild with ./run build"
    changed = [p for p, digest in source_digests(root).items() if built.get(p) != digest]
    if changed:
        return f"{', '.join(changed)} changed since the build; rebuild with ./run build"
    return None


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Imports the hot-path modules from their .py files, never their extension modules."""

    def __init__(self, root: Path, paths: Sequence[str]) -> None:
        self.files = {module_name(p): root / p for p in paths}

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        return importlib.util.spec_from_file_location(fullname, file)


_state: dict[str, str | None] = {}


def guard(root: Path = ROOT) -> None:
    """Run the sources when the compiled modules are missing, stale or not wanted. Called by
    poolpipe/__init__.py before any hot-path module is imported."""
    if "why" in _state:
        return
    why = _why_pure(root)
    _state["why"] = why
    if why is not None:  # (with nothing compiled, it finds what the path would)
        sys.meta_path.insert(0, _SourceFinder(root, HOT_PATH))
        _vecs_or_lists()


class _ListOf:
    """`vec[T]` where librt is missing: a list (`vec[float]()`, `vec[float](items)`)."""

    def __getitem__(self, item: object) -> type[list[object]]:
        return list


def _append(v: list[object], item: object) -> list[object]:
    v.append(item)
    return v


def _pop(v: list[object], i: int = -1) -> tuple[list[object], object]:
    return v, v.pop(i)


def _vecs_or_lists() -> None:
    """The sources use librt.vecs (mypyc's unboxed vectors; librt comes with mypy, which
    the build needs). A machine that only runs the sources may lack it (a lent GPU
    machine: PyTorch and what the run carries): there lists stand in, which behave alike
    where the code only rebinds what `append` and `pop` return, as it does."""
    try:
        importlib.import_module("librt.vecs")
    except ImportError:
        librt = sys.modules.get("librt") or ModuleType("librt")
        vecs = ModuleType("librt.vecs")
        vecs.vec = _ListOf()  # type: ignore[attr-defined]
        vecs.append = _append  # type: ignore[attr-defined]
        vecs.pop = _pop  # type: ignore[attr-defined]
        librt.vecs = vecs  # type: ignore[attr-defined]
        sys.modules.setdefault("librt", librt)
        sys.modules["librt.vecs"] = vecs


def status() -> str:
    """'compiled (mypyc)' or 'pure Python (<why>)', for the benchmarks' tables."""
    guard()
    why = _state["why"]
    if why is None:
        mod = sys.modules.get(module_name(HOT_PATH[-1]))
        if mod is not None and not (mod.__file__ or "").endswith(".py"):
            return "compiled (mypyc)"
        return "compiled (mypyc, not yet imported)"
    return f"pure Python ({why})"


def unasked_sources() -> str | None:
    """Why the sources run though nobody asked (POOLPIPE_PURE), or None: a build older
    than an edit, or none, runs the simulator and the router several times slower."""
    guard()
    why = _state["why"]
    return None if why is None or pure_requested() else why


def is_compiled() -> bool:
    guard()
    return _state["why"] is None
