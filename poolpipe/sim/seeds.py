"""The runs of one load point, one per seed, on two processes where the machine has the
cores: a capacity search's points are sequential (each depends on the last), but the seeds
of a point are independent, and the simulator holds Python's lock while it runs.

`SeedRuns` forks one helper when it is entered (the process as it is then: the topology
and the profiles are not copied, only the load factor goes down a pipe and the results come
back). The helper runs every other seed of each point while the caller runs the rest; the
results are the same, in the same order, as those of one process (every run is
deterministic in its seed). A helper that dies, or a machine without fork or with one core,
leaves the caller to run every seed itself. The helper ignores Ctrl-C (the caller's ends
it) and writes nothing.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import struct
import warnings
from collections.abc import Callable, Sequence
from types import TracebackType

from poolpipe.sim.metrics import SimResult

# one run of a load point: (load factor, seed) -> result
Run = Callable[[float, int], SimResult]

_LENGTH = struct.Struct("!Q")


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


class SeedRuns:
    """`runs(lf)`: `run(lf, seed)` for every seed, in order; on two processes where
    `processes` >= 2, there are two seeds or more and the system can fork."""

    def __init__(self, run: Run, seeds: Sequence[int], processes: int = 1):
        self.run = run
        self.seeds = tuple(seeds)
        self.processes = processes
        self._pid = 0
        self._sock: socket.socket | None = None

    def __enter__(self) -> SeedRuns:
        if self.processes >= 2 and len(self.seeds) >= 2 and hasattr(os, "fork"):
            self._start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop(kill=error is not None)

    def __call__(self, lf: float) -> list[SimResult]:
        if self._sock is not None:
            try:
                _send(self._sock, pickle.dumps(lf))
            except OSError:
                self._stop(kill=True)  # (the helper is gone: every seed here)
        if self._sock is None:
            return [self.run(lf, s) for s in self.seeds]
        theirs = self.seeds[1::2]
        mine = {s: self.run(lf, s) for s in self.seeds[0::2]}
        try:
            got = pickle.loads(_receive(self._sock))
        except (OSError, EOFError, pickle.UnpicklingError):
            got = None
        if not isinstance(got, list) or len(got) != len(theirs):
            self._stop(kill=True)  # (the helper died, or failed: every seed here)
            got = [self.run(lf, s) for s in theirs]
        mine.update(zip(theirs, got, strict=True))
        return [mine[s] for s in self.seeds]

    def _start(self) -> None:
        ours, helpers = socket.socketpair()
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            helpers.close()
            return
        if pid == 0:  # the helper
            code = 1
            try:
                ours.close()
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                warnings.simplefilter("ignore")
                _serve(helpers, self.run, self.seeds[1::2])
                code = 0
            finally:
                os._exit(code)
        helpers.close()
        self._pid, self._sock = pid, ours

    def _stop(self, kill: bool) -> None:
        if self._sock is None:
            return
        sock, self._sock = self._sock, None
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)
        sock.close()  # (the helper reads the end of its input and leaves)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self._pid, 0)


def _serve(sock: socket.socket, run: Run, seeds: Sequence[int]) -> None:
    """The helper's loop: a load factor in, its runs of `seeds` out, until the input ends."""
    while True:
        try:
            lf = pickle.loads(_receive(sock))
        except (EOFError, OSError):
            return
        try:
            out: object = [run(lf, s) for s in seeds]
        except Exception as e:  # (the caller runs them itself, and meets the error there)
            out = repr(e)
        _send(sock, pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _receive(sock: socket.socket) -> bytes:
    (n,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
    return _exactly(sock, n)


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)
