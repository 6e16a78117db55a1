"""The environment Triton processes need here.

PyTriton's Python-backend stub links libpython dynamically; with a pyenv interpreter it can
pick up another patch release's libpython and fail at model load
(`'_thread.RLock' object has no attribute '_recursion_count'`). The running interpreter's
LIBDIR goes first in LD_LIBRARY_PATH, and the stub sees this environment's site-packages.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import site
import socket
import sys
import sysconfig
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path


def libpython_first(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: a copy of os.environ) with this interpreter's LIBDIR first in
    LD_LIBRARY_PATH and its site-packages on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    parts = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and p != libdir]
    env["LD_LIBRARY_PATH"] = ":".join([libdir, *parts])
    paths = [*site.getsitepackages(), str(Path(__file__).resolve().parents[1])]
    old = [p for p in env.get("PYTHONPATH", "").split(":") if p and p not in paths]
    env["PYTHONPATH"] = ":".join([*paths, *old])
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def fix_this_process() -> None:
    """For PyTriton, which starts its tritonserver with this process's environment."""
    os.environ.update(libpython_first())


def pytriton_root() -> Path:
    import pytriton

    return Path(pytriton.__file__).resolve().parent


def triton_home(workspace: Path) -> Path:
    """A copy of PyTriton's tritonserver tree with the Python-backend stub of this
    interpreter in backends/python (what PyTriton does in its own workspace)."""
    home = Path(workspace) / "tritonserver"
    stub = home / "backends" / "python" / "triton_python_backend_stub"
    if stub.is_file():
        return home
    src = pytriton_root() / "tritonserver"
    tmp = Path(workspace) / f".tritonserver-{uuid.uuid4().hex[:12]}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("python_backend_stubs"))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    shutil.copy(
        src / "python_backend_stubs" / version / "triton_python_backend_stub",
        tmp / "backends" / "python" / "triton_python_backend_stub",
    )
    try:
        tmp.rename(home)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return home


def libs_path() -> Path:
    """Shared libraries tritonserver links against, shipped beside the pytriton package."""
    return pytriton_root().parent / "nvidia_pytriton.libs"


# Every port free_ports has handed out in this process: a port closed again before its
# server binds it is free to the kernel, which would hand it out twice (two nodes started
# together once got the same port: one Triton found it taken and crashed while loading).
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name, IPv6 with or without brackets) is this host's
    loopback: `localhost` or an address in 127.0.0.0/8 or ::1. A name other than
    localhost is taken for another host; 0.0.0.0 and :: listen on every interface."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_ports(n: int) -> list[int]:
    """n free TCP ports on loopback, none handed out before by this process (free when
    asked; bind soon)."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    with _HANDED_OUT_LOCK:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)  # held open until the end, so the kernel offers another next
            port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                ports.append(port)
        for s in socks:
            s.close()
    return ports


@contextlib.contextmanager
def signals_held() -> Iterator[list[int]]:
    """SIGINT and SIGTERM are noted (the yielded list), not acted on, while the block runs:
    for teardown that must finish, since a second Ctrl-C in the middle of stopping nodes
    left them running. Off the main thread (where handlers cannot be set) it does nothing;
    nested, the outer one holds."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    got: list[int] = []
    kinds = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.getsignal(s) for s in kinds}
    for s in kinds:
        signal.signal(s, lambda n, _frame: got.append(n))
    try:
        yield got
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
