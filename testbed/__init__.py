"""The test bed: what tests, demos and benchmarks use to exercise poolpipe on one machine,
apart from what serves. A multi-host cluster of network namespaces (netns.py), load
generators (loadgen.py), CPU accounting (cpu.py), the simulator's prediction for a live
deployment (predict.py), a stage client without Triton (fake_stages.py), and another
process holding the warehouse (holder.py).

Production adapters (triton_backend, flows) import none of it, nor the simulator: an import
contract checks it (pyproject.toml, tests/test_import_contracts.py)."""

import atexit
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from types import TracebackType


def _terminated(*_: object) -> None:
    raise KeyboardInterrupt  # unwinds every `with` and `finally` on the way out


def _hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        print("interrupted: stopped, and what it had started torn down", file=sys.stderr)
        return
    _default_hook(kind, value, tb)


_default_hook = sys.excepthook


def teardown_on_sigterm() -> None:
    """SIGTERM stops a benchmark as Ctrl-C does: its clusters, namespaces, servers and
    routers are torn down on the way out (Python's default for SIGTERM is to die at once,
    leaving them behind), and either ends with one line, not a traceback."""
    signal.signal(signal.SIGTERM, _terminated)
    sys.excepthook = _hook


def scratch_dir(prefix: str) -> Path:
    """A new temporary folder for a benchmark's workspaces (models cut, servers' logs and
    repositories: a few hundred MB), removed when the process exits however it exits
    short of SIGKILL (with teardown_on_sigterm, SIGTERM too)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path
